"""``rlhf bench sft|rm``: training throughput and model FLOP utilisation (MFU) of the SFT / RM trainers.

MFU = ``6 * N * tokens_per_s / peak``, where
- ``N`` = every trainable parameter counted once: embeddings (tied with the LM head here, so counted
  once) + transformer blocks + final norm (+ the value head for ``rm``).  ``6N`` FLOPs per token is the
  usual forward (2N) + backward (4N) estimate; attention-score FLOPs (``~12 * layers * seq * hidden``
  per token) are *not* counted, so the figure is slightly conservative;
- ``tokens_per_s`` counts the non-pad tokens the trainer processes (``rm``: chosen + rejected rows);
- ``peak`` is this machine's measured fp32 matmul throughput (the best of several timings of a large
  ``torch.matmul``, taken before and after the run).

``tokens_per_s`` / ``mfu`` use the median timed step; ``*_best`` the fastest step, which is the fairer
figure on a machine shared with other jobs (a best-of peak against a best-of step).

The measured loop is the real one (``rlhf_core.engine.fit`` with the SFT / RM loss and collation on
the DeepSpeed engine); ``--baseline`` also times a plain PyTorch loop (model + AdamW) on the same model
and data for comparison.  Synthetic random tokens, full-length rows (no padding).
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import asdict, dataclass

import torch

from rlhf_core.config import ComputeConfig, EpochConfig


@dataclass
class BenchResult:
    kind: str
    device: str
    threads: int
    world_size: int
    zero_stage: int
    params: int
    embedding_params: int
    non_embedding_params: int
    seq_len: int
    batch: int
    steps_timed: int
    step_time_s: float
    tokens_per_s: float
    achieved_gflops: float
    peak_matmul_gflops: float
    mfu: float
    tokens_per_s_best: float = 0.0
    mfu_best: float = 0.0
    baseline_tokens_per_s: float | None = None
    baseline_mfu: float | None = None
    baseline_mfu_best: float | None = None

    def table(self) -> str:
        rows = [
            ("kind", self.kind), ("device", self.device), ("threads", self.threads),
            ("world_size / zero", f"{self.world_size} / {self.zero_stage}"),
            ("params N", f"{self.params / 1e6:.2f}M (embedding {self.embedding_params / 1e6:.2f}M, "
                         f"non-embedding {self.non_embedding_params / 1e6:.2f}M)"),
            ("batch x seq", f"{self.batch} x {self.seq_len}"),
            ("step time", f"{self.step_time_s * 1000:.0f} ms (median of {self.steps_timed})"),
            ("tokens_per_s", f"{self.tokens_per_s:.0f}"),
            ("achieved GFLOP/s (6N)", f"{self.achieved_gflops:.1f}"),
            ("peak matmul GFLOP/s", f"{self.peak_matmul_gflops:.1f}"),
            ("MFU", f"{self.mfu * 100:.1f}% (best step {self.mfu_best * 100:.1f}%)"),
        ]
        if self.baseline_tokens_per_s is not None:
            rows += [("plain torch tokens_per_s", f"{self.baseline_tokens_per_s:.0f}"),
                     ("plain torch MFU", f"{(self.baseline_mfu or 0) * 100:.1f}% "
                                         f"(best step {(self.baseline_mfu_best or 0) * 100:.1f}%)")]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def matmul_peak_gflops(n: int = 2048, reps: int = 5, rounds: int = 3, dtype=torch.float32) -> float:
    """Best-of-``rounds`` throughput of ``reps`` ``n x n`` matmuls (GFLOP/s)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    torch.matmul(a, b)
    best = 0.0
    for _ in range(rounds):
        if device == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        for _ in range(reps):
            torch.matmul(a, b)
        if device == "cuda":
            torch.cuda.synchronize()
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - t) / 1e9)
    return best


def _llama_config(vocab: int, hidden: int, layers: int, heads: int, seq: int, intermediate: int | None):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads,
                       num_key_value_heads=heads, intermediate_size=intermediate or int(8 * hidden / 3 / 32 + 1) * 32,
                       max_position_embeddings=max(seq, 16), pad_token_id=0, bos_token_id=1, eos_token_id=2,
                       tie_word_embeddings=True)


