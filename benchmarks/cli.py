"""``rlhf bench sft|rm|ppo|grpo``: the benchmark verbs, added to the ``rlhf`` command by ``flows.cli``."""

from __future__ import annotations

import typer

bench_app = typer.Typer(help="Benchmarks: training tokens/s and model FLOP utilisation.", no_args_is_help=True)


def _bench(kind: str, hidden: int, layers: int, heads: int, seq: int, batch: int, vocab: int, steps: int,
           warmup: int, zero_stage: int, threads: int, baseline: bool, as_json: bool, matmul_n: int) -> None:
    from benchmarks.train import main as bench_main

    bench_main(kind, as_json=as_json, hidden=hidden, layers=layers, heads=heads, seq=seq, batch=batch, vocab=vocab,
               steps=steps, warmup=warmup, zero_stage=zero_stage, threads=threads, baseline=baseline,
               matmul_n=matmul_n)


_B_HIDDEN = typer.Option(512, help="Hidden size of the synthetic Llama.")
_B_LAYERS = typer.Option(6, help="Transformer layers.")
_B_HEADS = typer.Option(8, help="Attention heads.")
_B_SEQ = typer.Option(256, help="Tokens per row.")
_B_BATCH = typer.Option(8, help="Rows per step (RM: pairs per step).")
_B_VOCAB = typer.Option(256, help="Vocabulary size.")
_B_STEPS = typer.Option(8, help="Timed optimizer steps.")
_B_WARMUP = typer.Option(2, help="Untimed warm-up steps.")
_B_ZERO = typer.Option(0, help="DeepSpeed ZeRO stage.")
_B_THREADS = typer.Option(0, help="torch CPU threads (0: all cores).")
_B_BASELINE = typer.Option(False, "--baseline", help="Also time a plain PyTorch loop on the same model.")
_B_JSON = typer.Option(False, "--json", help="Print one JSON object instead of a table.")
_B_MATMUL = typer.Option(2048, "--matmul-n", help="Size n of the n x n matmul that measures peak throughput.")


@bench_app.command("sft")
def bench_sft(hidden: int = _B_HIDDEN, layers: int = _B_LAYERS, heads: int = _B_HEADS, seq: int = _B_SEQ,
              batch: int = _B_BATCH, vocab: int = _B_VOCAB, steps: int = _B_STEPS, warmup: int = _B_WARMUP,
              zero_stage: int = _B_ZERO, threads: int = _B_THREADS, baseline: bool = _B_BASELINE,
              as_json: bool = _B_JSON, matmul_n: int = _B_MATMUL) -> None:
    """SFT trainer throughput: tokens/s and MFU (6*N*tokens/s over measured fp32 matmul peak).

    Example: rlhf bench sft --hidden 512 --layers 6 --seq 256 --batch 8 --baseline
    """
    _bench("sft", hidden, layers, heads, seq, batch, vocab, steps, warmup, zero_stage, threads, baseline, as_json,
           matmul_n)


@bench_app.command("rm")
def bench_rm(hidden: int = _B_HIDDEN, layers: int = _B_LAYERS, heads: int = _B_HEADS, seq: int = _B_SEQ,
             batch: int = _B_BATCH, vocab: int = _B_VOCAB, steps: int = _B_STEPS, warmup: int = _B_WARMUP,
             zero_stage: int = _B_ZERO, threads: int = _B_THREADS, baseline: bool = _B_BASELINE,
             as_json: bool = _B_JSON, matmul_n: int = _B_MATMUL) -> None:
    """Reward-model trainer throughput (chosen + rejected tokens): tokens/s and MFU.

    Example: rlhf bench rm --hidden 512 --layers 6 --seq 256 --batch 4
    """
    _bench("rm", hidden, layers, heads, seq, batch, vocab, steps, warmup, zero_stage, threads, baseline, as_json,
           matmul_n)


_R_ITER = typer.Option(1, "--iterations", help="Timed RLHF iterations (after the warm-up).")
_R_WARMUP = typer.Option(1, "--warmup", help="Untimed warm-up iterations.")
_R_SET = typer.Option([], "--set", "-S", help="Override a benchmark param, e.g. -S rlhf.max_new_tokens=64.")


@bench_app.command("ppo")
def bench_ppo(iterations: int = _R_ITER, warmup: int = _R_WARMUP, set_: list[str] = _R_SET,
              as_json: bool = _B_JSON) -> None:
    """One PPO iteration (actor + critic) on a fixed small config: samples/s and generate / score / train.

    Example: rlhf bench ppo --iterations 3
    """
    from benchmarks.rlhf import run_cli

    run_cli("ppo", iterations, warmup, set_, as_json)


@bench_app.command("grpo")
def bench_grpo(iterations: int = _R_ITER, warmup: int = _R_WARMUP, set_: list[str] = _R_SET,
               as_json: bool = _B_JSON) -> None:
    """One GRPO iteration on a fixed small config (16 prompts x 8 samples x 32 tokens): samples/s and
    generate / score / train.

    Example: rlhf bench grpo --iterations 3 --json
    """
    from benchmarks.rlhf import run_cli

    run_cli("grpo", iterations, warmup, set_, as_json)
