"""Building, checking, adapting (LoRA) and saving the models the stages train.

- The base policy is ``models/base``: the model ``model.name_or_path`` names (a GGUF file or a package that
  ships one, a local HF folder, a Hub id), imported there by prepare (``models.importing``), or, when null,
  a fresh tiny Llama from ``models/base/config.json`` initialised with ``project.seed``.
- The tokenizer always comes from ``models/base`` (written by prepare).
- Saved models are plain HF directories (``save_pretrained``, safetensors) + tokenizer + ``rlhf_meta.json``;
  a reward model / critic is a ``*ForSequenceClassification`` checkpoint (``rlhf_core.models.reward_format``).
  LoRA adapters are merged on save by default; unmerged, the adapter goes to ``<dir>/adapter/`` next
  to the base weights and ``load_causal_lm`` (``ValueHeadModel.from_pretrained``) re-applies it.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from transformers.models.auto.configuration_auto import CONFIG_MAPPING
from transformers.models.auto.modeling_auto import (
    MODEL_FOR_CAUSAL_LM_MAPPING,
    MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING,
)
from transformers.models.auto.tokenization_auto import TOKENIZER_MAPPING

from rlhf_core.config import ComputeConfig, LoraConfig, Params
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.engine.errors import TrainingInputError
from rlhf_core.models.lean_norm import use_lean_rmsnorm
from rlhf_core.models.value_head import ValueHeadModel
from rlhf_core.ops import paths
from rlhf_core.ops.integrity import verify_model_dir
from rlhf_core.ops.paths import ADAPTER_DIR


# --------------------------------------------------------------------------- tokenizer
def load_training_tokenizer(root: str | Path, params: Params):
    """The tokenizer in ``models/base`` (left padding), checked against its manifest (``CorruptModelError``);
    missing pad/EOS tokens are errors naming the path."""
    path = Path(root) / paths.BASE_MODEL
    if not (path / "tokenizer_config.json").exists() and not (path / "tokenizer.json").exists():
        raise TrainingInputError(f"{path}: no tokenizer found; run `rlhf stage prepare` first")
    verify_model_dir(path)
    try:
        tok = load_tokenizer(path, params.model.trust_remote_code)
    except ValueError as err:
        raise TrainingInputError(str(err)) from None
    if tok.pad_token_id is None:
        raise TrainingInputError(f"tokenizer at {path} has no pad token; set one (distinct from EOS) and save it")
    return tok


def import_architecture(model_dir: Path) -> None:
    """Import the transformers modules of ``model_dir``'s architecture (its config, tokenizer, causal LM and
    sequence classifier classes), loading nothing: a process that then forks workers (``rm.parallel``) hands
    them over instead of each worker importing them again. A directory without a ``config.json``, or whose
    ``model_type`` transformers does not know (remote code), imports nothing."""
    config_file = model_dir / "config.json"
    model_type = json.loads(config_file.read_text()).get("model_type") if config_file.is_file() else None
    if model_type not in CONFIG_MAPPING:
        return
    config_class = CONFIG_MAPPING[model_type]
    for mapping in (TOKENIZER_MAPPING, MODEL_FOR_CAUSAL_LM_MAPPING, MODEL_FOR_SEQUENCE_CLASSIFICATION_MAPPING):
        mapping.get(config_class, None)  # a lazy mapping: the lookup imports the class's module


# --------------------------------------------------------------------------- checks
def embedding_rows(model: torch.nn.Module) -> int:
    """Rows of the input embedding (works on ZeRO-3 partitioned parameters)."""
    base = model.backbone if isinstance(model, ValueHeadModel) else model
    weight = base.get_input_embeddings().weight
    return int(getattr(weight, "ds_shape", weight.shape)[0])


def check_vocab_fits(tokenizer, model: torch.nn.Module, model_name: str) -> None:
    rows = embedding_rows(model)
    if len(tokenizer) > rows:
        raise TrainingInputError(
            f"tokenizer vocab does not fit the model: tokenizer has {len(tokenizer)} tokens but {model_name} has "
            f"{rows} embedding rows; use the model's own tokenizer (model.tokenizer) or re-run prepare")
    special = {"pad": tokenizer.pad_token_id, "eos": tokenizer.eos_token_id}
    too_big = {k: v for k, v in special.items() if v is not None and v >= rows}
    if too_big:
        raise TrainingInputError(f"special token ids {too_big} are outside {model_name}'s {rows} embedding rows")


# --------------------------------------------------------------------------- building
def _model_kwargs(params: Params) -> dict:
    return {"trust_remote_code": params.model.trust_remote_code,
            "attn_implementation": params.compute.attn_implementation}


def imported_base(params: Params, root: str | Path) -> Path | None:
    """``models/base`` when it holds the imported ``model.name_or_path`` (None for the tiny demo model); an error
    names the folder when prepare has not imported it."""
    if not params.model.name_or_path:
        return None
    path = Path(root) / paths.BASE_MODEL
    if not (path / "config.json").is_file() or not any(path.glob("*.safetensors")):
        raise TrainingInputError(f"{path}: no imported base model (config.json + safetensors) for model.name_or_path "
                                 f"{params.model.name_or_path}; run `rlhf stage prepare`")
    verify_model_dir(path)
    return path


def base_model_source(params: Params, root: str | Path) -> str:
    """Where the base weights come from: ``models/base`` (imported) or ``models/base/config.json`` (fresh init)."""
    imported = imported_base(params, root)
    if imported is not None:
        return str(imported)
    config = Path(root) / paths.BASE_MODEL / "config.json"
    if not config.exists():
        raise TrainingInputError(f"{config} not found and model.name_or_path is null; run `rlhf stage prepare`")
    return str(config)


def build_causal_lm(params: Params, root: str | Path) -> torch.nn.Module:
    """The base policy: ``from_pretrained(models/base)`` or a fresh tiny Llama seeded by ``project.seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    kw = _model_kwargs(params)
    imported = imported_base(params, root)
    if imported is not None:
        return AutoModelForCausalLM.from_pretrained(str(imported), use_safetensors=True, **kw)
    config = AutoConfig.from_pretrained(str(Path(root) / paths.BASE_MODEL), trust_remote_code=False)
    torch.manual_seed(params.project.seed)
    return AutoModelForCausalLM.from_config(config, attn_implementation=kw["attn_implementation"])


