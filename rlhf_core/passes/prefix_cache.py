"""The KV cache of left-padded prompt prefixes, with the head they all share computed once.

Prompts of one batch usually open alike: a BOS, a system prompt, a chat template's user turn (the demo's
``"Human: What is "``, 4 of its 9-11 tokens). Causal attention makes the keys and values of such a head the
same in every row, so it can go through the model once and its cache be indexed out to the rows, as the
group's prompt already is for its G samples (``generation.shared_prefix_logits``). The rows are re-laid out
so that the head comes first::

    [pad^p, h_1..h_K, r_1..r_m]   ->   [h_1..h_K, pad^p, r_1..r_m]

Positions count real tokens only (``position_ids``) and masked keys add nothing to attention, so every real
token sees the same keys at the same positions as in the left-padded row: the same outputs up to float
rounding. The index that repeats the head is a gather, so the head's gradient is the sum over its rows.

``prefix_cache`` serves the actor's and reference's log-prob passes, the critic and the reward model's scoring,
for models whose every layer is full attention (:func:`supports_prefix_cache`): a layer that carries a state
along the row (convolution, recurrence, linear attention) has no cache to index by rows, and a sliding window
counts columns, which the re-layout moves. Their callers run the full rows instead.

What attends to the cache are the rows' right-padded responses, mostly shorter than the longest. The rows are
cut into at most two buckets by length (``length_buckets``), each computed only as wide as its longest row
(``by_length``): on the demo a third of the response positions were padding.
"""

from __future__ import annotations

import copy
import functools
import logging
from collections.abc import Callable

import torch

from rlhf_core.engine import distributed as D

log = logging.getLogger(__name__)

# Layer kinds (``config.layer_types``) that keep keys and values per row and nothing else
ATTENTION_LAYERS = frozenset({"full_attention", "sliding_attention"})
# Model types whose layers carry a state along the row (convolution, recurrence, state space), for configs that
# list no ``layer_types`` (older transformers releases, remote code)
RECURRENT_MODEL_TYPES = frozenset({
    "bamba", "falcon_h1", "falcon_mamba", "granitemoehybrid", "jamba", "lfm2", "lfm2_moe", "mamba", "mamba2",
    "minimax", "nemotron_h", "qwen3_next", "recurrent_gemma", "rwkv", "xlstm", "zamba", "zamba2"})


def model_config(model):
    """The (text) config of ``model``, an HF model or a wrapper exposing one as ``.module``; None if it has none."""
    for _ in range(4):
        config = getattr(model, "config", None)
        if config is not None:
            return config.get_text_config() if hasattr(config, "get_text_config") else config
        model = getattr(model, "module", None)
    return None


def recurrent_layers(config) -> str | None:
    """Why a layer of ``config`` carries a state along the row besides keys and values (a layer type other than
    ``ATTENTION_LAYERS``; without ``layer_types``, a model type of ``RECURRENT_MODEL_TYPES``), or None."""
    types = set(getattr(config, "layer_types", None) or ())
    if types:
        other = sorted(types - ATTENTION_LAYERS)
        return f"layer types {other}" if other else None
    model_type = getattr(config, "model_type", None)
    return f"model type {model_type}" if model_type in RECURRENT_MODEL_TYPES else None


def windowed_attention(config) -> str | None:
    """Why a layer of ``config`` attends to less than every earlier position (a sliding window, unless
    ``use_sliding_window`` is False; a layer type other than ``full_attention``), or None."""
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) is not False:
        return f"sliding window {window}"
    other = sorted(set(getattr(config, "layer_types", None) or ()) - {"full_attention"})
    return f"layer types {other}" if other else None


@functools.cache
def warn_once(message: str) -> None:
    """Log ``message`` (a fallback and its reason) the first time only, per process."""
    log.warning(message)


def refused(model, what: str, fallback: str, *checks: Callable) -> bool:
    """True when a check (``config -> reason | None``) of ``model``'s config gives a reason; the first refusal of
    ``what`` per model type and reason is logged with the ``fallback`` taken. False without a config."""
    config = model_config(model)
    reasons = [check(config) for check in checks] if config is not None else []
    why = next((r for r in reasons if r is not None), None)
    if why is not None:
        warn_once(f"{what} is off for model type {getattr(config, 'model_type', '?')} ({why}): {fallback}")
    return why is not None


def supports_prefix_cache(model) -> bool:
    """True unless a layer of ``model`` carries a state along the row or has a window (:func:`recurrent_layers`,
    :func:`windowed_attention`); a refusal is logged once. Models without a config are tried (and their caller
    falls back when the cache :func:`prefix_cache` gets cannot be indexed)."""
    return not refused(model, "the shared prompt cache", "their rows go through whole",
                        recurrent_layers, windowed_attention)


