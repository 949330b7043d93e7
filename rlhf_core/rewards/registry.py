"""Registry of rule-based reward functions ``fn(prompts, completions, **columns) -> list[float]``.

Selected by name in ``rlhf.reward_fns`` (name -> weight) and summed with their
weights.  The trained reward model is the special source ``rm`` (handled by
the RLHF stage, not here).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from rlhf_core.rewards.arithmetic import check_final_number
from rlhf_core.rewards.demo_task import check_answer, parse_answer

RewardFn = Callable[..., list[float]]
REWARD_FUNCTIONS: dict[str, RewardFn] = {}


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    def deco(fn: RewardFn) -> RewardFn:
        REWARD_FUNCTIONS[name] = fn
        return fn

    return deco


def get_reward_fn(name: str) -> RewardFn:
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        known = ", ".join(sorted(REWARD_FUNCTIONS)) or "none"
        raise KeyError(f"unknown reward function {name!r} (rlhf.reward_fns); known: {known}, rm") from None


@register_reward("exact_answer")
def exact_answer(prompts: Sequence[str], completions: Sequence[str], answer: Sequence | None = None,
                 **_: object) -> list[float]:
    """1.0 when the completion is exactly the reference answer, else 0.0."""
    if answer is None:
        raise ValueError("reward 'exact_answer' needs an `answer` column in the prompts data")
    return [float(check_answer(c, a)) for c, a in zip(completions, answer, strict=True)]


@register_reward("final_number")
def final_number_reward(prompts: Sequence[str], completions: Sequence[str], answer: Sequence | None = None,
                        **_: object) -> list[float]:
    """1.0 when the last integer the completion states is the reference answer (the arithmetic task's checker)."""
    if answer is None:
        raise ValueError("reward 'final_number' needs an `answer` column in the prompts data")
    return [float(check_final_number(c, a)) for c, a in zip(completions, answer, strict=True)]


@register_reward("format")
def format_reward(prompts: Sequence[str], completions: Sequence[str], **_: object) -> list[float]:
    """1.0 when the completion is a single integer (the demo answer format), else 0.0."""
    return [float(parse_answer(c) is not None) for c in completions]


def weighted_rewards(weights: dict[str, float], prompts: Sequence[str], completions: Sequence[str],
                     **columns: object) -> list[float]:
    """sum_k w_k * fn_k(prompts, completions, **columns), element-wise."""
    total = [0.0] * len(completions)
    for name, weight in weights.items():
        scores = get_reward_fn(name)(prompts, completions, **columns)
        total = [t + weight * s for t, s in zip(total, scores, strict=True)]
    return total
