"""The multi-step task of process supervision (issue 29): a chain of sums and differences solved one operation
per line.

A question is a start value and ``n`` operations, ``a + b - c + d``: "Compute 12 + 7 - 5 + 30 one step at a
time." Its solution has one line per operation, each ``state op operand = new state``::

    12 + 7 = 19
    19 - 5 = 14
    14 + 30 = 44

so the steps end at :data:`STEP_DELIMITER` (and the last one at the end of the response). Differences never go
below 0. Held out (:func:`is_held_out`): a question whose operand tuple falls in the held-out share (a fixed
hash of the tuple and the seed), or one asked in a held-out phrasing.

The checker only judges. :func:`step_labels` gives each line of a completion a label, as Math-Shepherd labels a
step by whether the solution can still be right after it: line ``k`` is right when it is the ``k``-th line of
the solution and every line before it is right too (a step after a slip is wrong, even when its own arithmetic
holds). Lines past the solution's last, or missing, are wrong; a line the checker cannot read is wrong.
"""

from __future__ import annotations

import hashlib
import random
import re
from dataclasses import dataclass

STEP_DELIMITER = "\n"
PHRASINGS = [
    "Compute {expr} one step at a time.",
    "Work out {expr}, one operation per line.",
    "What is {expr}? Show each step on its own line.",
    "Solve {expr} step by step.",
    "Evaluate {expr}, writing each intermediate result.",
    "Find the value of {expr}, one step per line.",
]
_EXPRESSION = re.compile(r"\d+(?: [+-] \d+)+")
_STEP = re.compile(r"^\s*(-?\d+)\s*([+-])\s*(\d+)\s*=\s*(-?\d+)\s*\.?\s*$")


@dataclass(frozen=True)
class Problem:
    start: int
    ops: tuple[tuple[str, int], ...]  # (operator, operand) in order

    @property
    def expression(self) -> str:
        return " ".join([str(self.start), *(f"{op} {x}" for op, x in self.ops)])

    def solution(self) -> list[str]:
        """The solution's lines, ``state op operand = new state``."""
        lines, state = [], self.start
        for op, x in self.ops:
            new = state + x if op == "+" else state - x
            lines.append(f"{state} {op} {x} = {new}")
            state = new
        return lines

    @property
    def answer(self) -> int:
        return int(self.solution()[-1].rsplit("=", 1)[1])


def step_labels(completion: str, problem: Problem) -> list[bool]:
    """One label per line of ``completion`` (split at :data:`STEP_DELIMITER`, a trailing one ignored) and one
    ``False`` per solution line it lacks: ``True`` while the lines match the solution, ``False`` from the first
    that does not on."""
    lines = completion.rstrip(STEP_DELIMITER).split(STEP_DELIMITER) if completion.strip() else []
    expected = problem.solution()
    labels, right = [], True
    for k, line in enumerate(lines):
        found = _STEP.match(line)
        right = right and found is not None and k < len(expected) and \
            " ".join(found.groups()[:3]) + f" = {found.group(4)}" == expected[k]
        labels.append(right)
    return labels + [False] * (len(expected) - len(lines))


def check_steps(completion: str, problem: Problem) -> bool:
    """The whole solution right: every line, and no line missing or extra."""
    labels = step_labels(completion, problem)
    return bool(labels) and all(labels) and len(labels) == len(problem.ops)


def step_accuracy(completion: str, prompt: str) -> float:
    """The judge's step score: the share of the solution's steps that ``completion`` gets right, by
    :func:`step_labels` (so a step after the first wrong one is wrong, and a missing step too)."""
    problem = problem_from_prompt(prompt)
    return sum(step_labels(completion, problem)[:len(problem.ops)]) / len(problem.ops)


def slipped(problem: Problem, rng: random.Random) -> str:
    """A plausible wrong solution: one step's result off by 1, 2 or 10, and the lines after it carried on from
    the wrong state (each of them right arithmetic, so only a step-level check finds the slip)."""
    at = rng.randrange(len(problem.ops))
    lines, state = [], problem.start
    for k, (op, x) in enumerate(problem.ops):
        new = state + x if op == "+" else state - x
        if k == at:
            new = max(0, new + rng.choice([-10, -2, -1, 1, 2, 10])) if new > 0 else new + rng.choice([1, 2])
        lines.append(f"{state} {op} {x} = {new}")
        state = new
    return STEP_DELIMITER.join(lines)


