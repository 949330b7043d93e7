"""``rlhf stage rlhf``: PPO or GRPO on the SFT model (see ``rlhf_core.rlhf``; docs/rlhf.md).

Reads ``models/sft`` (actor init and frozen reference), ``models/rm`` (PPO critic init; the reward model when
``rlhf.reward_fns`` names ``rm``) and ``data/prepared/{prompts,eval_prompts}.parquet`` (``sft.parquet`` for the
ptx loss). Writes ``models/actor/``, ``models/critic/`` (PPO with GAE), ``models/actor_ema/`` (``rlhf.ema_decay``),
``metrics/rlhf.json`` and ``plots/rlhf_{reward,kl,response_length}.csv``; resumable checkpoints in
``checkpoints/rlhf/``. Runs in one process, or N under ``torchrun --nproc_per_node N -m rlhf_core.cli stage rlhf``.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import Params


def run(params: Params, root: str | Path = ".", log=None) -> dict:
    """Stage entry point used by the CLI."""
    from rlhf_core import tracking
    from rlhf_core.rlhf.trainer import RLHFHooks, train_rlhf

    return train_rlhf(params, root, log, RLHFHooks(log_table=tracking.log_table))
