"""``model.chat_template`` as one :class:`~rlhf_core.data.normalize.Rendering` of every phase's prompts, and the
``data.truncation`` it implies (prepare: ``rlhf_core.stages.prepare``; the formats: docs/data.md)."""

from __future__ import annotations

from pathlib import Path

from rlhf_core.config import ConfigError, Params
from rlhf_core.data.normalize import Rendering
from rlhf_core.data.tokenizer import chat_renderer, source_tokenizer_path

USER_SOURCES = ("mixed", "per_phase")  # the sources whose prompts model.chat_template renders


def prompt_rendering(params: Params, tok, root: Path) -> Rendering:
    """``model.chat_template`` as a :class:`Rendering` of the prompts of the user's files (the built-in tasks
    render their own: raw). A template file's text becomes the tokenizer's template (saved in ``models/base``, so
    generation and serving render as training did). Errors name the key."""
    mode, data = params.model.chat_template, params.data
    if data.source not in USER_SOURCES:
        return Rendering.raw(mode)
    if mode not in ("auto", "none", "tokenizer"):
        path = Path(mode) if Path(mode).is_absolute() else root / mode
        if not path.is_file():
            raise ConfigError(f"model.chat_template: no such template file {mode} (auto | none | tokenizer | a "
                              ".jinja file)")
        tok.chat_template = path.read_text(encoding="utf-8")
    elif mode == "none" or (mode == "auto" and not getattr(tok, "chat_template", None)):
        return Rendering.raw(mode)
    elif mode == "auto" and source_tokenizer_path(params.model) is None:  # the demo's, trained on these rows:
        return Rendering(mode, chat_renderer(tok), False)  # prompts as written, chat lists as Human/Assistant
    render = chat_renderer(tok)
    if render is None:
        raise ConfigError(f"model.chat_template: tokenizer, but the tokenizer of "
                          f"{source_tokenizer_path(params.model)} has no chat template; set auto, none or a .jinja "
                          "file")
    if data.truncation == "left":
        raise ConfigError(f"data.truncation: left would cut the head off prompts the chat template renders "
                          f"(model.chat_template: {mode}); set drop (or auto) to drop over-long ones, counted")
    return Rendering(mode, render, True)


def truncation(params: Params, rendering: Rendering) -> str:
    """``data.truncation`` with ``auto`` resolved: drop where a template rendered the prompts, else left."""
    if params.data.truncation != "auto":
        return params.data.truncation
    return "drop" if rendering.templated else "left"