def is_held_out(problem: Problem, phrasing: int, seed: int, share: float, held_out_phrasings: int) -> bool:
    digest = hashlib.sha256(f"{seed}:{problem.expression}".encode()).digest()
    return int.from_bytes(digest[:4], "big") / 2**32 < share or phrasing >= len(PHRASINGS) - held_out_phrasings


def draw(rng: random.Random, n_ops: tuple[int, int], max_operand: int) -> Problem:
    """A problem of ``n_ops[0]..n_ops[1]`` operations on operands ``0..max_operand``; a difference is drawn only
    where the state allows it (never below 0)."""
    state = rng.randint(0, max_operand)
    start, ops = state, []
    for _ in range(rng.randint(*n_ops)):
        x = rng.randint(0, max_operand)
        op = "-" if x <= state and rng.random() < 0.5 else "+"
        state = state + x if op == "+" else state - x
        ops.append((op, x))
    return Problem(start, tuple(ops))


def generate(n_train: int, n_held_out: int, n_ops: tuple[int, int], max_operand: int, seed: int, share: float,
             held_out_phrasings: int, render) -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` rows with the canonical fields (prompt, response, chosen, rejected, answer: the final
    result) and ``expression`` (:func:`problem_from_prompt` reads it back from the prompt); ``render(messages)
    -> prompt text`` applies the chat template. Deterministic in ``seed``."""
    if not 1 <= n_ops[0] <= n_ops[1]:
        raise ValueError(f"n_ops {n_ops}: expected 1 <= min <= max")
    if held_out_phrasings >= len(PHRASINGS):
        raise ValueError(f"held_out_phrasings {held_out_phrasings} leaves no training phrasing ({len(PHRASINGS)})")
    rng = random.Random(seed)
    train: list[dict] = []
    held: list[dict] = []
    for _ in range(100 * (n_train + n_held_out) + 1000):
        if len(train) >= n_train and len(held) >= n_held_out:
            return train, held
        problem, k = draw(rng, n_ops, max_operand), rng.randrange(len(PHRASINGS))
        out = held if is_held_out(problem, k, seed, share, held_out_phrasings) else train
        if len(out) >= (n_held_out if out is held else n_train):
            continue
        solution = STEP_DELIMITER.join(problem.solution())
        out.append({"id": f"steps-{'heldout' if out is held else 'train'}-{len(out)}",
                    "prompt": render([{"role": "user", "content": PHRASINGS[k].format(expr=problem.expression)}]),
                    "response": solution, "chosen": solution, "rejected": slipped(problem, rng),
                    "answer": str(problem.answer), "expression": problem.expression})
    raise ValueError("cannot draw enough rows; widen max_operand or lower the held-out shares")


def parse_expression(expression: str) -> Problem:
    """``"12 + 7 - 5"`` -> the problem; anything else is a ValueError naming it."""
    tokens = expression.split()
    if len(tokens) < 3 or len(tokens) % 2 == 0 or any(t not in "+-" for t in tokens[1::2]) or \
            not all(t.isdigit() for t in tokens[0::2]):
        raise ValueError(f"not an expression of the multi-step task: {expression!r}")
    return Problem(int(tokens[0]), tuple((op, int(x)) for op, x in zip(tokens[1::2], tokens[2::2], strict=True)))


def problem_from_prompt(prompt: str) -> Problem:
    """The problem a prompt of this task asks (its expression is quoted verbatim in every phrasing), so the step
    labels need no field beyond the canonical ones; a prompt without one is a ValueError naming it."""
    found = _EXPRESSION.findall(prompt)
    if not found:
        raise ValueError(f"no expression of the multi-step task in the prompt {prompt[-120:]!r}")
    return parse_expression(found[-1])
