"""Canonical rows -> the phases' rows, in bounded memory: batches in, Parquet files out.

prepare streams every source through these steps a batch (``BATCH_ROWS``) at a time; rows live on disk
between passes (:class:`RowFile`, a Parquet file written and read in batches). What stays in memory grows
with the row count only by a few bytes per row: a phase index (1 byte), a train/eval flag (1 byte), the
token lengths (4 bytes per field), and a 16-byte digest per distinct row for de-duplication.

Per phase (``sft``, ``pairs``, ``prompts``), for the rows assigned to it:
:func:`project` (keep the rows that can serve it, map them to its columns) -> :func:`length_filter`
(left-truncate or drop over-long prompts, drop over-long or empty responses) -> :class:`Deduper`. Every
dropped row is counted by reason.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Iterator
from itertools import islice
from pathlib import Path

import numpy as np

BATCH_ROWS = 4096
PHASE_COLUMNS = {
    "sft": ("id", "prompt", "response", "answer", "source"),
    "pairs": ("id", "prompt", "chosen", "rejected", "answer", "source"),
    "prompts": ("id", "prompt", "answer", "source"),
}
CANON_COLUMNS = ("id", "prompt", "response", "chosen", "rejected", "answer", "source")
RESPONSE_FIELDS = {"sft": ("response",), "pairs": ("chosen", "rejected"), "prompts": ()}


def batched(items: Iterable, n: int | None = None) -> Iterator[list]:
    it = iter(items)
    while batch := list(islice(it, n or BATCH_ROWS)):
        yield batch


class RowFile:
    """Rows of string columns appended to a Parquet file batch by batch, then read back batch by batch."""

    def __init__(self, path: Path, columns: tuple[str, ...]):
        import pyarrow as pa

        self.path, self.columns, self.count = path, columns, 0
        self.schema = pa.schema([(c, pa.string()) for c in columns])
        self._writer = None

    def write(self, rows: list[dict]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        if self._writer is None:
            self._writer = pq.ParquetWriter(self.path, self.schema)
        if rows:
            self._writer.write_table(pa.Table.from_pylist([{c: r.get(c) for c in self.columns} for r in rows],
                                                          schema=self.schema))
            self.count += len(rows)

    def close(self) -> RowFile:
        if self._writer is None:
            self.write([])  # an empty phase is still a file, with its schema
        self._writer.close()
        return self

    def batches(self) -> Iterator[list[dict]]:
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(self.path).iter_batches(batch_size=BATCH_ROWS):
            yield batch.to_pylist()

    def read(self) -> list[dict]:
        return [row for batch in self.batches() for row in batch]


def project(rows: list[dict], phase: str, dropped: Counter) -> list[dict]:
    """Keep the rows that can serve ``phase`` and map them to its columns."""
    out = []
    for row in rows:
        row = dict(row)
        if phase == "sft":
            row["response"] = row["response"] if row["response"] is not None else row["chosen"]
            if row["response"] is None:
                dropped["sft:no_response"] += 1
                continue
        elif phase == "pairs" and (row["chosen"] is None or row["rejected"] is None):
            dropped["pairs:no_pair"] += 1
            continue
        out.append({k: row.get(k) for k in PHASE_COLUMNS[phase]})
    return out


def length_filter(rows: list[dict], phase: str, tok, max_prompt_len: int, max_response_len: int,
                  truncation: str, dropped: Counter, modified: Counter) -> tuple[list[dict], dict[str, list[int]]]:
    """Left-truncate (or drop) over-long prompts; drop over-long responses. Returns rows and token lengths."""
    if not rows:
        return rows, {}
    enc = tok([r["prompt"] for r in rows], add_special_tokens=False, return_offsets_mapping=True)
    resp_lens = {f: [len(ids) for ids in tok([r[f] for r in rows], add_special_tokens=False)["input_ids"]]
                 for f in RESPONSE_FIELDS[phase]}
    kept, lengths = [], {"prompt": [], **{f: [] for f in resp_lens}}
    for i, row in enumerate(rows):
        n_prompt = len(enc["input_ids"][i])
        if any(resp_lens[f][i] > max_response_len for f in resp_lens):
            dropped[f"{phase}:response_too_long"] += 1
            continue
        if any(resp_lens[f][i] == 0 for f in resp_lens):
            dropped[f"{phase}:empty_field"] += 1
            continue
        if n_prompt > max_prompt_len:
            if truncation == "drop":
                dropped[f"{phase}:prompt_too_long"] += 1
                continue
            start_char = enc["offset_mapping"][i][n_prompt - max_prompt_len][0]
            row = {**row, "prompt": row["prompt"][start_char:]}
            modified[f"{phase}:prompt_truncated_left"] += 1
            n_prompt = max_prompt_len
        kept.append(row)
        lengths["prompt"].append(n_prompt)
        for f in resp_lens:
            lengths[f].append(resp_lens[f][i])
    return kept, lengths


class Deduper:
    """Drops a row whose content (every column but ``id`` and ``source``) was seen before in this phase; keeps
    a 16-byte digest per distinct row, not the row."""

    def __init__(self, phase: str):
        self.phase, self.seen = phase, set()
        self.key_columns = [k for k in PHASE_COLUMNS[phase] if k not in ("id", "source")]

    def __call__(self, rows: list[dict], dropped: Counter) -> list[dict]:
        out = []
        for row in rows:
            key = hashlib.blake2b(json.dumps([row[k] for k in self.key_columns]).encode(), digest_size=16).digest()
            if key in self.seen:
                dropped[f"{self.phase}:duplicate"] += 1
                continue
            self.seen.add(key)
            out.append(row)
        return out


class Lengths:
    """Token lengths per field, kept as int32 arrays batch by batch."""

    def __init__(self):
        self.parts: dict[str, list[np.ndarray]] = {}

    def add(self, lengths: dict[str, list[int]]) -> None:
        for field, values in lengths.items():
            self.parts.setdefault(field, []).append(np.asarray(values, dtype=np.int32))

    def stats(self) -> dict[str, dict[str, float]]:
        return {f: stats(np.concatenate(parts)) for f, parts in self.parts.items()}


def stats(values: np.ndarray) -> dict[str, float]:
    if not len(values):
        return {}
    arr = np.asarray(values)
    return {"mean": round(float(arr.mean()), 2), "p50": float(np.percentile(arr, 50)),
            "p95": float(np.percentile(arr, 95)), "max": int(arr.max())}
