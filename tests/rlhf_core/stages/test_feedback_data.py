"""Feedback rounds' pairs, hand-checked: drawing pairs of distinct answers, the simulated annotator and its
noise, the label import's bad inputs (error naming file:line, or dropped and counted), replay proportions."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.config import load_params
from rlhf_core.data.feedback import (
    checker_choices,
    dotted,
    draw_pairs,
    labelled_rows,
    read_labels,
    replay_indices,
)
from rlhf_core.data.readers import DataError
from rlhf_core.stages import IDLE


def test_pairs_are_drawn_among_distinct_answers_only():
    responses = [[" 3", " 3", " 4", " 5"], [" 7", " 7", " 7", " 7"], [" 1", " 2", " 1", " 2"]]
    pairs = draw_pairs(2, ["p0", "p1", "p2"], responses, pairs_per_prompt=5, rng=random.Random(0))
    by_prompt = {p: [x for x in pairs if x["prompt_index"] == p] for p in range(3)}
    assert len(by_prompt[0]) == 3  # C(3 distinct, 2)
    assert by_prompt[1] == []  # one distinct answer: nothing to compare
    assert len(by_prompt[2]) == 1
    for pair in pairs:
        assert pair["response_a"] != pair["response_b"] and pair["pair_id"].startswith(f"r2-p{pair['prompt_index']}-")
    assert len({p["pair_id"] for p in pairs}) == len(pairs)
    capped = draw_pairs(2, ["p0"], responses[:1], pairs_per_prompt=1, rng=random.Random(0))
    assert len(capped) == 1


def test_checker_prefers_the_right_answer_ties_otherwise_and_noise_flips():
    choices, flipped = checker_choices([True, False, True, False], [False, True, True, False], 0.0, random.Random(0))
    assert choices == ["a", "b", "tie", "tie"] and flipped == 0
    n = 4000
    noisy, flipped = checker_choices([True] * n, [False] * n, 0.2, random.Random(1))
    assert flipped == noisy.count("b") and abs(flipped / n - 0.2) < 0.02


def test_labelled_rows_drop_ties_and_unlabelled_and_count_them():
    pairs = [{"pair_id": i, "prompt": "q", "response_a": f"a{i}", "response_b": f"b{i}"} for i in ("x", "y", "z", "w")]
    rows, dropped = labelled_rows(pairs, {"x": "a", "y": "b", "z": "tie"})
    assert rows == [{"id": "x", "prompt": "q", "chosen": "ax", "rejected": "bx"},
                    {"id": "y", "prompt": "q", "chosen": "by", "rejected": "ay"}]
    assert dropped == {"tie": 1, "unlabelled": 1}


def _write(path, lines):
    path.write_text("".join((line if isinstance(line, str) else json.dumps(line)) + "\n" for line in lines))
    return path


COLS = {"id": "pair_id", "choice": "choice"}
KNOWN = {"r1-p0-0-1", "r1-p1-0-2", "r1-p2-1-3"}


@pytest.mark.parametrize(("line", "message", "reason"), [
    ('{"pair_id": "r1-p0-0-1", "choice": ', "labels.jsonl:2: malformed JSON", "malformed_json"),
    ({"pair_id": "r9-p0-0-1", "choice": "a"}, "labels.jsonl:2: unknown pair id 'r9-p0-0-1'", "unknown_pair"),
    ({"pair_id": "r1-p1-0-2"}, "labels.jsonl:2: no 'choice' in the label line", "missing_key"),
    ({"pair_id": "r1-p1-0-2", "choice": "both"}, "labels.jsonl:2: choice 'both' for r1-p1-0-2", "invalid_choice"),
])
def test_bad_label_lines_name_file_and_line_or_are_dropped_and_counted(tmp_path, line, message, reason):
    path = _write(tmp_path / "labels.jsonl", [{"pair_id": "r1-p0-0-1", "choice": "a"}, line])
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_labels(path, COLS, KNOWN, drop=False)
    choices, dropped = read_labels(path, COLS, KNOWN, drop=True)
    assert choices == {"r1-p0-0-1": "a"} and dropped == {reason: 1}


def test_contradictory_labels_name_both_lines_or_drop_the_pair(tmp_path):
    path = _write(tmp_path / "labels.jsonl", [
        {"pair_id": "r1-p0-0-1", "choice": "a"}, {"pair_id": "r1-p1-0-2", "choice": "B"},
        {"pair_id": "r1-p0-0-1", "choice": "a"},  # the same label twice agrees: kept once
        {"pair_id": "r1-p1-0-2", "choice": "a"}])
    with pytest.raises(DataError, match=r"labels.jsonl:4: pair r1-p1-0-2 labelled 'a' here and 'b' at "
                                        r".*labels.jsonl:2: contradictory"):
        read_labels(path, COLS, KNOWN, drop=False)
    choices, dropped = read_labels(path, COLS, KNOWN, drop=True)
    assert choices == {"r1-p0-0-1": "a"} and dropped == {"contradictory": 1}


def test_label_studio_shaped_export_maps_through_dotted_columns(tmp_path):
    export = {"data": {"pair_id": "r1-p2-1-3"}, "annotations": [{"result": [{"value": {"choices": ["b"]}}]}]}
    path = _write(tmp_path / "ls.jsonl", [export])
    cols = {"id": "data.pair_id", "choice": "annotations.0.result.0.value.choices.0"}
    assert read_labels(path, cols, KNOWN, drop=False)[0] == {"r1-p2-1-3": "b"}
    with pytest.raises(KeyError, match="7"):
        dotted(export, "annotations.7")
    with pytest.raises(DataError, match="label file not found"):
        read_labels(tmp_path / "missing.jsonl", cols, KNOWN, drop=False)


def test_replay_takes_the_share_without_replacement_reproducibly():
    picked = replay_indices(2160, 0.1, seed=3)
    assert len(picked) == 216 and len(set(picked)) == 216 and all(0 <= i < 2160 for i in picked)
    assert picked == replay_indices(2160, 0.1, seed=3) and picked != replay_indices(2160, 0.1, seed=4)
    assert replay_indices(10, 0.0, 1) == [] and replay_indices(10, 1.0, 1) == list(range(10))


def test_the_workspace_actor_is_snapshotted_sealed_with_its_source_named(tmp_path):
    """feedback.policy: workspace copies models/actor under the round with its meta naming the source; the
    copy is edited and sealed before it is renamed into place, so it loads checked and the source is untouched."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.ops import paths
    from rlhf_core.ops.integrity import MODEL_MANIFEST, seal_model_dir, verify_model_dir
    from rlhf_core.ops.meta import write_meta
    from rlhf_core.ops.paths import start_dir
    from rlhf_core.stages.feedback import snapshot_start
    from tests.conftest import make_params

    src = tmp_path / paths.ACTOR_MODEL
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=2)).save_pretrained(src)
    write_meta(src, {"stage": "rlhf"})
    seal_model_dir(src)
    source_manifest = (src / MODEL_MANIFEST).read_text()

    snapshot_start(make_params("feedback.policy=workspace", "feedback.rm_init=sft"), tmp_path, 1)
    actor = start_dir(tmp_path, 1, "actor")
    meta = json.loads((actor / "rlhf_meta.json").read_text())
    assert meta["stage"] == "rlhf" and meta["source"] == str(paths.ACTOR_MODEL)
    verify_model_dir(actor)  # the manifest covers the edited meta
    load_causal_lm(actor)
    assert (src / MODEL_MANIFEST).read_text() == source_manifest and "source" not in json.loads(
        (src / "rlhf_meta.json").read_text())
    assert not list(actor.parent.glob(".*tmp*"))  # no temp copy left beside it


def test_round_zero_writes_its_metrics_and_opens_no_mlflow_run(tmp_path):
    """The base pipeline's feedback stage (round 0) collects nothing: its metrics file says so and it opens no
    MLflow run (the store is never touched); a round that collects is not idle."""
    repo = Path(__file__).resolve().parents[3]
    db = tmp_path / "mlflow.db"
    (tmp_path / "params.yaml").write_text("project: {name: idle}\n")
    env = {**os.environ, "RLHF_TRACKING": "on", "MLFLOW_TRACKING_URI": f"sqlite:///{db}", "PYTHONPATH": str(repo)}
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "stage", "feedback"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads((tmp_path / "metrics/feedback.json").read_text()) == {"round": 0, "collected": False}
    assert not db.exists()
    assert not IDLE["feedback"](load_params(tmp_path / "params.yaml", ["feedback.round=1"]))
