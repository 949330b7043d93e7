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


def test_slipped_questions_are_always_demonstrated_wrong_and_half_their_pairs_reject_the_slip():
    plain = generate(600, max_operand=9, ops=["+", "-"], wrong_share=0.3, seed=3)
    slipping = generate(600, max_operand=9, ops=["+", "-"], wrong_share=0.3, seed=3, slip_share=0.3)
    assert [r["prompt"] for r in plain] == [r["prompt"] for r in slipping]  # the same rows, whatever the share
    by_question: dict[str, list[dict]] = {}
    for r in slipping:
        by_question.setdefault(r["prompt"], []).append(r)
    slipped = {q for q, rows in by_question.items() if all(r["response"] == f" {int(r['answer']) + 10}" for r in rows)}
    assert 0.15 < len(slipped) / len(by_question) < 0.45  # about slip_share of the questions
    slip_pairs = [r["rejected"] == r["response"] for r in slipping if r["prompt"] in slipped]
    for p, r in zip(plain, slipping, strict=True):
        assert check_answer(r["chosen"], r["answer"])  # the preferences always know the answer
        if r["prompt"] in slipped:  # the pair rejects the slip itself, or the neighbour it rejects unslipped
            assert r["rejected"] in (r["response"], p["rejected"])
    assert 0.35 < sum(slip_pairs) / len(slip_pairs) < 0.65
    unslipped = [r for q, rows in by_question.items() if q not in slipped for r in rows]
    right = sum(check_answer(r["response"], r["answer"]) for r in unslipped) / len(unslipped)
    assert 0.6 < right < 0.8  # the other questions keep wrong_share's mix
    assert plain == generate(600, max_operand=9, ops=["+", "-"], wrong_share=0.3, seed=3, slip_share=0.0)


def test_slip_split_sorts_prompts_by_their_question():
    from benchmarks.slip_split import split_by_slip
    from rlhf_core.rewards.demo_task import question_of, render_prompt, slipped

    questions = [f"{a} + {b}" for a in range(10) for b in range(10)]
    prompts = [render_prompt(f"What is {q}?") for q in questions]
    slip, rest = split_by_slip(prompts, 0.3, seed=5)
    assert sorted(slip + rest) == list(range(100)) and 10 < len(slip) < 50
    assert all(slipped(questions[i], 0.3, 5) for i in slip) and not any(slipped(questions[i], 0.3, 5) for i in rest)
    assert split_by_slip(prompts, 0.0, seed=5) == ([], list(range(100)))
    assert question_of(prompts[23]) == "2 + 3" and question_of("Human: hello\n\nAssistant:") is None
    with pytest.raises(ValueError, match="prompt 1 is not a demo question"):
        split_by_slip([prompts[0], "Human: hello\n\nAssistant:"], 0.3, seed=5)


def test_rm_top1_counts_questions_whose_best_scored_answer_is_right():
    import torch

    from benchmarks.rm_top1 import shares, top1_correct

    candidates = torch.arange(4)
    scores = torch.tensor([[0.0, 3.0, 1.0, 2.0],   # best: 1
                           [5.0, 5.0, 0.0, 0.0],   # tie: the first (0)
                           [0.0, 0.0, 0.0, 9.0]])  # best: 3
    correct = top1_correct(scores, torch.tensor([1, 1, 2]), candidates)
    assert correct.tolist() == [True, False, False]
    split = shares(correct, torch.tensor([True, True, False]))
    assert split == {"all": pytest.approx(1 / 3), "slipped": 0.5, "other": 0.0}
    assert shares(correct, torch.zeros(3, dtype=torch.bool))["slipped"] is None


def test_ptx_filter_shares_count_what_the_floor_keeps_and_drops():
    import torch

    from benchmarks.ptx_filter import filter_shares
    from rlhf_core.rewards.demo_task import solve

    scores = torch.tensor([1.0, 0.5, -0.2, -1.0, 0.0])
    correct = torch.tensor([True, False, True, False, False])
    # floor 0 keeps rows 0, 1, 4: one correct of three; the wrong rows are 1, 3, 4, of which row 3 is dropped
    assert filter_shares(scores, correct, 0.0) == {"floor": 0.0, "kept": 0.6, "correct_kept": pytest.approx(1 / 3),
                                                   "wrong_dropped": pytest.approx(1 / 3)}
    assert filter_shares(scores, correct, 2.0)["correct_kept"] is None  # nothing kept
    assert filter_shares(scores, torch.ones(5, dtype=torch.bool), 0.0)["wrong_dropped"] is None  # nothing wrong
    assert solve("7 + 5") == 12 and solve("3 - 9") == -6
