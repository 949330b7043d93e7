"""Resumable checkpoints under ``checkpoints/<stage>/`` and atomic final-model directories.

Layout::

    checkpoints/sft/
      fingerprint.json        what the checkpoints belong to (params + input hashes + world size)
      latest                  tag of the newest complete checkpoint (written last, atomically)
      step_00000020/          DeepSpeed files (model, optimizer, scheduler), trainer_state.json,
                              rng_rank<r>.pt (torch / cuda / numpy / python RNG per rank),
                              manifest.json (size and sha256 of every other file, written before ``latest``)

A checkpoint counts only once ``latest`` names it, so a crash while saving leaves the previous
one in force.  A fingerprint mismatch (changed params or data) starts training afresh.

Before resuming, the checkpoint is checked against its manifest: a missing, truncated or altered file (bit rot,
a half-copied volume, a full disk) is named, and the newest checkpoint that checks out is used instead
(``keep_checkpoints`` >= 2 keeps one to fall back to); when none does, the stage refuses
(:class:`CorruptCheckpointError`) rather than train from garbage or silently start over. ``latest`` naming a
step that is gone falls back the same way. A checkpoint written before manifests existed is accepted as is.
"""

from __future__ import annotations

import contextlib
import json
import pickle
import random
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rlhf_core.engine import distributed as D
from rlhf_core.ops import integrity
from rlhf_core.ops.atomic import write_json_atomic, write_text_atomic

LATEST = "latest"
FINGERPRINT = "fingerprint.json"
TRAINER_STATE = "trainer_state.json"
MANIFEST = "manifest.json"


class CorruptCheckpointError(ValueError):
    """No checkpoint of the stage checks out against its manifest; the message names each bad file."""


class CheckpointSaveError(OSError):
    """Writing a checkpoint failed (a full disk, a quota); the message says which one stays in force."""


def write_manifest(tag_dir: Path) -> None:
    """``manifest.json``: size and sha256 of every file under ``tag_dir`` (itself excluded)."""
    integrity.write_manifest(tag_dir, MANIFEST)


def verify_checkpoint(tag_dir: Path) -> str | None:
    """None when ``tag_dir`` is a complete checkpoint whose files match its manifest (or one written before
    manifests existed), else what is wrong, naming the file."""
    if not tag_dir.is_dir():
        return f"{tag_dir}: missing"
    if not (tag_dir / TRAINER_STATE).exists():
        return f"{tag_dir / TRAINER_STATE}: missing (an incomplete save)"
    return integrity.check_manifest(tag_dir, MANIFEST)


def rng_state() -> dict[str, Any]:
    """Every RNG's state in types ``torch.load(weights_only=True)`` reads (tensors, tuples, numbers): a file on
    shared storage is never unpickled as arbitrary objects (numpy's key array travels as a tensor)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {"torch": torch.get_rng_state(), "numpy": (name, torch.from_numpy(keys.astype(np.int64)), pos, has_gauss,
                                                       cached), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


class UnsafeCheckpointError(ValueError):
    """A checkpoint file holds more than tensors and numbers (a planted or foreign pickle): refused, not run."""


def _deepspeed_state_classes() -> list:
    """The classes DeepSpeed's ZeRO optimizer states pickle besides tensors and numbers (measured on ZeRO 1-3:
    the loss scaler, the stage enum, the fp32 fragment addresses); plain data, allowed by name."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


def load_state_file(path: str | Path, map_location: Any = None) -> Any:
    """``torch.load(path, weights_only=True)`` with DeepSpeed's state classes allowed: any other pickled object
    (a planted pickle, a foreign one) is refused naming the file and the object, never executed."""
    with torch.serialization.safe_globals(_deepspeed_state_classes()):
        try:
            return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(f"{path}: refused to load: it holds objects other than tensors, numbers and "
                                        f"DeepSpeed's state classes ({str(err).splitlines()[0]}); delete the "
                                        "checkpoint to start afresh") from None


def read_deepspeed_files_safely(ds_engine) -> None:
    """Make ``ds_engine.load_checkpoint`` read its files through ``load_state_file``: DeepSpeed's own loader
    unpickles with ``weights_only=False``, i.e. runs whatever a file on shared storage asks it to."""
    ds_engine.checkpoint_engine.load = load_state_file


