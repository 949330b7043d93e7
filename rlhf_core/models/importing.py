"""The base model imported once into ``models/base``: a plain Hugging Face folder every later stage reads.

``model.name_or_path`` may name a GGUF file an installed package ships (``pkg:<package>[/<file>.gguf]``), a
``.gguf`` file, a local HF folder or a Hub id: ``rlhf_core.model_source.locate`` tells which.

A model ``transformers`` loads from GGUF is de-quantised to fp32 but stays flagged as quantized, and
``save_pretrained`` refuses it ("quantized with gguf and is not serializable"). The import rebuilds the
architecture from its config without the ``quantization_config`` and loads the de-quantised state dict into it,
which then saves normally (safetensors). The tokenizer and its chat template are saved beside it, with a pad
token distinct from EOS where the tokenizer has one to spare (``data.tokenizer.load_tokenizer``).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_core.model_source import ModelSource, ModelSourceError, check_hub, locate


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
    check_hub(source)
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
