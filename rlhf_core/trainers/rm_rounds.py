"""The reward model's training pairs in a feedback round: the round's new pairs plus a replay of earlier ones.

Round ``n`` trains on ``data/feedback/round_<n>/pairs.parquet`` (the comparisons collected on the current policy)
and ``feedback.replay_share`` of every earlier pair: the prepared pairs and the pairs of rounds ``1 .. n-1``,
drawn without replacement with a seed of the round (``rlhf_core.data.feedback.replay_indices``). The RM's eval
pairs stay the prepared ``eval_pairs``, so its accuracy is comparable across rounds.
"""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import Params
from rlhf_core.data.feedback import replay_indices
from rlhf_core.data.readers import DataError
from rlhf_core.ops import paths

COLUMNS = ("id", "prompt", "chosen", "rejected")


def read_round_pairs(root: Path, n: int) -> dict[str, list]:
    import pyarrow.parquet as pq

    rel = paths.round_dir(n) / "pairs.parquet"
    if not (root / rel).exists():
        raise DataError(f"{rel}: not found; run `rlhf stage feedback` for round {n} first")
    table = pq.read_table(root / rel)
    return {c: table.column(c).to_pylist() for c in COLUMNS}


def round_training_pairs(root: Path, params: Params, prepared: dict[str, list]
                         ) -> tuple[dict[str, list], dict[str, list], list[Path], int]:
    """(training pairs = new + replay, the new pairs alone, the files read, the number of earlier pairs the
    replay drew from) for round ``feedback.round``."""
    n = params.feedback.round
    fresh = read_round_pairs(root, n)
    old = {c: list(prepared[c]) for c in COLUMNS}
    files = [paths.round_dir(n) / "pairs.parquet"]
    for k in range(1, n):
        earlier = read_round_pairs(root, k)
        for c in COLUMNS:
            old[c] += earlier[c]
        files.append(paths.round_dir(k) / "pairs.parquet")
    keep = replay_indices(len(old["id"]), params.feedback.replay_share, params.project.seed * 1009 + n)
    train = {c: fresh[c] + [old[c][i] for i in keep] for c in COLUMNS}
    return train, fresh, files, len(old["id"])
