"""The real-text task: sums and differences of one- and two-digit numbers, asked in many phrasings.

A question is an operand pair ``(a, b)``, an operator and a phrasing: plain ("What is 23 plus 45?"), imperative
("Compute 23 + 45.") or a short word problem ("Mia has 23 stickers and gets 45 more..."). Differences keep
``a >= b``. The prompt is the question as one user turn, rendered with the model's own chat template.

Held out (:func:`is_held_out`): an operand pair in the held-out share (a fixed hash of the pair and the seed), or
a phrasing among the last ``held_out_phrasings`` of its operator's list. Training rows use neither, so held-out
accuracy measures arithmetic on new numbers and reading new wordings, not recall.

SFT demonstrations use one answer style (``data.arithmetic.answer_style``): the bare result (``render_answer``),
or a worked answer that adds or takes away the second operand's tens, then its ones, the result last
(``render_worked``: "23 + 40 = 63, 63 + 5 = 68"). A worked answer's steps are shared by every question (the ones
step of a two-digit sum is one of 1,000 facts, not one of 10,000 results), so what RL corrects in one question's
steps can carry to held-out ones (so far it has not: docs/results/smollm2.md). The checker
(:func:`check_final_number`) only judges: a completion is right when the last integer it states is the result,
so "78", "The answer is 78." and "23 + 45 = 78" all count.
"""

from __future__ import annotations

import hashlib
import random
import re

PHRASINGS: dict[str, list[str]] = {
    "+": [
        "What is {a} + {b}?",
        "What is {a} plus {b}?",
        "Compute {a} + {b}.",
        "Add {a} and {b}.",
        "What is the sum of {a} and {b}?",
        "Calculate {a} plus {b}.",
        "{a} + {b} = ?",
        "Mia has {a} stickers and gets {b} more. How many stickers does she have now?",
        "A shelf holds {a} books and {b} more are put on it. How many books are on the shelf?",
        "Sam walked {a} meters, then {b} meters more. How many meters did he walk in all?",
        "There are {a} red apples and {b} green apples in a basket. How many apples are there?",
        "Find the total of {a} and {b}.",
        "If you add {b} to {a}, what do you get?",
        "A bus carries {a} people and {b} more get on. How many people are on the bus?",
    ],
    "-": [
        "What is {a} - {b}?",
        "What is {a} minus {b}?",
        "Compute {a} - {b}.",
        "Subtract {b} from {a}.",
        "What is the difference between {a} and {b}?",
        "Calculate {a} minus {b}.",
        "{a} - {b} = ?",
        "Mia has {a} stickers and gives away {b}. How many stickers does she have left?",
        "A shelf holds {a} books and {b} are taken off. How many books are left on the shelf?",
        "A tank has {a} liters of water and {b} liters leak out. How many liters remain?",
        "There were {a} birds on a tree and {b} flew away. How many birds are still on the tree?",
        "Take {b} away from {a}. What is left?",
        "How much is {a} less {b}?",
        "A bus carries {a} people and {b} get off. How many people are still on the bus?",
    ],
}

_INT = re.compile(r"-?\d+")


def solve(a: int, op: str, b: int) -> int:
    return a + b if op == "+" else a - b


def render_answer(value: int) -> str:
    """The one answer style of the SFT demonstrations and the chosen responses: the bare result."""
    return str(value)


def render_worked(a: int, op: str, b: int) -> str:
    """The worked answer style: ``b``'s tens then its ones, one step each (a step whose part is 0 is left out)::

        23 + 45 -> "23 + 40 = 63, 63 + 5 = 68"      45 - 7 -> "45 - 7 = 38"      45 - 0 -> "45 - 0 = 45"
    """
    parts = [p for p in (b - b % 10, b % 10) if p] or [0]
    steps, x = [], a
    for part in parts:
        y = solve(x, op, part)
        steps.append(f"{x} {op} {part} = {y}")
        x = y
    return ", ".join(steps)


def demonstration(a: int, op: str, b: int, style: str) -> str:
    """The demonstration of ``a op b`` in answer style ``style`` (``result`` or ``worked``)."""
    if style not in ("result", "worked"):
        raise ValueError(f"data.arithmetic.answer_style: unknown style {style!r} (result, worked)")
    return render_worked(a, op, b) if style == "worked" else render_answer(solve(a, op, b))


