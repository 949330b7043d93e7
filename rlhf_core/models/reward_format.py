"""The reward model's (and the PPO critic's) directory on disk: a transformers ``*ForSequenceClassification``
checkpoint with one label, read back into a :class:`ValueHeadModel` (one value per token).

Written by ``save_seq_cls`` (``ValueHeadModel.save_pretrained``, ``loading.save_value_model``)::

    config.json        architectures ["<Family>ForSequenceClassification"] (the backbone's family: Llama, Qwen2,
                       ...), num_labels 1, pad_token_id (HF pools the last token that is not pad)
    model.safetensors  the backbone under the class's ``base_model_prefix`` (``model.``) + ``score.weight`` [1, hidden]

so ``AutoModelForSequenceClassification.from_pretrained(dir)``, TRL (``RewardTrainer``, ``GRPOTrainer``'s
``reward_funcs``) and OpenRLHF (``value_head_prefix: score``, its default) load it unchanged and score a
right-padded row as we do: the head's value at the last non-pad token.

Read by ``load_value_model`` (``ValueHeadModel.from_pretrained``), by what the directory holds (``checkpoint_format``):

- ``seq_cls``: ``config.json`` names a ``*ForSequenceClassification`` architecture (ours, a Hub or TRL reward
  model; a Hub id works too): its backbone and ``score`` head, which must have one label and every weight in the
  checkpoint (transformers would start a missing one at random). An encoder classifier
  (BERT's pooler + ``classifier``) is refused: its score is not a value per token.
- ``value_head``: the layout before this one, ``value_head.safetensors`` (``{"weight": [1, hidden]}``) +
  ``value_head.json`` beside an ``AutoModel`` backbone: old workspaces and registered versions still load.
- ``backbone``: any other HF model (the SFT or base model): its backbone with a fresh head, or, where a head is
  required (a reward model, a critic's init), an error naming the path.

A local directory is checked against its manifest first (``CorruptModelError``); weights are read from safetensors
only; an unmerged LoRA adapter saved beside them (``adapter/``, ``compute.lora.merge_on_save: false``) is applied
and merged.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Literal

import torch
from torch import nn

from rlhf_core.engine.distributed import full_param
from rlhf_core.ops.integrity import verify_model_dir
from rlhf_core.ops.paths import ADAPTER_DIR

SEQ_CLS_SUFFIX = "ForSequenceClassification"
HEAD = "score"  # the head's name in every decoder *ForSequenceClassification (and OpenRLHF's default)
VALUE_HEAD_WEIGHTS = "value_head.safetensors"  # the previous layout (read only)
VALUE_HEAD_CONFIG = "value_head.json"

Format = Literal["seq_cls", "value_head", "backbone"]


class RewardModelFormatError(ValueError):
    """A directory (or Hub id) that cannot be read as a reward / value model; the message names it."""


def _config_dict(path: str | Path) -> dict:
    """``config.json`` of a local directory (an error names it when absent or unreadable) or of a Hub id."""
    local = Path(path)
    if local.is_dir():
        file = local / "config.json"
        if not file.is_file():
            raise RewardModelFormatError(f"{local}: no config.json; not a model directory (expected a "
                                         f"*{SEQ_CLS_SUFFIX} checkpoint or a value-head model)")
        try:
            return json.loads(file.read_text())
        except ValueError as err:
            raise RewardModelFormatError(f"{file}: unreadable ({err})") from None
    from transformers import PretrainedConfig

    try:
        return PretrainedConfig.get_config_dict(str(path))[0]
    except OSError as err:
        raise RewardModelFormatError(f"{path}: neither a local directory nor a Hub model id with a config.json "
                                     f"({err})") from None


def checkpoint_format(path: str | Path) -> Format:
    """What ``path`` holds: ``seq_cls``, ``value_head`` (the previous layout) or ``backbone`` (a plain HF model)."""
    architectures = _config_dict(path).get("architectures") or []
    if any(str(a).endswith(SEQ_CLS_SUFFIX) for a in architectures):
        return "seq_cls"
    if (Path(path) / VALUE_HEAD_WEIGHTS).is_file():
        return "value_head"
    return "backbone"


# --------------------------------------------------------------------------- writing
def save_seq_cls(model: nn.Module, directory: str | Path, pad_token_id: int | None = None) -> None:
    """``model`` (a ``ValueHeadModel``) as a ``*ForSequenceClassification`` checkpoint (``save_pretrained``,
    safetensors) in ``directory``.

    ``pad_token_id`` (the tokenizer's; else the backbone config's) goes into the config, where HF's pooling reads
    it. The checkpoint's class is the backbone family's: it is built on the meta device and given the model's own
    backbone and head, so nothing is copied (under ZeRO-3, call it on the gathered module). A family without a
    decoder ``score`` head over the backbone (an encoder such as BERT) is an error naming ``directory``.
    """
    from transformers import AutoModelForSequenceClassification

    backbone, head = model.backbone, model.value_head
    config = copy.deepcopy(backbone.config)
    config.num_labels = 1  # id2label / label2id for one label
    config.pad_token_id = pad_token_id if pad_token_id is not None else config.pad_token_id
    if config.pad_token_id is None:
        raise RewardModelFormatError(f"{directory}: no pad_token_id to write into the reward model's config (HF "
                                     "pools the last non-pad token); give the tokenizer's")
    if hasattr(config, "use_cache"):
        config.use_cache = True  # training turned it off; a saved model is for inference
    try:
        cls = AutoModelForSequenceClassification._model_mapping[type(config)]
    except KeyError:
        raise RewardModelFormatError(f"{directory}: transformers has no *{SEQ_CLS_SUFFIX} for "
                                     f"{type(config).__name__} ({config.model_type})") from None
    with torch.device("meta"):
        shell = cls(config)
    prefix = shell.base_model_prefix
    own = getattr(shell, HEAD, None)
    if (not isinstance(own, nn.Linear) or type(getattr(shell, prefix, None)) is not type(backbone)
            or (own.bias is None) != (head.bias is None)):
        raise RewardModelFormatError(
            f"{directory}: {cls.__name__} is not a {type(backbone).__name__} backbone + `{HEAD}` Linear(hidden, 1"
            f"{', bias' if head.bias is not None else ''}); this model cannot be saved as a "
            f"*{SEQ_CLS_SUFFIX} checkpoint")
    setattr(shell, prefix, backbone)
    setattr(shell, HEAD, head)
    left = [n for n, p in shell.named_parameters() if p.is_meta]
    if left:
        raise RewardModelFormatError(f"{directory}: {cls.__name__} has parameters outside the backbone and head "
                                     f"({left[:3]}); cannot be saved as a *{SEQ_CLS_SUFFIX} checkpoint")
    shell.save_pretrained(Path(directory))


# --------------------------------------------------------------------------- reading
def _from_seq_cls(model_cls: type[nn.Module], seq_cls: nn.Module, path: str | Path) -> nn.Module:
    """The backbone and ``score`` head of a loaded ``*ForSequenceClassification`` as a ``model_cls``."""
    name = type(seq_cls).__name__
    head = getattr(seq_cls, HEAD, None)
    if not isinstance(head, nn.Linear):
        raise RewardModelFormatError(
            f"{path}: {name} has no `{HEAD}` Linear head over every token (an encoder classifier pools one token "
            "through its own layers); only decoder *ForSequenceClassification reward models are supported")
    if head.out_features != 1:
        raise RewardModelFormatError(f"{path}: {name} has num_labels={head.out_features}; a reward model has one "
                                     "label (one scalar score)")
    return model_cls(getattr(seq_cls, seq_cls.base_model_prefix), head)


def _load_legacy_head(model: nn.Module, path: Path) -> None:
    from safetensors.torch import load_file

    head_file = path / VALUE_HEAD_WEIGHTS
    weight = load_file(str(head_file))["weight"]
    if weight.shape != model.value_head.weight.shape:
        raise RewardModelFormatError(f"{head_file}: value head shape {tuple(weight.shape)} does not match the "
                                     f"backbone hidden size {model.value_head.in_features}")
    with torch.no_grad(), full_param(model.value_head.weight) as w:
        w.copy_(weight.to(w.dtype))


def load_value_model(model_cls: type[nn.Module], path: str | Path, *, trust_remote_code: bool = False,
                     attn_implementation: str = "sdpa", dtype: torch.dtype | None = None,
                     require_head: bool = False) -> nn.Module:
    """A ``model_cls(backbone, head=None)`` (``ValueHeadModel``, whose ``from_pretrained`` passes itself) from a
    ``*ForSequenceClassification`` checkpoint (directory or Hub id), a value-head directory of the previous
    layout, or (unless ``require_head``) a plain HF model with a fresh head.
    Errors (``RewardModelFormatError``, a ``ValueError``) name the path."""
    from transformers import AutoModel, AutoModelForSequenceClassification

    local = Path(path).is_dir()
    if local:
        verify_model_dir(Path(path))
    kind = checkpoint_format(path)
    if kind == "backbone" and require_head:
        raise RewardModelFormatError(
            f"{path}: not a reward / value model: config.json names no *{SEQ_CLS_SUFFIX} architecture and there is "
            f"no {VALUE_HEAD_WEIGHTS} (the previous value-head layout)")
    kw = {"use_safetensors": True, "trust_remote_code": trust_remote_code,
          "attn_implementation": attn_implementation, **({"dtype": dtype} if dtype is not None else {})}
    if kind == "seq_cls":
        seq_cls, info = AutoModelForSequenceClassification.from_pretrained(str(path), output_loading_info=True, **kw)
        if info.get("missing_keys"):  # transformers would start them at random: a reward nobody trained
            missing = sorted(info["missing_keys"])
            raise RewardModelFormatError(f"{path}: the checkpoint lacks weights of {type(seq_cls).__name__}: "
                                         f"{', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}")
        model = _from_seq_cls(model_cls, seq_cls, path)
    else:
        model = model_cls(AutoModel.from_pretrained(str(path), **kw))
        if kind == "value_head":
            _load_legacy_head(model, Path(path))
    if local and (Path(path) / ADAPTER_DIR).is_dir():
        from peft import PeftModel

        model.backbone = PeftModel.from_pretrained(model.backbone, str(Path(path) / ADAPTER_DIR)).merge_and_unload()
    if dtype is not None:
        model.value_head.to(dtype)
    return model
