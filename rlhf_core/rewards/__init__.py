"""Reward sources: the demo task's exact checker and the reward-function registry."""

from rlhf_core.rewards.demo_task import check_answer, parse_answer
from rlhf_core.rewards.registry import REWARD_FUNCTIONS, get_reward_fn, register_reward, weighted_rewards

__all__ = [
    "REWARD_FUNCTIONS",
    "check_answer",
    "get_reward_fn",
    "parse_answer",
    "register_reward",
    "weighted_rewards",
]