def set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.int64).astype(np.uint32), pos, has_gauss, cached))
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class CheckpointManager:
    """Save / find / load training checkpoints of one stage (all ranks call save and load)."""

    def __init__(self, directory: str | Path, fingerprint: dict, keep: int = 1):
        self.dir = Path(directory)
        self.fingerprint = json.loads(json.dumps(fingerprint, sort_keys=True, default=str))
        self.keep = keep

    # ------------------------------------------------------------------ queries
    def latest_tag(self) -> str | None:
        path = self.dir / LATEST
        if not path.exists():
            return None
        tag = path.read_text().strip()
        return tag if (self.dir / tag / TRAINER_STATE).exists() else None

    def latest_path(self) -> str | None:
        tag = self.latest_tag()
        return str(self.dir / tag) if tag else None

    def matches(self) -> bool:
        path = self.dir / FINGERPRINT
        return path.exists() and json.loads(path.read_text()) == self.fingerprint

    def prepare(self, resume: bool) -> str | None:
        """Decide where training starts: the tag to resume from, or None (stale checkpoints are cleared).
        Raises :class:`CorruptCheckpointError` on every rank when checkpoints exist and none checks out."""
        tag, error = None, None
        if D.is_main():
            candidates = self.candidates() if resume and self.matches() else []
            if candidates:
                tag, error = self.resume_tag(candidates)
            else:
                if self.dir.exists():
                    shutil.rmtree(self.dir)
                self.dir.mkdir(parents=True, exist_ok=True)
                write_json_atomic(self.dir / FINGERPRINT, self.fingerprint)
        tag, error = D.broadcast_object((tag, error))
        D.barrier()
        if error:
            raise CorruptCheckpointError(error)
        return tag

    def candidates(self) -> list[str]:
        """Tags to resume from, best first: the one ``latest`` names, then the other ``step_*`` newest first."""
        named = (self.dir / LATEST).read_text().strip() if (self.dir / LATEST).exists() else None
        steps = sorted((p.name for p in self.dir.glob("step_*") if p.is_dir()), reverse=True)
        return ([named] if named else []) + [t for t in steps if t != named]

    def resume_tag(self, candidates: list[str]) -> tuple[str | None, str | None]:
        """(the first candidate that checks out, None), or (None, an error naming every bad file)."""
        bad = []
        for tag in candidates:
            problem = verify_checkpoint(self.dir / tag)
            if problem is None:
                if bad:  # said where the stage's output goes (the flow's logs), as SIGTERM handling does
                    print(f"checkpoint: resuming from {self.dir / tag} instead: {'; '.join(bad)}", file=sys.stderr,
                          flush=True)
                return tag, None
            bad.append(problem)
        return None, (f"no usable checkpoint in {self.dir}: " + "; ".join(bad) + f". Refusing to train from it; "
                      f"delete {self.dir} to start the stage afresh (keep_checkpoints >= 2 keeps one to fall "
                      "back to)")

    @contextlib.contextmanager
    def saving(self, tag: str) -> Iterator[None]:
        """Around writing checkpoint ``tag``: a failed write (no space left, file too large, a quota: an
        ``OSError``, or the ``RuntimeError`` torch's zip writer turns it into) becomes a
        :class:`CheckpointSaveError` saying that ``latest`` was not moved and which checkpoint a re-run resumes
        from (the partial ``tag`` directory is left for the next save or prune to replace)."""
        try:
            yield
        except (OSError, RuntimeError) as err:
            if isinstance(err, CheckpointSaveError):
                raise
            kept = self.latest_tag()
            then = (f"{self.dir / kept} stays the checkpoint a re-run resumes from" if kept
                    else "there is no earlier checkpoint: a re-run starts the stage afresh")
            cause = (err.strerror if isinstance(err, OSError) and err.strerror
                     else f"{type(err).__name__}: {str(err).strip()}: a write was cut short, e.g. a full disk")
            raise CheckpointSaveError(f"{self.dir / tag}: saving the checkpoint failed ({cause}); {then}") from err

    def _commit(self, tag: str, trainer_state: dict) -> None:
        """Rank 0, after every rank saved its files: trainer state, the manifest, then ``latest``, then prune."""
        write_json_atomic(self.dir / tag / TRAINER_STATE, trainer_state)
        write_manifest(self.dir / tag)
        write_text_atomic(self.dir / LATEST, tag)
        self._prune(keep_tag=tag)

    # ------------------------------------------------------------------ save / load
    def save(self, engine, step: int, trainer_state: dict) -> str:
        """All ranks: DeepSpeed state + per-rank RNG; rank 0 then writes trainer state and flips ``latest``."""
        tag = f"step_{step:08d}"
        with self.saving(tag):
            engine.ds.save_checkpoint(str(self.dir), tag=tag, save_latest=False)
            torch.save(rng_state(), self.dir / tag / f"rng_rank{D.rank()}.pt")
            D.barrier()
            if D.is_main():
                self._commit(tag, trainer_state)
        D.barrier()
        return str(self.dir / tag)

    def load(self, engine, tag: str) -> dict:
        """Restore model, optimizer, scheduler (DeepSpeed) and this rank's RNG; return the trainer state."""
        path, _ = engine.ds.load_checkpoint(str(self.dir), tag=tag, load_module_strict=True,
                                            load_optimizer_states=True, load_lr_scheduler_states=True)
        if path is None:
            raise RuntimeError(f"could not load checkpoint {self.dir / tag}")
        rng_file = self.dir / tag / f"rng_rank{D.rank()}.pt"
        if rng_file.exists():
            set_rng_state(load_state_file(rng_file))
        return json.loads((self.dir / tag / TRAINER_STATE).read_text())

    def _prune(self, keep_tag: str) -> None:
        tags = sorted(p.name for p in self.dir.glob("step_*") if p.is_dir())
        stale = [t for t in tags if t != keep_tag][: max(0, len(tags) - self.keep)]
        for t in stale:
            shutil.rmtree(self.dir / t, ignore_errors=True)
