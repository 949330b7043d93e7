"""Where an RL iteration's device memory goes (issue #31): the resident part and the training phase's parts.

``TrainPeaks`` wraps one trainer's update: what is allocated when the update starts (``resident``: both models'
weights and the optimizer's states, nothing of the iteration), and the peak of each micro-batch's loss forward,
its backward and its optimizer micro-step, each since its own start. ``live_by_origin`` groups the blocks of a
``torch.cuda.memory._snapshot()`` by the innermost Python frame outside torch that allocated them, so that the
activations alive after a training forward read as lines of the model's code. CUDA only: on a CPU every figure
is ``None`` and the wrappers pass through (the rehearsal runs the same calls).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_core.trainers.rlhf import trainer as trainer_module

GIB = 2**30


def live_by_origin(snapshot: dict, top: int = 25) -> dict:
    """``{"total_gib", "origins": [[file:line function, GiB], ...]}`` of the active blocks, largest first; blocks
    allocated before the history was recorded have no frames and count as ``(before recording)``."""
    totals: dict[str, int] = {}
    for segment in snapshot.get("segments", []):
        for block in segment.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            frames = block.get("frames") or []
            origin = next((f"{Path(f['filename']).name}:{f['line']} {f['name']}" for f in frames
                           if f.get("filename", "").endswith(".py") and "/torch/" not in f["filename"]),
                          "(torch internals)" if frames else "(before recording)")
            totals[origin] = totals.get(origin, 0) + int(block.get("size", 0))
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    return {"total_gib": sum(totals.values()) / GIB, "origins": [[k, v / GIB] for k, v in ranked[:top]]}


class TrainPeaks:
    """Installs the wrappers on ``trainer`` (after its warm-up). ``fold`` is called before every reset of the
    peak counter, so that a coarser phase's peak (``PhasePeaks.close("train")``) still sees the whole phase.
    With ``snapshot`` the allocation history is recorded from ``record()`` on, and the first backward after it
    takes a snapshot of what the forward left alive."""

    def __init__(self, trainer, fold, snapshot: bool = False):
        self.on = torch.cuda.is_available()
        self.fold, self.snapshot = fold, snapshot and self.on
        self.peaks: dict[str, float] = {}
        self.resident_gib: float | None = None
        self.live: dict | None = None
        self._recording = False
        actor = trainer.actor
        trainer_module.actor_loss = self.wrap(trainer_module.actor_loss, "train_forward")
        actor.backward = self.wrap(actor.backward, "train_backward", before=self.take_snapshot)
        actor.step = self.wrap(actor.step, "train_step")
        update = trainer.update

        def wrapped_update(*args, **kwargs):
            if self.on:
                self.resident_gib = torch.cuda.memory_allocated() / GIB
            return update(*args, **kwargs)

        trainer.update = wrapped_update

    def wrap(self, fn, name: str, before=None):
        def wrapped(*args, **kwargs):
            if before is not None:
                before()
            if self.on:
                self.fold()
                torch.cuda.reset_peak_memory_stats()
            out = fn(*args, **kwargs)
            if self.on:
                self.peaks[name] = max(self.peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / GIB)
            return out

        return wrapped

    def record(self) -> None:
        """Starts recording allocations (Python stacks) for the snapshot of the next backward."""
        if not self.snapshot:
            return
        try:
            torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                                     max_entries=1_000_000)
            self._recording = True
        except Exception as e:  # a figure lost, not the run: the row says why
            self.live = {"error": f"{type(e).__name__}: {e}"}

    def take_snapshot(self) -> None:
        if not self._recording:
            return
        self._recording = False
        try:
            self.live = live_by_origin(torch.cuda.memory._snapshot())
        except Exception as e:  # a figure lost, not the run: the row says why
            self.live = {"error": f"{type(e).__name__}: {e}"}
        torch.cuda.memory._record_memory_history(enabled=None)

    def row(self) -> dict:
        return {"resident_gib": self.resident_gib, "train_part_peak_gib": self.peaks,
                **({"live_after_forward": self.live} if self.snapshot else {})}
