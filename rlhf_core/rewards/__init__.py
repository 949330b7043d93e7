"""Reward sources: the task checkers and the reward-function registry."""

from rlhf_core.rewards.checkers import CHECKERS, get_checker
from rlhf_core.rewards.demo_task import check_answer, parse_answer
from rlhf_core.rewards.registry import REWARD_FUNCTIONS, get_reward_fn, register_reward, weighted_rewards

__all__ = [
    "CHECKERS",
    "get_checker",
    "REWARD_FUNCTIONS",
    "check_answer",
    "get_reward_fn",
    "parse_answer",
    "register_reward",
    "weighted_rewards",
]
