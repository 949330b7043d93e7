"""The shared training loop: resumable data order, accumulation, NaN guard, logging, checkpoints.

A trainer supplies ``collate(indices) -> batch`` and ``loss_fn(engine, batch) -> (loss, stats)`` where
``stats`` is a dict of scalar tensors (means over the micro-batch, e.g. RM accuracy) and may carry
``"tokens"`` (non-pad tokens in the micro-batch, summed for throughput).  Everything reported is
averaged over ranks; only rank 0 calls ``log``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from rlhf_core.engine import distributed as D
from rlhf_core.engine.checkpoint import CheckpointManager
from rlhf_core.engine.engine import TrainEngine
from rlhf_core.engine.errors import NonFiniteLossError
from rlhf_core.engine.sampler import ResumableSampler, StepPlan
from rlhf_core.engine.stop import StopRequested, stop_requested

LogFn = Callable[[dict, int], None]


@dataclass
class TrainState:
    """What a checkpoint needs beyond DeepSpeed's own state (JSON-serialisable)."""

    step: int = 0  # optimizer steps done
    micro: int = 0  # micro-batches consumed (data position)
    tokens: float = 0.0
    train_time_s: float = 0.0
    curve: list[dict] = field(default_factory=list)  # one row per optimizer step
    extra: dict[str, Any] = field(default_factory=dict)  # trainer data, e.g. metrics before training

    def to_json(self) -> dict:
        return {"step": self.step, "micro": self.micro, "tokens": self.tokens, "train_time_s": self.train_time_s,
                "curve": self.curve, "extra": self.extra}

    @classmethod
    def from_json(cls, d: dict) -> TrainState:
        return cls(**{k: d[k] for k in ("step", "micro", "tokens", "train_time_s", "curve", "extra") if k in d})


@dataclass
class Hooks:
    """Test/instrumentation hooks (all optional)."""

    on_batch: Callable[[int, torch.Tensor], None] | None = None  # (micro index, example indices)
    after_step: Callable[[int, dict], None] | None = None  # (step, metrics), after any checkpoint


def fit(engine: TrainEngine, plan: StepPlan, sampler: ResumableSampler, collate: Callable[[torch.Tensor], Any],
        loss_fn: Callable[[TrainEngine, Any], tuple[torch.Tensor, dict]], state: TrainState,
        ckpt: CheckpointManager | None, log: LogFn | None, save_every: int = 0, log_every: int = 1,
        hooks: Hooks | None = None) -> TrainState:
    """Train from ``state`` to ``plan.total_steps``; checkpoint every ``save_every`` steps and at the end, and
    after a SIGTERM at the step it interrupted (then raise :class:`StopRequested`)."""
    hooks = hooks or Hooks()
    engine.train()
    accum = plan.grad_accum
    window: list[dict] = []
    while state.step < plan.total_steps:
        t0 = time.perf_counter()
        sums: dict[str, float] = {}
        tokens = 0.0
        lr = engine.lr
        for _ in range(accum):
            indices = sampler.batch(state.micro)
            if hooks.on_batch is not None:
                hooks.on_batch(state.micro, indices)
            batch = collate(indices)
            loss, stats = loss_fn(engine, batch)
            n_tok = float(stats.pop("tokens", 0.0))
            values = torch.stack([loss.detach().float().cpu(), torch.tensor(n_tok)]
                                 + [v.detach().float().cpu().reshape(()) for v in stats.values()])
            values = D.all_reduce_sum(values)
            if not math.isfinite(float(values[0])):
                raise NonFiniteLossError(state.step + 1, "loss", float(values[0]) / D.world_size(),
                                         ckpt.latest_path() if ckpt else None)
            engine.backward(loss)
            engine.step()
            state.micro += 1
            tokens += float(values[1])
            for k, v in zip(["loss", *stats], [values[0], *values[2:]], strict=True):
                sums[k] = sums.get(k, 0.0) + float(v) / D.world_size() / accum
        state.step += 1
        grad_norm = engine.grad_norm
        if grad_norm is not None and not math.isfinite(grad_norm):
            raise NonFiniteLossError(state.step, "gradient norm", grad_norm, ckpt.latest_path() if ckpt else None)
        dt = time.perf_counter() - t0
        state.tokens += tokens
        state.train_time_s += dt
        epoch = sampler.position(state.micro - 1)[0]
        metrics = {**sums, "lr": lr, "grad_norm": grad_norm if grad_norm is not None else float("nan"),
                   "tokens_per_s": tokens / dt if dt > 0 else 0.0, "epoch": epoch}
        state.curve.append({"step": state.step, **{k: round(v, 6) for k, v in sums.items()}})
        window.append(metrics)
        saved = ckpt is not None and ((save_every and state.step % save_every == 0) or state.step == plan.total_steps)
        if saved:
            ckpt.save(engine, state.step, state.to_json())
        if stop_requested():  # SIGTERM: checkpoint this step and leave (a re-run resumes here)
            if ckpt is not None and not saved:
                ckpt.save(engine, state.step, state.to_json())
            raise StopRequested(state.step, str(ckpt.latest_path()) if ckpt is not None else None)
        if log is not None and D.is_main() and (state.step % log_every == 0 or state.step == plan.total_steps):
            avg = {k: sum(m[k] for m in window) / len(window) for k in sums}
            log({**metrics, **avg}, state.step)
            window = []
        if hooks.after_step is not None:
            hooks.after_step(state.step, metrics)
    return state
