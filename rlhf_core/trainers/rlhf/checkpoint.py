"""Checkpoints of an RLHF run: several DeepSpeed engines (actor, critic) + trainer state in one tag.

An adapter over the engine's ``CheckpointManager`` (same fingerprint, ``latest`` and pruning rules)::

    checkpoints/rlhf/
      fingerprint.json
      latest                   written last: a checkpoint counts only once it is named here
      step_00000010/
        actor/                 DeepSpeed files: weights, optimizer, LR scheduler
        critic/                (PPO with GAE)
        ema.pt                 EMA actor weights (when rlhf.ema_decay)
        rng_rank<r>.pt         torch / numpy / python (/ cuda) RNG per rank
        trainer_state.json     step, KL controller, curves, SFT accuracy, ...
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from rlhf_core.engine import distributed as D
from rlhf_core.engine.checkpoint import (
    TRAINER_STATE,
    CheckpointManager,
    load_state_file,
    rng_state,
    set_rng_state,
)
from rlhf_core.ops import paths

EMA_FILE = "ema.pt"


class MultiEngineCheckpoint(CheckpointManager):
    """``save``/``load`` a dict of named engines (all ranks call both)."""

    def save(self, engines: dict, step: int, trainer_state: dict, ema: dict | None = None) -> str:  # type: ignore[override]
        tag = f"step_{step:08d}"
        tag_dir = self.dir / tag
        with self.saving(tag):
            for name, engine in engines.items():
                engine.ds.save_checkpoint(str(tag_dir), tag=name, save_latest=False)
            torch.save(rng_state(), tag_dir / f"rng_rank{D.rank()}.pt")
            if ema is not None and D.is_main():
                torch.save(ema, tag_dir / EMA_FILE)
            D.barrier()
            if D.is_main():
                self._commit(tag, trainer_state)
        D.barrier()
        return str(tag_dir)

    def load(self, engines: dict, tag: str) -> dict:  # type: ignore[override]
        """Restore every engine (weights, optimizer, scheduler) and this rank's RNG; return the trainer state."""
        tag_dir = self.dir / tag
        for name, engine in engines.items():
            path, _ = engine.ds.load_checkpoint(str(tag_dir), tag=name, load_module_strict=True,
                                                load_optimizer_states=True, load_lr_scheduler_states=True)
            if path is None:
                raise RuntimeError(f"could not load the {name} checkpoint from {tag_dir / name}")
        rng_file = tag_dir / f"rng_rank{D.rank()}.pt"
        if rng_file.exists():
            set_rng_state(load_state_file(rng_file))
        return json.loads((tag_dir / TRAINER_STATE).read_text())

    def load_ema(self, tag: str) -> dict | None:
        """The EMA actor weights saved with ``tag`` (None when the run keeps no EMA)."""
        ema_file = self.dir / tag / EMA_FILE
        return load_state_file(ema_file) if ema_file.exists() else None


def checkpoint_dir(root: str | Path) -> Path:
    return Path(root) / paths.CHECKPOINTS / "rlhf"
