"""``rlhf cache verify``: re-hash the DVC cache entries ``dvc.lock`` names, find the ones that no longer match.

DVC names each cache entry by the md5 of its content, but trusts an entry once it has made it read-only: its own
check (``HashFileDB.check``) returns early for a file whose mode is 0444, and its state database re-uses a hash
while a file's inode, size and mtime stay the same. ``dvc checkout``, ``dvc repro`` restoring from the run cache,
and ``dvc push`` therefore carry an entry damaged in place (bit rot, a bad disk, a half-finished copy into a
shared cache) to the workspace and the remote, unnoticed (measured: a flipped bit in the cache entry of
``data/prepared/sft.parquet`` came back through ``dvc checkout``, and ``dvc status`` said it was up to date).

The stages catch such a file when they read it (model manifests, the prepare manifest's hashes). This check
finds it where it sits, before a push spreads it: for each output of each stage in ``dvc.lock`` (a directory
output: its ``.dir`` listing and every file in it), ``md5(cache file) == the name DVC gave it``. ``repair``
removes the damaged entries, as DVC's own check does, so ``dvc pull`` (from the remote) or
``dvc commit -f STAGE`` (from a good workspace copy) can put a good one back. Entries absent from the cache
(never pulled) are counted, not errors. Only DVC 3 outputs (``hash: md5``) are checked; older ones are counted
as skipped. The cache location comes from DVC itself (``dvc cache dir`` is honoured).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path

import yaml


@dataclass
class CacheReport:
    checked: int = 0
    absent: int = 0
    skipped: list[str] = field(default_factory=list)  # outputs not in DVC 3's md5 layout
    damaged: list[str] = field(default_factory=list)  # one line each: cache file, output path, stage, fix


def md5_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, lambda: hashlib.md5(usedforsecurity=False)).hexdigest()


def _lock_outs(root: Path) -> list[tuple[str, dict]]:
    """(stage, out) for every output recorded in ``dvc.lock``; a missing or unreadable lock is a ValueError."""
    lock = root / "dvc.lock"
    if not lock.exists():
        raise ValueError(f"{lock}: not found; nothing DVC produced to verify (run the pipeline first)")
    try:
        stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    except yaml.YAMLError as err:
        raise ValueError(f"{lock}: not valid YAML ({err})") from None
    return [(name, out) for name, stage in stages.items() for out in stage.get("outs", [])]


def verify_cache(root: str | Path, repair: bool = False) -> CacheReport:
    """Re-hash every cache entry ``dvc.lock``'s outputs name (see the module docstring); ``repair`` removes the
    damaged ones."""
    from dvc.repo import Repo

    root = Path(root)
    outs = _lock_outs(root)
    report = CacheReport()
    with Repo(str(root)) as repo:
        odb = repo.cache.local

        def check(oid: str, what: str, stage: str) -> bytes | None:
            """The entry's bytes when it is a ``.dir`` listing that checks out; records damage."""
            path = Path(odb.oid_to_path(oid))
            if not path.is_file():
                report.absent += 1
                return None
            report.checked += 1
            if md5_file(path) == oid.removesuffix(".dir"):
                return path.read_bytes() if oid.endswith(".dir") else None
            fix = f"`dvc pull {stage}` (the remote's copy) or `dvc commit -f {stage}` (a good workspace copy)"
            if repair:
                path.chmod(0o644)
                path.unlink()
            report.damaged.append(f"{path}: content no longer matches its md5 ({what}, stage {stage}); "
                                  + (f"removed: restore it with {fix}" if repair else
                                     "remove it with `rlhf cache verify --repair`, then restore it with " + fix))
            return None

        for stage, out in outs:
            oid = out.get("md5")
            if out.get("hash") != "md5" or not oid:
                report.skipped.append(f"{out.get('path')} (stage {stage})")
                continue
            listing = check(oid, out["path"], stage)
            if oid.endswith(".dir") and listing is not None:
                for entry in json.loads(listing):
                    check(entry["md5"], f"{out['path']}/{entry['relpath']}", stage)
    return report
