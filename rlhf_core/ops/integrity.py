"""File manifests: the size and sha256 of every file in a directory, written last, checked before it is used.

A checkpoint (``manifest.json``) and every model directory a stage writes (``rlhf_manifest.json``) carry one.
A file that is missing, truncated, or altered after the write (bit rot, an interrupted copy, a partial
``dvc checkout``) is then named before anything is loaded from it, instead of training on garbage. Sizes are
compared first, so a truncated file costs no hashing; the hashes cost one read of the directory (about a
second per GB). A directory without a manifest (written elsewhere, or by hand) is accepted as is.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from rlhf_core.ops.atomic import write_json_atomic

MODEL_MANIFEST = "rlhf_manifest.json"


class CorruptModelError(ValueError):
    """A model directory does not match its manifest; the message names the file and the way out."""


def sha256_file(path: Path) -> str:
    with open(path, "rb") as fh:
        return hashlib.file_digest(fh, "sha256").hexdigest()


def write_manifest(directory: Path, name: str) -> None:
    """``directory/name``: ``{"files": {relative path: {"size", "sha256"}}}`` of every other file under it."""
    directory = Path(directory)
    files = {str(p.relative_to(directory)): {"size": p.stat().st_size, "sha256": sha256_file(p)}
             for p in sorted(directory.rglob("*")) if p.is_file() and p != directory / name}
    write_json_atomic(directory / name, {"files": files})


def check_manifest(directory: Path, name: str) -> str | None:
    """None when ``directory`` has no manifest ``name`` or matches it; else what is wrong, naming the file."""
    directory = Path(directory)
    manifest = directory / name
    if not manifest.exists():
        return None
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError) as err:
        return f"{manifest}: unreadable ({err})"
    for rel, want in files.items():
        path = directory / rel
        if not path.is_file():
            return f"{path}: missing"
        if path.stat().st_size != want["size"]:
            return f"{path}: {path.stat().st_size} bytes, the manifest says {want['size']} (truncated or altered)"
    for rel, want in files.items():
        if sha256_file(directory / rel) != want["sha256"]:
            return f"{directory / rel}: sha256 differs from the manifest (corrupted)"
    return None


def seal_model_dir(directory: Path) -> None:
    """Write the model directory's manifest: the last file written before the directory is renamed into place."""
    write_manifest(directory, MODEL_MANIFEST)


def verify_model_dir(directory: Path) -> None:
    """Raise ``CorruptModelError`` when a sealed model directory no longer matches its manifest."""
    problem = check_manifest(directory, MODEL_MANIFEST)
    if problem:
        raise CorruptModelError(
            f"{problem}; the model in {directory} is damaged and was not loaded: restore it (`rm -r {directory} && "
            f"dvc checkout {directory}`; `rlhf cache verify` checks DVC's cache) or re-run the stage that wrote it. "
            "A model edited on purpose: delete "
            f"{Path(directory) / MODEL_MANIFEST} (it is then loaded unchecked)")
