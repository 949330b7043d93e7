"""One ``rlhf run`` per workspace at a time: an exclusive ``flock`` on ``<workspace>/run.lock``.

Two runs on one workspace (a schedule and a manual run) would write the same ``data/``, ``models/`` and
``dvc.lock`` at once. The lock is taken without waiting; a second run fails at once with a message naming the
holder (pid, host, start time, command), written into the lock file by the holder. The kernel releases a
``flock`` when its process dies, so a killed run never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path

LOCK_FILE = "run.lock"


class WorkspaceBusy(RuntimeError):
    """Another process holds the workspace's run lock."""


@contextlib.contextmanager
def workspace_lock(workspace: str | Path) -> Iterator[Path]:
    """Hold ``<workspace>/run.lock`` for the block; raises :class:`WorkspaceBusy` naming the holder."""
    path = Path(workspace) / LOCK_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            raise WorkspaceBusy(f"{path}: another `rlhf run` is using this workspace ({holder}); wait for it to "
                                "finish, or give this run another project.workspace") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "command": " ".join(sys.argv)}).encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock
