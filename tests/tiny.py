"""The tiny demo the SFT and RM tests train on: operands 0-9, no de-duplication (so correct demonstrations are
the majority), a 2-layer 64-wide Llama; seconds per stage on one CPU thread."""

from __future__ import annotations

from rlhf_core.config import apply_overrides, validate

TINY_DEMO = [
    "data.demo.n_rows=3000", "data.demo.max_operand=9", "data.dedupe=false", "data.max_prompt_len=16",
    "data.max_response_len=4", "compute.num_threads=1",
    "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128", "model.tiny.num_hidden_layers=2",
    "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=2", "model.tiny.max_position_embeddings=32",
    "sft.micro_batch_size=32", "sft.lr=0.003", "sft.warmup_steps=3", "sft.log_every=5",
    "eval.batch_size=48", "eval.max_new_tokens=4",
]


def tiny_params(base: list[str], *overrides: str):
    """Validated Params from ``base`` then ``overrides`` (later keys win)."""
    return validate(apply_overrides({}, [*base, *overrides]), origin="<test>")


def reseal_prepared(root, *names: str) -> None:
    """Record the sha256 of prepared files a test edited on purpose in ``data/prepared/manifest.json`` (stages
    refuse a prepared file whose hash differs from the one prepare recorded)."""
    import json
    from pathlib import Path

    from rlhf_core.ops.meta import file_sha256

    manifest = Path(root) / "data/prepared/manifest.json"
    data = json.loads(manifest.read_text())
    for name in names:
        data["hashes"][name] = file_sha256(manifest.parent / name)
    manifest.write_text(json.dumps(data))


def tiny_lm(arch: str = "llama", attn: str = "sdpa", kv_heads: int = 2, init_std: float = 0.2):
    """A random 2-layer 32-wide causal LM over 16 tokens (pad 0, BOS 1, EOS 2), built from its config (no
    download): ``llama``; ``sliding_window``, a Mistral whose layers see 4 tokens back; ``full_window``, the
    same Mistral without a window; ``conv_layer``, an LFM2 whose first layer is a short convolution. A wide
    ``init_std`` makes the outputs depend on every token they see (not only on the last)."""
    import torch
    from transformers import (
        Lfm2Config,
        Lfm2ForCausalLM,
        LlamaConfig,
        LlamaForCausalLM,
        MistralConfig,
        MistralForCausalLM,
    )

    shape = {"vocab_size": 16, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
             "num_attention_heads": 2, "num_key_value_heads": kv_heads, "max_position_embeddings": 64,
             "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "initializer_range": init_std}
    config, cls = {
        "llama": lambda: (LlamaConfig(**shape), LlamaForCausalLM),
        "sliding_window": lambda: (MistralConfig(sliding_window=4, **shape), MistralForCausalLM),
        "full_window": lambda: (MistralConfig(sliding_window=None, **shape), MistralForCausalLM),
        "conv_layer": lambda: (Lfm2Config(layer_types=["conv", "full_attention"], **shape), Lfm2ForCausalLM),
    }[arch]()
    config._attn_implementation = attn
    torch.manual_seed(0)
    return cls(config)


def save_with_random_adapter(model_dir, dest, r: int = 4, alpha: int = 64):
    """``model_dir``'s causal LM saved to ``dest`` as a stage saves it with ``compute.lora.merge_on_save: false``
    (``save_causal_lm``: base weights, LoRA apart in ``adapter/``); the adapter is random with B != 0, so it acts.
    Returns the same policy with the adapter merged, to compare a loader against."""
    import copy

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from rlhf_core.models.loading import save_causal_lm

    torch.manual_seed(0)
    lora = LoraConfig(r=r, lora_alpha=alpha, target_modules="all-linear", init_lora_weights=False)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora)
    merged = copy.deepcopy(peft_model).merge_and_unload()
    save_causal_lm(peft_model, dest, merge_lora=False)
    return merged
