"""An exponential moving average of the actor's trainable weights: ``ema <- ema + (1 - decay) (w - ema)`` at
every optimizer step; saved as ``models/actor_ema`` (rank 0 keeps it; not with ZeRO-3)."""

from __future__ import annotations

import copy

import torch


class EMA:
    def __init__(self, model: torch.nn.Module, decay: float):
        self.decay = decay
        self.shadow = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        for n, p in model.named_parameters():
            if n in self.shadow:
                self.shadow[n].lerp_(p.detach(), 1.0 - self.decay)

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {k: v.cpu() for k, v in self.shadow.items()}

    def load_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        self.shadow = {k: v.to(self.shadow[k].device) for k, v in state.items()}

    def model(self, model: torch.nn.Module) -> torch.nn.Module:
        """A copy of ``model`` with the EMA weights, in eval mode."""
        out = copy.deepcopy(model)
        with torch.no_grad():
            for n, p in out.named_parameters():
                if n in self.shadow:
                    p.copy_(self.shadow[n])
        return out.eval()
