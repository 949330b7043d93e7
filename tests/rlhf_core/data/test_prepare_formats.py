"""Each supported input format, normalised by the prepare stage."""

from __future__ import annotations

import json

import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from rlhf_core.stages.prepare import prepare
from tests.conftest import make_params, write_jsonl

QUESTIONS = [f"What is {a} plus {b}?" for a in range(6) for b in range(5)]  # 30 distinct prompts


def per_phase(sft: str, pairs: str, prompts: str, *overrides: str, fmt: dict | None = None):
    fmt = fmt or {}
    files = {ph: {"path": p, "format": fmt.get(ph, "auto")} for ph, p in (("sft", sft), ("pairs", pairs),
                                                                        ("prompts", prompts))}
    return make_params(*overrides, base={"data": {"source": "per_phase", "files": files}})


def read(ws, name):
    return pd.read_parquet(ws / "data" / "prepared" / f"{name}.parquet")


@pytest.fixture
def std_files(workspace):
    """SFT as JSONL, pairs as CSV, prompts as Parquet."""
    write_jsonl(workspace / "sft.jsonl", [{"prompt": q, "response": " fine answer"} for q in QUESTIONS])
    pd.DataFrame({"prompt": QUESTIONS, "chosen": [" good"] * 30, "rejected": [" bad"] * 30}).to_csv(
        workspace / "pairs.csv", index=False)
    pq.write_table(pa.table({"prompt": QUESTIONS, "answer": [str(i) for i in range(30)]}),
                   workspace / "prompts.parquet")
    return workspace


def test_jsonl_csv_parquet(std_files):
    manifest = prepare(per_phase("sft.jsonl", "pairs.csv", "prompts.parquet"))
    ws = std_files
    assert manifest["counts"]["sft"] + manifest["counts"]["eval_sft"] == 30
    assert manifest["dropped_total"] == 0
    sft, pairs, prompts = read(ws, "sft"), read(ws, "pairs"), read(ws, "prompts")
    assert list(sft.columns) == ["id", "prompt", "response", "answer", "source"]
    assert set(sft.response) == {" fine answer"}
    assert set(pairs.chosen) == {" good"} and set(pairs.rejected) == {" bad"}
    assert prompts.answer.notna().all() and (prompts.source == "prompts.parquet").all()
    assert manifest["hashes"].keys() == {f"{p}{n}.parquet" for n in ("sft", "pairs", "prompts") for p in ("", "eval_")}


def test_json_messages_rendered_with_chat_template(std_files):
    ws = std_files
    rows = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q},
                          {"role": "assistant", "content": "ok then"}]} for q in QUESTIONS]
    (ws / "chat.json").write_text(json.dumps(rows))
    prepare(per_phase("chat.json", "pairs.csv", "prompts.parquet"))
    sft = pd.concat([read(ws, "sft"), read(ws, "eval_sft")])
    row = sft[sft.prompt.str.contains("What is 0 plus 0?", regex=False)].iloc[0]
    assert row.prompt == "Be brief.\n\nHuman: What is 0 plus 0?\n\nAssistant:"
    assert row.response == "ok then"


def test_pairwise_messages_need_the_same_prompt(std_files):
    ws = std_files

    def conv(q, a):
        return [{"role": "user", "content": q}, {"role": "assistant", "content": a}]

    rows = [{"chosen": conv(q, "yes"), "rejected": conv(q, "no")} for q in QUESTIONS]
    rows.append({"chosen": conv("one question", "yes"), "rejected": conv("another question", "no")})
    write_jsonl(ws / "chatpairs.jsonl", rows)
    manifest = prepare(per_phase("sft.jsonl", "chatpairs.jsonl", "prompts.parquet"))
    assert manifest["dropped"] == {"prompt_mismatch": 1}
    pairs = read(ws, "pairs")
    assert pairs.prompt.str.endswith("\n\nAssistant:").all() and set(pairs.chosen) == {"yes"}


def test_hh_transcripts_split_at_last_assistant(std_files):
    ws = std_files
    rows = [{"chosen": f"\n\nHuman: hi\n\nAssistant: hello\n\nHuman: {q}\n\nAssistant: right",
             "rejected": f"\n\nHuman: hi\n\nAssistant: hello\n\nHuman: {q}\n\nAssistant: wrong"} for q in QUESTIONS]
    rows.append({"chosen": "no assistant tag here", "rejected": "nor here"})
    write_jsonl(ws / "hh.jsonl", rows)
    manifest = prepare(per_phase("sft.jsonl", "hh.jsonl", "prompts.parquet", fmt={"pairs": "hh"}))
    assert manifest["dropped"] == {"invalid_hh": 1}
    pairs = pd.concat([read(ws, "pairs"), read(ws, "eval_pairs")])
    row = pairs[pairs.prompt.str.contains("What is 1 plus 2?", regex=False)].iloc[0]
    assert row.prompt == "\n\nHuman: hi\n\nAssistant: hello\n\nHuman: What is 1 plus 2?\n\nAssistant:"
    assert (row.chosen, row.rejected) == (" right", " wrong")


def test_column_mapping(workspace):
    write_jsonl(workspace / "qa.jsonl", [{"question": q, "reply": " yes", "good": " a", "bad": " b", "gold": "7"}
                                         for q in QUESTIONS])
    params = make_params(base={"data": {
        "source": "mixed", "sources": [{"path": "qa.jsonl"}], "data_split": [1, 1, 1],
        "columns": {"prompt": "question", "response": "reply", "chosen": "good", "rejected": "bad",
                    "answer": "gold"}}})
    manifest = prepare(params)
    assert sum(manifest["counts"].values()) == 30
    pairs = read(workspace, "pairs")
    assert set(pairs.chosen) == {" a"} and set(pairs.answer) == {"7"}


def test_hf_dataset_from_local_paths(workspace):
    """The real `datasets` loading code, pointed at local folders (the hub is unreachable here)."""
    import datasets

    datasets.Dataset.from_dict({"prompt": QUESTIONS, "response": [" r"] * 30}).save_to_disk(str(workspace / "saved"))
    (workspace / "raw").mkdir()
    write_jsonl(workspace / "raw" / "train.jsonl", [{"prompt": q, "chosen": " c", "rejected": " r"} for q in QUESTIONS])
    files = {"sft": {"hf_id": str(workspace / "saved")},
             "pairs": {"hf_id": str(workspace / "raw"), "hf_split": "train"},
             "prompts": {"hf_id": str(workspace / "saved")}}
    manifest = prepare(make_params(base={"data": {"source": "per_phase", "files": files}}))
    assert manifest["counts"]["pairs"] + manifest["counts"]["eval_pairs"] == 30
    assert any(s.startswith("hf:") for s in manifest["source"])
    assert set(read(workspace, "pairs").source) == {f"hf:{workspace / 'raw'}[train]"}


def test_mixed_pairwise_source_feeds_all_phases(workspace):
    """DeepSpeed-Chat style: one pairwise dataset split 2/4/4; SFT trains on `chosen`."""
    write_jsonl(workspace / "pw.jsonl", [{"prompt": q, "chosen": " good", "rejected": " bad"} for q in QUESTIONS])
    manifest = prepare(make_params(base={"data": {"source": "mixed", "sources": [{"path": "pw.jsonl"}]}}))
    c = manifest["counts"]
    assert (c["sft"] + c["eval_sft"], c["pairs"] + c["eval_pairs"], c["prompts"] + c["eval_prompts"]) == (6, 12, 12)
    assert set(read(workspace, "sft").response) == {" good"}
