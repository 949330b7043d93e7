"""``inputs/``: DVC's view of the files and folders ``params.yaml`` names outside the workspace.

DVC hashes a stage's ``deps``, and ours are paths in the workspace; a user's own data files, model folder or
reward model are named by params (``data.files.*.path``, ``data.sources[*].path``, ``model.name_or_path``,
``model.tokenizer``, ``model.chat_template``, ``rm.external``), and a params dep sees the path, not the
content: appending a row to ``sft.jsonl`` would leave ``dvc status`` clean. So every local file they name gets
a symlink here, and every local folder a tree of symlinks to its files (DVC follows a link to a file, not one
to a folder), in three folders the stages list as deps::

    inputs/data/   the data files and the chat template file  -> prepare
    inputs/model/  the base model and its tokenizer           -> prepare
    inputs/rm/     the external reward model (rm.external)    -> rm

The links are re-made (``sync_input_links``) by ``rlhf init``, ``rlhf run`` before DVC runs, and the stages
that read them, so ``dvc status`` names the stage an edit affects. Hub ids, ``pkg:`` specs and URLs are not
linked (params carry them; a Hub revision is the Hub's to pin). Nothing outside ``inputs/`` is written, and
the user's files are only read.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from rlhf_core.config import ConfigError, Params, load_params

INPUTS = Path("inputs")
GROUPS = ("data", "model", "rm")
KEEP = ".gitkeep"  # committed, so each folder exists (a missing dep is an error to DVC)
SKIP_DIRS = {".git", ".cache", "__pycache__", ".ipynb_checkpoints"}


def _local(spec: str | None, root: Path) -> Path | None:
    """``spec`` as an existing local path (relative to ``root``), or None for null, a URL, a Hub id, ``pkg:``."""
    if not spec or "://" in spec or spec.startswith("pkg:"):
        return None
    path = Path(spec).expanduser()
    path = path if path.is_absolute() else root / path
    return path.resolve() if path.exists() else None


def named_inputs(params: Params, root: Path) -> dict[str, dict[str, Path]]:
    """``{group: {link name: local path}}`` for every local file or folder ``params`` names."""
    data, model = params.data, params.model
    files: dict[str, Path] = {}
    if data.source == "per_phase":
        for phase in ("sft", "pairs", "prompts"):
            src = getattr(data.files, phase)
            path = _local(src.path if src is not None else None, root)
            if path is not None:
                files[f"{phase}{''.join(path.suffixes) if path.is_file() else ''}"] = path
    elif data.source == "mixed":
        for k, src in enumerate(data.sources):
            path = _local(src.path, root)
            if path is not None:
                files[f"source{k}-{path.name}"] = path
    template = model.chat_template
    if template not in ("auto", "none", "tokenizer") and (path := _local(template, root)) is not None:
        files["chat_template.jinja"] = path
    models = {name: path for name, spec in (("base", model.name_or_path), ("tokenizer", model.tokenizer))
              if (path := _local(spec, root)) is not None}
    rm = {"external": path} if (path := _local(params.rm.external, root)) is not None else {}
    return {"data": files, "model": models, "rm": rm}


def _mirror(src: Path, dst: Path) -> int:
    """``dst`` -> ``src`` as a symlink (a file) or a tree of symlinks to its files (a folder); the file count."""
    if src.is_file():
        dst.parent.mkdir(parents=True, exist_ok=True)
        dst.symlink_to(src)
        return 1
    n = 0
    for dirpath, dirnames, filenames in os.walk(src, followlinks=True):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            n += _mirror(Path(dirpath) / name, dst / Path(dirpath).relative_to(src) / name)
    return n


def sync_input_links(params: Params, root: str | Path = ".") -> dict[str, dict[str, str]]:
    """Re-make ``root/inputs/{data,model,rm}`` from ``params``; returns ``{group: {name: target}}``.

    Only links (and the folders holding them) are removed: a file someone put in ``inputs/`` is an error
    naming it, never deleted."""
    root = Path(root)
    out: dict[str, dict[str, str]] = {}
    for group, named in named_inputs(params, root).items():
        folder = root / INPUTS / group
        folder.mkdir(parents=True, exist_ok=True)
        (folder / KEEP).touch()
        for entry in folder.iterdir():
            if entry.name != KEEP:
                _clear(entry)
        for name, path in named.items():
            _mirror(path, folder / name)
        out[group] = {name: str(path) for name, path in named.items()}
    return out


def _clear(entry: Path) -> None:
    if entry.is_symlink():
        entry.unlink()
        return
    if entry.is_dir():
        stray = [p for p in entry.rglob("*") if not p.is_symlink() and not p.is_dir()]
        if stray:
            raise FileExistsError(f"{stray[0]}: not a link; inputs/ holds only links to what params.yaml names "
                                  "(move the file out of it)")
        shutil.rmtree(entry)
        return
    raise FileExistsError(f"{entry}: not a link; inputs/ holds only links to what params.yaml names (move the file "
                          "out of it)")


def sync_from_params_file(root: str | Path = ".") -> None:
    """``sync_input_links`` for ``root/params.yaml``, before DVC compares the deps (``dvc_repro.run_repro``).
    Params that do not load are left to the stage, which names the key; the folders exist either way."""
    root = Path(root)
    try:
        params = load_params(root / "params.yaml")
    except (ConfigError, OSError):
        for group in GROUPS:
            (root / INPUTS / group).mkdir(parents=True, exist_ok=True)
        return
    sync_input_links(params, root)
