"""Normalise raw rows of any supported format to the canonical schema.

Canonical record: ``{"id", "prompt", "response", "chosen", "rejected", "answer", "source"}``
(missing fields are None).  ``prompt`` is fully rendered text, ready to
tokenise; responses are the text that follows it.

Formats (``data.*.format``; ``auto`` picks by the columns present):

==================  ==========================================================
``prompt_response``  prompt + response (SFT demonstrations)
``pairwise``         prompt + chosen + rejected
``prompt``           prompt only (RL prompts)
``messages``         a chat ``messages`` list; the last assistant turn is the
                     response, the rest is rendered with the chat template.
                     ``chosen``/``rejected`` may also be message lists.
``hh``               DeepSpeed-Chat / Anthropic HH strings: ``chosen`` and
                     ``rejected`` are whole ``Human: ... Assistant: ...``
                     transcripts; the prompt is everything up to and including
                     the last ``Assistant:``.
==================  ==========================================================

Per-row problems are dropped and counted by reason (never silently):
``missing_field``, ``empty_field``, ``chosen_equals_rejected``,
``prompt_mismatch``, ``invalid_messages``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from typing import Any

from rlhf_core.config import ColumnMap

ChatRenderer = Callable[[list[dict]], str]
ASSISTANT_TAG = "Assistant:"
FORMATS = ("prompt_response", "pairwise", "prompt", "messages", "hh")


class RowDropped(Exception):
    """Raised inside normalisation to drop one row with a counted reason."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def detect_format(record: dict, cols: ColumnMap) -> str:
    """Pick a format from the columns present in ``record``."""
    has = {k for k, v in record.items() if v is not None}
    if cols.messages in has:
        return "messages"
    if cols.chosen in has and cols.rejected in has:
        if isinstance(record[cols.chosen], list):
            return "messages"
        return "pairwise" if cols.prompt in has else "hh"
    if cols.prompt in has and cols.response in has:
        return "prompt_response"
    if cols.prompt in has:
        return "prompt"
    return "unknown"


def _text(record: dict, key: str) -> str:
    if key not in record or record[key] is None:
        raise RowDropped("missing_field")
    value = record[key]
    if not isinstance(value, str):
        raise RowDropped("missing_field")
    if not value.strip():
        raise RowDropped("empty_field")
    return value


def _optional_answer(record: dict, key: str) -> str | None:
    value = record.get(key)
    return None if value is None or str(value).strip() == "" else str(value)


def split_hh(transcript: str) -> tuple[str, str]:
    """``"Human: q\\n\\nAssistant: a"`` -> (``"Human: q\\n\\nAssistant:"``, ``" a"``)."""
    cut = transcript.rfind(ASSISTANT_TAG)
    if cut < 0:
        raise RowDropped("invalid_hh")
    cut += len(ASSISTANT_TAG)
    return transcript[:cut], transcript[cut:]


def _check_messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or len(messages) < 2:
        raise RowDropped("invalid_messages")
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str) or not isinstance(m.get("content"), str):
            raise RowDropped("invalid_messages")
    if messages[-1]["role"] != "assistant":
        raise RowDropped("invalid_messages")
    if not messages[-1]["content"].strip():
        raise RowDropped("empty_field")
    return messages


def _messages_split(messages: Any, render: ChatRenderer) -> tuple[str, str]:
    messages = _check_messages(messages)
    return render(messages[:-1]), messages[-1]["content"]


def normalize_record(record: dict, fmt: str, cols: ColumnMap, render: ChatRenderer | None) -> dict:
    """One raw record -> canonical record; raises :class:`RowDropped`."""
    out: dict[str, Any] = {"prompt": None, "response": None, "chosen": None, "rejected": None,
                           "answer": _optional_answer(record, cols.answer)}
    if fmt == "auto":
        fmt = detect_format(record, cols)
    if fmt == "prompt_response":
        out["prompt"], out["response"] = _text(record, cols.prompt), _text(record, cols.response)
        for extra in ("chosen", "rejected"):  # demo-style rows may carry a pair too
            key = getattr(cols, extra)
            if isinstance(record.get(key), str) and record[key].strip():
                out[extra] = record[key]
    elif fmt == "pairwise":
        out["prompt"], out["chosen"] = _text(record, cols.prompt), _text(record, cols.chosen)
        out["rejected"] = _text(record, cols.rejected)
    elif fmt == "prompt":
        out["prompt"] = _text(record, cols.prompt)
    elif fmt == "hh":
        p_c, out["chosen"] = split_hh(_text(record, cols.chosen))
        if record.get(cols.rejected) is not None:
            p_r, out["rejected"] = split_hh(_text(record, cols.rejected))
            if p_r != p_c:
                raise RowDropped("prompt_mismatch")
        out["prompt"] = p_c
    elif fmt == "messages":
        if render is None:
            raise ValueError("chat `messages` rows need a tokenizer with a chat template")
        if record.get(cols.messages) is not None:
            out["prompt"], out["response"] = _messages_split(record[cols.messages], render)
        else:
            out["prompt"], out["chosen"] = _messages_split(record.get(cols.chosen), render)
            p_r, out["rejected"] = _messages_split(record.get(cols.rejected), render)
            if p_r != out["prompt"]:
                raise RowDropped("prompt_mismatch")
    else:
        raise RowDropped("unknown_format")
    if not out["prompt"].strip():
        raise RowDropped("empty_field")
    if out["chosen"] is not None and out["rejected"] is not None and out["chosen"].strip() == out["rejected"].strip():
        raise RowDropped("chosen_equals_rejected")
    return out


def normalize_rows(rows: list[tuple[str, dict]], fmt: str, cols: ColumnMap, render: ChatRenderer | None,
                   dropped: Counter, source: str) -> list[dict]:
    """Canonical records for ``rows``; dropped ones are counted in ``dropped`` by reason."""
    out = []
    for origin, record in rows:
        try:
            canon = normalize_record(record, fmt, cols, render)
        except RowDropped as drop:
            dropped[drop.reason] += 1
            continue
        canon["id"] = str(record.get("id") or origin)
        canon["source"] = source
        out.append(canon)
    return out
