"""Two ZeRO-3 ranks on CPU given unequal rows (run by tests/rlhf_core/passes/test_group_packing.py as
``torchrun --standalone --nproc_per_node 2 tests/zero3_ranks.py OUT``).

Every forward of a ZeRO-3 model all-gathers its parameters, so the ranks must make the same passes. Each case
gives rank 0 and rank 1 rows that would take different paths on their own (packed or not, a common head or
not, one length bucket or two, a shared prompt or none, a shared prefill or not, one slice of the experience
rows or three, a reward model's pair layout worth sharing or not); each rank checks its shared pass against its
plain forward and writes ``OUT/rank<r>.json``: the case, the forward passes it made and the largest difference.
A rank that made a pass the other did not waits in the all-gather: the test times out.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

PAD, EOS = 0, 2


def _rows(prompts: list[list[int]], responses: list[list[int]], group: list[int]):
    from rlhf_core.passes.generation import response_mask

    p, r, g = torch.tensor(prompts), torch.tensor(responses), torch.tensor(group)
    seq = torch.cat([p[g], r], dim=1)
    att = torch.cat([(p[g] != PAD).long(), response_mask(r, EOS)], dim=1)
    return seq, att, g


# case -> (rank 0's rows, rank 1's rows): prompts, responses, group ids. PACK_MAX_WIDTH is 8 here.
CASES = {
    # rank 0 packs to 4 + 1 + 1 = 6 columns; rank 1's responses pack to 4 + 3 + 3 = 10 > 8: the cache
    "pack": (([[PAD, 1, 7, 8]], [[4, 5], [6, 7]], [0, 0]),
             ([[1, 7, 9, 5]], [[4, 5, 6, 7], [6, 7, 8, 9]], [0, 0])),
    # with packing off: rank 0's prompts open with the head "1 7", rank 1's part at their first token
    "head": (([[1, 7, 8, 9], [1, 7, 3, 4]], [[4, EOS], [5, EOS], [6, EOS], [7, EOS]], [0, 0, 1, 1]),
             ([[1, 7, 8, 9], [3, 7, 3, 4]], [[4, EOS], [5, EOS], [6, EOS], [7, EOS]], [0, 0, 1, 1])),
    # rank 0: one long response among one-token ones (two buckets); rank 1: equal lengths (one bucket)
    "buckets": (([[1, 7, 8, 9]], [[EOS, PAD, PAD, PAD, PAD, PAD]] * 5 + [[4, 5, 6, 7, 8, EOS]], [0] * 6),
                ([[1, 7, 8, 9]], [[4, 5, 6, 7, 8, EOS]] * 6, [0] * 6)),
    # rank 0's rows share their prompt; rank 1's are every one its own group: nothing to share
    "no_group": (([[1, 7, 8, 9]], [[4, EOS], [5, EOS]], [0, 0]),
                 ([[1, 7, 8, 9], [1, 7, 3, 4]], [[4, EOS], [5, EOS]], [0, 1])),
}


def main(out: Path) -> None:
    from rlhf_core.engine import distributed as D

    D.init_distributed()
    import deepspeed

    from rlhf_core.models.value_head import ValueHeadModel
    from rlhf_core.passes import generation
    from rlhf_core.passes.generation import prefilled_cache, response_logits
    from rlhf_core.passes.values import sequence_values
    from rlhf_core.trainers.rlhf.experience import batched
    from rlhf_core.trainers.rm_objectives import head_scores
    from tests.tiny import tiny_lm

    rank = D.rank()
    conf = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": D.world_size(),
            "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}}  # gather every weight
    actor = deepspeed.initialize(model=tiny_lm(), config=conf, dist_init_required=False)[0].module.eval()
    critic = deepspeed.initialize(model=ValueHeadModel(tiny_lm().model), config=conf,
                                  dist_init_required=False)[0].module.eval()
    assert all(hasattr(p, "ds_id") for p in [*actor.parameters(), *critic.parameters()])  # partitioned
    generation.PACK_MAX_WIDTH = 8
    passes = []
    actor.model.register_forward_pre_hook(lambda m, a, kw: passes.append(list(kw["input_ids"].shape)),
                                          with_kwargs=True)
    results = {}
    with torch.no_grad():
        for case, rows in CASES.items():
            seq, att, group = _rows(*rows[rank])
            R = seq.shape[1] - 4
            m = att[:, -R:].bool()
            passes.clear()
            shared = response_logits(actor, seq, att, R, group=group, pack=case == "pack")
            made = list(passes)
            full = response_logits(actor, seq, att, R)
            diff = float((shared - full)[m].abs().max())
            shared_v = sequence_values(critic, seq, att, R, group)
            diff = max(diff, float((shared_v - sequence_values(critic, seq, att, R))[m].abs().max()))
            results[case] = {"passes": made, "max_diff": diff}
        # the experience passes in slices of 2 rows: rank 0 keeps 6 rows (3 slices), rank 1 keeps 2 (1 slice)
        seq, att, group = _rows(*(CASES["buckets"][0] if rank == 0 else CASES["pack"][1]))
        R = seq.shape[1] - 4
        passes.clear()
        sliced = batched(lambda s: response_logits(actor, seq[s], att[s], R, group=group[s]), len(seq), 2, True)
        made = list(passes)
        m = att[:, -R:].bool()
        results["slices"] = {"passes": made,
                             "max_diff": float((sliced - response_logits(actor, seq, att, R))[m].abs().max())}
        # the rollout's prefill: rank 1 has a one-token prompt, whose prefix would be all padding
        prompts = torch.tensor([[PAD, 1, 7, 8]] * 2 if rank == 0 else [[PAD, PAD, PAD, 1]] * 2)
        passes.clear()
        cache = prefilled_cache(actor, prompts, (prompts != PAD).long(), 2)
        results["prefill"] = {"passes": list(passes), "cache": cache is not None}
        # the RM's pair layout (two pairs, each prompt with its chosen and rejected answer): rank 0's prompts
        # are long and its answers short, so sharing the prompt skips most positions; rank 1's the other way round
        # (rm_objectives.pair_layout: worth_sharing); neither may share alone
        P, S = (8, 2) if rank == 0 else (2, 8)
        prefix = torch.randint(3, 16, (2, P), generator=torch.Generator().manual_seed(rank))
        suffix = torch.randint(3, 16, (4, S), generator=torch.Generator().manual_seed(10 + rank))
        full = torch.cat([prefix.repeat(2, 1), suffix], dim=1)
        batch = {"input_ids": full, "attention_mask": torch.ones_like(full), "prefix_ids": prefix,
                 "prefix_mask": torch.ones_like(prefix), "suffix_ids": suffix, "suffix_mask": torch.ones_like(suffix)}
        rm_passes = []
        hook = critic.backbone.register_forward_pre_hook(
            lambda m, a, kw: rm_passes.append(list((a[0] if a else kw["input_ids"]).shape)), with_kwargs=True)
        scores = head_scores(critic, batch, torch.device("cpu"))
        hook.remove()
        plain = critic(full, torch.ones_like(full)).scores
        results["pair_layout"] = {"passes": rm_passes, "max_diff": float((scores - plain).abs().max())}
    (out / f"rank{rank}.json").write_text(json.dumps(results))
    D.barrier()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
