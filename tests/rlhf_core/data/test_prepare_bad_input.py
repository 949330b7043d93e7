"""Bad input: structural problems name file:line; per-row problems are dropped and counted."""

from __future__ import annotations

import pandas as pd
import pytest

from rlhf_core.data.readers import DataError
from rlhf_core.stages.prepare import prepare
from tests.conftest import make_params, write_jsonl

QUESTIONS = [f"Question number {i} about apples and pears?" for i in range(30)]


def mixed(path: str, *overrides: str, **data):
    return make_params(*overrides, base={"data": {"source": "mixed", "sources": [{"path": path}],
                                                 "data_split": [1, 1, 1], **data}})


def good_rows():
    return [{"prompt": q, "chosen": " good", "rejected": " bad", "response": " ok"} for q in QUESTIONS]


def test_malformed_json_line_names_file_and_line(workspace):
    write_jsonl(workspace / "d.jsonl", good_rows()[:3], raw_lines=[b'{"prompt": "x", "chosen": '])
    with pytest.raises(DataError, match=r"d\.jsonl:4: malformed JSON: Expecting value"):
        prepare(mixed("d.jsonl"))


def test_non_object_line_names_file_and_line(workspace):
    write_jsonl(workspace / "d.jsonl", good_rows()[:2], raw_lines=[b"[1, 2]"])
    with pytest.raises(DataError, match=r"d\.jsonl:3: expected a JSON object, got list"):
        prepare(mixed("d.jsonl"))


def test_non_utf8_names_file_and_line(workspace):
    write_jsonl(workspace / "d.jsonl", good_rows()[:5], raw_lines=[b'{"prompt": "caf\xe9 ?", "response": " x"}'])
    with pytest.raises(DataError, match=r"d\.jsonl:6: not valid UTF-8"):
        prepare(mixed("d.jsonl"))


def test_non_utf8_in_json_file_names_line(workspace):
    (workspace / "d.json").write_bytes(b'[\n{"prompt": "a", "response": " b"},\n{"prompt": "\xff"}\n]')
    with pytest.raises(DataError, match=r"d\.json:3: not valid UTF-8"):
        prepare(mixed("d.json"))


def test_malformed_lines_dropped_and_counted_when_configured(workspace):
    write_jsonl(workspace / "d.jsonl", good_rows(),
                raw_lines=[b"{broken", b'{"prompt": "caf\xe9"}', b'"just a string"'])
    manifest = prepare(mixed("d.jsonl", on_malformed="drop"))
    assert manifest["dropped"] == {"malformed_json": 2, "non_utf8": 1}
    assert sum(manifest["counts"].values()) == 30


def test_missing_and_empty_fields_and_identical_pair_are_counted(workspace):
    rows = good_rows()
    rows += [{"prompt": "", "chosen": " a", "rejected": " b"},            # empty prompt
             {"prompt": "   ", "chosen": " a", "rejected": " b"},         # whitespace-only prompt
             {"prompt": "p1", "chosen": " same", "rejected": " same"},    # chosen == rejected
             {"prompt": "p2", "chosen": " a", "rejected": " same "},      # fine
             {"chosen": " a", "rejected": " b"},                           # no prompt -> hh without tag
             {"prompt": "p3", "chosen": None, "rejected": " b"},          # prompt-only, chosen null
             {"prompt": 5, "response": " r"}]                               # prompt not text
    write_jsonl(workspace / "d.jsonl", rows)
    manifest = prepare(mixed("d.jsonl", "data.dedupe=false"))
    d = manifest["dropped"]
    assert d.get("empty_field") == 2
    assert d.get("chosen_equals_rejected") == 1
    assert d.get("invalid_hh") == 1
    assert d.get("missing_field") == 1
    # p3 is a valid prompt-only row: it cannot serve SFT or pairs if it lands there
    kept = sum(manifest["counts"].values())
    assert kept + sum(v for k, v in d.items() if ":" in k) == 32


def test_left_truncation_keeps_the_end_of_the_prompt(workspace):
    long_prompt = "alpha beta gamma delta " * 10 + "final words?"
    rows = [{"prompt": f"{i} {long_prompt}", "response": " ok", "chosen": " a", "rejected": " b"} for i in range(30)]
    write_jsonl(workspace / "d.jsonl", rows)
    manifest = prepare(mixed("d.jsonl", "data.max_prompt_len=6", "data.dedupe=false"))
    sft = pd.read_parquet(workspace / "data/prepared/sft.parquet")
    assert sft.prompt.str.endswith("final words?").all()
    assert (sft.prompt.str.len() < 40).all()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(workspace / "models/base")
    assert all(len(tok(p, add_special_tokens=False)["input_ids"]) <= 6 for p in sft.prompt)
    assert manifest["modified"]["sft:prompt_truncated_left"] == manifest["counts"]["sft"] + manifest["counts"][
        "eval_sft"]
    assert manifest["token_stats"]["sft"]["prompt"]["max"] == 6


def test_overlong_prompts_dropped_when_configured(workspace):
    rows = good_rows() + [{"prompt": "word " * 80, "response": " r", "chosen": " a", "rejected": " b"}] * 3
    write_jsonl(workspace / "d.jsonl", rows)
    manifest = prepare(mixed("d.jsonl", "data.max_prompt_len=20", "data.truncation=drop", "data.dedupe=false"))
    dropped = sum(v for k, v in manifest["dropped"].items() if k.endswith("prompt_too_long"))
    assert dropped == 3


def test_overlong_responses_are_dropped_and_counted(workspace):
    rows = good_rows()
    rows[0]["response"] = rows[0]["chosen"] = " many many words " * 20
    write_jsonl(workspace / "d.jsonl", rows)
    files = {ph: {"path": "d.jsonl"} for ph in ("sft", "pairs", "prompts")}
    manifest = prepare(make_params("data.max_response_len=4", base={"data": {"source": "per_phase", "files": files}}))
    assert manifest["dropped"] == {"sft:response_too_long": 1, "pairs:response_too_long": 1}
    assert manifest["counts"]["prompts"] + manifest["counts"]["eval_prompts"] == 30


def test_empty_after_filtering_is_an_error(workspace):
    rows = [{"prompt": f"q{i}", "chosen": " same", "rejected": " same"} for i in range(20)]
    write_jsonl(workspace / "d.jsonl", rows)
    with pytest.raises(DataError, match=r"phase 'sft' has 0 rows after filtering .* chosen_equals_rejected=20"):
        prepare(mixed("d.jsonl"))
    assert not (workspace / "data" / "prepared").exists()  # an empty result never becomes an output


def test_missing_file_and_unsupported_type(workspace):
    with pytest.raises(DataError, match=r"nope\.jsonl: no such data file"):
        prepare(mixed("nope.jsonl"))
    (workspace / "d.txt").write_text("x")
    with pytest.raises(DataError, match=r"d\.txt: unsupported file type '\.txt'"):
        prepare(mixed("d.txt"))


def test_per_phase_requires_every_phase(workspace):
    write_jsonl(workspace / "d.jsonl", good_rows())
    params = make_params(base={"data": {"source": "per_phase", "files": {"sft": {"path": "d.jsonl"}}}})
    with pytest.raises(DataError, match=r"data\.files\.pairs: `source: per_phase` needs a source"):
        prepare(params)
