"""The bytes a training forward of the #31 GPU workload saves for backward, counted on the CPU (bf16 weights).

The workload's Llama shape (hidden 1024, MLP 5504, 16 heads, 4 KV heads, vocabulary 32000) with 1 and 2 layers,
one group of 8 rows (a 128-token prompt, 256-token responses), through the actor's log-prob pass with entropy
(``response_logprobs``): packed groups (the default) and whole rows. Every tensor autograd saves is counted once
by its storage (``saved_tensors_hooks``); the difference between 2 and 1 layers is one layer's share, the rest is
the embedding, the final norm and the logits. With ``--lean-norm`` the model's RMSNorms run the lean forward
(``rlhf_core/models/lean_norm.py``, what ``compute.lean_rmsnorm`` gives a training model). One JSON row per
setting::

    python docs/measurements/train_activation_bytes_cpu.py >> docs/measurements/train-memory-cpu-2026-11-27.jsonl
    python docs/measurements/train_activation_bytes_cpu.py --lean-norm \
        >> docs/measurements/train-memory-cpu-2026-11-28.jsonl
"""
import json
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from rlhf_core.models.lean_norm import use_lean_rmsnorm
from rlhf_core.passes.generation import response_logprobs

ROWS, P, R = 8, 128, 256


def saved_mib(fn) -> float:
    sizes: dict[int, int] = {}

    def keep(t):
        storage = t.untyped_storage()
        sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t):
        fn()
    return sum(sizes.values()) / 2**20


def main() -> None:
    torch.manual_seed(0)
    prompt = torch.randint(2, 32000, (1, P)).repeat(ROWS, 1)
    seq = torch.cat([prompt, torch.randint(2, 32000, (ROWS, R))], dim=1)
    att = torch.ones_like(seq)
    group = torch.zeros(ROWS, dtype=torch.long)
    lean = "--lean-norm" in sys.argv
    for layers in (1, 2):
        cfg = LlamaConfig(vocab_size=32000, hidden_size=1024, intermediate_size=5504, num_hidden_layers=layers,
                          num_attention_heads=16, num_key_value_heads=4, tie_word_embeddings=True,
                          attn_implementation="sdpa")
        model = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
        if lean:
            use_lean_rmsnorm(model)
        for layout, kw in (("packed", {"group": group, "pack": True}), ("whole rows", {})):
            mib = saved_mib(lambda m=model, k=kw: response_logprobs(m, seq, att, R, return_entropy=True, **k))
            print(json.dumps({"cmd": " ".join(sys.argv), "layers": layers, "rows": ROWS, "prompt_len": P,
                              "response_len": R, "layout": layout, "norm": "lean" if lean else "transformers'",
                              "saved_mib": round(mib, 1)}), flush=True)


if __name__ == "__main__":
    main()
