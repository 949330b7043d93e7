"""Splits: deterministic under a seed, disjoint, covering; manifest and base model contents."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest

from rlhf_core.data.split import split_by_shares, train_eval_split
from rlhf_core.ops.meta import file_sha256
from rlhf_core.stages.prepare import prepare
from tests.conftest import make_params

NAMES = [f"{p}{n}" for n in ("sft", "pairs", "prompts") for p in ("", "eval_")]


def test_split_by_shares_counts_disjoint_and_deterministic():
    parts = split_by_shares(100, [2, 4, 4], seed=7)
    assert [len(p) for p in parts] == [20, 40, 40]
    assert len(np.unique(np.concatenate(parts))) == 100
    again = split_by_shares(100, [2, 4, 4], seed=7)
    assert all((a == b).all() for a, b in zip(parts, again, strict=True))
    other = split_by_shares(100, [2, 4, 4], seed=8)
    assert any((a != b).any() for a, b in zip(parts, other, strict=True))
    assert [len(p) for p in split_by_shares(10, [1, 0, 1], seed=0)] == [5, 0, 5]


def test_train_eval_split_sizes():
    tr, ev = train_eval_split(30, 0.1, seed=0)
    assert (len(tr), len(ev)) == (27, 3) and not set(tr) & set(ev)
    assert [len(x) for x in train_eval_split(2, 0.01, seed=0)] == [1, 1]  # at least one eval row
    assert [len(x) for x in train_eval_split(5, 0.99, seed=0)] == [1, 4]  # at least one train row


def _prepare_into(ws, name, *overrides):
    root = ws / name
    root.mkdir()
    return root, prepare(make_params(*overrides), root)


def test_demo_split_is_deterministic_and_disjoint(workspace):
    a, ma = _prepare_into(workspace, "a")
    b, mb = _prepare_into(workspace, "b")
    c, mc = _prepare_into(workspace, "c", "project.seed=99")
    assert ma["hashes"] == mb["hashes"]
    assert ma["hashes"] != mc["hashes"]
    ids = {n: set(pd.read_parquet(a / "data/prepared" / f"{n}.parquet").id) for n in NAMES}
    all_ids = [i for s in ids.values() for i in s]
    assert len(all_ids) == len(set(all_ids)), "a demo row landed in two splits"
    for n in NAMES:
        assert ma["counts"][n] == len(ids[n]) > 0


def test_manifest_records_hashes_params_and_tokenizer(workspace):
    manifest = prepare(make_params())
    prepared = workspace / "data/prepared"
    on_disk = json.loads((prepared / "manifest.json").read_text())
    assert on_disk == manifest
    for fname, digest in manifest["hashes"].items():
        assert file_sha256(prepared / fname) == digest
    assert manifest["params_hash"] == make_params().section_hash("project", "data", "model")
    tok = manifest["tokenizer"]
    assert tok["pad_token_id"] != tok["eos_token_id"]
    assert set(manifest["token_stats"]) == {"sft", "pairs", "prompts"}
    meta = json.loads((prepared / "rlhf_meta.json").read_text())
    assert meta["stage"] == "prepare" and "torch" in meta["versions"]
    metrics = json.loads((workspace / "metrics/prepare.json").read_text())
    assert metrics["counts"] == manifest["counts"]


def test_demo_base_model_config_and_tokenizer(workspace):
    prepare(make_params("model.tiny.hidden_size=64", "model.tiny.num_attention_heads=2",
                        "model.tiny.num_key_value_heads=2"))
    from transformers import AutoConfig, AutoTokenizer

    base = workspace / "models/base"
    tok = AutoTokenizer.from_pretrained(base)
    cfg = AutoConfig.from_pretrained(base)
    assert cfg.model_type == "llama" and cfg.hidden_size == 64 and cfg.vocab_size == len(tok)
    assert tok.pad_token == "<pad>" and tok.eos_token == "</s>" and tok.pad_token_id != tok.eos_token_id
    assert cfg.pad_token_id == tok.pad_token_id and cfg.eos_token_id == tok.eos_token_id
    assert tok.padding_side == "left"
    ids = tok("Human: What is 17 + 5?\n\nAssistant: 22", add_special_tokens=False)["input_ids"]
    assert tok.unk_token_id not in ids
    assert tok.decode(ids) == "Human: What is 17 + 5?\n\nAssistant: 22"  # lossless round trip
    digits = tok.tokenize(" 22")
    assert digits[-2:] == ["2", "2"], "digits must be split individually"


def test_demo_task_has_mixed_quality_sft_and_correct_pairs(workspace):
    from rlhf_core.rewards import check_answer

    prepare(make_params("data.demo.n_rows=2000", "data.demo.wrong_share=0.3", "data.dedupe=false"))
    sft = pd.read_parquet(workspace / "data/prepared/sft.parquet")
    pairs = pd.read_parquet(workspace / "data/prepared/pairs.parquet")
    wrong = 1 - np.mean([check_answer(r, a) for r, a in zip(sft.response, sft.answer, strict=True)])
    assert wrong == pytest.approx(0.3, abs=0.06)
    assert all(check_answer(c, a) for c, a in zip(pairs.chosen, pairs.answer, strict=True))
    assert not any(check_answer(r, a) for r, a in zip(pairs.rejected, pairs.answer, strict=True))
    prompts = pd.read_parquet(workspace / "data/prepared/eval_prompts.parquet")
    assert prompts.answer.notna().all()
