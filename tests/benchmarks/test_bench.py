"""``rlhf bench sft|rm`` runs on a tiny config and reports its fields (speed itself is not asserted)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TINY = ["--hidden", "32", "--layers", "1", "--heads", "2", "--seq", "16", "--batch", "2", "--steps", "2",
        "--warmup", "1", "--vocab", "64", "--threads", "1", "--matmul-n", "256"]


def test_bench_sft_cli_prints_throughput_and_mfu(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "bench", "sft", *TINY, "--json", "--baseline"],
                          cwd=tmp_path, capture_output=True, text=True, env=env, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["kind"] == "sft" and result["steps_timed"] == 2 and result["seq_len"] == 16
    for key in ("tokens_per_s", "achieved_gflops", "peak_matmul_gflops", "mfu", "baseline_tokens_per_s"):
        assert result[key] > 0, key
    assert result["params"] == result["embedding_params"] + result["non_embedding_params"]
    assert abs(result["achieved_gflops"] - 6 * result["params"] * result["tokens_per_s"] / 1e9) < 1e-6


def test_bench_rm_counts_chosen_and_rejected_tokens():
    from benchmarks.train import run_bench

    r = run_bench("rm", hidden=32, layers=1, heads=2, seq=16, batch=2, vocab=64, steps=2, warmup=1, threads=1,
                  matmul_n=256)
    assert r.kind == "rm" and r.steps_timed == 2
    assert abs(r.step_time_s * r.tokens_per_s - 2 * 2 * 16) < 1e-6  # 2 pairs x (chosen + rejected) x 16 tokens
    assert r.mfu > 0 and r.mfu_best >= r.mfu
    table = r.table()
    assert "MFU" in table and "tokens_per_s" in table and "peak matmul GFLOP/s" in table


def test_shared_prefix_bench_prints_each_pass_and_the_two_agree(capsys):
    """The shared-prompt benchmark times the actor, critic and RM passes both ways; on the tiny CPU model the
    outputs and gradients agree to float rounding, with the prompts' common head computed once too."""
    from benchmarks.shared_prefix import main

    rows = main(["--rows", "8", "--repeats", "1", "--layers", "1", "--head", "3"])
    assert rows[0]["head"] == 3
    assert [r["pass"] for r in rows] == ["actor fwd+bwd", "actor fwd+bwd packed", "critic fwd+bwd", "rm score"]
    for r in rows:
        assert r["plain_ms"] > 0 and r["shared_ms"] > 0
        # the ratio of the unrounded times: the printed ms (2 decimals) give it within their rounding, not 0.01
        rounding = r["ratio"] * (0.005 / r["plain_ms"] + 0.005 / r["shared_ms"]) + 5e-4
        assert abs(r["ratio"] - r["shared_ms"] / r["plain_ms"]) <= rounding
        assert r["max_abs_diff"] < 1e-4 and r["max_rel_grad_diff"] < 1e-3
    assert rows[0]["max_rel_grad_diff"] > 0  # gradients were compared, not skipped
    assert rows[1]["packed_width"] <= 12 + 4 * 7  # a prompt, then 4 responses but their last token
    assert len(capsys.readouterr().out.strip().splitlines()) == 4
    with pytest.raises(SystemExit):
        main(["--rows", "10", "--group", "4"])


def test_free_rows_bench_runs_both_decoders_and_they_agree(tmp_path, tiny_chat_tokenizer_dir):
    """``benchmarks.free_rows`` on a tiny random Llama whose EOS is likely: both kinds timed every repeat, the same
    tokens, and lengths that vary (so rows were freed)."""
    import pandas as pd
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from benchmarks.free_rows import main

    tok = AutoTokenizer.from_pretrained(tiny_chat_tokenizer_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         max_position_embeddings=256))
    with torch.no_grad():  # every input embeds alike: one last hidden state c, near-uniform logits, and EOS's
        model.model.embed_tokens.weight[:] = model.model.embed_tokens.weight[0]  # set to make it 1 in ~10 a step
        c = model.model(input_ids=torch.tensor([[1, 2, 3]])).last_hidden_state[0, -1]
        model.lm_head.weight[tok.eos_token_id] = math.log(len(tok) / 9) * c / c.dot(c)
    model.save_pretrained(tmp_path / "m")
    tok.save_pretrained(tmp_path / "m")
    pd.DataFrame({"prompt": [f"What is {i} + {i + 1}?" for i in range(16)]}).to_parquet(tmp_path / "p.parquet")
    row = main(["--model", str(tmp_path / "m"), "--prompts", str(tmp_path / "p.parquet"), "--rows", "16",
                "--new-tokens", "40", "--repeats", "2", "--threads", "1"])
    assert row["same_tokens"] and row["rows"] == 16
    assert len(row["times_s"]["kept"]) == len(row["times_s"]["freed"]) == 2 and row["freed_over_kept"] > 0
    assert 1 <= row["response_len_mean"] < row["response_len_max"] <= 40
