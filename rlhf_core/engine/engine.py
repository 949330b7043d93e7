"""``TrainEngine``: one model + AdamW + warmup/decay LR under ``deepspeed.initialize``.

The engine owns the DeepSpeed config (ZeRO 0-3, offload, clipping, accumulation, bf16/fp16 on GPU,
fp32 on CPU), the optimizer and the scheduler; the training loop (``rlhf_core.engine.loop.fit``) and
the checkpoint manager drive it.  ``save_model`` writes a final model in HF format (safetensors),
gathering ZeRO-3 partitions and merging LoRA adapters when asked.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch

from rlhf_core.config import ComputeConfig, OptimConfig
from rlhf_core.engine import distributed as D
from rlhf_core.engine.checkpoint import read_deepspeed_files_safely
from rlhf_core.engine.ds_config import (
    WarmupDecay,
    build_ds_config,
    make_optimizer,
    manual_clip,
    param_groups,
    resolve_precision,
)
from rlhf_core.engine.jit_ops import op_build_guard


@contextlib.contextmanager
def model_init_context(compute: ComputeConfig, optim: OptimConfig) -> Iterator[Any]:
    """Build models inside this context: under ZeRO-3 transformers then constructs them partitioned
    (``deepspeed.zero.Init`` via ``HfDeepSpeedConfig``), so no rank holds the full fp32 model."""
    if compute.zero_stage != 3:
        yield None
        return
    from transformers.integrations.deepspeed import HfDeepSpeedConfig, unset_hf_deepspeed_config

    D.init_distributed()
    hf_cfg = HfDeepSpeedConfig(build_ds_config(compute, optim, D.world_size()))
    try:
        yield hf_cfg
    finally:
        unset_hf_deepspeed_config()


class TrainEngine:
    """A DeepSpeed engine for ``model`` with the optimiser/schedule of one stage section."""

    def __init__(self, model: torch.nn.Module, compute: ComputeConfig, optim: OptimConfig, total_steps: int):
        D.init_distributed()
        import deepspeed

        self.compute, self.optim, self.total_steps = compute, optim, total_steps
        self.precision = resolve_precision(compute.precision)
        self.manual_clip = manual_clip(compute, self.precision)
        self.ds_config = build_ds_config(compute, optim, D.world_size(), self.precision)
        groups = param_groups(model, optim.weight_decay)
        if not groups:
            raise ValueError("the model has no trainable parameters")
        with op_build_guard():  # the optimizer may JIT-load an op (CPU Adam); no collective in here
            optimizer = make_optimizer(groups, optim, compute)
        schedule = WarmupDecay(optim.warmup_steps, total_steps, optim.lr_scheduler, optim.min_lr_ratio)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, schedule)
        self.ds, self.optimizer, _, self.scheduler = deepspeed.initialize(
            model=model, optimizer=optimizer, lr_scheduler=scheduler, config=self.ds_config,
            dist_init_required=False)
        read_deepspeed_files_safely(self.ds)
        if D.world_size() == 1 and compute.zero_stage == 0:
            self.ds.enable_backward_allreduce = False  # nothing to reduce; skips flattening every gradient
        self._trainable = [p for p in self.ds.module.parameters() if p.requires_grad]
        self._grad_norm: float | None = None

    # ------------------------------------------------------------------ training
    @property
    def module(self) -> torch.nn.Module:
        return self.ds.module

    @property
    def device(self) -> torch.device:
        return self.ds.device

    @property
    def lr(self) -> float:
        return float(self.scheduler.get_last_lr()[0])

    @property
    def global_steps(self) -> int:
        return int(self.ds.global_steps)

    def __call__(self, *args, **kwargs):
        return self.ds(*args, **kwargs)

    def backward(self, loss: torch.Tensor) -> None:
        self.ds.backward(loss)

    def step(self) -> bool:
        """One micro-step; returns True when it completed an optimizer step (accumulation boundary)."""
        boundary = self.ds.is_gradient_accumulation_boundary()
        if boundary and self.manual_clip:
            norm = torch.nn.utils.clip_grad_norm_(self._trainable, self.compute.grad_clip)
            self._grad_norm = float(norm)
        self.ds.step()
        if boundary and not self.manual_clip:
            norm = self.ds.get_global_grad_norm()
            self._grad_norm = None if norm is None else float(norm)
        return boundary

    @property
    def grad_norm(self) -> float | None:
        """Global gradient norm of the last optimizer step (before clipping)."""
        return self._grad_norm

    def train(self, mode: bool = True) -> None:
        self.ds.train(mode)

    # ------------------------------------------------------------------ export
    @contextlib.contextmanager
    def gathered(self) -> Iterator[torch.nn.Module]:
        """The full module on every rank (ZeRO-3 partitions gathered for the duration)."""
        if self.compute.zero_stage == 3:
            import deepspeed

            with deepspeed.zero.GatheredParameters(list(self.module.parameters()), modifier_rank=None):
                yield self.module
        else:
            yield self.module

    def save_model(self, out_dir: str | Path, save_fn) -> None:
        """Rank 0 calls ``save_fn(module, out_dir)`` on the full (gathered) module; all ranks must call this."""
        with self.gathered() as module:
            if D.is_main():
                save_fn(module, Path(out_dir))
        D.barrier()
