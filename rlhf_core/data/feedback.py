"""Comparison pairs of a feedback round: drawn from the policy's answers, labelled, imported, replayed.

A round samples ``K`` responses per prompt; :func:`draw_pairs` pairs distinct responses of one prompt. An
annotator gives each pair a choice, ``a``, ``b`` or ``tie``; :func:`labelled_rows` turns the choices into the
``(id, prompt, chosen, rejected)`` rows the RM trains on. Ties and unlabelled pairs carry no preference and are
dropped and counted, never silently.

Label files (``feedback.annotator: file``) follow the prepare stage's bad-input policy (``data.on_malformed``):
a line that is not a JSON object, that lacks the id or choice key, names an unknown pair, or gives a choice other
than ``a``/``b``/``tie`` is an error naming ``file:line`` (``drop``: dropped and counted); the same pair labelled
twice with different choices is an error naming both lines (``drop``: the pair is dropped and counted). Keys are
dotted paths, so an export of Label Studio or Argilla maps onto them (``feedback.label_columns``).

Replay (:func:`replay_indices`): a share of all earlier pairs, drawn without replacement (DeepSeekMath's iterative
RL keeps 10 % of the historical data beside the new).
"""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from rlhf_core.data.readers import DataError, read_jsonl

CHOICES = ("a", "b", "tie")


def draw_pairs(round_: int, prompts: Sequence[str], responses: Sequence[Sequence[str]], pairs_per_prompt: int,
               rng: random.Random) -> list[dict]:
    """Up to ``pairs_per_prompt`` pairs of *distinct* responses per prompt, drawn uniformly among the
    ``C(distinct, 2)`` pairs, sides shuffled. ``pair_id = r<round>-p<prompt>-<i>-<j>`` (response indices)."""
    pairs = []
    for p, (prompt, resp) in enumerate(zip(prompts, responses, strict=True)):
        first = {}
        for i, text in enumerate(resp):
            first.setdefault(text, i)
        distinct = sorted(first.values())
        candidates = [(i, j) for x, i in enumerate(distinct) for j in distinct[x + 1:]]
        for i, j in rng.sample(candidates, min(pairs_per_prompt, len(candidates))):
            if rng.random() < 0.5:
                i, j = j, i
            pairs.append({"pair_id": f"r{round_}-p{p}-{i}-{j}", "prompt_index": p, "prompt": prompt,
                          "response_a": resp[i], "response_b": resp[j]})
    return pairs


def checker_choices(correct_a: Sequence[bool], correct_b: Sequence[bool], noise: float,
                    rng: random.Random) -> tuple[list[str], int]:
    """The simulated annotator: prefers the checker-correct response, ``tie`` when both or neither are correct;
    each preference is flipped with probability ``noise`` (annotator disagreement). Returns (choices, flipped)."""
    choices, flipped = [], 0
    for a, b in zip(correct_a, correct_b, strict=True):
        if a == b:
            choices.append("tie")
            continue
        choice = "a" if a else "b"
        if rng.random() < noise:
            choice = "b" if choice == "a" else "a"
            flipped += 1
        choices.append(choice)
    return choices, flipped


def dotted(record: Any, key: str) -> Any:
    """``record["data"]["pair_id"]`` for ``"data.pair_id"``; list positions are numbers (``annotations.0``).
    Raises KeyError naming the first missing part."""
    node = record
    for part in key.split("."):
        if isinstance(node, list) and part.isdigit() and int(part) < len(node):
            node = node[int(part)]
        elif isinstance(node, dict) and part in node:
            node = node[part]
        else:
            raise KeyError(part)
    return node


def read_labels(path: Path, columns: dict[str, str], known_ids: set[str], drop: bool) -> tuple[dict[str, str], Counter]:
    """``{pair_id: choice}`` from a JSONL label file, and the counts of what was dropped (by reason).

    ``columns`` maps ``id`` and ``choice`` to (dotted) keys of a line. See the module docstring for the policy.
    """
    if not path.is_file():
        raise DataError(f"{path}: label file not found")
    dropped: Counter = Counter()
    found: dict[str, tuple[str, str]] = {}  # id -> (choice, origin)
    contradicted: set[str] = set()

    def bad(origin: str, reason: str, message: str) -> None:
        if not drop:
            raise DataError(f"{origin}: {message}")
        dropped[reason] += 1

    for origin, record in read_jsonl(path, drop, dropped):
        try:
            pair_id, choice = str(dotted(record, columns["id"])), dotted(record, columns["choice"])
        except KeyError as err:
            bad(origin, "missing_key", f"no {err.args[0]!r} in the label line (feedback.label_columns: "
                                       f"id={columns['id']!r}, choice={columns['choice']!r})")
            continue
        choice = str(choice).strip().lower()
        if pair_id not in known_ids:
            bad(origin, "unknown_pair", f"unknown pair id {pair_id!r} (not exported in this round)")
        elif choice not in CHOICES:
            bad(origin, "invalid_choice", f"choice {choice!r} for {pair_id}: expected one of {', '.join(CHOICES)}")
        elif pair_id in found and found[pair_id][0] != choice:
            if not drop:
                raise DataError(f"{origin}: pair {pair_id} labelled {choice!r} here and {found[pair_id][0]!r} at "
                                f"{found[pair_id][1]}: contradictory labels")
            contradicted.add(pair_id)
        elif pair_id not in found:
            found[pair_id] = (choice, origin)
    for pair_id in contradicted:
        del found[pair_id]
    if contradicted:
        dropped["contradictory"] += len(contradicted)
    return {k: v[0] for k, v in found.items()}, dropped


def labelled_rows(pairs: Sequence[dict], choices: dict[str, str]) -> tuple[list[dict], Counter]:
    """RM training rows ``{id, prompt, chosen, rejected}`` from the pairs a choice prefers; ``tie`` and
    unlabelled pairs dropped and counted."""
    rows, dropped = [], Counter()
    for pair in pairs:
        choice = choices.get(pair["pair_id"])
        if choice is None:
            dropped["unlabelled"] += 1
        elif choice == "tie":
            dropped["tie"] += 1
        else:
            chosen, rejected = ("response_a", "response_b") if choice == "a" else ("response_b", "response_a")
            rows.append({"id": pair["pair_id"], "prompt": pair["prompt"], "chosen": pair[chosen],
                         "rejected": pair[rejected]})
    return rows, dropped


def replay_indices(n_old: int, share: float, seed: int) -> list[int]:
    """``round(share * n_old)`` indices of the earlier pairs, drawn without replacement, sorted."""
    k = round(share * n_old)
    return sorted(random.Random(seed).sample(range(n_old), k))