def with_final_number(text: str, value: int) -> str:
    """``text`` with its last integer replaced by ``value``: a wrong answer in the style of a right one
    (``"23 + 40 = 63, 63 + 5 = 68"``, 67 -> ``"23 + 40 = 63, 63 + 5 = 67"``; ``"68"``, 67 -> ``"67"``)."""
    found = list(_INT.finditer(text))
    if not found:
        raise ValueError(f"with_final_number: {text!r} states no integer")
    last = found[-1]
    return f"{text[:last.start()]}{value}{text[last.end():]}"


def final_number(completion: str) -> int | None:
    """The last integer a completion states (``"23 + 45 = 78."`` -> 78), or None when it states none."""
    found = _INT.findall(completion.replace(",", ""))
    return int(found[-1]) if found else None


def check_final_number(completion: str, answer: int | str | None) -> bool:
    """True iff the last integer in ``completion`` is ``answer``."""
    if answer is None:
        return False
    value = final_number(completion)
    return value is not None and value == int(answer)


def is_held_out(a: int, op: str, b: int, phrasing: int, seed: int, pair_share: float,
                held_out_phrasings: int) -> bool:
    """Whether question ``(a, op, b)`` in phrasing ``phrasing`` (its index in ``PHRASINGS[op]``) is held out."""
    digest = hashlib.sha256(f"{seed}:{op}:{a}:{b}".encode()).digest()
    pair_held = int.from_bytes(digest[:4], "big") / 2**32 < pair_share
    return pair_held or phrasing >= len(PHRASINGS[op]) - held_out_phrasings


def near_miss(rng: random.Random, correct: int) -> int:
    """A plausible wrong result: off by 1 or 2, off by ten (a carry slip), or the digits of a two-digit result
    swapped."""
    offsets = [-2, -1, 1, 2, 10, -10]
    if correct >= 10 and correct % 10 != correct // 10 % 10 and correct < 100:
        swapped = int(str(correct)[::-1])
        if rng.random() < 0.2:
            return swapped
    candidate = correct + rng.choice(offsets)
    return candidate if candidate >= 0 else correct + rng.choice([1, 2])


def generate(n_train: int, n_held_out: int, max_operand: int, ops: list[str], seed: int, pair_share: float,
             held_out_phrasings: int, render, answer_style: str = "result") -> tuple[list[dict], list[dict]]:
    """``(train, held_out)`` rows with every canonical field (prompt, response, chosen, rejected, answer);
    ``render(messages) -> prompt text`` applies the chat template. Deterministic in ``seed`` (the same
    questions in either answer style); the rejected answer is the chosen one ending in a near miss (prepare may
    put the base model's own wrong result there)."""
    for op in ops:
        if held_out_phrasings >= len(PHRASINGS[op]):
            raise ValueError(f"data.arithmetic.held_out_phrasings: {held_out_phrasings} leaves no training phrasing "
                             f"for {op!r} ({len(PHRASINGS[op])} phrasings)")
    rng = random.Random(seed)
    train: list[dict] = []
    held: list[dict] = []
    tries = 0
    while len(train) < n_train or len(held) < n_held_out:
        tries += 1
        if tries > 100 * (n_train + n_held_out) + 1000:
            raise ValueError("data.arithmetic: cannot draw enough rows; widen max_operand or lower the held-out "
                             "shares")
        op = rng.choice(ops)
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and b > a:
            a, b = b, a
        k = rng.randrange(len(PHRASINGS[op]))
        out = held if is_held_out(a, op, b, k, seed, pair_share, held_out_phrasings) else train
        if len(out) >= (n_held_out if out is held else n_train):
            continue
        correct = solve(a, op, b)
        question = PHRASINGS[op][k].format(a=a, b=b)
        chosen = demonstration(a, op, b, answer_style)
        out.append({
            "id": f"arith-{'heldout' if out is held else 'train'}-{len(out)}",
            "prompt": render([{"role": "user", "content": question}]),
            "response": chosen,
            "chosen": chosen,
            "rejected": with_final_number(chosen, near_miss(rng, correct)),
            "answer": str(correct),
        })
    return train, held
