"""The demo checker on hand-written right and wrong answers, and the reward registry."""

import pytest

from rlhf_core.rewards import check_answer, get_reward_fn, parse_answer, weighted_rewards
from rlhf_core.rewards.demo_task import generate


@pytest.mark.parametrize("completion, answer", [(" 12", "12"), ("12", 12), (" 12\n", "12"), (" 0", "0"),
                                                 ("  7 ", "7"), (" -3", "-3")])
def test_checker_accepts_exact_answers(completion, answer):
    assert check_answer(completion, answer)


@pytest.mark.parametrize("completion, answer", [(" 13", "12"), (" 12 13", "12"), (" twelve", "12"), ("", "12"),
                                                 (" 12.5", "12"), (" 1 2", "12"), (" 3", "-3"), (" 12", None),
                                                 ("The answer is 12", "12")])
def test_checker_rejects_everything_else(completion, answer):
    assert not check_answer(completion, answer)


def test_parse_answer():
    assert parse_answer(" 42 ") == 42 and parse_answer(" 4 2") is None and parse_answer("x") is None


def test_generator_is_deterministic_and_self_consistent():
    rows = generate(200, max_operand=9, ops=["+", "-"], wrong_share=0.5, seed=3)
    assert rows == generate(200, max_operand=9, ops=["+", "-"], wrong_share=0.5, seed=3)
    for r in rows:
        q = r["prompt"].removeprefix("Human: What is ").removesuffix("?\n\nAssistant:")
        a, op, b = q.split()
        expected = int(a) + int(b) if op == "+" else int(a) - int(b)
        assert int(r["answer"]) == expected >= 0
        assert check_answer(r["chosen"], r["answer"]) and not check_answer(r["rejected"], r["answer"])


def test_reward_registry():
    completions, answers = [" 5", " 6", "five"], ["5", "5", "5"]
    assert get_reward_fn("exact_answer")([""] * 3, completions, answer=answers) == [1.0, 0.0, 0.0]
    assert get_reward_fn("format")([""] * 3, completions) == [1.0, 1.0, 0.0]
    total = weighted_rewards({"exact_answer": 1.0, "format": 0.5}, [""] * 3, completions, answer=answers)
    assert total == [1.5, 0.5, 0.0]
    with pytest.raises(KeyError, match="unknown reward function 'nope'.*known: .*exact_answer"):
        get_reward_fn("nope")
    with pytest.raises(ValueError, match="needs an `answer` column"):
        get_reward_fn("exact_answer")([""], [" 1"])
