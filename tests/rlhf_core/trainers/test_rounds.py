"""Continuous RLHF rounds through the real flow, a real `mlflow server` and DVC.

Round 0 (the base pipeline) and round 1 run with ``rlhf run --rounds 1``. Round 2 uses the file annotator and a
gate made to fail: its first run exports the pairs and stops (the round is left started); the annotators' labels
are written and the next ``rlhf run --rounds 1`` resumes round 2 rather than starting round 3; its gate fails, so
the champion stays (a later round starts from the ``champion`` alias again: round 2 itself started from it).
"""

from __future__ import annotations

import csv
import json

import pytest

from flows.rounds import plan_rounds
from tests.flows.test_pipeline_e2e import rlhf_run
from tests.rlhf_core.rewards.test_reward_hacking import TINY
from tests.servers import mlflow_server, project_copy

ROUNDS = {**TINY,
          "sft": {**TINY["sft"], "epochs": 10},  # the flow is what is tested here, not how well SFT learns
          "rlhf": {**TINY["rlhf"], "algorithm": "grpo", "reward_fns": {"rm": 1.0}, "num_steps": 3},
          "rm": {"epochs": 3},
          "eval": {**TINY["eval"], "max_prompts": 48},
          "feedback": {"prompts_per_round": 48, "samples_per_prompt": 4, "pairs_per_prompt": 2, "rl_steps": 2}}


def test_plan_resumes_an_unfinished_round_and_never_reruns_a_finished_one():
    assert plan_rounds([], 2) == [0, 1, 2]
    done = [{"round": 0, "status": "finished"}, {"round": 1, "status": "finished"}]
    assert plan_rounds(done, 1) == [2]
    assert plan_rounds([*done, {"round": 2, "status": "started"}], 1) == [2]
    assert plan_rounds([*done, {"round": 2, "status": "started"}], 3) == [2, 3, 4]
    assert plan_rounds([{"round": 0, "status": "started"}], 1) == [0, 1]


def _plot_rows(project) -> list[dict]:
    return list(csv.DictReader((project / "plots/rounds.csv").read_text().splitlines()))


def _ledger(project) -> dict[int, dict]:
    return {r["round"]: r for r in json.loads((project / ".rlhf/rounds.json").read_text())["rounds"]}


@pytest.mark.slow
def test_rounds_gate_resume_and_the_file_annotator(tmp_path):
    from mlflow import MlflowClient

    project = project_copy(tmp_path / "project", ROUNDS)
    with mlflow_server(tmp_path) as uri:
        client = MlflowClient(uri)
        first = rlhf_run(project, uri, "--rounds", "1")
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
        ledger = _ledger(project)
        assert sorted(ledger) == [0, 1] and all(r["status"] == "finished" for r in ledger.values())
        manifest = json.loads((project / "data/feedback/round_1/manifest.json").read_text())
        assert manifest["policy"] == "models:/rlhf-demo-actor/1" and manifest["counts"]["labelled"] > 0
        assert manifest["label_agreement_with_checker"] == 1.0  # the checker annotator without noise
        rm = json.loads((project / "metrics/rm.json").read_text())
        assert rm["round"] == 1 and rm["n_train_new"] == manifest["counts"]["labelled"]
        assert rm["n_train_replay"] == round(0.1 * rm["n_train_replay_pool"])
        actor_meta = json.loads((project / "models/actor/rlhf_meta.json").read_text())
        assert actor_meta["actor_init"] == "data/feedback/round_1/start/actor" and actor_meta["feedback_round"] == 1
        rows = _plot_rows(project)
        assert [r["round"] for r in rows] == ["0", "1"] and rows[1]["judge_accuracy"]
        tagged = client.search_runs([client.get_experiment_by_name("rlhf-demo").experiment_id],
                                    "tags.`rlhf.round` = '1'")
        assert tagged and "round.judge_accuracy" in tagged[0].data.metrics
        champion = client.get_model_version_by_alias("rlhf-demo-actor", "champion").version

        labels = project / "data/feedback/round_2/labels.jsonl"
        refuse = ("-S", "gates.min_judge_gain=1.0", "-S", "feedback.annotator=file")
        waiting = rlhf_run(project, uri, "--rounds", "1", *refuse)
        said = " ".join((waiting.stdout + waiting.stderr).split())  # the console wraps long lines
        assert waiting.returncode == 1 and "waiting for their labels in data/feedback/round_2/labels.jsonl" in said
        assert _ledger(project)[2]["status"] == "started"
        pairs = [json.loads(line) for line in (project / "data/feedback/round_2/pairs.jsonl").read_text().splitlines()]
        # the annotators prefer the first answer, except one pair they call a tie
        labels.write_text("".join(json.dumps({"pair_id": p["pair_id"], "choice": "tie" if i == 0 else "a"}) + "\n"
                                  for i, p in enumerate(pairs)))
        resumed = rlhf_run(project, uri, "--rounds", "1", *refuse)
        assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
        ledger = _ledger(project)
        assert sorted(ledger) == [0, 1, 2] and ledger[2]["status"] == "finished"
        assert ledger[2]["gate_passed"] is False
        assert client.get_model_version_by_alias("rlhf-demo-actor", "champion").version == champion
        m2 = json.loads((project / "data/feedback/round_2/manifest.json").read_text())
        assert m2["policy"] == f"models:/rlhf-demo-actor/{champion}"
        assert m2["counts"]["labelled"] == len(pairs) - 1 and m2["counts"]["dropped_tie"] == 1
        assert len(_plot_rows(project)) == 3
