"""Exclusive workspace locks: an ``flock`` on a file that names its holder.

Two writers of one workspace (a schedule and a manual ``rlhf run``; a stage re-run while its previous process is
still alive) would interleave writes to the same data, checkpoints and models. The lock is taken without
waiting; a second holder fails at once with a message naming the first (pid, host, start time, command), which
the holder writes into the lock file. The kernel releases a ``flock`` when its process dies, so a killed holder
never leaves a stale lock behind.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from collections.abc import Iterator
from pathlib import Path


class LockBusy(RuntimeError):
    """Another process holds the lock; the message names it."""


@contextlib.contextmanager
def exclusive_lock(path: str | Path, what: str, busy: type[LockBusy] = LockBusy) -> Iterator[Path]:
    """Hold ``path`` for the block; raises ``busy`` ("``path``: ``what`` (holder); ...") when another process does."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 4096, 0).decode(errors="replace").strip() or "unknown"
            raise busy(f"{path}: {what} ({holder}); wait for it to finish") from None
        except OSError as err:  # a filesystem without locks (some network volumes): say so, do not stop the work
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
            print(f"{path}: this filesystem does not support locks ({err.strerror}); continuing without the lock",
                  file=sys.stderr, flush=True)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({"pid": os.getpid(), "host": socket.gethostname(),
                                  "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                                  "command": " ".join(sys.argv)}).encode(), 0)
        yield path
    finally:
        os.close(fd)  # releases the lock


def stage_lock(workspace: str | Path, stage: str) -> contextlib.AbstractContextManager[Path]:
    """``<workspace>/locks/stage-<stage>.lock``: one process tree per stage and workspace (under torchrun only
    rank 0 takes it: the other ranks are the same run)."""
    if os.environ.get("RANK", "0") != "0":
        return contextlib.nullcontext(Path(workspace) / "locks" / f"stage-{stage}.lock")
    return exclusive_lock(Path(workspace) / "locks" / f"stage-{stage}.lock",
                          f"stage {stage} is already running on this workspace")
