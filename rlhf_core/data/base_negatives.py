"""Rejected answers from the base model itself: the errors a real model makes, not only synthetic near misses.

For each chosen row the base model samples one answer (temperature 1) to the prompt; where the last integer it
states is wrong, the row's chosen answer ending in that integer (the task's answer style) replaces its
``rejected`` (a near miss until then). Where it is right, or states no integer, the near miss stays. The counts
say which happened.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch

from rlhf_core.passes.generation import generate


@torch.inference_mode()
def replace_with_base_errors(model, tokenizer, rows: list[dict], max_new_tokens: int, seed: int,
                             final_number: Callable[[str], int | None], with_final_number: Callable[[str, int], str],
                             batch_size: int = 32) -> Counter:
    """Sample the base model once per row of ``rows`` (in place: ``rejected`` set where it erred); returns
    ``{"sampled", "base_wrong", "base_right", "base_no_number"}``."""
    counts: Counter = Counter()
    torch.manual_seed(seed)
    model.eval()
    for i in range(0, len(rows), batch_size):
        batch = rows[i:i + batch_size]
        texts = generate(model, tokenizer, [r["prompt"] for r in batch], max_new_tokens, temperature=1.0).texts
        for row, text in zip(batch, texts, strict=True):
            counts["sampled"] += 1
            value = final_number(text)
            if value is None:
                counts["base_no_number"] += 1
            elif value == int(row["answer"]):
                counts["base_right"] += 1
            else:
                counts["base_wrong"] += 1
                row["rejected"] = with_final_number(row["chosen"], value)
    return counts
