"""The pipeline's params file: a profile put in place, and ``-S key.path=value`` overrides applied to it.

DVC's stages read ``params.yaml`` (it tracks their params there), so a run with another profile
(``rlhf run -p configs/smollm2.yaml``, a deployment's ``params_file``) first writes that profile, with every
key filled in, over ``params.yaml``, as ``dvc exp run`` edits it; ``git checkout params.yaml`` brings the demo
profile back.
Overrides keep comments and key order (ruamel round trip). Both are validated before anything is written,
so a bad profile or override never reaches the file.
"""

from __future__ import annotations

import io
from pathlib import Path

import yaml
from ruamel.yaml import YAML

from rlhf_core.config import DEFAULT_PARAMS, apply_overrides, load_params, parse_override, validate


def use_profile(root: str | Path, profile: str | Path) -> bool:
    """Write ``profile`` (relative to ``root``) over ``root/params.yaml`` when it is another file, every key filled
    in (DVC refuses a stage whose params are missing from the file, and a profile lists only what it changes);
    returns whether ``params.yaml`` changed. A missing or invalid profile is an error naming it."""
    root = Path(root)
    src, dst = root / profile, root / DEFAULT_PARAMS
    if src.resolve() == dst.resolve():  # params.yaml itself (missing: every default)
        return False
    if not src.is_file():
        raise FileNotFoundError(f"params file {src} not found")
    full = load_params(src).model_dump(mode="json")  # ConfigError names the file and key
    text = (f"# Written from {Path(profile).as_posix()} by `rlhf run -p` (every key filled in with its default): edit "
            "the profile, not this file.\n" + yaml.safe_dump(full, sort_keys=False, allow_unicode=True))
    if dst.exists() and dst.read_text() == text:
        return False
    tmp = dst.with_name(f".{dst.name}.tmp")
    tmp.write_text(text)
    tmp.replace(dst)
    return True


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
