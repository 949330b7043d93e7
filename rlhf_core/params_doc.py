"""Generate the params reference (``docs/params.md``) from the pydantic models, so it cannot drift."""

from __future__ import annotations

import json
import types
import typing

from pydantic import BaseModel

from rlhf_core.config import Params, SourceConfig

HEADER = """# Params reference

Generated from `rlhf_core/config/` by `rlhf params docs > docs/params.md`;
a test fails when this file and the models disagree.  Every key lives in
`params.yaml`; override any of them with `-S key.path=value`.

"""


def _type_name(annotation) -> str:
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return " \\| ".join(f"`{a}`" for a in typing.get_args(annotation))
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_type_name(a) for a in typing.get_args(annotation))
    if origin is not None:
        args = ", ".join(_type_name(a) for a in typing.get_args(annotation))
        return f"{origin.__name__}[{args}]"
    if annotation is type(None):
        return "null"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field) -> str:
    parts = []
    for meta in field.metadata:
        for attr, sym in (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="), ("min_length", "len >=")):
            value = getattr(meta, attr, None)
            if value is not None:
                parts.append(f"{sym} {value}")
    return ", ".join(parts)


def _section(model: type[BaseModel], prefix: str, out: list[str]) -> None:
    nested = []
    rows = []
    for name, field in model.model_fields.items():
        ann = field.annotation
        sub = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
        if sub is not None:
            nested.append((name, sub))
            continue
        default = field.get_default(call_default_factory=True)
        if isinstance(default, BaseModel):
            default = default.model_dump(mode="json")
        rows.append(f"| `{prefix}{name}` | {_type_name(ann)} | `{json.dumps(default)}` | "
                    f"{_constraints(field)} | {field.description or ''} |")
    if rows:
        out.append(f"## `{prefix.rstrip('.') or 'top level'}`\n")
        out.append("| key | type | default | constraint | meaning |\n|---|---|---|---|---|")
        out.extend(rows)
        out.append("")
    for name, sub in nested:
        _section(sub, f"{prefix}{name}.", out)


def render_params_reference() -> str:
    out: list[str] = [HEADER]
    _section(Params, "", out)
    _section(SourceConfig, "<source>.", out)
    out.append("A `<source>` is an item of `data.sources` or the value of `data.files.sft|pairs|prompts`.\n")
    return "\n".join(out)