def count_params(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameters counted once, embedding parameters)."""
    seen, total, emb = set(), 0, 0
    for name, p in model.named_parameters():
        if id(p) in seen:
            continue
        seen.add(id(p))
        n = int(getattr(p, "ds_numel", p.numel()))
        total += n
        if "embed_tokens" in name:
            emb += n
    return total, emb


def _data(kind: str, n_rows: int, seq: int, vocab: int):
    from rlhf_core.data.collate import PairData, Ragged, TokenizedSequences, build_sft_data

    g = torch.Generator().manual_seed(0)

    def seqs():
        tokens = Ragged.from_lengths(torch.randint(3, vocab, (n_rows * seq,), generator=g),
                                     torch.full((n_rows,), seq, dtype=torch.long))
        prompt = torch.full((n_rows,), seq // 4, dtype=torch.long)
        response = (torch.arange(seq).repeat(n_rows) >= seq // 4)
        return TokenizedSequences(tokens, response, prompt, 0)

    return build_sft_data(seqs()) if kind == "sft" else PairData(seqs(), seqs())


def run_bench(kind: str = "sft", hidden: int = 512, layers: int = 6, heads: int = 8, seq: int = 256, batch: int = 8,
              vocab: int = 256, intermediate: int | None = None, steps: int = 8, warmup: int = 2, zero_stage: int = 0,
              threads: int = 0, baseline: bool = False, matmul_n: int = 2048) -> BenchResult:
    """Time ``steps`` optimizer steps (after ``warmup``) of the SFT or RM trainer on a synthetic model."""
    from transformers import AutoModel, AutoModelForCausalLM

    from rlhf_core.data.collate import collate_pairs, collate_sft
    from rlhf_core.engine import distributed as D
    from rlhf_core.engine.engine import TrainEngine
    from rlhf_core.engine.loop import Hooks, TrainState, fit
    from rlhf_core.engine.sampler import ResumableSampler, StepPlan
    from rlhf_core.models.value_head import ValueHeadModel
    from rlhf_core.trainers.rm import make_rm_loss
    from rlhf_core.trainers.sft import sft_loss

    if kind not in ("sft", "rm"):
        raise ValueError(f"unknown bench {kind!r}; expected sft or rm")
    D.init_distributed()
    n_threads = D.set_num_threads(threads)
    cfg = _llama_config(vocab, hidden, layers, heads, seq, intermediate)

    def build():
        torch.manual_seed(0)
        if kind == "sft":
            return AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")
        return ValueHeadModel(AutoModel.from_config(cfg, attn_implementation="sdpa"))

    total_steps = warmup + steps
    data = _data(kind, batch * total_steps * D.world_size(), seq, vocab)
    compute = ComputeConfig(zero_stage=zero_stage, num_threads=threads)
    optim = EpochConfig(lr=1e-4, warmup_steps=0, epochs=1, micro_batch_size=batch, lr_scheduler="constant")
    plan = StepPlan(len(data), batch, 1, D.world_size(), 1)
    if kind == "sft":
        collate, loss_fn = (lambda idx: collate_sft(data, idx, 0)), sft_loss
    else:
        collate, loss_fn = (lambda idx: collate_pairs(data, idx, 0)), make_rm_loss("sequence", 0.0)

    peak_before = matmul_peak_gflops(matmul_n)
    model = build()
    n_params, n_emb = count_params(model)
    engine = TrainEngine(model, compute, optim, plan.total_steps)
    rates: list[float] = []
    hooks = Hooks(after_step=lambda step, m: rates.append(m["tokens_per_s"]) if step > warmup else None)
    fit(engine, plan, ResumableSampler(plan, 0, D.rank()), collate, loss_fn, TrainState(), None, None, hooks=hooks)
    tokens_per_step = batch * seq * (2 if kind == "rm" else 1) * D.world_size()
    tps = statistics.median(rates)

    base_rates: list[float] = []
    if baseline:
        base_rates = _plain_torch(build(), collate, loss_fn, steps, warmup, tokens_per_step, batch)
    peak = max(peak_before, matmul_peak_gflops(matmul_n)) * D.world_size()
    flops = 6 * n_params * tps / 1e9
    base_tps = statistics.median(base_rates) if base_rates else None
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else f"cpu ({n_threads} threads)"
    return BenchResult(
        kind=kind, device=device, threads=n_threads, world_size=D.world_size(), zero_stage=zero_stage,
        params=n_params, embedding_params=n_emb, non_embedding_params=n_params - n_emb, seq_len=seq, batch=batch,
        steps_timed=len(rates), step_time_s=tokens_per_step / tps, tokens_per_s=tps, achieved_gflops=flops,
        peak_matmul_gflops=peak, mfu=flops / peak, tokens_per_s_best=max(rates),
        mfu_best=6 * n_params * max(rates) / 1e9 / peak, baseline_tokens_per_s=base_tps,
        baseline_mfu=(6 * n_params * base_tps / 1e9 / peak) if base_tps else None,
        baseline_mfu_best=(6 * n_params * max(base_rates) / 1e9 / peak) if base_rates else None)


def _plain_torch(model, collate, loss_fn, steps: int, warmup: int, tokens_per_step: int,
                 batch: int) -> list[float]:
    """The same model and batches in a bare PyTorch loop (AdamW, clipping): tokens/s of each timed step."""
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model.to(device).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)

    class Bare:
        def __init__(self, m):
            self.m, self.device = m, device

        def __call__(self, *a, **k):
            return self.m(*a, **k)

    bare, rates = Bare(model), []
    for step in range(warmup + steps):
        t = time.perf_counter()
        loss, _ = loss_fn(bare, collate(torch.arange(step * batch, (step + 1) * batch)))
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.detach().item()  # sync, like the trainer
        if step >= warmup:
            rates.append(tokens_per_step / (time.perf_counter() - t))
    return rates


def main(kind: str, as_json: bool = False, **kwargs) -> BenchResult:
    result = run_bench(kind, **kwargs)
    from rlhf_core.engine import distributed as D

    if D.is_main():
        print(json.dumps(asdict(result)) if as_json else result.table(), flush=True)
    return result
