"""``ValueHeadModel``: a transformer backbone + ``Linear(hidden, 1)``: one value per token, a score per sequence.

Used as the reward model and later as the PPO critic (per-token values). A row's score is its value where
transformers' ``*ForSequenceClassification`` pools (``algos.masking.pooled_index``): the rightmost token whose id
is not ``pad_token_id`` (with pad = EOS, the token before a trailing EOS), so the scores of a saved RM, ours or
one from the Hub, are those ``AutoModelForSequenceClassification`` gives on the same token ids, and an RM trains
where it will be read. Works with left or right padding: position ids are derived from the attention mask, the
pooled index from the mask and the ids, vectorised.

The in-memory model that trains; on disk it is a transformers ``*ForSequenceClassification`` checkpoint (the
backbone + the head as ``score``, one label), which HF, TRL and OpenRLHF load unchanged: ``save_pretrained`` and
``from_pretrained`` go through ``rlhf_core.models.reward_format``, which also reads the value-head layout that came
before it and Hub / TRL reward models.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from rlhf_core.algos import gather_pooled
from rlhf_core.engine.distributed import full_param
from rlhf_core.models.reward_format import load_value_model, save_seq_cls
from rlhf_core.passes.prefix_cache import position_ids as positions_from_mask
from rlhf_core.passes.values import shared_prefix_scores


@dataclass
class ValueHeadOutput:
    values: torch.Tensor  # [B, T] one value per token (per new token, on top of a cache)
    scores: torch.Tensor  # [B] value at the pooled token (algos.masking.pooled_index)
    past_key_values: object | None = None  # the backbone's KV cache, with use_cache


class ValueHeadModel(nn.Module):
    """``AutoModel`` backbone + value head. ``forward(input_ids, attention_mask) -> ValueHeadOutput``.

    ``pad_token_id`` (default: the backbone config's) is the id the score skips, as transformers' pooling does;
    the RM stage sets the tokenizer's, the one ``save_pretrained`` writes into the checkpoint's config."""

    def __init__(self, backbone: nn.Module, value_head: nn.Linear | None = None, pad_token_id: int | None = None):
        super().__init__()
        self.backbone = backbone
        self.pad_token_id = pad_token_id if pad_token_id is not None else getattr(backbone.config, "pad_token_id",
                                                                                  None)
        hidden = self.base_config.hidden_size
        self.value_head = value_head if value_head is not None else nn.Linear(hidden, 1, bias=False)
        if value_head is None:
            with full_param(self.value_head.weight) as w:
                nn.init.normal_(w, mean=0.0, std=1.0 / (hidden + 1))  # OpenRLHF's init

    # ------------------------------------------------------------------ properties
    @property
    def base_config(self):
        """The backbone's ``PretrainedConfig`` (through a peft wrapper if present)."""
        return self.backbone.config

    @property
    def config(self):
        return self.base_config

    def gradient_checkpointing_enable(self, **kwargs) -> None:
        self.backbone.gradient_checkpointing_enable(**kwargs)

    def scale_head(self, factor: float) -> None:
        """Multiply the value head by ``factor`` (every value and score scales with it)."""
        with full_param(self.value_head.weight) as w, torch.no_grad():
            w.mul_(factor)

    # ------------------------------------------------------------------ forward
    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None, past_key_values=None,
                use_cache: bool = False) -> ValueHeadOutput:
        """Values of ``input_ids``; on top of ``past_key_values`` (a cache of the rows' earlier tokens),
        ``attention_mask`` and ``position_ids`` cover the full rows and the new tokens respectively."""
        if attention_mask is None:
            attention_mask = torch.ones_like(input_ids)
        if position_ids is None:
            position_ids = positions_from_mask(attention_mask)[:, -input_ids.shape[1]:]
        out = self.backbone(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                            past_key_values=past_key_values, use_cache=use_cache)
        hidden = out.last_hidden_state if hasattr(out, "last_hidden_state") else out[0]
        values = self.value_head(hidden.to(self.value_head.weight.dtype)).squeeze(-1)
        scores = gather_pooled(values, input_ids, attention_mask[:, -values.shape[1]:], self.pad_token_id)
        return ValueHeadOutput(values=values, scores=scores,
                               past_key_values=getattr(out, "past_key_values", None) if use_cache else None)

    def score(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.forward(input_ids, attention_mask).scores

    def shared_prefix_scores(self, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, owner: torch.Tensor,
                             suffix_ids: torch.Tensor, suffix_mask: torch.Tensor) -> torch.Tensor | None:
        """Scores ``[B]`` of the rows ``cat(prefix_ids[owner[i]], suffix_ids[i])`` with each prefix computed once
        (``passes.values.shared_prefix_scores``); None when the backbone's cache cannot be shared."""
        return shared_prefix_scores(self, prefix_ids, prefix_mask, owner, suffix_ids, suffix_mask)

    # ------------------------------------------------------------------ save / load
    def save_pretrained(self, directory: str | Path, pad_token_id: int | None = None) -> None:
        """A ``*ForSequenceClassification`` checkpoint (safetensors) with ``pad_token_id`` (the tokenizer's; else
        the backbone config's) in its config: ``reward_format.save_seq_cls``."""
        save_seq_cls(self, directory, pad_token_id)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, trust_remote_code: bool = False, attn_implementation: str = "sdpa",
                        dtype: torch.dtype | None = None, require_head: bool = False) -> ValueHeadModel:
        """A saved reward / value model (``*ForSequenceClassification``, directory or Hub id; or the previous
        value-head layout); a plain HF model directory (e.g. the SFT model) gets a fresh head unless
        ``require_head``: ``reward_format.load_value_model``. Safetensors only, a sealed directory checked against
        its manifest first (``CorruptModelError`` names the file)."""
        return load_value_model(cls, path, trust_remote_code=trust_remote_code, attn_implementation=attn_implementation,
                                dtype=dtype, require_head=require_head)