def checkpointed(model) -> bool:
    """True in a forward whose layers re-run in backward (gradient checkpointing, training, gradients on) of
    ``model`` (or the module a wrapper exposes as ``.module``): such a forward must not share a prompt's KV cache,
    which each re-run would append to again."""
    while not isinstance(model, torch.nn.Module) and hasattr(model, "module"):
        model = model.module
    return (isinstance(model, torch.nn.Module) and torch.is_grad_enabled() and model.training
            and any(getattr(m, "gradient_checkpointing", False) is True for m in model.modules()))


def supports_cache_repeat(model) -> bool:
    """True unless a layer of ``model`` carries a state along the row (:func:`recurrent_layers`): a windowed KV
    cache repeats to rows as a full one does (``generation.prefilled_cache``); a refusal is logged once."""
    return not refused(model, "the rollout's shared prefill", "each row prefills itself", recurrent_layers)


# forward(input_ids, attention_mask over the cache and the new tokens, position_ids of the new tokens, cache)
#   -> the cache extended by the new tokens
CacheForward = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, object], object]


def position_ids(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions that count real tokens only: cumsum(mask) - 1, clamped at 0 (padding anywhere is skipped)."""
    return (attention_mask.long().cumsum(dim=-1) - 1).clamp(min=0)


def common_head(ids: torch.Tensor, mask: torch.Tensor) -> tuple[int, torch.Tensor, torch.Tensor]:
    """``(K, ids', mask')``: K, the number of real tokens every left-padded row of ``ids`` ``[N, C]`` opens
    with, capped at the shortest row's length minus one (each row keeps a token of its own); and the rows
    re-laid out head first (column ``j < K`` takes ``p + j``, ``K <= j < K + p`` takes the pad ``j - K``, the
    rest stay, with ``p`` the row's padding). ``K = 0`` and the rows unchanged when there are fewer than two
    rows or a row is not left-padded."""
    N, C = ids.shape
    lengths = mask.sum(dim=1)
    pad = C - lengths
    cols = torch.arange(C, device=ids.device)
    left_padded = torch.equal(mask.bool(), cols[None, :] >= pad[:, None])
    if N < 2 or not left_padded:
        return 0, ids, mask
    aligned = ids.gather(1, (cols[None, :] + pad[:, None]).clamp(max=C - 1))  # row i's real tokens from column 0
    agree = (aligned == aligned[:1]).all(dim=0) & (cols < int(lengths.min()) - 1)
    K = int(agree.long().cumprod(dim=0).sum())
    if K == 0:
        return 0, ids, mask
    src = torch.where(cols < K, cols + pad[:, None], torch.where(cols < K + pad[:, None], cols - K, cols))
    return K, ids.gather(1, src), mask.gather(1, src)


def prefix_cache(forward: CacheForward, ids: torch.Tensor, mask: torch.Tensor,
                 hoist: bool = True) -> tuple[object, torch.Tensor]:
    """The KV cache of the left-padded prefixes ``ids`` ``[N, C]`` and the attention mask ``[N, C]`` of its
    columns (re-laid out by :func:`common_head`); what attends to the cache must extend that mask. Index it out
    to rows with :func:`select_rows`.

    The common head goes through ``forward`` once (one row, K positions) and is indexed out to the N prefixes,
    then each prefix's remaining ``C - K`` columns go through on top of it: ``K + N (C - K)`` positions instead
    of ``N C`` (one pass, as the rows are, without ``hoist``). The cache is None when the model's cannot be
    indexed (a remote-code model's tuples)."""
    K, ids, mask = common_head(ids, mask) if hoist else (0, ids, mask)
    pos = position_ids(mask)
    if K == 0:
        cache = forward(ids, mask, pos, None)
    else:
        head = forward(ids[:1, :K], mask[:1, :K], pos[:1, :K], None)
        if not hasattr(head, "batch_select_indices"):
            return None, mask
        head.batch_select_indices(torch.zeros(len(ids), dtype=torch.long, device=ids.device))
        cache = forward(ids[:, K:], mask, pos[:, K:], head)
    return (cache if hasattr(cache, "batch_select_indices") else None), mask


# forward(input_ids, attention_mask over the cache and the new tokens, cache) -> the output for the new tokens
SuffixForward = Callable[[torch.Tensor, torch.Tensor, object], torch.Tensor]


def on_shared_prefixes(cache_forward: CacheForward, suffix_forward: SuffixForward, prefix_ids: torch.Tensor,
                       prefix_mask: torch.Tensor, owner: torch.Tensor, suffix_ids: torch.Tensor,
                       suffix_mask: torch.Tensor, lengths: torch.Tensor, width: int | None = None,
                       lockstep: bool = False) -> torch.Tensor | None:
    """``suffix_forward`` over the rows ``cat(prefix_ids[owner[i]], suffix_ids[i])`` with each prefix computed once
    (:func:`prefix_cache`), the rows in buckets of ``lengths`` (:func:`by_length`): per bucket of width ``w`` the
    cache is indexed out to its rows (:func:`select_rows`) and their first ``w`` suffix columns attend to it,
    under the prefix mask extended by theirs. The output as :func:`by_length` assembles it (``width``: per
    column); None when the model's cache cannot be indexed.

    The passes this makes depend on the rows: a common head or not, one bucket or two. ``lockstep`` (ZeRO-3 over
    several ranks: ``distributed.forwards_in_lockstep``) makes every rank choose alike: the head hoisted only
    where every rank has one, two buckets only where every rank would cut its rows in two."""
    hoist, two = common_head(prefix_ids, prefix_mask)[0] > 0, len(length_buckets(lengths)) > 1
    if lockstep:
        hoist, two = D.all_agree(hoist, two)
    cache, cache_mask = prefix_cache(cache_forward, prefix_ids, prefix_mask, hoist)
    if cache is None:
        return None

    def bucket(rows: torch.Tensor, w: int) -> torch.Tensor:
        mask = torch.cat([cache_mask[owner[rows]], suffix_mask[rows, :w]], dim=1)
        return suffix_forward(suffix_ids[rows, :w], mask, select_rows(cache, owner[rows]))

    return by_length(lengths, bucket, width, max_buckets=2 if two else 1)


def select_rows(cache, rows: torch.Tensor):
    """A new cache holding rows ``rows`` of ``cache`` (a gather: differentiable; ``cache`` is left as it was)."""
    out = copy.copy(cache)
    out.layers = [copy.copy(layer) for layer in cache.layers]
    out.batch_select_indices(rows)
    return out


# A second bucket costs another pass through the model's layers; below this share of the positions saved it
# costs more than it saves (the measurement that set it: docs/rlhf.md, "Length buckets where the cache is shared").
MIN_BUCKET_SAVING = 0.25


def length_buckets(lengths: torch.Tensor, max_buckets: int = 2) -> list[tuple[torch.Tensor, int]]:
    """Rows ``[B]`` of ``lengths`` as ``[(rows, width)]``: one bucket of all rows at the longest length, or two
    (the rows up to a cut length ``c``, the rest) when ``max_buckets`` allows and the cut that minimises the
    positions computed, ``n(<= c) c + n(> c) max``, saves at least ``MIN_BUCKET_SAVING`` of ``B max``. Widths
    are at least 1."""
    lens = lengths.long().clamp(min=1).cpu()
    W, B = int(lens.max()), len(lens)
    values = torch.unique(lens)[:-1]
    short = (lens[None, :] <= values[:, None]).sum(dim=1)
    cost = short * values + (B - short) * W
    if max_buckets < 2 or len(values) == 0 or int(cost.min()) > (1 - MIN_BUCKET_SAVING) * B * W:
        return [(torch.arange(B, device=lengths.device), W)]
    cut = int(values[cost.argmin()])
    rows = torch.arange(B)
    return [(rows[lens <= cut].to(lengths.device), cut), (rows[lens > cut].to(lengths.device), W)]


def by_length(lengths: torch.Tensor, compute: Callable[[torch.Tensor, int], torch.Tensor],
              width: int | None = None, max_buckets: int = 2) -> torch.Tensor:
    """``compute(rows, w)`` per bucket of :func:`length_buckets` (the rows' first ``w`` columns), put back in row
    order: ``[B, ...]`` from parts ``[len(rows), ...]`` (one value per row, e.g. a score); with ``width``,
    ``[B, width, ...]`` from parts ``[len(rows), w, ...]``, the columns past a row's bucket width 0 (they must
    be masked)."""
    buckets = length_buckets(lengths, max_buckets)
    if len(buckets) == 1 and width in (None, buckets[0][1]):
        return compute(*buckets[0])
    out = None
    for rows, w in buckets:
        part = compute(rows, w)
        if out is None:
            shape = (len(lengths), *part.shape[1:]) if width is None else (len(lengths), width, *part.shape[2:])
            out = part.new_zeros(shape)
        if width is None:
            out[rows] = part
        else:
            out[rows, :w] = part
    return out


def response_lengths(response_mask: torch.Tensor) -> torch.Tensor:
    """``[B]``: each row's last masked-in column + 1 (0 for an all-masked row) of a ``[B, R]`` response mask."""
    cols = torch.arange(1, response_mask.shape[1] + 1, device=response_mask.device)
    return (response_mask.bool() * cols).amax(dim=1)
