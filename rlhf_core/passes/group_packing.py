"""A group's prompt once and its responses packed after it in one row, under a block-causal mask.

GRPO's G samples (PPO's ``samples_per_prompt``) of one prompt are scored by one row per group::

    rows   [pad, x, y_1, pad] [pad, x, y_2, pad] ...   ->   packed  [x, y_1[:-1], y_2[:-1], ..., y_G[:-1], pad]

Token ``k`` of ``y_j`` attends to the prompt ``x`` and to ``y_j[:k]`` only (the mask below), at the position
it has in its own row (``|x| + k``), so its hidden states, and the logits, are those of the row up to float
rounding. The logit that scores ``y_j[0]`` is the prompt's last position, shared by the group; ``y_j[k]`` is
scored at ``y_j[k - 1]``. A response's last token scores nothing and is not fed. So a group costs
``|x| + sum_j (|y_j| - 1)`` positions (:func:`packed_width`), padded to the widest group, in one pass with no KV
cache to index, against ``generation.shared_prefix_logits`` (the prompt's cache indexed out to length buckets)
and the plain forward: timings in docs/results/benchmarks-gpu-passes.md (the demo's on CPU in
docs/results/benchmarks-rl-speed.md).

The mask is a dense ``[U, 1, W, W]`` boolean for ``scaled_dot_product_attention`` (transformers passes a 4D mask
through as is), and it is all that decides what a token sees only where every layer attends to all earlier
positions: models running ``attn_implementation="sdpa"`` with no sliding window and no convolutional or
recurrent layer are packed (:func:`supports_packing`; a window counts columns, which packing moves, and a
convolution or recurrence runs along the packed row across the responses). Rows are packed only up to
``PACK_MAX_WIDTH`` columns, beyond which attention over the packed row (quadratic in its width) outgrows what
padding costs; the caller checks :func:`packed_width` before :func:`pack_groups` builds the mask. Otherwise the
caller falls back to the shared-prefix cache, or to plain forwards where the model cannot share it
(``prefix_cache.supports_prefix_cache``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_core.passes.prefix_cache import model_config, recurrent_layers, refused, response_lengths, windowed_attention

# Attention over a packed row grows with its width squared: the widest row packed, where packing stopped paying
# against the shared cache (docs/results/benchmarks-gpu-passes.md, "Packed groups on a GPU, and where packing stops
# paying").
PACK_MAX_WIDTH = 2560


@dataclass(frozen=True)
class PackedGroups:
    """One row per group: ``input_ids``/``position_ids`` ``[U, W]``, ``attention_mask`` ``[U, 1, W, W]`` (True:
    attend); ``index`` ``[B, R]`` the flat position ``u W + w`` of the logit that scores each response token,
    ``valid`` ``[B, R]`` the masked-in response tokens."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    attention_mask: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor

    @property
    def width(self) -> int:
        return self.input_ids.shape[1]


def _sdpa(config) -> str | None:
    attn = getattr(config, "_attn_implementation", None)
    return None if attn == "sdpa" else f"attention {attn}, not sdpa"


def supports_packing(model) -> bool:
    """True when ``model`` (an HF model, or a wrapper exposing it as ``.module``) attends with SDPA and every layer
    to all earlier positions (no window: ``prefix_cache.windowed_attention``; no convolution or recurrence:
    ``prefix_cache.recurrent_layers``); a refusal is logged once. False without a config."""
    return model_config(model) is not None and not refused(
        model, "group packing", "the groups share the prompt's cache or go through whole", _sdpa,
        recurrent_layers, windowed_attention)


def _group_sizes(attention_mask: torch.Tensor, response_len: int, first: torch.Tensor, owner: torch.Tensor):
    """``(prompt_len [U], lengths [B], fed [B], width [U])``: each run's prompt length, each row's response length
    and the tokens it feeds (all but its last), each run's packed width ``|x| + sum_j fed_j``."""
    P = attention_mask.shape[1] - response_len
    prompt_len = attention_mask[first, :P].sum(dim=1)
    lengths = response_lengths(attention_mask[:, P:])
    fed = (lengths - 1).clamp(min=0)
    return prompt_len, lengths, fed, prompt_len + torch.zeros_like(prompt_len).index_add(0, owner, fed)


