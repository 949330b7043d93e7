"""Apply ``-S key.path=value`` overrides to ``params.yaml`` in place, as ``dvc exp run -S`` does.

Comments and key order survive (ruamel round trip).  The result is validated
before anything is written, so a bad override never reaches the file.
"""

from __future__ import annotations

import io
from pathlib import Path

from ruamel.yaml import YAML

from rlhf_core.config import apply_overrides, load_params, parse_override, validate


def set_params(path: str | Path, overrides: list[str]) -> None:
    path = Path(path)
    if not overrides:
        return
    plain = load_params(path).model_dump(mode="json")
    validate(apply_overrides(plain, overrides), origin=f"{path} with overrides")
    yaml = YAML()
    yaml.preserve_quotes = True
    doc = yaml.load(path.read_text()) if path.exists() else {}
    for text in overrides:
        keys, value = parse_override(text)
        node = doc
        for key in keys[:-1]:
            if node.get(key) is None:
                node[key] = {}
            node = node[key]
        node[keys[-1]] = value
    buf = io.StringIO()
    yaml.dump(doc, buf)
    path.write_text(buf.getvalue())
