"""``rlhf_meta.json``: what produced an output directory (stage, params hash, inputs, git sha, versions)."""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import subprocess
import warnings
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from rlhf_core.ops.atomic import write_json_atomic
from rlhf_core.ops.integrity import MODEL_MANIFEST
from rlhf_core.ops.integrity import sha256_file as file_sha256

META_FILE = "rlhf_meta.json"
_PACKAGES = ("rlhf-ops", "torch", "transformers", "deepspeed", "datasets", "peft", "tokenizers")


def git_sha(cwd: str | Path = ".") -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() or None if out.returncode == 0 else None


def code_lineage(root: str | Path = ".") -> dict[str, str]:
    """Which code ran: the checkout's git sha, else the one baked into the image (``RLHF_GIT_SHA``, a build
    arg), else ``unknown``; the package version; the image the pod runs (``RLHF_IMAGE``, set in every stage
    pod) and its digest when the reference pins one (``repo@sha256:...``; a tag alone is warned about once)."""
    sha = git_sha(root) or os.environ.get("RLHF_GIT_SHA", "").strip()
    out = {"git_sha": sha if sha and sha != "unknown" else "unknown",
           "version": versions().get("rlhf-ops", "unknown")}
    image = os.environ.get("RLHF_IMAGE", "").strip()
    if image:
        out["image"] = image
        if "@" in image:
            out["image_digest"] = image.rsplit("@", 1)[1]
        else:
            _warn_unpinned(image)
    return out


@functools.cache
def _warn_unpinned(image: str) -> None:
    warnings.warn(f"RLHF_IMAGE={image} names a tag, not a digest (repo@sha256:...): the lineage of what this "
                  "run produces cannot tell which build of that tag ran", stacklevel=3)


def versions() -> dict[str, str]:
    found = {}
    for name in _PACKAGES:
        try:
            found[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
    return found


def dir_sha256(path: str | Path) -> str:
    """Content hash of a directory: sha256 over sorted (relative path, file sha256), skipping ``rlhf_meta.json``
    (it holds times) and the manifest (derived from the files, meta included)."""
    root = Path(path)
    h = hashlib.sha256()
    for f in sorted(p for p in root.rglob("*") if p.is_file() and p.name not in (META_FILE, MODEL_MANIFEST)):
        h.update(f.relative_to(root).as_posix().encode())
        h.update(file_sha256(f).encode())
    return h.hexdigest()


def build_meta(stage: str, params_hash: str, inputs: dict[str, str] | None = None, **extra) -> dict:
    return {
        "stage": stage,
        "params_hash": params_hash,
        "inputs": inputs or {},
        **{k: v for k, v in code_lineage().items() if k != "version"},
        "versions": versions(),
        "created_at": datetime.now(UTC).isoformat(timespec="seconds"),
        **extra,
    }


def write_meta(out_dir: str | Path, meta: dict) -> None:
    write_json_atomic(Path(out_dir) / META_FILE, meta)


def write_meta_only(out_dir: str | Path, meta: dict) -> None:
    """Replace ``out_dir`` with a directory holding only ``rlhf_meta.json``: a DVC output whose model this run
    does not train (GRPO's critic, the judge RM when off), so no stale model of an earlier run survives in it."""
    shutil.rmtree(out_dir, ignore_errors=True)
    write_meta(out_dir, meta)


def read_meta(out_dir: str | Path) -> dict:
    path = Path(out_dir) / META_FILE
    return json.loads(path.read_text()) if path.exists() else {}