def packed_width(attention_mask: torch.Tensor, response_len: int, first: torch.Tensor, owner: torch.Tensor) -> int:
    """``W``, the width of :func:`pack_groups`' rows (the widest run's ``|x| + sum_j (|y_j| - 1)``), from the mask
    alone: compare it with ``PACK_MAX_WIDTH`` before the ``[U, 1, W, W]`` mask is built."""
    return int(_group_sizes(attention_mask, response_len, first, owner)[3].max())


def pack_groups(sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int, first: torch.Tensor,
                owner: torch.Tensor) -> PackedGroups:
    """Pack rows ``[B, P + R]`` (prompts left-padded to ``P`` columns, responses right-padded to ``R``) whose runs
    share a prompt (``first``: each run's first row; ``owner``: each row's run, as
    ``generation.shared_prefix_split`` gives them) into one row per run, prompt first, then each row's response
    but its last token (padding: token 0, attending to itself only). The mask takes ``U W^2`` bytes: check
    :func:`packed_width` first."""
    B, T = sequences.shape
    R, dev = response_len, sequences.device
    P = T - R
    prompt_len, lengths, fed, width = _group_sizes(attention_mask, R, first, owner)
    cols = torch.arange(P, device=dev)
    shift = (cols[None, :] + (P - prompt_len)[:, None]).clamp(max=P - 1)
    prompts = sequences[first, :P].gather(1, shift)  # each prompt's real tokens from column 0
    before = fed.cumsum(0) - fed
    start = prompt_len[owner] + before - before[first][owner]  # [B] column of each row's first fed token
    U, W = len(prompt_len), int(width.max())

    wcols = torch.arange(W, device=dev)
    in_prompt = wcols[None, :] < prompt_len[:, None]
    ids = torch.zeros((U, W), dtype=sequences.dtype, device=dev)
    ids[:, :min(P, W)] = torch.where(in_prompt[:, :P], prompts[:, :W], 0)
    pos = torch.where(in_prompt, wcols[None, :], 0)
    segment = torch.where(in_prompt, 0, -1)  # 0: the prompt, i + 1: row i's response, -1: padding

    k = torch.arange(R, device=dev)
    feeds = k[None, :] < fed[:, None]  # [B, R]
    run = owner[:, None].expand(B, R)[feeds]
    dest = (start[:, None] + k[None, :])[feeds]
    ids[run, dest] = sequences[:, P:][feeds]
    pos[run, dest] = (prompt_len[owner][:, None] + k[None, :])[feeds]
    segment[run, dest] = (torch.arange(B, device=dev)[:, None] + 1).expand(B, R)[feeds]

    real = segment >= 0
    causal = wcols[None, :] <= wcols[:, None]
    sees = (segment[:, None, :] == 0) | (segment[:, None, :] == segment[:, :, None])
    mask = (causal[None] & sees & real[:, None, :] & real[:, :, None]) | torch.eye(W, dtype=torch.bool, device=dev)
    valid = k[None, :] < lengths[:, None]
    scorer = torch.where(k[None, :] == 0, (prompt_len[owner] - 1)[:, None], start[:, None] + k[None, :] - 1)
    index = owner[:, None] * W + torch.where(valid, scorer, 0)
    return PackedGroups(ids, pos, mask[:, None], index, valid)


def packed_logits(model, packed: PackedGroups) -> torch.Tensor:
    """Logits ``[B, R, V]`` of the response tokens from one pass over the packed rows; 0 where not ``valid``.
    Only the columns from the shortest prompt's last token on reach the LM head (``logits_to_keep``)."""
    W = packed.width
    first_scoring = int((packed.index % W).masked_fill(~packed.valid, W - 1).min())
    keep = W - first_scoring
    logits = model(input_ids=packed.input_ids, attention_mask=packed.attention_mask,
                   position_ids=packed.position_ids, logits_to_keep=keep, use_cache=False).logits
    flat = logits.reshape(-1, logits.shape[-1])
    row, col = packed.index // W, packed.index % W - first_scoring
    out = flat[(row * keep + col.clamp(min=0)).reshape(-1)].reshape(*packed.index.shape, -1)
    return torch.where(packed.valid[..., None], out, 0)
