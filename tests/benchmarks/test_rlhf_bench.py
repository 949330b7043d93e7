"""``rlhf bench ppo|grpo`` runs on a tiny config and reports the per-phase breakdown (speed is not asserted)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.conftest import REPO

TINY = ["model.tiny.hidden_size=32", "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=2",
        "model.tiny.num_hidden_layers=1", "model.tiny.intermediate_size=64", "data.demo.n_rows=300",
        "rlhf.max_new_tokens=4", "compute.num_threads=1"]


def _bench(kind: str, *extra: str) -> subprocess.CompletedProcess:
    args = [a for o in TINY for a in ("-S", o)]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLHF_TRACKING": "off"}
    return subprocess.run([sys.executable, "-m", "flows.cli", "bench", kind, *args, *extra],
                          capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.slow
def test_bench_grpo_and_ppo_report_phases():
    proc = _bench("grpo", "--json", "--iterations", "2")
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    assert r["algorithm"] == "grpo" and r["iterations"] == 2 and r["rows_per_iteration"] == 16 * 8
    assert r["new_tokens_per_row"] == 4  # EOS suppressed until max_new_tokens: a fixed workload
    s = r["seconds"]
    assert all(s[k] > 0 for k in ("generate", "score", "train", "iteration"))
    assert s["generate"] + s["score"] + s["train"] <= s["iteration"] + 1e-6
    assert r["samples_per_s"] == pytest.approx(r["rows_per_iteration"] / s["iteration"])
    proc = _bench("ppo", "-S", "rlhf.prompts_per_step=32")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "rlhf bench ppo: 32 samples" in proc.stdout and "generate" in proc.stdout and "train" in proc.stdout
