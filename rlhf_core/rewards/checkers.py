"""The task checkers by name (``eval.checker``): ``(completion, answer) -> bool``. They judge; a reward uses one
only when named in ``rlhf.reward_fns`` (``exact_answer``, ``final_number``: the oracle controls)."""

from __future__ import annotations

from collections.abc import Callable

from rlhf_core.rewards.arithmetic import check_final_number, final_number
from rlhf_core.rewards.demo_task import check_answer

Checker = Callable[[str, "int | str | None"], bool]
CHECKERS: dict[str, Checker] = {"exact": check_answer, "final_number": check_final_number}
# what each checker reads as the answer: two completions with the same one give the same verdict (a majority vote)
ANSWER_OF: dict[str, Callable[[str], object]] = {"exact": str.strip, "final_number": final_number}


def get_checker(name: str) -> Checker:
    try:
        return CHECKERS[name]
    except KeyError:
        raise KeyError(f"unknown checker {name!r} (eval.checker); known: {', '.join(sorted(CHECKERS))}") from None
