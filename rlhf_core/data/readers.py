"""Read raw rows from local files and Hugging Face datasets.

Policy (see ``docs/data.md``): *structural* problems — a line that is not JSON,
a line that is not an object, bytes that are not UTF-8, a file that cannot be
read — raise :class:`DataError` naming ``file:line`` unless
``data.on_malformed: drop``, in which case the line is dropped and counted.
Per-row content problems are handled later in ``normalize``.

Every row comes back as ``(origin, record)`` where origin is ``"file:line"``.
"""

from __future__ import annotations

import csv
import io
import json
from collections import Counter
from pathlib import Path
from typing import Any

SUPPORTED_SUFFIXES = (".jsonl", ".json", ".parquet", ".csv")


class DataError(ValueError):
    """A structural data problem; the message names the file and line."""


def _decode_lines(path: Path, data: bytes, drop: bool, dropped: Counter) -> list[tuple[int, str]]:
    lines = []
    for lineno, raw in enumerate(data.split(b"\n"), start=1):
        try:
            lines.append((lineno, raw.decode("utf-8")))
        except UnicodeDecodeError as err:
            if not drop:
                raise DataError(f"{path}:{lineno}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
            dropped["non_utf8"] += 1
    return lines


def read_jsonl(path: Path, drop: bool, dropped: Counter) -> list[tuple[str, dict]]:
    rows = []
    for lineno, line in _decode_lines(path, path.read_bytes(), drop, dropped):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
        except json.JSONDecodeError as err:
            if not drop:
                raise DataError(f"{path}:{lineno}: malformed JSON: {err.msg} (column {err.colno})") from None
            dropped["malformed_json"] += 1
            continue
        if not isinstance(obj, dict):
            if not drop:
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(obj).__name__}")
            dropped["malformed_json"] += 1
            continue
        rows.append((f"{path}:{lineno}", obj))
    return rows


def read_json(path: Path, drop: bool, dropped: Counter) -> list[tuple[str, dict]]:
    data = path.read_bytes()
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as err:
        lineno = data[: err.start].count(b"\n") + 1
        raise DataError(f"{path}:{lineno}: not valid UTF-8 ({err.reason} at byte {err.start})") from None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as err:
        raise DataError(f"{path}:{err.lineno}: malformed JSON: {err.msg} (column {err.colno})") from None
    if isinstance(obj, dict) and isinstance(obj.get("data"), list):
        obj = obj["data"]
    if not isinstance(obj, list):
        raise DataError(f"{path}:1: expected a JSON list of objects (or {{'data': [...]}})")
    rows = []
    for i, item in enumerate(obj):
        if not isinstance(item, dict):
            if not drop:
                raise DataError(f"{path}: item {i}: expected a JSON object, got {type(item).__name__}")
            dropped["malformed_json"] += 1
            continue
        rows.append((f"{path}:item{i}", item))
    return rows


def read_csv(path: Path, drop: bool, dropped: Counter) -> list[tuple[str, dict]]:
    lines = _decode_lines(path, path.read_bytes(), drop, dropped)
    text = "\n".join(line for _, line in lines)
    reader = csv.DictReader(io.StringIO(text))
    return [(f"{path}:{reader.line_num}", dict(row)) for row in reader]


def read_parquet(path: Path) -> list[tuple[str, dict]]:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    return [(f"{path}:row{i}", row) for i, row in enumerate(table.to_pylist())]


def read_file(path: str | Path, drop: bool = False, dropped: Counter | None = None) -> list[tuple[str, dict]]:
    """Rows of a JSONL/JSON/Parquet/CSV file, by suffix."""
    path = Path(path)
    dropped = dropped if dropped is not None else Counter()
    if not path.is_file():
        raise DataError(f"{path}: no such data file")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return read_jsonl(path, drop, dropped)
    if suffix == ".json":
        return read_json(path, drop, dropped)
    if suffix == ".csv":
        return read_csv(path, drop, dropped)
    if suffix == ".parquet":
        return read_parquet(path)
    raise DataError(f"{path}: unsupported file type {suffix!r}; expected one of {', '.join(SUPPORTED_SUFFIXES)}")


def read_hf(hf_id: str, split: str = "train", config: str | None = None) -> list[tuple[str, dict]]:
    """Rows of a Hugging Face dataset: a hub id, a local dataset directory, or a ``save_to_disk`` folder."""
    import datasets

    local = Path(hf_id)
    if local.is_dir() and ((local / "state.json").exists() or (local / "dataset_dict.json").exists()):
        ds: Any = datasets.load_from_disk(str(local))
        if isinstance(ds, datasets.DatasetDict):
            if split not in ds:
                raise DataError(f"{hf_id}: no split {split!r}; available: {', '.join(ds)}")
            ds = ds[split]
    else:
        try:
            ds = datasets.load_dataset(hf_id, config, split=split)
        except ValueError as err:  # unknown split and similar
            raise DataError(f"{hf_id} (split {split!r}): {err}") from None
    return [(f"{hf_id}[{split}]:row{i}", row) for i, row in enumerate(ds)]
