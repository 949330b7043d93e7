"""Stage Jobs under DVC against a remote (``dvc_remote``): what they run, what they refuse, how the flow reads
their outcome; and ``$RLHF_LAUNCH``, which lets DVC's one ``rlhf stage`` command run several processes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rlhf_core.ops.dvc_remote import STATE_DIR
from rlhf_core.ops.launch import LAUNCH_ENV, relaunch_command
from tasks.k8s.options import StageJobOptions, StageJobSettings, pipeline_dvc_remote
from tasks.k8s.render import render_stage_job
from tasks.k8s.render_operators import RENDERERS
from tasks.stages import kubernetes_stage
from tests.tasks.k8s.test_k8s_jobs import COMPLETE, RUNNING, FakeCluster, apis, pod

REMOTE = "s3://ml-artifacts/rlhf"


def container(opts: StageJobOptions) -> dict:
    return render_stage_job(opts)["spec"]["template"]["spec"]["containers"][0]


def env_of(opts: StageJobOptions) -> dict:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(opts)["env"]}


def test_a_stage_under_a_remote_runs_rlhf_repro_with_the_object_store_env():
    assert container(StageJobOptions("sft", dvc_remote=REMOTE))["command"] == [
        "rlhf", "repro", "sft", "--remote", REMOTE, "--params", "params.yaml"]  # the seeded ConfigMap copy
    flow_job = StageJobOptions("sft", dvc_remote=REMOTE, seed_params=False)
    assert container(flow_job)["command"] == ["rlhf", "repro", "sft", "--remote", REMOTE]  # params: the remote's
    env = env_of(flow_job)
    assert env["AWS_ACCESS_KEY_ID"]["secretKeyRef"] == {"name": "rlhf-credentials", "key": "AWS_ACCESS_KEY_ID",
                                                         "optional": True}
    assert env["AWS_ENDPOINT_URL"]["configMapKeyRef"]["optional"] is True  # MinIO; absent on AWS itself
    assert LAUNCH_ENV not in env
    assert "AWS_ACCESS_KEY_ID" not in env_of(StageJobOptions("sft"))  # no remote, no object-store credentials


def test_several_processes_under_a_remote_go_through_rlhf_launch():
    env = env_of(StageJobOptions("rm", gpus=4, dvc_remote=REMOTE))
    assert env[LAUNCH_ENV] == "python -m rlhf_core.ops.launch --shutdown-timeout=870 --standalone --nproc_per_node=4"
    assert container(StageJobOptions("rm", gpus=4, dvc_remote=REMOTE))["command"][:3] == ["rlhf", "repro", "rm"]


@pytest.mark.parametrize("kind", ["pytorchjob", "trainjob"])
def test_the_multi_node_kinds_refuse_a_remote(kind):
    with pytest.raises(ValueError, match="in one pod"):
        RENDERERS[kind](StageJobOptions("sft", gpus=8, nnodes=2, name="big", dvc_remote=REMOTE))


def test_a_multi_node_job_under_a_remote_is_refused():
    with pytest.raises(ValueError, match="nnodes > 1"):
        StageJobOptions("sft", gpus=8, nnodes=2, dvc_remote=REMOTE)


def test_the_remote_is_the_pipelines_not_a_stages():
    assert pipeline_dvc_remote({"dvc_remote": REMOTE}, None) == REMOTE
    assert pipeline_dvc_remote(StageJobSettings(dvc_remote=REMOTE), {"rm": {"gpus": 2}}) == REMOTE
    assert pipeline_dvc_remote(None, None) is None
    with pytest.raises(ValueError, match=r"k8s_stages\['rm'\].dvc_remote"):
        pipeline_dvc_remote({"dvc_remote": REMOTE}, {"rm": {"dvc_remote": "s3://other/x"}})


def test_rlhf_launch_re_executes_the_stage_under_the_launcher_once(tmp_path):
    record = tmp_path / "argv.json"
    fake_launcher = tmp_path / "launcher.py"
    fake_launcher.write_text("import json, os, sys\n"
                             f"json.dump([sys.argv[1:], os.environ.get({LAUNCH_ENV!r})], open({str(record)!r}, 'w'))\n")
    env = {**os.environ, LAUNCH_ENV: f"{sys.executable} {fake_launcher}"}
    env.pop("LOCAL_RANK", None)
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "stage", "prepare", "-p", "x.yaml"], env=env,
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    argv, inherited = json.loads(record.read_text())
    assert argv == ["-m", "rlhf_core.cli", "stage", "prepare", "-p", "x.yaml"]
    assert inherited is None  # the workers never relaunch


def test_relaunch_command_is_none_in_a_worker_or_without_a_launcher(monkeypatch):
    monkeypatch.delenv(LAUNCH_ENV, raising=False)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert relaunch_command(["stage", "sft"]) is None
    monkeypatch.setenv(LAUNCH_ENV, "python -m rlhf_core.ops.launch --nproc_per_node=2")
    assert relaunch_command(["stage", "sft"]) == ["python", "-m", "rlhf_core.ops.launch", "--nproc_per_node=2", "-m",
                                                  "rlhf_core.cli", "stage", "sft"]
    monkeypatch.setenv("LOCAL_RANK", "0")
    assert relaunch_command(["stage", "sft"]) is None


@pytest.mark.parametrize("pod_log,status", [
    ("2025-01-01T00:00:01Z Running stage 'sft':\n2025-01-01T00:00:02Z sft ran\n", "ran"),
    ("2025-01-01T00:00:01Z Data and pipelines are up to date.\n2025-01-01T00:00:02Z sft skipped\n", "skipped"),
])
def test_the_flow_reads_ran_or_skipped_from_the_pod_and_fetches_the_state(tmp_path, pod_log, status):
    remote = tmp_path / "remote"  # a local folder is a remote too (fsspec): the state the pod left
    (remote / STATE_DIR / "metrics").mkdir(parents=True)
    (remote / STATE_DIR / "metrics" / "sft.json").write_text('{"eval_loss": 1.5}')
    (remote / STATE_DIR / "dvc.lock").write_text("schema: '2.0'\nstages: {}\n")
    cluster = FakeCluster(job_states=[RUNNING, COMPLETE], pods=[pod("rlhf-sft-x-abcde")], logs=[pod_log])
    batch, core = apis(cluster)
    root = tmp_path / "flow"
    root.mkdir()
    lines: list[str] = []
    got = kubernetes_stage("sft", root, {}, {"dvc_remote": str(remote), "name": "rlhf-sft-x", "batch_api": batch,
                                             "core_api": core, "poll_s": 0}, lines.append)
    assert got == status
    assert json.loads((root / "metrics" / "sft.json").read_text()) == {"eval_loss": 1.5}
    assert (root / "dvc.lock").exists()
    posted = [r.body for r in cluster.requests if r.method == "POST"][0]
    assert posted["spec"]["template"]["spec"]["containers"][0]["command"] == [
        "rlhf", "repro", "sft", "--remote", str(remote)]


@pytest.mark.parametrize("opts", [StageJobOptions("sft", dvc_remote=REMOTE),
                                  StageJobOptions("rlhf", gpus=8, dvc_remote=REMOTE, seed_params=False)])
def test_a_job_under_a_remote_validates_strictly(opts):
    from tests.tasks.k8s.test_k8s_manifests import validate_strict

    validate_strict(render_stage_job(opts))
