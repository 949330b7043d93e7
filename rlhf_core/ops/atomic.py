"""Atomic writes: a reader (or a resumed run) sees the old content or the new, never half a file.

Files are written to a temp file in the same directory, then ``os.replace``d over the target (atomic on
POSIX within one filesystem). Directories (models, checkpoints' final outputs) are built in a temp
directory next to the target and renamed in; the previous directory is moved aside first and removed
after, so a crash leaves either the old or the new one under the target's name.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path


def write_text_atomic(path: str | Path, text: str) -> None:
    """Write ``text`` to ``path`` through a temp file + rename (parents created)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w") as fh:
            fh.write(text)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


def write_json_atomic(path: str | Path, data: dict) -> None:
    """``data`` as indented, key-sorted JSON with a final newline, written atomically."""
    write_text_atomic(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


def make_temp_dir(target: str | Path) -> Path:
    """A fresh temp dir next to ``target`` (same filesystem, so ``commit_dir`` is a rename)."""
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(dir=target.parent, prefix=f".{target.name}.tmp-"))


def commit_dir(tmp: str | Path, target: str | Path) -> None:
    """Replace ``target`` by ``tmp``: the old directory is moved aside, the new one renamed in, the old removed."""
    tmp, target = Path(tmp), Path(target)
    old = target.with_name(f".{target.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if target.exists():
        target.rename(old)
    tmp.rename(target)
    shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(target: str | Path) -> Iterator[Path]:
    """Yield a temp dir next to ``target``; on success it replaces ``target`` by rename (else it is removed).
    An ``OSError`` while writing (no space left, a quota) says that ``target`` is unchanged."""
    tmp = make_temp_dir(target)
    try:
        try:
            yield tmp
        except OSError as err:
            raise OSError(err.errno, f"writing {target} failed ({err.strerror or err}); {target} is unchanged "
                                     "(the partial copy is removed)") from err
        commit_dir(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # another filesystem, or links not allowed
        shutil.copy2(src, dst)


def copy_dir_atomic(src: str | Path, target: str | Path, finish: Callable[[Path], None] | None = None) -> None:
    """``target`` becomes a copy of ``src`` (atomically, as ``atomic_dir``), after ``finish(copy)`` edited the
    copy where given. Files are hard-linked where the filesystem allows: free for model weights, and safe because
    every writer here replaces files by rename rather than writing into them."""
    with atomic_dir(target) as tmp:
        shutil.copytree(src, tmp, copy_function=_link_or_copy, dirs_exist_ok=True)
        if finish is not None:
            finish(tmp)
