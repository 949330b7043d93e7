"""Llama-style RMSNorm that keeps its input and one float per row for backward, not two copies of the input.

transformers' ``LlamaRMSNorm`` (and its copies: Qwen2, Mistral, SmolLM2's Llama, ...) computes

    y = w * dtype(x_hat),   x_hat = f32(x) * r,   r = 1 / sqrt(mean(f32(x)^2) + eps)

and autograd keeps ``f32(x)`` (4 bytes per element) and ``dtype(x_hat)`` (2 in bf16) for backward. Here backward
recomputes ``x_hat`` from the input as given (2 bytes in bf16) and ``r`` (one float per row):

    dL/dw = sum over rows of  g * dtype(x_hat)
    dL/dx = dtype(r * (h - x_hat * mean(h * x_hat))),   h = f32(g * w)

The forward is the same ops in the same order (bit-equal output); the gradients agree up to float rounding
(tests/rlhf_core/models/test_lean_norm.py). What it saves on the GPU workload of issue #31:
docs/results/benchmarks-gpu-rollout.md.

:func:`use_lean_rmsnorm` gives every module that computes exactly this (probed on a small input: bit-equal
output, so Gemma's ``1 + w`` or a norm without the float32 upcast keeps its own) the lean forward, used when
autograd records; without a gradient (rollouts, scoring, a compiled decode step) the module's own forward runs.
"""

from __future__ import annotations

import types

import torch


class _LeanRMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.to(torch.float32)
        r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, r)
        return weight * (xf * r).to(x.dtype)

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, weight, r = ctx.saved_tensors
        x_hat = x.to(torch.float32) * r
        grad_w = (g * x_hat.to(x.dtype)).reshape(-1, x.shape[-1]).sum(0).to(weight.dtype)
        h = (g * weight).to(torch.float32)
        grad_x = r * (h - x_hat * (h * x_hat).mean(-1, keepdim=True))
        return grad_x.to(x.dtype), grad_w, None


def lean_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """``weight * dtype(f32(x) * rsqrt(mean(f32(x)^2) + eps))`` keeping ``x`` and the row factors for backward."""
    return _LeanRMSNorm.apply(x, weight, eps)


def _eps(module: torch.nn.Module) -> float | None:
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return float(eps) if isinstance(eps, int | float) else None


def _computes_llama_rmsnorm(module: torch.nn.Module, eps: float) -> bool:
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 1 or weight.numel() == 0:
        return False  # none, or partitioned (ZeRO-3): nothing to probe
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(2, 3, weight.numel(), generator=gen).to(device=weight.device, dtype=weight.dtype) * 3
    with torch.no_grad():
        try:
            own = type(module).forward(module, x)
        except Exception:  # a norm whose forward takes other arguments is not this one
            return False
        return isinstance(own, torch.Tensor) and torch.equal(own, lean_rmsnorm(x, weight, eps))


def _lean_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled() and (hidden_states.requires_grad or self.weight.requires_grad):
        return lean_rmsnorm(hidden_states, self.weight, self._lean_eps)
    return type(self).forward(self, hidden_states)


def use_lean_rmsnorm(model: torch.nn.Module) -> int:
    """Gives every Llama-style RMSNorm of ``model`` the lean forward (module docstring); returns how many."""
    n = 0
    for module in model.modules():
        if "rmsnorm" not in type(module).__name__.lower() or "forward" in module.__dict__:
            continue
        eps = _eps(module)
        if eps is not None and _computes_llama_rmsnorm(module, eps):
            module._lean_eps = eps
            module.forward = types.MethodType(_lean_forward, module)
            n += 1
    return n
