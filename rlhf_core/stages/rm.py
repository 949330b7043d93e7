"""``rlhf stage rm``: reward-model training (see ``rlhf_core.trainers.rm``).

Reads ``data/prepared/{pairs,eval_pairs}.parquet``, ``models/base`` and (``rm.init_from: sft``)
``models/sft``; writes ``models/rm``, ``metrics/rm.json``, ``plots/rm_accuracy.csv``; checkpoints in
``checkpoints/rm``; ``models/judge`` (a judge RM on the held-out pairs with ``rm.judge``, else its meta only).
Runs in one process, or N under ``torchrun``.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import Params


def run(params: Params, root: str | Path = ".", log=None) -> dict:
    """Stage entry point used by the CLI."""
    from rlhf_core.trainers.rm import train_rm

    return train_rm(params, root, log)
