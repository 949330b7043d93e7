"""The whole pipeline as a Prefect flow against a real `mlflow server`, checked through the MLflow client.

Covers: runs (parent + one child per stage), step metrics, registered versions and aliases, lineage tags,
the champion actor loading and generating, a re-run that skips every stage and registers nothing new, and a
stage killed mid-way that resumes on the flow's retry.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import mlflow_server, project_copy

pytestmark = pytest.mark.slow

TINY = {
    "data": {"demo": {"n_rows": 600}},
    "model": {"tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "num_key_value_heads": 2}},
    "sft": {"epochs": 1, "max_steps": 6, "save_every": 2, "micro_batch_size": 16, "log_every": 1},
    "rm": {"epochs": 1, "max_steps": 4, "micro_batch_size": 16, "log_every": 1, "ensemble": 2},
    "rlhf": {"num_steps": 2, "prompts_per_step": 8, "max_new_tokens": 4, "log_every": 1},
    "eval": {"max_prompts": 16, "max_new_tokens": 4},
    "gates": {"min_reward_gain": -1000.0, "min_win_rate_vs_champion": 0.0, "max_kl": 1.0e9, "min_accuracy": 0.0,
              "min_judge_gain": -1000.0},
    "tracking": {"system_metrics": False},
}


# Secret-looking credentials in the first run's environment: they must not leak anywhere (test below).
SECRETS = {"AWS_SECRET_ACCESS_KEY": "sk-aws-3f9a1c7e5b2d4e6f8a0b", "HF_TOKEN": "hf_Zq8XwV2nT5kLpR9sY4uB",
           "MLFLOW_TRACKING_TOKEN": "mlflow-tok-7c1e9d3b5a2f4e6c", "PREFECT_API_KEY": "pnu_8b2d4f6a1c3e5g7h9j"}


def rlhf_run(project: Path, uri: str, *args: str, extra_env: dict | None = None) -> subprocess.CompletedProcess:
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "RLHF_TRACKING": "on",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **(extra_env or {})}
    for key in ("PREFECT_API_URL", "PREFECT_HOME"):  # the embedded default: the project's .rlhf/prefect
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", "flows.cli", "run", *args], cwd=project, env=env,
                          capture_output=True, text=True, timeout=900)


@pytest.fixture(scope="module", autouse=True)
def _restore_tracking_env():
    """mlflow.set_tracking_uri exports MLFLOW_TRACKING_URI; keep it from leaking into later tests."""
    old = os.environ.get("MLFLOW_TRACKING_URI")
    yield
    if old is None:
        os.environ.pop("MLFLOW_TRACKING_URI", None)
    else:
        os.environ["MLFLOW_TRACKING_URI"] = old


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("e2e")
    project = project_copy(tmp / "project", TINY)
    with mlflow_server(tmp) as uri:
        marker = tmp / "fault-fired"
        first = rlhf_run(project, uri, extra_env={"RLHF_FAULT": f"sft:3:{marker}", **SECRETS})
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
        yield {"project": project, "uri": uri, "first": first, "marker": marker}


def test_stage_killed_midway_resumes_on_retry(pipeline):
    assert pipeline["marker"].exists(), "the injected fault never fired"
    logs = pipeline["first"].stdout + pipeline["first"].stderr
    assert "fault injected" in logs
    sft = json.loads((pipeline["project"] / "metrics/sft.json").read_text())
    assert sft.get("resumed_from_step", 0) >= 2, sft


def test_runs_metrics_versions_aliases_lineage(pipeline):
    import mlflow
    from mlflow import MlflowClient

    mlflow.set_tracking_uri(pipeline["uri"])
    client = MlflowClient()
    exp = client.get_experiment_by_name("rlhf-demo")
    runs = client.search_runs([exp.experiment_id])
    parents = [r for r in runs if r.info.run_name.startswith("pipeline-")]
    assert len(parents) == 1
    # the sft run killed by the injected fault stays behind unfinished; its retry is the finished one
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parents[0].info.run_id
                and r.info.status == "FINISHED"}
    assert {"prepare", "sft", "rm", "rlhf", "evaluate"} <= set(children)
    sft = children["sft"]
    assert len(client.get_metric_history(sft.info.run_id, "loss")) >= 3
    assert sft.data.tags["rlhf.dvc.data_prepared"].endswith(".dir")
    assert sft.data.params["sft.max_steps"] == "6"
    inputs = sft.inputs.dataset_inputs
    assert {d.dataset.name for d in inputs} >= {"sft", "eval_sft"}
    assert inputs[0].dataset.digest == sft.data.tags["rlhf.dvc.data_prepared"][:len(inputs[0].dataset.digest)]
    artifacts = {a.path for a in client.list_artifacts(sft.info.run_id, "plots")}
    assert "plots/sft_loss.png" in artifacts
    # per-prompt evidence: sampled RL responses with proxy reward and judge score, and the evaluation's answers
    samples = {a.path for a in client.list_artifacts(children["rlhf"].info.run_id, "rlhf_samples")}
    assert {"rlhf_samples/step_00001.json", "rlhf_samples/step_00002.json"} <= samples
    def table(run, path):  # what mlflow.load_table reads (that searches the active experiment; none is set here)
        tags = json.loads(run.data.tags["mlflow.loggedArtifacts"])
        assert {"path": path, "type": "table"} in tags
        return json.loads(Path(client.download_artifacts(run.info.run_id, path)).read_text())

    samples_table = table(client.get_run(children["rlhf"].info.run_id), "rlhf_samples/step_00002.json")
    assert {"prompt", "response", "proxy", "judge"} <= set(samples_table["columns"]) and samples_table["data"]
    answers = table(client.get_run(children["evaluate"].info.run_id), "eval_answers.json")
    assert len(answers["data"]) == 16
    assert {"candidate_response", "candidate_proxy", "candidate_judge"} <= set(answers["columns"])

    actor = client.get_model_version_by_alias("rlhf-demo-actor", "champion")
    assert actor.version == "1"
    assert client.get_model_version_by_alias("rlhf-demo-actor", "challenger").version == "1"
    assert client.get_model_version_by_alias("rlhf-demo-reward", "challenger").version == "1"
    assert actor.tags["rlhf.gate"] == "passed" and actor.tags["rlhf.previous_champion"] == "none"
    assert actor.tags["rlhf.gate.judge"] == "checker"
    assert actor.tags["rlhf.promotion_reason"] == "passed evaluation gate (judge: checker)"
    assert actor.tags["rlhf.input.sft"] and actor.tags["rlhf.dvc.data_prepared"]
    assert actor.tags["rlhf.pipeline_run_id"] == parents[0].info.run_id
    # "which run made this version" is one click: each model is logged in the stage run that trained it
    assert actor.run_id == children["rlhf"].info.run_id
    assert client.get_model_version("rlhf-demo-reward", "1").run_id == children["rm"].info.run_id
    # rm.ensemble: 2 through the flow: the members beside the RM, their held-out accuracy logged, the RL reward
    ensemble = json.loads((pipeline["project"] / "models/rm/ensemble.json").read_text())["members"]
    assert [m["path"] for m in ensemble] == [".", "members/1"]
    assert {"ensemble_accuracy", "member1.accuracy"} <= set(children["rm"].data.metrics)
    # the evaluation's figures are linked to the logged model
    assert actor.source.startswith("models:/m-")  # MLflow 3: the version's source is its logged model
    logged = mlflow.get_logged_model(actor.source.removeprefix("models:/"))
    linked = {m.key: m.value for m in logged.metrics}
    report = json.loads((pipeline["project"] / "reports/eval.json").read_text())
    assert linked["accuracy"] == report["candidate"]["accuracy"]
    assert linked["kl_to_reference"] == pytest.approx(report["candidate"]["kl_to_reference"])

    components = mlflow.transformers.load_model("models:/rlhf-demo-actor@champion", return_type="components")
    tok, model = components["tokenizer"], components["model"]
    ids = tok("Human: What is 2 + 3?\n\nAssistant:", return_tensors="pt", add_special_tokens=False)
    out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] > ids["input_ids"].shape[1]

    reward = mlflow.pyfunc.load_model("models:/rlhf-demo-reward@challenger")
    import pandas as pd

    assert [c.name for c in reward.metadata.signature.inputs.inputs] == ["prompt", "response", "text"]
    scores = reward.predict(pd.DataFrame({"prompt": ["Human: What is 2 + 3?\n\nAssistant:"] * 2,
                                          "response": [" 5", " 7"]}))
    assert len(scores) == 2 and all(isinstance(s, float) for s in scores)


def test_flow_run_artifacts_link_to_the_mlflow_runs_and_versions(pipeline):
    """The Prefect flow run's link artifacts open the MLflow parent run, each stage's run and each version."""
    from mlflow import MlflowClient

    project, uri = pipeline["project"], pipeline["uri"]
    script = ("import json; from prefect.client.orchestration import get_client\n"
              "with get_client(sync_client=True) as c:\n"
              "    arts = [[a.key, a.data] for a in c.read_artifacts() if (a.key or '').startswith('mlflow-')]\n"
              "print(json.dumps(arts))")
    env = {**os.environ, "PREFECT_HOME": str(project / ".rlhf/prefect"),
           "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS": "300"}
    env.pop("PREFECT_API_URL", None)
    proc = subprocess.run([sys.executable, "-c", script], cwd=project, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # a link artifact's data is the markdown link "[title](url)"
    links = {key: data.rsplit("(", 1)[1].rstrip(")") for key, data in json.loads(proc.stdout.strip().splitlines()[-1])}
    assert "mlflow-pipeline-run" in links, (links, pipeline["first"].stdout[-3000:] + pipeline["first"].stderr[-3000:])
    client = MlflowClient(uri)
    parents = client.search_runs([client.get_experiment_by_name("rlhf-demo").experiment_id],
                                 "tags.`rlhf.stage` = 'pipeline'")
    parent_ids = {r.info.run_id for r in parents}
    assert links["mlflow-pipeline-run"].startswith(f"{uri}/#/experiments/")
    assert links["mlflow-pipeline-run"].rsplit("/", 1)[1] in parent_ids
    for stage in ("prepare", "sft", "rm", "rlhf", "evaluate"):
        run_id = links[f"mlflow-run-{stage}"].rsplit("/", 1)[1]
        run = client.get_run(run_id)
        assert run.data.tags["rlhf.stage"] == stage and run.data.tags["mlflow.parentRunId"] in parent_ids
    assert links["mlflow-model-actor"] == f"{uri}/#/models/rlhf-demo-actor/versions/1"


def test_no_secret_from_the_environment_leaks(pipeline, tmp_path):
    """Credentials in the flow's environment appear in no MLflow param, tag, metric name or artifact, no Prefect
    log line, no file the run wrote into the project, and no rendered stage Job."""
    from mlflow import MlflowClient

    project, uri = pipeline["project"], pipeline["uri"]
    values = list(SECRETS.values())
    found: list[str] = []

    def scan(where: str, text: str) -> None:
        found.extend(f"{where}: {v[:6]}..." for v in values if v in text)

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name("rlhf-demo")
    for run in client.search_runs([exp.experiment_id]):
        scan(f"run {run.info.run_name} params/tags/metrics",
             json.dumps([run.data.params, run.data.tags, list(run.data.metrics)]))
        local = Path(client.download_artifacts(run.info.run_id, "", str(tmp_path / run.info.run_id)))
        for f in local.rglob("*"):
            if f.is_file():
                scan(f"artifact {f.relative_to(tmp_path)}", f.read_bytes().decode("utf-8", "replace"))
    for version in client.search_model_versions("name LIKE 'rlhf-demo-%'"):
        scan(f"version {version.name} v{version.version}", json.dumps([version.tags, version.description or ""]))
    for f in project.rglob("*"):  # workspace, models, reports, the embedded Prefect database and its logs
        if f.is_file() and f.stat().st_size < 200_000_000 and f.relative_to(project).parts[0] != "tests":
            scan(f"file {f.relative_to(project)}", f.read_bytes().decode("utf-8", "replace"))
    scan("rlhf run output", pipeline["first"].stdout + pipeline["first"].stderr)
    from tasks.k8s.options import StageJobOptions
    from tasks.k8s.render import render_stage_job

    scan("rendered Job", json.dumps(render_stage_job(StageJobOptions("rlhf", env={"RLHF_PARENT_RUN_ID": "x"}))))
    assert not found, found


def test_rerun_skips_every_stage_and_registers_nothing(pipeline):
    import compileall

    from mlflow import MlflowClient

    # every module imported in between writes bytecode beside the directory deps (rlhf_core/engine, ...): as
    # `make test`, `rlhf bench` or a notebook would; .dvcignore keeps it out of the stages' inputs
    assert compileall.compile_dir(pipeline["project"] / "rlhf_core", quiet=1, force=True)
    assert list((pipeline["project"] / "rlhf_core/engine/__pycache__").glob("*.pyc"))
    again = rlhf_run(pipeline["project"], pipeline["uri"])
    assert again.returncode == 0, again.stderr[-4000:]
    out = again.stdout + again.stderr
    for stage in ("prepare", "sft", "rm", "rlhf"):
        assert f"stage {stage} skipped" in out, stage
    # the first run promoted v1, so evaluate re-runs once against the new champion (DVC cannot see the registry)
    assert "stage evaluate ran" in out
    client = MlflowClient(pipeline["uri"])
    assert [v.version for v in client.search_model_versions("name='rlhf-demo-actor'")] == ["1"]
