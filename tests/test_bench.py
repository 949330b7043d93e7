"""``rlhf bench sft|rm`` runs on a tiny config and reports its fields (speed itself is not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "2",
        "--warmup", "1", "--vocab", "64", "--threads", "1", "--matmul-n", "256"]


def test_bench_sft_cli_prints_throughput_and_mfu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "bench", "sft", *TINY, "--json", "--baseline"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kind"] == "sft" and result["steps_timed"] == 2 and result["seq_len"] == 16
    for key in ("tokens_per_s", "achieved_gflops", "peak_matmul_gflops", "mfu", "baseline_tokens_per_s"):
        assert result[key] > 0, key
    assert result["params"] == result["embedding_params"] + result["non_embedding_params"]
    assert abs(result["achieved_gflops"] - 6 * result["params"] * result["tokens_per_s"] / 1e9) < 1e-6


def test_bench_rm_counts_chosen_and_rejected_tokens():
    from rlhf_core.bench.train import run_bench

    r = run_bench("rm", hidden=32, layers=1, heads=2, seq=16, batch=2, vocab=64, steps=2, warmup=1, threads=1,
                  matmul_n=256)
    assert r.kind == "rm" and r.steps_timed == 2
    assert abs(r.step_time_s * r.tokens_per_s - 2 * 2 * 16) < 1e-6  # 2 pairs x (chosen + rejected) x 16 tokens
    assert r.mfu > 0 and r.mfu_best >= r.mfu
    table = r.table()
    assert "MFU" in table and "tokens_per_s" in table and "peak matmul GFLOP/s" in table
