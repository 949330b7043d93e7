"""One ``rlhf run`` per workspace at a time: an exclusive ``flock`` on ``<workspace>/run.lock``
(``rlhf_core.ops.locks``: a second run fails at once naming the holder; a killed holder leaves no stale lock)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from rlhf_core.ops.locks import LockBusy, exclusive_lock

LOCK_FILE = "run.lock"


class WorkspaceBusy(LockBusy):
    """Another process holds the workspace's run lock."""


@contextlib.contextmanager
def workspace_lock(workspace: str | Path) -> Iterator[Path]:
    """Hold ``<workspace>/run.lock`` for the block; raises :class:`WorkspaceBusy` naming the holder."""
    with exclusive_lock(Path(workspace) / LOCK_FILE, "another `rlhf run` is using this workspace",
                        WorkspaceBusy) as path:
        yield path
