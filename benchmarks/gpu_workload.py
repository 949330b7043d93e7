"""The workload of ``benchmarks.gpu_grpo`` (issue #31): the model's shape, the GRPO settings, the reward, and the
workspace the pipeline's own ``prepare`` builds for it."""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import torch

from rlhf_core.rewards.registry import register_reward

SHAPE = {"hidden": 1024, "layers": 24, "heads": 16, "kv_heads": 4, "intermediate": 5504, "vocab": 32000}
WORKLOAD = {"prompts": 64, "group": 8, "prompt_len": 128, "new_tokens": 256, "micro_batch": 32, "grad_accum": 16}


@register_reward("bench_even_words")
def even_words(prompts, completions, **_) -> list[float]:
    """The share of the completion's words ``w<i>`` with an even ``i``: a reward that differs within a group."""
    def share(text: str) -> float:
        words = [w for w in text.split() if w[1:].isdigit()]
        return sum(int(w[1:]) % 2 == 0 for w in words) / max(1, len(words))
    return [share(c) for c in completions]


def device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def dtype() -> torch.dtype:
    return torch.bfloat16 if torch.cuda.is_available() else torch.float32


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def peak_gib() -> float | None:
    return torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else None


# --------------------------------------------------------------------------- the workspace
def build_workspace(root: Path, shape: dict, work: dict, rows: int, seed: int = 1234) -> dict:
    """``root/src``: the random Llama and its word-level tokenizer (``w2 .. w<V-1>``, pad, EOS) and pairwise
    rows whose prompts are ``prompt_len`` random words; then the pipeline's own prepare imports the model into
    ``models/base`` and splits the rows, and ``models/sft`` is a copy of the base."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from rlhf_core.ops import paths
    from rlhf_core.stages.prepare import prepare

    src = root / "src"
    (src / "model").mkdir(parents=True, exist_ok=True)
    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, shape["vocab"])}}
    tk = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tk.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", eos_token="<eos>")
    tok.save_pretrained(src / "model")
    cfg = LlamaConfig(vocab_size=shape["vocab"], hidden_size=shape["hidden"], intermediate_size=shape["intermediate"],
                      num_hidden_layers=shape["layers"], num_attention_heads=shape["heads"],
                      num_key_value_heads=shape["kv_heads"], max_position_embeddings=1024, tie_word_embeddings=True,
                      pad_token_id=0, eos_token_id=1, bos_token_id=None)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(src / "model")
    rng = random.Random(seed)

    def words(n: int) -> str:
        return " ".join(f"w{rng.randrange(2, shape['vocab'])}" for _ in range(n))

    with open(src / "pairs.jsonl", "w") as f:
        for _ in range(rows):
            f.write(json.dumps({"prompt": words(work["prompt_len"]), "chosen": words(4), "rejected": words(4)}) + "\n")
    params = workspace_params(root, shape, work)
    prepare(params, root)
    shutil.copytree(root / paths.BASE_MODEL, root / paths.SFT_MODEL, dirs_exist_ok=True)
    return {"verb": "workspace", "parameters": sum(p.numel() for p in model.parameters()), **shape}


def workspace_params(root: Path, shape: dict, work: dict, engine: str = "auto", settings: tuple[str, ...] = ()):
    from rlhf_core.config import apply_overrides, validate

    n_per_step = work["prompts"] * work["group"]
    overrides = [
        "data.source=mixed", f"data.sources=[{{path: {root / 'src' / 'pairs.jsonl'}, format: pairwise}}]",
        "data.data_split=[1, 1, 8]", "data.eval_fraction=0.05", f"data.max_prompt_len={work['prompt_len']}",
        "data.max_response_len=16", f"model.name_or_path={root / 'src' / 'model'}",
        f"compute.precision={'bf16' if torch.cuda.is_available() else 'fp32'}", "compute.zero_stage=0",
        "compute.gradient_checkpointing=false",
        "rlhf.algorithm=grpo", f"rlhf.prompts_per_step={work['prompts']}", f"rlhf.grpo.group_size={work['group']}",
        f"rlhf.max_new_tokens={work['new_tokens']}", "rlhf.temperature=1.0", "rlhf.top_p=1.0",
        f"rlhf.micro_batch_size={work['micro_batch']}", f"rlhf.grad_accum={n_per_step // work['micro_batch']}",
        "rlhf.ppo_epochs=1", "rlhf.ptx_coef=0", "rlhf.grpo.beta=0.04", "rlhf.grpo.clip_eps=0.2", "rlhf.lr=1e-6",
        "rlhf.warmup_steps=0", "rlhf.lr_scheduler=constant", "rlhf.num_steps=1000",
        "rlhf.reward_fns={bench_even_words: 1.0}", f"rlhf.rollout_engine={engine}", "eval.max_prompts=8", *settings,
    ]
    return validate(apply_overrides({}, overrides), origin="<bench gpu_grpo>")


def read_workspace(root: Path) -> tuple[dict, dict]:
    meta = json.loads((root / "bench.json").read_text())
    return meta["shape"], meta["workload"]


def rollout_inputs(root: Path, work: dict):
    """The tokenizer and the first iteration's prompt rows (``prompts`` x ``group``, left-padded)."""
    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.ops import paths
    from rlhf_core.passes.generation import encode_prompts
    from rlhf_core.trainers.common import read_split

    tok = load_tokenizer(root / paths.SFT_MODEL)
    texts = read_split(root, "prompts", columns=("prompt",))["prompt"][:work["prompts"]]
    ids, mask = encode_prompts(tok, texts, work["prompt_len"])
    return tok, ids.repeat_interleave(work["group"], 0), mask.repeat_interleave(work["group"], 0)
