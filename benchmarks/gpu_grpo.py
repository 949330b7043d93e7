"""GRPO at realistic lengths on one device, ours beside TRL's ``GRPOTrainer``, and the rollout alone by engine.

The workload of issue #31: a random-initialised Llama (default: hidden 1024, 24 layers, 16 heads, 4 KV heads,
MLP 5504, vocabulary 32000, tied embeddings: 0.5B parameters), 64 prompts of 128 tokens x 8 samples, 256 new
tokens per sample (EOS banned before: ``min_new_tokens``), temperature 1, beta 0.04, clip 0.2, one optimizer
step of 32 x 16 micro-batches per iteration, bf16, no gradient checkpointing. The reward is a rule over the
words of the completion (``bench_even_words``: the share of even-numbered words), so groups differ and
every row trains. Each verb runs in its own process, so that peak memory is its own::

    python -m benchmarks.gpu_grpo workspace --root W     # the model, a word-level tokenizer, prepared prompts
    python -m benchmarks.gpu_grpo decode --root W [--engines generate,static_eager,static,static_compiled,...]
    python -m benchmarks.gpu_grpo ours --root W [--engine static|generate] [--set compute.bf16_master=true ...]
        [--snapshot]   # + what the first training forward leaves alive, by the line that allocated it
    python -m benchmarks.gpu_grpo trl --root W
    python -m benchmarks.gpu_grpo profile --root W [--engines static_compiled]   # top kernels of a few steps
    python -m benchmarks.gpu_grpo score --root W [--forward-batch N]   # the reference pass alone: time, memory

Every verb prints one JSON row. The script that runs them all on a GPU machine is
docs/measurements/gpu-grpo-*.sh; the figures are in docs/results/benchmarks-gpu-rollout.md.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

import torch

from benchmarks.gpu_workload import (
    SHAPE,
    WORKLOAD,
    build_workspace,
    device,
    dtype,
    even_words,
    peak_gib,
    read_workspace,
    rollout_inputs,
    sync,
    workspace_params,
)


# --------------------------------------------------------------------------- the rollout alone
def copy_bandwidth() -> float | None:
    """Bytes read + written per second by a 2 GiB device-to-device copy (the HBM figure the bound uses)."""
    if not torch.cuda.is_available():
        return None
    a = torch.empty(2**30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    sync()
    t0 = time.perf_counter()
    for _ in range(10):
        b.copy_(a)
    sync()
    return 2 * 10 * a.numel() / (time.perf_counter() - t0)


def decode_bound_s(model, rows: int, prompt_len: int, new_tokens: int, bandwidth: float) -> float:
    """Seconds to read the weights and the KV cache written so far once per decode step at ``bandwidth``."""
    cfg = model.config
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    width = next(model.parameters()).element_size()
    kv_per_token = 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * width
    kv = sum(rows * (prompt_len + t) * kv_per_token for t in range(new_tokens))
    return (new_tokens * weights + kv) / bandwidth


ENGINES = ("generate", "static_eager", "static", "static_compiled", "static_compiled_product")


def sampler(engine: str, model, tok, ids, mask, new_tokens: int, group: int, compile: bool = False):
    """A function that samples ``new_tokens`` (EOS banned) after every row with ``engine``: ``generate`` (the
    rollout, texts decoded too: a few ms), or the static decoder without its graph, with it, or with its
    forward compiled as well (``compile``: also without the graph), its decode attention as two products
    (``static_compiled_product``: ``rlhf.rollout_attention: product``)."""
    from rlhf_core.passes.generation import GenerationConfig, rollout
    from rlhf_core.passes.static_decode import static_rollout

    if engine == "generate":
        gen = GenerationConfig(new_tokens, min_new_tokens=new_tokens, engine="generate")
        return lambda: rollout(model, ids, mask, tok, gen, group_size=group).responses
    cuda = next(model.parameters()).device.type == "cuda"
    graph, compiled = not engine.startswith("static_eager") and cuda, compile or engine.startswith("static_compiled")
    attention = "product" if engine.endswith("_product") else "sdpa"
    return lambda: static_rollout(model, ids, mask, new_tokens, tok.eos_token_id, tok.pad_token_id,
                                  min_new_tokens=new_tokens, group_size=group, use_graph=graph,
                                  compile=compiled, attention=attention)[0]


def bench_decode(root: Path, repeats: int = 2, engines: tuple[str, ...] = ENGINES) -> dict:
    from transformers import AutoModelForCausalLM

    from rlhf_core.ops import paths

    _, work = read_workspace(root)
    tok, ids, mask = rollout_inputs(root, work)
    dev = device()
    model = AutoModelForCausalLM.from_pretrained(root / paths.SFT_MODEL, dtype=dtype()).to(dev).eval()
    R = work["new_tokens"]
    out = {"verb": "decode", "rows": ids.shape[0], "prompt_len": ids.shape[1], "new_tokens": R, "engines": {}}
    for engine in engines:
        sample = sampler(engine, model, tok, ids, mask, R, work["group"])
        times, first = [], 0.0
        torch.manual_seed(0)
        for i in range(repeats + 1):
            sync()
            t0 = time.perf_counter()
            responses = sample()
            sync()
            if i:
                times.append(time.perf_counter() - t0)
            else:
                first = time.perf_counter() - t0
        s = sum(times) / len(times)
        out["engines"][engine] = {"s": s, "tokens_per_s": ids.shape[0] * R / s, "ms_per_step": 1000 * s / R,
                                  "times": times, "first_call_s": first, "response_len": responses.shape[1]}
    bw = copy_bandwidth()
    if bw:
        out["copy_bandwidth_tb_s"] = bw / 1e12
        out["bound_s"] = decode_bound_s(model, ids.shape[0], ids.shape[1], R, bw)
    out["peak_gib"] = peak_gib()
    return out


def bench_profile(root: Path, engine: str = "generate", steps: int = 16) -> dict:
    """The torch profiler over a rollout of ``steps`` tokens by ``engine`` (a static one runs without its graph,
    so that each kernel shows, and over the workload's full length, whose compiled code the decode verb left in
    inductor's cache): the top ops by device time, and by host time for ``generate`` (a static step records the
    device alone: its host time is what the graph removes, and recording it overran the call's limit)."""
    from torch.profiler import ProfilerActivity, profile
    from transformers import AutoModelForCausalLM

    from rlhf_core.ops import paths

    _, work = read_workspace(root)
    tok, ids, mask = rollout_inputs(root, work)
    model = AutoModelForCausalLM.from_pretrained(root / paths.SFT_MODEL, dtype=dtype()).to(device()).eval()
    steps = steps if engine == "generate" else work["new_tokens"]
    eager = "static_eager_product" if engine.endswith("_product") else "static_eager"
    sample = sampler("generate" if engine == "generate" else eager, model, tok, ids, mask, steps,
                     work["group"], compile=engine.startswith("static_compiled"))
    sample()
    cuda = torch.cuda.is_available()
    host_too = engine == "generate" or not cuda  # a static step's host time is what its graph removes
    activities = ([ProfilerActivity.CPU] if host_too else []) + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        sample()
        sync()
    events = prof.key_averages()
    table = events.table(sort_by="self_cuda_time_total" if cuda else "self_cpu_time_total", row_limit=25)
    host = events.table(sort_by="self_cpu_time_total", row_limit=15) if host_too else ""
    return {"verb": "profile", "engine": engine, "steps": steps, "by_device": table, "by_host": host}


# --------------------------------------------------------------------------- the scoring pass alone
def bench_score(root: Path, forward_batch: int, precision: str = "auto") -> dict:
    """The reference log-prob pass of one iteration (every row, packed groups, ``forward_batch`` rows per pass)
    over random responses, its time and peak memory: device memory on a GPU, the process's peak RSS on a CPU."""
    import resource

    from transformers import AutoModelForCausalLM

    from rlhf_core.ops import paths
    from rlhf_core.passes.generation import response_logprobs
    from rlhf_core.trainers.rlhf.experience import batched

    _, work = read_workspace(root)
    tok, ids, mask = rollout_inputs(root, work)
    dev = device()
    dt = {"auto": dtype(), "bf16": torch.bfloat16, "fp32": torch.float32}[precision]
    model = AutoModelForCausalLM.from_pretrained(root / paths.SFT_MODEL, dtype=dt).to(dev).eval()
    R, n = work["new_tokens"], ids.shape[0]
    torch.manual_seed(0)
    responses = torch.randint(2, model.config.vocab_size, (n, R))
    seq = torch.cat([ids, responses], dim=1).to(dev)
    att = torch.cat([mask, torch.ones_like(responses)], dim=1).to(dev)
    group = torch.arange(n, device=dev) // work["group"]
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    sync()
    t0 = time.perf_counter()
    with torch.inference_mode():
        batched(lambda s: response_logprobs(model, seq[s], att[s], R, group=group[s], pack=True).float(), n,
                forward_batch or n)
    sync()
    return {"verb": "score", "rows": n, "forward_batch": forward_batch or n, "dtype": str(dt),
            "s": time.perf_counter() - t0,
            "peak_gib": peak_gib(), "peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20,
            "rss_before_gib": rss_before}


# --------------------------------------------------------------------------- one GRPO iteration
class PhasePeaks:
    """Peak device memory per phase of an iteration: the rollout, the scoring passes, and the update (what the
    iteration allocates after the passes), each since its own start (``reset_peak_memory_stats``)."""

    def __init__(self, trainer):
        from rlhf_core.trainers.rlhf import experience

        self.peaks: dict[str, float] = {}
        self.on = torch.cuda.is_available()
        experience.rollout = self.wrap(experience.rollout, "generate", "score_and_reward")
        trainer.maker._forward_passes = self.wrap(trainer.maker._forward_passes, None, "train")

    def wrap(self, fn, name: str | None, after: str):
        def wrapped(*args, **kwargs):
            if self.on and name is not None:
                torch.cuda.reset_peak_memory_stats()
            out = fn(*args, **kwargs)
            self.close(name or "score_and_reward")
            if self.on:
                torch.cuda.reset_peak_memory_stats()
            return out

        return wrapped

    def close(self, name: str) -> None:
        if self.on:
            self.peaks[name] = max(self.peaks.get(name, 0.0), torch.cuda.max_memory_allocated() / 2**30)


def bench_ours(root: Path, engine: str, iterations: int = 2, warmup: int = 1, settings: tuple[str, ...] = (),
               snapshot: bool = False) -> dict:
    """One GRPO iteration of ours: times and peaks per phase, the resident memory and the training parts' peaks
    (``TrainPeaks``); with ``snapshot``, what the last iteration's first training forward leaves alive."""
    from benchmarks.gpu_memory import TrainPeaks
    from rlhf_core.trainers.rlhf.trainer import RLHFTrainer

    shape, work = read_workspace(root)
    params = workspace_params(root, shape, work, engine, settings)
    trainer = RLHFTrainer(params, root, evaluate=False, checkpoints=False).setup()
    trainer.maker.cfg.gen = replace(trainer.maker.cfg.gen, min_new_tokens=work["new_tokens"])
    for _ in range(warmup):
        trainer.step()
    if torch.cuda.is_available():
        torch.cuda.reset_peak_memory_stats()
    phases = PhasePeaks(trainer)
    parts = TrainPeaks(trainer, lambda: phases.close("train"), snapshot)
    overall = 0.0
    runs = []
    for i in range(iterations):
        if i == iterations - 1:
            parts.record()
        runs.append(trainer.step())
        phases.close("train")
        overall = max(overall, *phases.peaks.values()) if phases.peaks else overall
    mean = {k: sum(r[k] for r in runs) / len(runs) for k in ("t_generate", "t_score", "t_train", "t_step", "rows")}
    return {"verb": "ours", "engine": engine, "settings": list(settings), "iterations": iterations,
            "rows": mean["rows"],
            "s_per_iteration": mean["t_step"], "samples_per_s": mean["rows"] / mean["t_step"],
            "generate_s": mean["t_generate"], "score_ref_s": mean["t_score"], "train_s": mean["t_train"],
            "step_times_s": [r["t_step"] for r in runs], "peak_gib": overall if phases.on else None,
            "phase_peak_gib": phases.peaks, **parts.row(), "precision": trainer.actor.precision}


def bench_trl(root: Path, iterations: int = 2, warmup: int = 1, weights: str = "bf16") -> dict:
    import trl
    from datasets import Dataset
    from transformers import AutoModelForCausalLM
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.trl_speed import step_timer
    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.ops import paths
    from rlhf_core.trainers.common import read_split

    _, work = read_workspace(root)
    per_step = work["prompts"] * work["group"]

    steps = warmup + iterations
    texts = read_split(root, "prompts", columns=("prompt",))["prompt"][:steps * work["prompts"]]
    data = Dataset.from_dict({"prompt": texts})
    tok = load_tokenizer(root / paths.SFT_MODEL)
    gpu = torch.cuda.is_available()
    model = AutoModelForCausalLM.from_pretrained(root / paths.SFT_MODEL,
                                                 dtype=torch.bfloat16 if gpu and weights == "bf16" else torch.float32)
    args = GRPOConfig(
        output_dir=str(root / "trl"), use_cpu=not gpu, bf16=gpu, fp16=False, report_to=[], save_strategy="no",
        logging_steps=1, max_steps=steps, learning_rate=1e-6, lr_scheduler_type="constant",
        per_device_train_batch_size=work["micro_batch"], gradient_accumulation_steps=per_step // work["micro_batch"],
        num_generations=work["group"], max_completion_length=work["new_tokens"],
        generation_kwargs={"min_new_tokens": work["new_tokens"]}, temperature=1.0, top_p=1.0, top_k=0, beta=0.04,
        num_iterations=1, epsilon=0.2, seed=1234, dataloader_num_workers=0, shuffle_dataset=False,
        gradient_checkpointing=False)
    timer = step_timer(warmup)
    trainer = GRPOTrainer(model=model, reward_funcs=even_words, args=args, train_dataset=data,
                          processing_class=tok, callbacks=[timer])
    trainer.train()
    gaps = timer.timed_gaps()
    s = sum(gaps) / len(gaps)
    return {"verb": "trl", "framework": f"trl {trl.__version__}", "weights": weights, "iterations": len(gaps),
            "rows": per_step, "s_per_iteration": s, "samples_per_s": per_step / s, "step_times_s": gaps,
            "peak_gib": peak_gib()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("verb", choices=["workspace", "decode", "profile", "score", "ours", "trl"])
    ap.add_argument("--root", type=Path, required=True)
    ap.add_argument("--engine", default="static", choices=["static", "generate", "auto"])
    ap.add_argument("--weights", default="bf16", choices=["bf16", "fp32"], help="TRL's model weights.")
    ap.add_argument("--iterations", type=int, default=2)
    ap.add_argument("--engines", default=",".join(ENGINES), help="decode, profile: engines, comma-separated")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="ours: a params override on top of the workload's (repeatable)")
    ap.add_argument("--snapshot", action="store_true",
                    help="ours: group what the last iteration's first training forward leaves alive by origin")
    ap.add_argument("--forward-batch", type=int, default=0, help="score: rows per pass (0: all at once)")
    ap.add_argument("--dtype", default="auto", choices=["auto", "bf16", "fp32"], help="score: the model's dtype")
    ap.add_argument("--rows", type=int, default=400, help="workspace: pairwise rows (about 80 %% become prompts)")
    ap.add_argument("--shape", default="", help='workspace: JSON overrides of the model shape, e.g. {"layers": 2}')
    ap.add_argument("--workload", default="", help='workspace: JSON overrides, e.g. {"new_tokens": 8}')
    a = ap.parse_args()
    os.environ.setdefault("RLHF_TRACKING", "off")
    if a.verb == "workspace":
        shape = {**SHAPE, **json.loads(a.shape or "{}")}
        work = {**WORKLOAD, **json.loads(a.workload or "{}")}
        row = build_workspace(a.root, shape, work, a.rows)
        (a.root / "bench.json").write_text(json.dumps({"shape": shape, "workload": work}))
    elif a.verb == "decode":
        row = bench_decode(a.root, a.iterations, tuple(a.engines.split(",")))
    elif a.verb == "profile":
        row = bench_profile(a.root, a.engines.split(",")[0])
    elif a.verb == "score":
        row = bench_score(a.root, a.forward_batch, a.dtype)
    elif a.verb == "ours":
        row = bench_ours(a.root, a.engine, a.iterations, settings=tuple(a.set), snapshot=a.snapshot)
    else:
        row = bench_trl(a.root, a.iterations, weights=a.weights)
    row["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