def build_value_model(params: Params, root: str | Path, init_from: str,
                      previous: str | Path | None = None) -> ValueHeadModel:
    """Reward model / critic: backbone from ``models/sft`` (``init_from='sft'``) or the base model, fresh head;
    ``init_from='previous'``: a saved reward model at ``previous`` (relative to ``root``), backbone and head
    (a feedback round continues from the previous round's RM)."""
    from transformers import AutoConfig, AutoModel

    kw = _model_kwargs(params)
    torch.manual_seed(params.project.seed + 1)
    if init_from == "previous":
        path = Path(root) / Path(previous)
        if not (path / "config.json").exists():
            raise TrainingInputError(f"{path}: no reward model to continue from; run `rlhf stage feedback` for this "
                                     "round first or set feedback.rm_init: sft")
        return ValueHeadModel.from_pretrained(path, require_head=True, **kw)
    if init_from == "sft":
        path = Path(root) / paths.SFT_MODEL
        if not (path / "config.json").exists():
            raise TrainingInputError(f"{path}: no SFT model; run `rlhf stage sft` first or set rm.init_from: base")
        if (path / ADAPTER_DIR).exists():  # unmerged LoRA SFT: merge, then take the causal LM's backbone
            causal = load_causal_lm(path, **kw)
            return ValueHeadModel(causal.base_model)
        return ValueHeadModel.from_pretrained(path, **kw)
    imported = imported_base(params, root)
    if imported is not None:
        backbone = AutoModel.from_pretrained(str(imported), use_safetensors=True, **kw)
    else:
        config = AutoConfig.from_pretrained(str(Path(root) / paths.BASE_MODEL))
        backbone = AutoModel.from_config(config, attn_implementation=kw["attn_implementation"])
    return ValueHeadModel(backbone)


