"""``params.yaml`` to validated :class:`Params`: ``-S key.path=value`` overrides (the value parsed as YAML, as
``dvc exp run -S``), and errors that name the file and the key path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from rlhf_core.config.base import ConfigError, ParamsFileMissing
from rlhf_core.config.params import Params

DEFAULT_PARAMS = "params.yaml"


def parse_override(text: str) -> tuple[list[str], Any]:
    """``"a.b.c=value"`` -> (["a", "b", "c"], yaml-parsed value)."""
    if "=" not in text:
        raise ConfigError(f"override {text!r}: expected KEY.PATH=VALUE")
    key, raw = text.split("=", 1)
    path = [p for p in key.strip().split(".") if p]
    if not path:
        raise ConfigError(f"override {text!r}: empty key")
    return path, yaml.safe_load(raw) if raw.strip() else None


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set each ``key.path=value`` into a nested dict (creating levels as needed)."""
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {text!r}: {part!r} is not a section")
            node = child
        node[path[-1]] = value
    return raw


def _format_errors(err: ValidationError, origin: str) -> str:
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "<root>"
        msg = "unknown key" if e["type"] == "extra_forbidden" else e["msg"]
        lines.append(f"  {loc}: {msg}")
    return f"invalid configuration in {origin}:\n" + "\n".join(lines)


def validate(raw: dict, origin: str = "<params>") -> Params:
    try:
        return Params.model_validate(raw or {})
    except ValidationError as err:
        raise ConfigError(_format_errors(err, origin)) from None


def load_params(path: str | Path = DEFAULT_PARAMS, overrides: list[str] | None = None) -> Params:
    """Read ``path``, apply ``-S`` overrides, validate. A missing ``params.yaml`` (the default name) means every
    default; any other missing file is :class:`ParamsFileMissing`, naming it (a mistyped ``-p`` never runs the
    defaults)."""
    path = Path(path)
    raw: dict = {}
    if not path.exists() and path.name != DEFAULT_PARAMS:
        raise ParamsFileMissing(f"params file {path} not found")
    if path.exists():
        try:
            raw = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as err:
            raise ConfigError(f"{path}: not valid YAML: {err}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path}: top level must be a mapping")
    raw = apply_overrides(raw, list(overrides or []))
    return validate(raw, origin=str(path))
