"""A stage started by a flow stops when that flow's process is gone.

The flow runs each stage as ``dvc repro`` in a session of its own (so that a cancellation or a task timeout can
stop the whole process group) and reads its output through a pipe. A flow process killed outright (SIGKILL,
the OOM killer) runs no hook, and its stage died at its next line of output, written into a pipe nobody reads,
wherever it was: every step since its last checkpoint lost (measured: a demo SFT stage gone 2 s after its
flow, mid-interval, no checkpoint written); under a stage that printed nothing for a while it would have gone
on training unobserved, holding its stage lock against the flow's re-run. So the flow names itself in
``RLHF_FLOW_PID``, and the stage watches that process (a pidfd: no polling, no pid reuse). When it exits, the
stage's output moves to ``<workspace>/logs/stage-<name>.log`` and the stage gets SIGTERM: a training stage
checkpoints at its next step boundary and exits 75 (:mod:`rlhf_core.engine.stop`), so the flow's re-run
resumes there; the other stages end at once (their outputs are written atomically).

A line the stage writes in the instant between the flow's death and the switch meets the broken pipe (EPIPE)
before the watcher has woken: it used to raise ``BrokenPipeError`` there and end the stage with no log and no
checkpoint (a CI run lost the race under load; a stage printing flat out loses it every time). So
``sys.stdout`` and ``sys.stderr`` write through :class:`_SwitchableFd`: on EPIPE it waits for the switch and
writes the same bytes again, now into the log file. Nothing is lost and nothing is written twice (a raw
``write(2)`` that fails with EPIPE wrote nothing).
"""

from __future__ import annotations

import io
import os
import select
import signal
import sys
import threading
import time
from pathlib import Path

FLOW_PID_ENV = "RLHF_FLOW_PID"
SWITCH_WAIT_S = 30.0  # how long a write that met EPIPE waits for the watcher before the error stands


class _SwitchableFd(io.RawIOBase):
    """File descriptor ``fd`` as a raw stream; a write that meets EPIPE waits (at most :data:`SWITCH_WAIT_S`)
    for ``switched``, set once the watcher has pointed ``fd`` at the log file, and writes the same bytes again."""

    def __init__(self, fd: int, switched: threading.Event):
        super().__init__()
        self._fd, self._switched = fd, switched

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self._fd

    def isatty(self) -> bool:
        return os.isatty(self._fd)

    def write(self, b) -> int:
        try:
            return os.write(self._fd, b)
        except BrokenPipeError:
            if not self._switched.wait(SWITCH_WAIT_S):
                raise
            return os.write(self._fd, b)


def _switchable(stream, fd: int, switched: threading.Event):
    stream.flush()
    return io.TextIOWrapper(io.BufferedWriter(_SwitchableFd(fd, switched)), encoding=stream.encoding,
                            errors=stream.errors, line_buffering=True)


def _wait_for_exit(pid: int) -> None:
    try:
        fd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    except OSError:  # no pidfd (a kernel before 5.3): poll
        while True:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
            time.sleep(1.0)
    try:
        select.select([fd], [], [])
    finally:
        os.close(fd)


def _stop(pid: int, log_file: Path, switched: threading.Event) -> None:
    _wait_for_exit(pid)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    out = os.open(log_file, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    for fd in (1, 2):  # the flow's pipe has no reader any more
        os.dup2(out, fd)
    os.close(out)
    switched.set()  # before this thread writes: a write waiting on the switch may hold the stream's lock
    print(f"the flow process {pid} that started this stage is gone: stopping (SIGTERM to {os.getpid()})",
          file=sys.stderr, flush=True)
    os.kill(os.getpid(), signal.SIGTERM)


def stop_when_flow_exits(log_file: Path) -> int | None:
    """Watch the process ``RLHF_FLOW_PID`` names (if set) in a daemon thread; returns that pid.

    Replaces ``sys.stdout`` and ``sys.stderr`` (fds 1 and 2) with streams that survive the switch: call it
    before anything keeps a reference to the old ones (a ``logging.StreamHandler``)."""
    value = os.environ.get(FLOW_PID_ENV)
    if not value:
        return None
    pid = int(value)
    switched = threading.Event()
    sys.stdout = _switchable(sys.stdout, 1, switched)
    sys.stderr = _switchable(sys.stderr, 2, switched)
    threading.Thread(target=_stop, args=(pid, log_file, switched), name="flow-watch", daemon=True).start()
    return pid
