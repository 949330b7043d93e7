"""The demo task: small integer arithmetic with an exact checker.

A prompt asks ``What is 7 + 5?`` in the DeepSpeed-Chat ``Human: ... Assistant:``
form; the reference answer is the integer result.  SFT demonstrations are of
deliberately mixed quality (``wrong_share`` of them carry a plausible wrong
answer) so a reward model and RL have headroom above SFT; preference pairs
contrast the correct answer with a plausible wrong one. With ``slip_share``,
some questions are demonstrated wrong every time (the same slip), so only the
preference pairs know their answer.
"""

from __future__ import annotations

import random
import re

_ANSWER_RE = re.compile(r"\s*(-?\d+)\s*")
_QUESTION_RE = re.compile(r"What is (\d+ [+-] \d+)\?")


def render_prompt(question: str) -> str:
    """DeepSpeed-Chat style prompt: ``Human: {question}\\n\\nAssistant:``."""
    return f"Human: {question}\n\nAssistant:"


def question_of(prompt: str) -> str | None:
    """The ``a op b`` of a prompt made by ``render_prompt(f"What is {a op b}?")``, or None for any other prompt."""
    m = _QUESTION_RE.search(prompt)
    return m.group(1) if m else None


def solve(question: str) -> int:
    """The answer of a question ``"a + b"`` or ``"a - b"`` (the ``a op b`` that :func:`question_of` returns)."""
    a, op, b = question.split()
    return int(a) + int(b) if op == "+" else int(a) - int(b)


def render_answer(value: int | str) -> str:
    """The response text for an answer: a leading space, then the integer."""
    return f" {value}"


def parse_answer(completion: str) -> int | None:
    """The integer a completion states, or None unless it is exactly one integer (surrounding space allowed)."""
    m = _ANSWER_RE.fullmatch(completion)
    return int(m.group(1)) if m else None


def check_answer(completion: str, answer: int | str | None) -> bool:
    """Exact checker: True iff the completion is exactly the reference integer.

    ``" 12"`` and ``"12\\n"`` pass for answer 12; ``" 12 13"``, ``" twelve"``,
    ``" 012"`` (a different literal) and ``""`` do not.
    """
    if answer is None:
        return False
    m = _ANSWER_RE.fullmatch(completion)
    return bool(m) and m.group(1) == str(int(answer))


def _wrong_answer(rng: random.Random, correct: int) -> int:
    """A plausible wrong answer: off by 1-3, or off by ten (a carry slip)."""
    offsets = [-3, -2, -1, 1, 2, 3, 10, -10]
    candidate = correct + rng.choice(offsets)
    return candidate if candidate >= 0 else correct + rng.choice([1, 2, 3])


def slipped(question: str, slip_share: float, seed: int) -> bool:
    """Whether ``question`` is one whose demonstrations all carry the slip (a fixed draw per question and seed,
    independent of the row order)."""
    return slip_share > 0 and random.Random(f"slip-{seed}-{question}").random() < slip_share


def generate(n_rows: int, max_operand: int, ops: list[str], wrong_share: float, seed: int,
             slip_share: float = 0.0) -> list[dict]:
    """Deterministic rows with every canonical field: prompt, response, chosen, rejected, answer.

    ``slip_share`` of the *questions* get a systematic error: every demonstration of such a question answers
    ``correct + 10`` (a carry slip); half of its preference pairs reject exactly that answer, the others a
    plausible wrong answer as for any question (so the pairs rank the correct answer above its neighbours too,
    not only above the slip). Imitation then learns the slip, and only the preferences can correct it. The rows
    drawn are the same for any ``slip_share``.
    """
    rng = random.Random(seed)
    rows = []
    for i in range(n_rows):
        op = rng.choice(ops)
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        question = f"{a} {op} {b}"
        correct = solve(question)
        wrong = _wrong_answer(rng, correct)
        demo = wrong if rng.random() < wrong_share else correct
        if slipped(question, slip_share, seed):
            demo = correct + 10
            if random.Random(f"slip-pair-{seed}-{i}").random() < 0.5:
                wrong = demo
        rows.append({
            "id": f"demo-{i}",
            "prompt": render_prompt(f"What is {question}?"),
            "response": render_answer(demo),
            "chosen": render_answer(correct),
            "rejected": render_answer(wrong),
            "answer": str(correct),
        })
    return rows
