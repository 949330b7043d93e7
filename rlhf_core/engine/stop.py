"""Graceful stop on SIGTERM (preemption, eviction, node drain, a cancelled flow): checkpoint, then exit.

``rlhf stage`` calls :func:`install` with ``compute.stop_grace_s``. A SIGTERM then only raises a flag. The
training loops call :func:`stop_requested` after each optimizer step (SFT, RM) or rollout iteration (RL); the
ranks agree through one all-reduce, so all of them save the same step. The loop saves a checkpoint and raises
:class:`StopRequested`; the CLI exits with ``exit_codes.STOPPED`` (75), and the retry resumes from that
checkpoint, losing nothing.

If no step boundary comes within ``grace_s`` seconds of the signal (a long generation, a hung collective), a
timer exits the process with 143 (128 + SIGTERM) before the kubelet's SIGKILL can land mid-write: the last
periodic checkpoint stands (checkpoints are committed atomically). Set the pod's
``terminationGracePeriodSeconds`` above ``grace_s`` plus one checkpoint write.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

import torch

from rlhf_core.engine import distributed as D

SIGTERM_EXIT = 128 + signal.SIGTERM


class StopRequested(Exception):
    """Raised by a training loop after it saved the checkpoint of ``step`` following a SIGTERM."""

    def __init__(self, step: int, checkpoint: str | None):
        super().__init__(f"stopped on SIGTERM after step {step}; checkpoint {checkpoint or 'none'} "
                         "(a re-run resumes from it)")
        self.step, self.checkpoint = step, checkpoint

    def __reduce__(self):  # raised in a worker process (rm.parallel), re-raised in the stage's
        return type(self), (self.step, self.checkpoint)


_signalled_at: float | None = None
_grace_s: float = 0.0


def install(grace_s: float) -> None:
    """SIGTERM sets the stop flag and arms a ``grace_s`` timer that exits 143 if no checkpoint was reached."""
    global _grace_s
    _grace_s = grace_s
    signal.signal(signal.SIGTERM, _on_sigterm)


def _on_sigterm(signum, frame) -> None:
    global _signalled_at
    if _signalled_at is not None:
        return
    _signalled_at = time.monotonic()
    say = f"SIGTERM: checkpointing at the next step boundary (at most {_grace_s:.0f}s)\n"
    with contextlib.suppress(OSError):  # os.write, not print: the signal may land inside a write to sys.stderr
        os.write(2, say.encode())  # (a Python raw stream, ops.flow_watch), whose buffer is not reentrant
    timer = threading.Timer(_grace_s, _out_of_grace)
    timer.daemon = True
    timer.start()


def _out_of_grace() -> None:
    print(f"SIGTERM: no step boundary within {_grace_s:.0f}s; exiting without a new checkpoint (the previous "
          "one stands)", file=sys.stderr, flush=True)
    os._exit(SIGTERM_EXIT)


def stop_requested() -> bool:
    """True on every rank once any rank got SIGTERM (one all-reduce of a scalar per call)."""
    flag = torch.tensor([1.0 if _signalled_at is not None else 0.0])
    return float(D.all_reduce_sum(flag)[0]) > 0


def signalled() -> bool:
    """Whether this process got SIGTERM (no collective: for a parent that forwards it to its workers)."""
    return _signalled_at is not None


def reset() -> None:
    """Clear the flag (tests, and a process that trains twice)."""
    global _signalled_at
    _signalled_at = None
