"""``rlhf stage sft``: supervised fine-tuning of the base model (see ``rlhf_core.trainers.sft``).

Reads ``data/prepared/{sft,eval_sft,eval_prompts}.parquet`` and ``models/base``; writes ``models/sft``,
``metrics/sft.json``, ``plots/sft_loss.csv``; resumable checkpoints in ``checkpoints/sft``.
Runs in one process, or N under ``torchrun --nproc_per_node N -m rlhf_core.cli stage sft``.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import Params


def run(params: Params, root: str | Path = ".", log=None) -> dict:
    """Stage entry point used by the CLI."""
    from rlhf_core.trainers.sft import train_sft

    return train_sft(params, root, log)
