"""SDPA for a compiled decode step of a GQA model: one query token, its query heads grouped over the KV heads.

For one query token transformers' SDPA path reshapes the query ``[B, H, 1, d]`` to ``[B, H_kv, H / H_kv, d]``
(``pack_gqa``), so attention reads the KV cache ``[B, H_kv, L, d]`` as it is. It does so eagerly only: traced
(``torch.compile``) it repeats the cache to ``[B, H, L, d]`` instead, a copy of the whole cache per layer and
step, which made the compiled decode slower than the eager one (docs/results/benchmarks-gpu-rollout.md). This
module registers, under :data:`GROUPED_SDPA` in transformers' attention and mask interfaces, the eager path's
computation for one query token, traced or not:

    q'  = q.reshape(B, H_kv, H / H_kv, d)                  the query heads of KV head k: rows of q'[:, k]
    o'  = SDPA(q', K, V, mask[B, 1, 1, L], scale)          every row masked alike
    o   = o'.reshape(B, H, 1, d).transpose(1, 2)           as transformers returns it

and transformers' own ``sdpa_attention_forward`` for everything else (prefill, MHA, a position bias).

:data:`GROUPED_PRODUCT` (``rlhf.rollout_attention: product``) is the same grouping with the attention written
out, for one query token of any model (MHA too):

    s   = (q' K^T) scale,  -inf where the mask is False   [B, H_kv, H / H_kv, L]
    o'  = softmax(s) V

The product is rounded to the model's dtype and the softmax taken in float32 at least, as transformers' eager
attention does (SDPA keeps the scores in float32: in bf16 the two differ by the scores' bf16 rounding).

An SDPA flash kernel tiles the queries 64 or 128 rows at a time, and a decode step gives it ``H / H_kv`` rows
per (row, KV head): on a GPU its attention took several times as long as reading the KV cache (run 8's profile
in docs/results/benchmarks-gpu-rollout.md). The two products read K and V once each, and the compile fuses the
mask and softmax between them. Whether that is faster on a GPU is not measured yet.

:func:`grouped_decode` runs a call under one of them and restores the model's own after, so training forwards
never see it.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch

GROUPED_SDPA = "rlhf_grouped_sdpa"
GROUPED_PRODUCT = "rlhf_grouped_product"
DECODE_ATTENTION = {"sdpa": GROUPED_SDPA, "product": GROUPED_PRODUCT}  # rlhf.rollout_attention -> implementation


def grouped_sdpa(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None, **kwargs):
    """transformers' attention-function signature; the module docstring's equations for one grouped query
    token."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    B, H, q_len, d = query.shape
    if q_len != 1 or groups == 1 or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    out = torch.nn.functional.scaled_dot_product_attention(query.reshape(B, H // groups, groups, d), key, value,
                                                           attn_mask=attention_mask, dropout_p=dropout, scale=scaling)
    return out.reshape(B, H, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def grouped_product(module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                    attention_mask: torch.Tensor | None, dropout: float = 0.0, scaling: float | None = None,
                    **kwargs):
    """transformers' attention-function signature; the module docstring's two products for one query token
    (``H / H_kv`` = 1 for MHA), transformers' SDPA for the rest."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    B, H, q_len, d = query.shape
    if q_len != 1 or dropout or kwargs.get("position_bias") is not None or kwargs.get("cache") is not None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    q = query.reshape(B, H // groups, groups, d)
    at_least_fp32 = torch.promote_types(query.dtype, torch.float32)
    s = torch.matmul(q, key.transpose(-1, -2)).to(at_least_fp32) * (d ** -0.5 if scaling is None else scaling)
    if attention_mask is not None:
        s = s.masked_fill(~attention_mask, float("-inf")) if attention_mask.dtype == torch.bool else s + attention_mask
    out = torch.matmul(s.softmax(dim=-1).to(value.dtype), value)
    return out.reshape(B, H, 1, value.shape[-1]).transpose(1, 2).contiguous(), None


def register() -> None:
    """Register :data:`GROUPED_SDPA` and :data:`GROUPED_PRODUCT` with transformers (idempotent); their masks are
    SDPA's."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    for name, fn in ((GROUPED_SDPA, grouped_sdpa), (GROUPED_PRODUCT, grouped_product)):
        AttentionInterface.register(name, fn)
        AttentionMaskInterface.register(name, sdpa_mask)


@contextmanager
def grouped_decode(config, implementation: str = GROUPED_SDPA):
    """Run the block with ``config``'s attention set to ``implementation`` (:data:`GROUPED_SDPA` or
    :data:`GROUPED_PRODUCT`; an SDPA model's only); restore it after."""
    own = config._attn_implementation
    config._attn_implementation = implementation
    try:
        yield
    finally:
        config._attn_implementation = own
