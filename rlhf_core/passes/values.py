"""The value model's forwards on shared prompts: the critic's per-action values of the response tokens, and a reward
model's scores, each prompt's KV cache computed once for all its rows."""

from __future__ import annotations

import torch

from rlhf_core.engine import distributed as D
from rlhf_core.passes.generation import position_ids, shared_prefix_split
from rlhf_core.passes.prefix_cache import checkpointed, on_shared_prefixes, response_lengths, supports_prefix_cache


def sequence_values(critic, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                    group: torch.Tensor | None = None) -> torch.Tensor:
    """Critic values ``[B, R]`` of the response actions: the value head at positions ``-R-1 .. -2`` (the state
    before each response token; the last token is not fed).

    ``group`` (rows of one prompt consecutive): each prompt but its last token goes through the critic once and
    its KV cache is indexed out to its rows per bucket of response lengths, as the actor's log-prob pass does
    (``generation.shared_prefix_logits``); the same values and gradients at the masked-in positions up to float
    rounding, 0 past a row's bucket width. Models that cannot share the cache (``supports_prefix_cache``), a
    checkpointed training forward (``prefix_cache.checkpointed``: its layers re-run in backward), and
    under ZeRO-3 over several ranks all ranks unless every one can, run the full rows.
    """
    split = shared_prefix_split(sequences, attention_mask, response_len, group) if group is not None else None
    shares = split is not None and not checkpointed(critic) and supports_prefix_cache(critic)
    lockstep = D.forwards_in_lockstep(critic)
    if lockstep:
        (shares,) = D.all_agree(shares)
    values = None
    if shares:
        first, owner, P = split

        def cache_forward(ids, mask, pos, cache):
            return critic(ids, mask, pos, past_key_values=cache, use_cache=True).past_key_values

        def suffix_values(ids, mask, cache):  # positions: from that mask, as the full rows'
            return critic(ids, mask, past_key_values=cache, use_cache=True).values

        values = on_shared_prefixes(cache_forward, suffix_values, sequences[first, :P - 1],
                                    attention_mask[first, :P - 1], owner, sequences[:, P - 1:],
                                    attention_mask[:, P - 1:], response_lengths(attention_mask[:, P:]), response_len,
                                    lockstep)
    if values is None:
        mask = attention_mask[:, :-1]
        values = critic(sequences[:, :-1], mask, position_ids(mask)).values[:, -response_len:]
    return values


# Scoring with shared prompts runs two forwards (prompts, then responses on their cache); it is used when it
# computes at most this share of the plain forward's (padded) positions (how it was set, with the measurements
# of `python -m benchmarks.shared_prefix`: docs/results/benchmarks-gpu-passes.md).
SHARED_PREFIX_MAX_COST = 0.75


def worth_sharing(n_prefixes: int, prefix_width: int, n_rows: int, suffix_width: int) -> bool:
    """``n_prefixes x P + n_rows x S <= SHARED_PREFIX_MAX_COST x n_rows x (P + S)`` positions."""
    return n_prefixes * prefix_width + n_rows * suffix_width <= SHARED_PREFIX_MAX_COST * n_rows * (
        prefix_width + suffix_width)


def shared_prefix_scores(model, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor, owner: torch.Tensor,
                         suffix_ids: torch.Tensor, suffix_mask: torch.Tensor) -> torch.Tensor | None:
    """Scores ``[B]`` of the rows ``cat(prefix_ids[owner[i]], suffix_ids[i])`` with each prefix computed once;
    ``model`` is a ``ValueHeadModel`` or an engine wrapping one (training: the gradients flow through the cache).

    ``prefix_ids`` ``[U, P]`` are left-padded (every prefix has at least one token), ``suffix_ids`` ``[B, S]``
    right-padded (every suffix has at least one token, its last one is scored). The prefixes go through the
    backbone once (the head they all open with once for all: ``prefix_cache.prefix_cache``); per bucket of
    suffix lengths (``prefix_cache.length_buckets``) their KV cache is indexed out to the bucket's rows and
    the suffixes, cut to the bucket's width, attend to it with the positions and attention mask of the full
    rows, so the scores are those of ``forward`` over the full rows, up to float rounding, for at most
    ``U x P + B x S`` positions instead of ``B x (P + S)``. None when the backbone's cache cannot be shared
    (``prefix_cache.supports_prefix_cache``: a sliding window, a convolutional or recurrent layer; under ZeRO-3
    over several ranks, unless every rank's can) or returns no KV cache that can be indexed (a remote-code
    model), or when a suffix holds no token but ``pad_token_id`` (the pooled token would lie in its prefix,
    ``algos.masking.pooled_index``): score the full rows instead.
    """
    lockstep = D.forwards_in_lockstep(model)
    pad = getattr(getattr(model, "module", model), "pad_token_id", None)
    shares = supports_prefix_cache(model) and (pad is None or bool(
        ((suffix_ids != pad) & suffix_mask.bool()).any(dim=1).all()))
    if lockstep:
        (shares,) = D.all_agree(shares)
    if not shares:
        return None

    def cache_forward(ids, mask, pos, cache):
        return model(ids, mask, pos, past_key_values=cache, use_cache=True).past_key_values

    def suffix_scores(ids, mask, cache):
        return model(ids, mask, past_key_values=cache, use_cache=True).scores

    return on_shared_prefixes(cache_forward, suffix_scores, prefix_ids, prefix_mask.long(), owner, suffix_ids,
                              suffix_mask.long(), response_lengths(suffix_mask), lockstep=lockstep)
