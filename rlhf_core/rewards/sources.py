"""Reward sources combined for RLHF and evaluation: rule functions by name, plus the trained RM (``rm``).

``rlhf.reward_fns`` maps a source name to its weight; the score of a completion
is ``sum_k w_k * source_k(prompt, completion)``.  ``rm`` scores ``prompt +
completion`` with the reward model in ``models/rm`` (with ``rm.ensemble``, the
mean standardised score of its members), re-tokenised from text, so an RM with
a different tokenizer than the actor works; with ``rm_tokenizer_mismatch:
error`` a mismatch is refused instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import torch

from rlhf_core.data.tokenizer import same_tokenizer
from rlhf_core.models import load_scorer
from rlhf_core.rewards.registry import get_reward_fn

RM_SOURCE = "rm"


class RewardSources:
    """Callable ``(prompts, completions, **columns) -> FloatTensor[B]`` over the configured sources."""

    def __init__(self, weights: dict[str, float], rm_path: str | Path | None = None, actor_tokenizer=None,
                 on_mismatch: str = "retokenize", device: str | torch.device = "cpu", batch_size: int = 32):
        if not weights:
            raise ValueError("rlhf.reward_fns is empty: name at least one reward source")
        self.weights = dict(weights)
        self.rules = {name: get_reward_fn(name) for name in self.weights if name != RM_SOURCE}
        self.rm = None
        if RM_SOURCE in self.weights:
            if rm_path is None or not Path(rm_path).is_dir():
                raise ValueError(f"reward source 'rm' needs a trained reward model at {rm_path}")
            self.rm = load_reward_model(rm_path, device, batch_size)
            if actor_tokenizer is not None and on_mismatch == "error" and not same_tokenizer(
                    self.rm.tokenizer, actor_tokenizer):
                raise ValueError(f"the reward model at {rm_path} uses a different tokenizer than the actor "
                                 "(rlhf.rm_tokenizer_mismatch: error); retrain the RM or set it to retokenize")

    def rm_scores(self, prompts: Sequence[str], completions: Sequence[str]) -> torch.Tensor:
        if self.rm is None:
            raise ValueError("no reward model configured (add `rm` to rlhf.reward_fns)")
        return self.rm.score_responses(list(prompts), list(completions)).float().cpu()

    def __call__(self, prompts: Sequence[str], completions: Sequence[str], **columns) -> torch.Tensor:
        """The weighted sum; a source of weight 0 is not run (a control's RM: loaded, never scored here)."""
        total = torch.zeros(len(completions))
        for name, fn in self.rules.items():
            if self.weights[name]:
                total += self.weights[name] * torch.tensor(fn(prompts, completions, **columns), dtype=torch.float)
        if self.rm is not None and self.weights[RM_SOURCE]:
            total += self.weights[RM_SOURCE] * self.rm_scores(prompts, completions)
        return total


def load_reward_model(path: str | Path, device: str | torch.device = "cpu", batch_size: int = 32):
    """The trained RM's scorer (``score(texts) -> Tensor[B]``, ``batch_size`` rows per forward): the ensemble's
    mean when ``rm.ensemble`` > 1."""
    return load_scorer(path, device=device, batch_size=batch_size)
