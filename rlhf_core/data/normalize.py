"""Normalise raw rows of any supported format to the canonical schema.

Canonical record: ``{"id", "prompt", "response", "chosen", "rejected", "answer", "source"}``
(missing fields are None).  ``prompt`` is fully rendered text, ready to
tokenise; responses are the text that follows it.

Formats (``data.*.format``; ``auto`` picks by the columns present):

==================  ==========================================================
``prompt_response``  prompt + response (SFT demonstrations)
``pairwise``         prompt + chosen + rejected
``prompt``           prompt only (RL prompts)
``messages``         a chat ``messages`` list (or a ShareGPT ``conversations``
                     list of ``from``/``value`` turns); the last assistant turn
                     is the response, the rest is the prompt. A list that ends
                     with a user turn is a prompt only (an RL prompt).
                     ``chosen``/``rejected`` may also be message lists.
``hh``               DeepSpeed-Chat / Anthropic HH strings: ``chosen`` and
                     ``rejected`` are whole ``Human: ... Assistant: ...``
                     transcripts; the prompt is everything up to and including
                     the last ``Assistant:``.
==================  ==========================================================

Every prompt goes through one :class:`Rendering` (``model.chat_template``), whatever its format, so the
same question reads the same in every phase: a chat list through ``chat`` (the chat template with the
generation prompt, or ``Human: ... Assistant:`` without one), a plain prompt through ``plain`` (with a
template: one user turn, or the turns of an HH transcript; without: as it is).

Per-row problems are dropped and counted by reason (never silently):
``missing_field``, ``empty_field``, ``chosen_equals_rejected``,
``prompt_mismatch``, ``invalid_messages``; the first ones are named by ``file:line``.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_core.config import ColumnMap

ChatRenderer = Callable[[list[dict]], str]
ASSISTANT_TAG = "Assistant:"
FORMATS = ("prompt_response", "pairwise", "prompt", "messages", "hh")
ROLES = ("system", "user", "assistant")
SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}
MAX_EXAMPLES = 20  # dropped rows named by file:line in the manifest
_HH_TURN = re.compile(r"(?:^|\n\n)(Human|Assistant):")


def render_hh(messages: list[dict]) -> str:
    """Chat turns as the demo's text, without a chat template: ``system\n\nHuman: q\n\nAssistant: a\n\n...
    Assistant:`` (the generation prompt last)."""
    head = {"system": "", "user": "Human: ", "assistant": "Assistant: "}
    return "".join(f"{head[m['role']]}{m['content']}\n\n" for m in messages) + ASSISTANT_TAG


def hh_turns(text: str) -> list[dict] | None:
    """The turns of a ``Human: q\n\nAssistant: a\n\nHuman: q2\n\nAssistant:`` prompt (the generation prompt
    dropped), or None when ``text`` is not one (it does not start with ``Human:`` and end with ``Assistant:``)."""
    body = text.strip()
    if not (body.startswith("Human:") and body.endswith(ASSISTANT_TAG)):
        return None
    parts = _HH_TURN.split(body)[1:]  # role, content, role, content, ...
    turns = [{"role": "user" if r == "Human" else "assistant", "content": c.strip()}
             for r, c in zip(parts[::2], parts[1::2], strict=True)]
    return turns[:-1] if turns and turns[-1]["role"] == "assistant" and not turns[-1]["content"] else None


@dataclass(frozen=True)
class Rendering:
    """How every prompt is rendered (``model.chat_template``): ``chat`` for turn lists, ``plain`` for text
    prompts; ``templated``: a chat template renders them (so a prompt cut on the left loses its head)."""

    name: str
    chat: ChatRenderer
    templated: bool

    def plain(self, text: str) -> str:
        if not self.templated:
            return text
        return self.chat(hh_turns(text) or [{"role": "user", "content": text}])

    @classmethod
    def raw(cls, name: str = "none") -> Rendering:
        return cls(name, render_hh, False)


class RowDropped(Exception):
    """Raised inside normalisation to drop one row with a counted reason."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def detect_format(record: dict, cols: ColumnMap) -> str:
    """Pick a format from the columns present in ``record``."""
    has = {k for k, v in record.items() if v is not None}
    if cols.messages in has or cols.conversations in has:
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


def _turns(messages: Any) -> list[dict]:
    """A chat list as ``{role, content}`` turns (ShareGPT ``from``/``value`` mapped): the roles system (first
    only), user and assistant, at least one user turn, ending with a user or an assistant turn."""
    if not isinstance(messages, list) or not messages:
        raise RowDropped("invalid_messages")
    turns = []
    for m in messages:
        if not isinstance(m, dict):
            raise RowDropped("invalid_messages")
        role, content = (m.get("role"), m.get("content")) if "role" in m else (
            SHAREGPT_ROLES.get(m.get("from")), m.get("value"))
        if role not in ROLES or not isinstance(content, str):
            raise RowDropped("invalid_messages")
        turns.append({"role": role, "content": content})
    roles = [t["role"] for t in turns]
    if "system" in roles[1:] or "user" not in roles or roles[-1] == "system":
        raise RowDropped("invalid_messages")
    return turns


def _messages_split(messages: Any, render: ChatRenderer, need_response: bool = False) -> tuple[str, str | None]:
    """(rendered prompt, last assistant turn); a list ending with a user turn is a prompt only (None)."""
    turns = _turns(messages)
    if turns[-1]["role"] == "user":
        if need_response:
            raise RowDropped("invalid_messages")
        return render(turns), None
    if "user" not in (t["role"] for t in turns[:-1]):
        raise RowDropped("invalid_messages")
    if not turns[-1]["content"].strip():
        raise RowDropped("empty_field")
    return render(turns[:-1]), turns[-1]["content"]


def normalize_record(record: dict, fmt: str, cols: ColumnMap, rendering: Rendering) -> dict:
    """One raw record -> canonical record, its prompt rendered by ``rendering``; raises :class:`RowDropped`."""
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
        chat = record.get(cols.messages) if record.get(cols.messages) is not None else record.get(cols.conversations)
        if chat is not None:
            out["prompt"], out["response"] = _messages_split(chat, rendering.chat)
        else:
            out["prompt"], out["chosen"] = _messages_split(record.get(cols.chosen), rendering.chat, True)
            p_r, out["rejected"] = _messages_split(record.get(cols.rejected), rendering.chat, True)
            if p_r != out["prompt"]:
                raise RowDropped("prompt_mismatch")
    else:
        raise RowDropped("unknown_format")
    if not out["prompt"].strip():
        raise RowDropped("empty_field")
    if fmt != "messages":
        out["prompt"] = rendering.plain(out["prompt"])
    if out["chosen"] is not None and out["rejected"] is not None and out["chosen"].strip() == out["rejected"].strip():
        raise RowDropped("chosen_equals_rejected")
    return out


def normalize_rows(rows: list[tuple[str, dict]], fmt: str, cols: ColumnMap, rendering: Rendering,
                   dropped: Counter, source: str, examples: list[str] | None = None) -> list[dict]:
    """Canonical records for ``rows``; dropped ones are counted in ``dropped`` by reason, and the first
    ``MAX_EXAMPLES`` named in ``examples`` as ``file:line: reason``."""
    out = []
    for origin, record in rows:
        try:
            canon = normalize_record(record, fmt, cols, rendering)
        except RowDropped as drop:
            dropped[drop.reason] += 1
            if examples is not None and len(examples) < MAX_EXAMPLES:
                examples.append(f"{origin}: {drop.reason}")
            continue
        canon["id"] = str(record.get("id") or origin)
        canon["source"] = source
        out.append(canon)
    return out
