"""The critic's forward: per-action values of the response tokens, sharing each prompt's KV cache across its group."""

from __future__ import annotations

import torch

from rlhf_core.engine import distributed as D
from rlhf_core.passes.generation import position_ids, shared_prefix_split
from rlhf_core.passes.prefix_cache import on_shared_prefixes, response_lengths, supports_prefix_cache


def sequence_values(critic, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                    group: torch.Tensor | None = None) -> torch.Tensor:
    """Critic values ``[B, R]`` of the response actions: the value head at positions ``-R-1 .. -2`` (the state
    before each response token; the last token is not fed).

    ``group`` (rows of one prompt consecutive): each prompt but its last token goes through the critic once and
    its KV cache is indexed out to its rows per bucket of response lengths, as the actor's log-prob pass does
    (``generation.shared_prefix_logits``); the same values and gradients at the masked-in positions up to float
    rounding, 0 past a row's bucket width. Models that cannot share the cache (``supports_prefix_cache``), and
    under ZeRO-3 over several ranks all ranks unless every one can, run the full rows.
    """
    split = shared_prefix_split(sequences, attention_mask, response_len, group) if group is not None else None
    shares = split is not None and supports_prefix_cache(critic)
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