def apply_lora(model: torch.nn.Module, lora: LoraConfig, seed: int) -> torch.nn.Module:
    """Wrap with peft LoRA adapters; for a ValueHeadModel the backbone is adapted and the head stays trainable.
    The adapters' random init is drawn after ``torch.manual_seed(seed)``: it depends on the seed alone, not on
    what drew from the global generator before (a model loaded from a folder draws nothing). That reseeds the
    global generator, so the caller's later draws follow from ``seed`` too."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    def cfg(task_type):
        return PeftLoraConfig(r=lora.r, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                              target_modules=list(lora.target_modules), task_type=task_type, bias="none")

    torch.manual_seed(seed)
    if isinstance(model, ValueHeadModel):
        model.backbone = get_peft_model(model.backbone, cfg(None))
        target = model.backbone
    else:
        model = get_peft_model(model, cfg("CAUSAL_LM"))
        target = model
    if not lora.only_optimize_lora:
        for p in target.parameters():
            p.requires_grad_(True)
    if isinstance(model, ValueHeadModel):
        model.value_head.requires_grad_(True)
    return model


def prepare_for_training(model: torch.nn.Module, compute: ComputeConfig, seed: int) -> torch.nn.Module:
    """The lean RMSNorm (``lean_norm``: its input and one float per row kept for backward), LoRA (its init seeded
    by ``seed``) and gradient checkpointing, as configured; KV cache off."""
    cfg = model.config
    if hasattr(cfg, "use_cache"):
        cfg.use_cache = False
    if compute.lean_rmsnorm:
        use_lean_rmsnorm(model)
    if compute.lora.enabled:
        model = apply_lora(model, compute.lora, seed)
    if compute.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def disable_dropout(model: torch.nn.Module) -> torch.nn.Module:
    """Every dropout off (TRL's ``disable_dropout_in_model``), for RL's policy and critic.

    The rollout pass runs in eval mode and the training pass in train mode: with dropout on (a checkpoint's
    ``attention_dropout``, ``compute.lora.dropout``) the same tokens get different log-probs and the first
    PPO ratio is not 1. Zeroes ``nn.Dropout`` modules (LoRA's included) and the float ``*dropout*``
    attributes that attention layers pass to the kernel, in the modules and their configs.
    """
    for m in model.modules():
        if isinstance(m, torch.nn.Dropout):
            m.p = 0.0
        for obj in (m, getattr(m, "config", None)):
            for name in [n for n in vars(obj) if "dropout" in n] if obj is not None else ():
                if isinstance(getattr(obj, name), float):
                    setattr(obj, name, 0.0)
    return model


# --------------------------------------------------------------------------- saving / loading
def _is_peft(model) -> bool:
    try:
        from peft import PeftModel
    except ImportError:  # pragma: no cover
        return False
    return isinstance(model, PeftModel)


def _export_backbone(model, directory: Path, merge: bool):
    """The plain HF model to save (LoRA merged, or adapter written to ``directory/adapter`` and unloaded)."""
    if not _is_peft(model):
        return model
    if merge:
        return model.merge_and_unload()
    model.save_pretrained(directory / ADAPTER_DIR)
    return model.unload()


def save_causal_lm(model, directory: str | Path, merge_lora: bool = True) -> None:
    """``save_pretrained`` (safetensors) of a policy, LoRA merged (default) or saved beside it."""
    directory = Path(directory)
    model = _export_backbone(model, directory, merge_lora)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = True
    model.save_pretrained(directory)
    gen = getattr(model, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(directory)


def save_value_model(model: ValueHeadModel, directory: str | Path, merge_lora: bool = True,
                     pad_token_id: int | None = None) -> None:
    """A reward model / critic as a ``*ForSequenceClassification`` checkpoint (``reward_format.save_seq_cls``),
    LoRA merged (default) or its adapter saved beside it; ``pad_token_id``: the tokenizer's, for HF's pooling."""
    directory = Path(directory)
    backbone = _export_backbone(model.backbone, directory, merge_lora)
    ValueHeadModel(backbone, model.value_head).save_pretrained(directory, pad_token_id)


def load_causal_lm(path: str | Path, *, trust_remote_code: bool = False, dtype: torch.dtype | None = None,
                   attn_implementation: str = "sdpa") -> torch.nn.Module:
    """A saved policy (``models/sft``, later ``models/actor``), with an unmerged adapter re-applied and merged;
    a directory a stage sealed is checked against its manifest first (``CorruptModelError`` names the file)."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    verify_model_dir(path)
    model = AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True, trust_remote_code=trust_remote_code,
                                                 attn_implementation=attn_implementation,
                                                 **({"dtype": dtype} if dtype is not None else {}))
    if (path / ADAPTER_DIR).exists():
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, str(path / ADAPTER_DIR)).merge_and_unload()
    return model
