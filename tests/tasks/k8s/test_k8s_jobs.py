"""tasks/k8s/: rendering rules, and submission through the real ``kubernetes`` client.

Submission tests run the real ``BatchV1Api`` / ``CoreV1Api`` (request building, model serialisation,
response deserialisation) over an ``ApiClient`` whose ``rest_client.request`` is replaced by a fake
cluster: it records each HTTP request (method, path, query, the JSON body as it would go on the wire)
and answers with canned HTTP responses.  No network, no cluster.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
import yaml

from rlhf_core.stages import STAGE_NAMES
from tasks.k8s import manifests, names, submit
from tasks.k8s.options import StageJobOptions
from tasks.k8s.render import render_stage_job, render_stage_resources
from tasks.k8s.render_operators import RENDERERS, main_render, render_trainjob

REPO = Path(__file__).resolve().parents[3]
k8s_client = pytest.importorskip("kubernetes.client", reason="kubernetes is in the [dev] / [k8s] extras")
from kubernetes.client.rest import RESTResponse  # noqa: E402

NS = "rlhf"
JOB_UID = "6f1c2d5e-0000-4000-8000-000000000001"


# ------------------------------------------------------------------------------------------------------------------
# A fake cluster behind the real client
# ------------------------------------------------------------------------------------------------------------------
class FakeHTTPResponse:
    """The slice of urllib3.HTTPResponse that kubernetes.client.rest.RESTResponse reads."""

    def __init__(self, status: int, payload, content_type: str = "application/json"):
        self.status = status
        self.reason = {200: "OK", 201: "Created", 404: "Not Found", 400: "Bad Request"}.get(status, "")
        self.data = payload if isinstance(payload, bytes) else json.dumps(payload).encode()
        self.headers = {"content-type": content_type}


@dataclass
class Request:
    method: str
    path: str
    query: dict
    body: dict | None


@dataclass
class FakeCluster:
    """Answers the API calls submit_stage_job makes; job states and pod logs are scripted per poll."""

    job_states: list[dict]  # successive `status` objects returned by GET job
    listed_jobs: list[dict] = field(default_factory=list)  # GET jobs?labelSelector=... answers these
    pods: list[dict] = field(default_factory=list)
    logs: list[str] = field(default_factory=list)  # successive GET log bodies
    requests: list[Request] = field(default_factory=list)
    jobset_states: list[dict] | None = None  # successive JobSet `status`es; None: the cluster has no JobSet API
    listed_jobsets: list[dict] = field(default_factory=list)

    def request(self, method, url, headers=None, body=None, post_params=None, _request_timeout=None):
        parts = urlsplit(url)
        wire = json.dumps(body) if body is not None else None  # what RESTClientObject sends for JSON bodies
        req = Request(method, parts.path, {k: v[0] for k, v in parse_qs(parts.query).items()},
                      json.loads(wire) if wire else None)
        self.requests.append(req)
        return RESTResponse(self.answer(req))

    def answer(self, req: Request) -> FakeHTTPResponse:
        jobs = f"/apis/batch/v1/namespaces/{NS}/jobs"
        jobsets = f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
        if req.path.startswith(jobsets) and self.jobset_states is not None:
            if req.method == "POST":
                return FakeHTTPResponse(201, req.body)
            if req.method == "GET" and req.path == jobsets:
                return FakeHTTPResponse(200, {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSetList",
                                              "metadata": {}, "items": self.listed_jobsets})
            if req.method == "GET":
                status = self.jobset_states.pop(0) if len(self.jobset_states) > 1 else self.jobset_states[0]
                return FakeHTTPResponse(200, {"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                                              "metadata": {"name": req.path.rsplit("/", 1)[1]}, "status": status})
            if req.method == "DELETE":
                return FakeHTTPResponse(200, {"apiVersion": "v1", "kind": "Status", "status": "Success"})
        if req.method == "POST" and req.path == jobs:
            created = json.loads(json.dumps(req.body))
            created["metadata"].update(uid=JOB_UID, resourceVersion="1", creationTimestamp="2025-01-01T00:00:00Z")
            return FakeHTTPResponse(201, created)
        if req.method == "POST" and req.path == f"/api/v1/namespaces/{NS}/services":
            return FakeHTTPResponse(201, req.body)
        if req.method == "GET" and req.path.startswith(jobs + "/"):
            name = req.path.rsplit("/", 1)[1]
            status = self.job_states.pop(0) if len(self.job_states) > 1 else self.job_states[0]
            return FakeHTTPResponse(200, {"apiVersion": "batch/v1", "kind": "Job",
                                          "metadata": {"name": name, "namespace": NS, "uid": JOB_UID},
                                          "status": status})
        if req.method == "GET" and req.path == jobs:
            return FakeHTTPResponse(200, {"apiVersion": "batch/v1", "kind": "JobList", "metadata": {},
                                          "items": self.listed_jobs})
        if req.method == "DELETE" and req.path.startswith(jobs + "/"):
            return FakeHTTPResponse(200, {"apiVersion": "v1", "kind": "Status", "status": "Success"})
        if req.method == "GET" and req.path == f"/api/v1/namespaces/{NS}/pods":
            return FakeHTTPResponse(200, {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": self.pods})
        if req.method == "GET" and req.path.endswith("/log"):
            text = self.logs.pop(0) if self.logs else ""
            return FakeHTTPResponse(200, text.encode(), content_type="text/plain")
        return FakeHTTPResponse(404, {"kind": "Status", "code": 404, "message": f"no route {req.method} {req.path}"})


def apis(cluster: FakeCluster):
    api_client = k8s_client.ApiClient(k8s_client.Configuration(host="https://k8s.invalid"))
    api_client.rest_client.request = cluster.request
    return k8s_client.BatchV1Api(api_client), k8s_client.CoreV1Api(api_client)


def pod(name: str, *, index: str | None = None, terminated: dict | None = None, phase: str = "Running",
        reason: str | None = None) -> dict:
    annotations = {names.COMPLETION_INDEX_ANNOTATION: index} if index is not None else {}
    status: dict = {"phase": phase}
    if terminated:
        status["containerStatuses"] = [{"name": "rlhf", "ready": False, "restartCount": 0, "image": "x",
                                        "imageID": "", "state": {"terminated": terminated}}]
    if reason:
        status["reason"] = reason
    return {"metadata": {"name": name, "namespace": NS, "annotations": annotations,
                         "creationTimestamp": "2025-01-01T00:00:01Z"}, "status": status}


RUNNING = {"active": 1}
COMPLETE = {"succeeded": 1, "conditions": [{"type": "Complete", "status": "True"}]}
FAILED = {"failed": 3, "conditions": [
    {"type": "FailureTarget", "status": "True", "reason": "BackoffLimitExceeded"},
    {"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
     "message": "Job has reached the specified backoff limit"}]}


# ------------------------------------------------------------------------------------------------------------------
# Submission
# ------------------------------------------------------------------------------------------------------------------
def test_submit_posts_the_rendered_job_and_streams_logs():
    cluster = FakeCluster(
        job_states=[RUNNING, RUNNING, COMPLETE],
        pods=[pod("rlhf-sft-t1-abcde")],
        logs=["2025-01-01T00:00:02.5Z step 1\n2025-01-01T00:00:03Z step 2\n",
              # the next poll overlaps the first (since_seconds): step 2 must not be emitted twice
              "2025-01-01T00:00:03Z step 2\n2025-01-01T00:00:03.000000001Z step 3\n",
              "2025-01-01T00:00:04Z done\n"])
    batch, core = apis(cluster)
    lines: list[str] = []
    env = {"RLHF_PARENT_RUN_ID": "run-123", "MLFLOW_TRACKING_URI": "http://mlflow.example:5000"}
    result = submit.submit_stage_job("sft", name="rlhf-sft-t1", env=env, batch_api=batch, core_api=core,
                                 poll_s=0, log=lines.append)

    posts = [r for r in cluster.requests if r.method == "POST"]
    assert [r.path for r in posts] == [f"/apis/batch/v1/namespaces/{NS}/jobs"]
    expected = render_stage_job(StageJobOptions("sft", name="rlhf-sft-t1", env=env, seed_params=False))
    assert posts[0].body == expected  # the serialised V1Job is exactly the rendered manifest
    body_env = posts[0].body["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.example:5000"} in body_env
    assert [e["name"] for e in body_env].count("MLFLOW_TRACKING_URI") == 1
    assert "initContainers" not in posts[0].body["spec"]["template"]["spec"]  # the flow's params.yaml is used

    gets = [r for r in cluster.requests if r.method == "GET"]
    assert f"/apis/batch/v1/namespaces/{NS}/jobs/rlhf-sft-t1" in [r.path for r in gets]
    pod_lists = [r for r in gets if r.path == f"/api/v1/namespaces/{NS}/pods"]
    assert pod_lists and all(r.query["labelSelector"] == "rlhf-ops/job=rlhf-sft-t1" for r in pod_lists)
    log_reqs = [r for r in gets if r.path.endswith("/log")]
    assert log_reqs[0].path == f"/api/v1/namespaces/{NS}/pods/rlhf-sft-t1-abcde/log"
    assert all(r.query["container"] == "rlhf" and r.query["timestamps"] == "true" for r in log_reqs)
    assert "sinceSeconds" not in log_reqs[0].query and "sinceSeconds" in log_reqs[1].query

    assert [ln for ln in lines if not ln.startswith(("created job", "job "))] == \
        ["step 1", "step 2", "step 3", "done"]
    assert result["status"] == "succeeded" and result["job_name"] == "rlhf-sft-t1"
    assert result["pods"] == ["rlhf-sft-t1-abcde"] and result["namespace"] == NS


def test_env_from_the_flow_parameter_reaches_the_pod_under_the_flows_own_variables(tmp_path):
    """``k8s.env`` (e.g. NCCL_* for the fabric) is a flow parameter now; the flow's own variables (tracking,
    parent run) are set over it, so a user value cannot point the stage at another MLflow."""
    from flows.pipeline import stage_job_options
    from tasks.stages import kubernetes_stage

    options = stage_job_options(["sft"], {"env": {"NCCL_SOCKET_IFNAME": "eth0", "MLFLOW_TRACKING_URI": "wrong"}},
                                None, None)
    assert options["sft"]["env"]["NCCL_SOCKET_IFNAME"] == "eth0"
    cluster = FakeCluster(job_states=[COMPLETE], pods=[pod("rlhf-sft-t9-abcde")], logs=["done\n"])
    batch, core = apis(cluster)
    flow_env = {"MLFLOW_TRACKING_URI": "http://mlflow.flow:5000", "RLHF_PARENT_RUN_ID": "run-9"}
    assert kubernetes_stage("sft", tmp_path, flow_env, {**options["sft"], "name": "rlhf-sft-t9", "batch_api": batch,
                                                        "core_api": core, "poll_s": 0}, lambda _line: None) == "ran"
    (post,) = [r for r in cluster.requests if r.method == "POST"]
    env = {e["name"]: e.get("value") for e in post.body["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["NCCL_SOCKET_IFNAME"] == "eth0" and env["MLFLOW_TRACKING_URI"] == "http://mlflow.flow:5000"
    assert env["RLHF_PARENT_RUN_ID"] == "run-9"


def test_submit_multi_node_creates_headless_service_owned_by_the_job():
    cluster = FakeCluster(job_states=[COMPLETE], pods=[pod("rlhf-rm-t2-1-x", index="1"),
                                                        pod("rlhf-rm-t2-0-y", index="0")],
                          logs=["2025-01-01T00:00:02Z rank0 line\n"])
    batch, core = apis(cluster)
    submit.submit_stage_job("rm", name="rlhf-rm-t2", nnodes=2, gpus=4, batch_api=batch, core_api=core, poll_s=0,
                        log=lambda _: None)
    posts = [r for r in cluster.requests if r.method == "POST"]
    assert [r.path for r in posts] == [f"/apis/batch/v1/namespaces/{NS}/jobs", f"/api/v1/namespaces/{NS}/services"]
    job, svc = posts[0].body, posts[1].body
    assert job == render_stage_job(StageJobOptions("rm", name="rlhf-rm-t2", nnodes=2, gpus=4, seed_params=False))
    assert svc["metadata"]["ownerReferences"] == [{"apiVersion": "batch/v1", "kind": "Job", "name": "rlhf-rm-t2",
                                                   "uid": JOB_UID}]
    assert svc["spec"]["clusterIP"] == "None" and job["spec"]["template"]["spec"]["subdomain"] == "rlhf-rm-t2"
    logs = [r.path for r in cluster.requests if r.path.endswith("/log")]
    assert logs and all("/pods/rlhf-rm-t2-0-y/" in p for p in logs), "streams rank 0 (completion index 0) only"


def test_failed_job_raises_with_the_pods_termination_reason():
    cluster = FakeCluster(
        job_states=[RUNNING, FAILED],
        pods=[pod("rlhf-rlhf-t3-aaaaa", phase="Failed",
                  terminated={"exitCode": 137, "reason": "OOMKilled", "startedAt": "2025-01-01T00:00:01Z",
                              "finishedAt": "2025-01-01T00:05:00Z"})],
        logs=["2025-01-01T00:00:02Z loading actor\n2025-01-01T00:04:59Z rollout batch 17\n"])
    batch, core = apis(cluster)
    with pytest.raises(submit.StageJobFailed) as info:
        submit.submit_stage_job("rlhf", name="rlhf-rlhf-t3", batch_api=batch, core_api=core, poll_s=0,
                            log=lambda _: None)
    err = info.value
    assert err.pod_reason == "OOMKilled" and err.exit_code == 137 and err.reason == "BackoffLimitExceeded"
    assert err.pod_name == "rlhf-rlhf-t3-aaaaa" and err.stage == "rlhf" and err.job_name == "rlhf-rlhf-t3"
    text = str(err)
    for part in ("OOMKilled", "exit code 137", "BackoffLimitExceeded", "rlhf-rlhf-t3-aaaaa", "rollout batch 17"):
        assert part in text
    assert not [r for r in cluster.requests if r.method == "DELETE"], "a failed Job is kept for inspection"
    again = pickle.loads(pickle.dumps(err))  # Prefect persists a failed task's exception
    assert str(again) == text and again.pod_reason == "OOMKilled" and again.exit_code == 137


def test_failed_job_with_evicted_pod_names_the_pod_reason():
    cluster = FakeCluster(job_states=[FAILED], pods=[
        pod("rlhf-sft-t5-a", phase="Failed", terminated={"exitCode": 1, "reason": "Error"}),
        pod("rlhf-sft-t5-b", phase="Failed", reason="DeadlineExceeded")])
    batch, core = apis(cluster)
    with pytest.raises(submit.StageJobFailed, match="rlhf-sft-t5-b: DeadlineExceeded"):
        submit.submit_stage_job("sft", name="rlhf-sft-t5", batch_api=batch, core_api=core, poll_s=0, log=lambda _: None)


def test_timeout_deletes_the_job():
    cluster = FakeCluster(job_states=[RUNNING])
    batch, core = apis(cluster)
    with pytest.raises(submit.StageJobTimeout, match="still running"):
        submit.submit_stage_job("evaluate", name="rlhf-evaluate-t4", batch_api=batch, core_api=core, poll_s=0,
                            timeout_s=0, log=lambda _: None)
    (delete,) = [r for r in cluster.requests if r.method == "DELETE"]
    assert delete.path == f"/apis/batch/v1/namespaces/{NS}/jobs/rlhf-evaluate-t4"
    assert delete.query["propagationPolicy"] == "Background"


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_client_model_round_trip_is_lossless(stage):
    """Every field we render is known to the client's models (an unknown one would be dropped silently)."""
    api_client = k8s_client.ApiClient()
    for kw in ({}, {"gpus": 0}, {"nnodes": 2, "gpus": 2} if stage != "prepare" else {"gpus": 2}):
        for doc in render_stage_resources(StageJobOptions(stage, **kw)):
            model = getattr(k8s_client, f"V1{doc['kind']}")
            assert api_client.sanitize_for_serialization(model.from_dict(doc)) == doc


# ------------------------------------------------------------------------------------------------------------------
# Rendering rules
# ------------------------------------------------------------------------------------------------------------------
def _container(job):
    return job["spec"]["template"]["spec"]["containers"][0]


def test_commands():
    assert _container(render_stage_job(StageJobOptions("sft")))["command"] == ["rlhf", "stage", "sft"]
    launch = ["python", "-m", "rlhf_core.ops.launch", "--shutdown-timeout=870"]  # the pod's 900 s grace less 30 s
    assert _container(render_stage_job(StageJobOptions("sft", gpus=4)))["command"] == [
        *launch, "--standalone", "--nproc_per_node=4", "-m", "rlhf_core.cli", "stage", "sft"]
    assert _container(render_stage_job(StageJobOptions("sft", gpus=2, termination_grace_s=1200)))["command"][:4] == [
        *launch[:3], "--shutdown-timeout=1170"]
    assert _container(render_stage_job(StageJobOptions("rm", gpus=8, nnodes=3, name="big")))["command"] == [
        *launch, "--nnodes=3", "--nproc_per_node=8", "--node_rank=$(JOB_COMPLETION_INDEX)",
        "--master_addr=big-0.big", "--master_port=29500", "-m", "rlhf_core.cli", "stage", "rm"]
    assert _container(render_stage_job(StageJobOptions("evaluate", params_path="configs/gpu.yaml")))["command"] == [
        "rlhf", "stage", "evaluate", "-p", "configs/gpu.yaml"]


def test_gpu_defaults_per_stage():
    prep = render_stage_job(StageJobOptions("prepare"))
    assert names.GPU_RESOURCE not in json.dumps(prep) and "nodeSelector" not in prep["spec"]["template"]["spec"]
    sft = render_stage_job(StageJobOptions("sft"))
    limits = _container(sft)["resources"]["limits"]
    assert limits[names.GPU_RESOURCE] == "1"
    assert sft["spec"]["template"]["spec"]["nodeSelector"] == names.GPU_NODE_SELECTOR
    eight = _container(render_stage_job(StageJobOptions("sft", gpus=8)))
    assert eight["resources"]["requests"][names.GPU_RESOURCE] == "8"


@pytest.mark.parametrize("kw,match", [
    ({"stage": "train"}, "unknown stage"),
    ({"stage": "sft", "gpus": 2, "nproc_per_node": 4}, "exceeds gpus"),
    ({"stage": "prepare", "nnodes": 2}, "one process"),
    ({"stage": "sft", "name": "Bad_Name"}, "not a valid Kubernetes name"),
    ({"stage": "sft", "params_path": "../params.yaml"}, "relative to the workspace"),
    ({"stage": "sft", "nnodes": 0}, "nnodes"),
])
def test_render_rejects_bad_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        render_stage_job(StageJobOptions(**kw))


def test_extra_env_replaces_same_name():
    opts = StageJobOptions("sft", env={"MLFLOW_TRACKING_URI": "http://x:5000", "A": "1"})
    env = _container(render_stage_job(opts))["env"]
    assert [e for e in env if e["name"] == "MLFLOW_TRACKING_URI"] == [{"name": "MLFLOW_TRACKING_URI",
                                                                      "value": "http://x:5000"}]
    assert {"name": "A", "value": "1"} in env


def test_main_render_yaml():
    docs = list(yaml.safe_load_all(main_render("sft", nnodes=2, gpus=8)))
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    (job,) = yaml.safe_load_all(main_render("prepare"))
    assert job == render_stage_job(StageJobOptions("prepare"))
    (pj,) = yaml.safe_load_all(main_render("rlhf", kind="pytorchjob", nnodes=3, gpus=2))
    assert pj["kind"] == "PyTorchJob" and pj["spec"]["pytorchReplicaSpecs"]["Worker"]["replicas"] == 2
    (tj,) = yaml.safe_load_all(main_render("rlhf", kind="trainjob", nnodes=3, gpus=2))
    assert tj == render_trainjob(StageJobOptions("rlhf", nnodes=3, gpus=2))
    assert tj["kind"] == "TrainJob" and tj["spec"]["trainer"]["numNodes"] == 3
    assert tuple(RENDERERS) == names.RENDER_KINDS
    with pytest.raises(ValueError, match="expected one of job, jobset, pytorchjob, trainjob"):
        main_render("rlhf", kind="mpijob")


def test_both_clis_render_a_trainjob():
    from typer.testing import CliRunner

    from flows.cli import app

    expected = render_trainjob(StageJobOptions("rm", nnodes=2, gpus=8))
    result = CliRunner().invoke(app, ["k8s", "render", "rm", "--kind", "trainjob", "--nnodes", "2", "--gpus", "8"])
    assert result.exit_code == 0, result.output
    assert list(yaml.safe_load_all(result.output)) == [expected]
    proc = subprocess.run([sys.executable, "-m", "tasks.k8s", "render", "rm", "--kind", "trainjob", "--nnodes", "2",
                           "--gpus", "8"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert list(yaml.safe_load_all(proc.stdout)) == [expected]
    proc = subprocess.run([sys.executable, "-m", "tasks.k8s", "render", "prepare", "--kind", "trainjob"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "not distributed" in proc.stderr and "Traceback" not in proc.stderr


def test_render_help_names_every_kind():
    from typer.testing import CliRunner

    from flows.cli import app

    result = CliRunner().invoke(app, ["k8s", "render", "--help"], env={"COLUMNS": "100", "NO_COLOR": "1"})
    assert result.exit_code == 0, result.output
    text = " ".join(re.sub(r"[│╭╮╰╯─]", " ", result.output).split())  # rich's boxes and wrapping out
    proc = subprocess.run([sys.executable, "-m", "tasks.k8s", "render", "--help"], cwd=REPO, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert "{" + ",".join(names.RENDER_KINDS) + "}" in proc.stdout
    module_help = " ".join(proc.stdout.split())
    for kind in names.RENDER_KINDS:
        assert re.search(rf"(^|[\s,(]){kind} \(", text), f"rlhf k8s render --help does not describe {kind}:\n{text}"
        assert re.search(rf"(^|[\s,(]){kind} \(", module_help), f"python -m tasks.k8s render --help: {kind}"


def test_trainjob_command_takes_its_rendezvous_from_the_trainers_pet_env(monkeypatch):
    """The TrainJob's command has no rendezvous flags: torchrun's parser (which rlhf_core.ops.launch uses) reads
    each option it is not given from PET_<OPTION>, which the Trainer's torch plugin sets (v2.3.0,
    pkg/runtime/framework/plugins/torch/torch.go: PET_NNODES = numNodes, PET_NPROC_PER_NODE = numProcPerNode,
    PET_NODE_RANK = the Job completion index, PET_MASTER_ADDR = <name>-node-0-0.<name>, PET_MASTER_PORT = 29500)."""
    run = pytest.importorskip("torch.distributed.run")
    tj = render_trainjob(StageJobOptions("rm", nnodes=3, gpus=8, name="rm-x"))
    cmd = tj["spec"]["trainer"]["command"]
    assert cmd[:3] == ["python", "-m", "rlhf_core.ops.launch"]
    argv = cmd[3:]
    for key in [k for k in os.environ if k.startswith("PET_")]:
        monkeypatch.delenv(key)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # config_from_args would set it for nproc > 1
    pet = {"PET_NNODES": str(tj["spec"]["trainer"]["numNodes"]),
           "PET_NPROC_PER_NODE": str(tj["spec"]["trainer"]["numProcPerNode"]),
           "PET_NODE_RANK": "2", "PET_MASTER_ADDR": "rm-x-node-0-0.rm-x", "PET_MASTER_PORT": "29500"}
    for key, value in pet.items():
        monkeypatch.setenv(key, value)
    args = run.parse_args(argv)
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("3", "8", 2)
    assert (args.master_addr, args.master_port, args.rdzv_backend, args.standalone) == (
        "rm-x-node-0-0.rm-x", 29500, "static", False)
    assert args.module and args.training_script == "rlhf_core.cli"
    assert args.training_script_args == ["stage", "rm", "-p", "/etc/rlhf/params.yaml"]
    assert args.shutdown_timeout == 900 - 30
    config, _, script_args = run.config_from_args(args)
    assert (config.min_nodes, config.max_nodes, config.nproc_per_node) == (3, 3, 8)
    assert config.rdzv_endpoint == "rm-x-node-0-0.rm-x:29500" and config.rdzv_configs["rank"] == 2
    assert script_args[-5:] == ["rlhf_core.cli", "stage", "rm", "-p", "/etc/rlhf/params.yaml"]
    for key in pet:  # the guard: without the env the same command is one process on one node
        monkeypatch.delenv(key)
    args = run.parse_args(argv)
    assert (args.nnodes, args.nproc_per_node, args.node_rank) == ("1:1", "1", 0)


def test_log_follower_skips_lines_already_seen():
    emitted: list[str] = []

    class Core:
        bodies = ["2025-01-01T00:00:01Z a\n2025-01-01T00:00:01Z b\n",
                  "2025-01-01T00:00:01Z a\n2025-01-01T00:00:01Z b\n2025-01-01T00:00:01Z c\n2025-01-01T00:00:01.1Z d\n"]

        def read_namespaced_pod_log(self, *a, **kw):
            return self.bodies.pop(0)

    follower = submit.LogFollower(Core(), NS, "rlhf", emitted.append)
    follower.poll("p")
    follower.poll("p")
    assert emitted == ["a", "b", "c", "d"]


def test_module_imports_without_kubernetes_or_prefect():
    code = ("import sys\n"
            "for m in ('kubernetes', 'prefect', 'prefect_kubernetes'): sys.modules[m] = None\n"
            "import tasks.k8s.render_operators as k, tasks.k8s.render, tasks.k8s.manifests, tasks.k8s.submit\n"
            "import tasks.k8s.__main__\n"
            "print(k.main_render('sft')[:20])\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("apiVersion: batch/v1")


def test_write_manifests_check_reports_stale(tmp_path):
    pytest.importorskip("prefect_kubernetes", reason="the work-pool template is built from prefect-kubernetes")
    template = json.loads((REPO / "k8s/prefect/base-job-template.json").read_text())
    assert manifests.write_manifests(tmp_path, check=True)  # nothing written yet: everything stale
    assert not (tmp_path / "k8s").exists()
    (tmp_path / "params.yaml").write_text("project: {name: x}\n")
    written = manifests.write_manifests(tmp_path)
    assert tmp_path / "k8s/base/params.yaml" in written and tmp_path / "k8s/stages/sft/job.yaml" in written
    assert manifests.write_manifests(tmp_path, check=True) == []
    (tmp_path / "k8s/stages/rm/job.yaml").write_text("edited by hand\n")
    assert manifests.write_manifests(tmp_path, check=True) == [tmp_path / "k8s/stages/rm/job.yaml"]
    assert json.loads((tmp_path / "k8s/prefect/base-job-template.json").read_text()) == template


def test_stage_job_options_from_keyword_options_name_an_unknown_key():
    """The flow passes its ``k8s`` dict through ``StageJobOptions.from_dict``: a typo fails, naming the key."""
    with pytest.raises(ValueError, match=r"unknown Kubernetes stage option\(s\) \['gpu'\]"):
        StageJobOptions.from_dict("sft", {"gpu": 2})
    opts = StageJobOptions.from_dict("sft", {"gpus": 2, "memory": "100Gi"})
    assert (opts.procs_per_node, opts.job_name, opts.requests) == (2, "rlhf-sft", ("8", "100Gi", "8Gi"))
    assert opts.deadline_s == names.STAGE_DEADLINE_S["sft"]


def test_interrupted_wait_deletes_the_job_and_re_raises():
    """A task timeout or flow cancellation arrives while the Job runs: the Job is deleted, the interruption
    propagates (the retry decision and the flow see it unchanged)."""
    cluster = FakeCluster(job_states=[RUNNING])
    batch, core = apis(cluster)

    def interrupt(line: str) -> None:
        if line.startswith("created job"):
            return
        raise KeyboardInterrupt

    cluster.logs = ["2025-01-01T00:00:02Z step 1\n"]
    cluster.pods = [pod("rlhf-rlhf-t6-a")]
    with pytest.raises(KeyboardInterrupt):
        submit.submit_stage_job("rlhf", name="rlhf-rlhf-t6", batch_api=batch, core_api=core, poll_s=0, log=interrupt)
    (delete,) = [r for r in cluster.requests if r.method == "DELETE"]
    assert delete.path == f"/apis/batch/v1/namespaces/{NS}/jobs/rlhf-rlhf-t6"
    assert delete.query["propagationPolicy"] == "Background"


def _listed(name: str, status: dict) -> dict:
    return {"metadata": {"name": name, "namespace": NS, "labels": {names.FLOW_RUN_LABEL: "run-1"}}, "status": status}


def test_delete_flow_run_jobs_deletes_the_running_ones_of_that_run():
    cluster = FakeCluster(job_states=[RUNNING], listed_jobs=[
        _listed("rlhf-sft-a1", COMPLETE), _listed("rlhf-rm-b2", RUNNING), _listed("rlhf-rlhf-c3", {})])
    batch, _ = apis(cluster)
    deleted = submit.delete_flow_run_jobs("run-1", NS, batch_api=batch, log=lambda _: None)
    assert deleted == ["rlhf-rm-b2", "rlhf-rlhf-c3"]
    (listing,) = [r for r in cluster.requests if r.method == "GET" and r.path.startswith("/apis/batch/")]
    assert listing.query["labelSelector"] == f"{names.FLOW_RUN_LABEL}=run-1"
    assert [r.path.rsplit("/", 1)[1] for r in cluster.requests if r.method == "DELETE"] == deleted


def test_flow_cancellation_hook_deletes_the_runs_jobs_in_every_namespace(monkeypatch):
    """The flow's on_cancellation / on_crashed hook, given a real Prefect FlowRun with the kubernetes backend."""
    import uuid

    from prefect.client.schemas.objects import FlowRun

    from flows.pipeline import rlhf_pipeline, stop_stage_jobs

    assert stop_stage_jobs in rlhf_pipeline.on_cancellation_hooks and stop_stage_jobs in rlhf_pipeline.on_crashed_hooks
    cluster = FakeCluster(job_states=[RUNNING], listed_jobs=[_listed("rlhf-rm-b2", RUNNING)])
    monkeypatch.setattr(submit, "_load_apis", lambda b, c: apis(cluster))
    params = {"backend": "kubernetes", "k8s": {"gpus": 8}, "k8s_stages": {"rlhf": {"namespace": "gpu"}}}
    run = FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="r", parameters=params)
    stop_stage_jobs(rlhf_pipeline, run, None)
    lists = [r.path for r in cluster.requests if r.method == "GET"]
    assert lists == [p for n in ("gpu", NS)  # "gpu" answers 404: goes on; no JobSet API (404): no JobSet
                     for p in (f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{n}/jobsets",
                               f"/apis/batch/v1/namespaces/{n}/jobs")]
    assert [r.path for r in cluster.requests if r.method == "DELETE"] == [f"/apis/batch/v1/namespaces/{NS}/jobs/"
                                                                          "rlhf-rm-b2"]
    assert all(r.query["labelSelector"] == f"{names.FLOW_RUN_LABEL}={run.id}" for r in cluster.requests
               if r.method == "GET")
    cluster.requests.clear()
    stop_stage_jobs(rlhf_pipeline, FlowRun(id=uuid.uuid4(), flow_id=uuid.uuid4(), name="l",
                                           parameters={"backend": "local"}), None)
    assert cluster.requests == []


def test_queue_priority_labels_and_annotations_land_on_job_and_pods():
    opts = StageJobOptions("rlhf", queue="team-a", priority_class="training-low",
                           labels={"team": "nlp", "rlhf-ops/stage": "spoofed"}, annotations={"owner": "nlp"})
    job = render_stage_job(opts)
    for meta in (job["metadata"], job["spec"]["template"]["metadata"]):
        assert meta["labels"][names.KUEUE_QUEUE_LABEL] == "team-a" and meta["labels"]["team"] == "nlp"
        assert meta["labels"]["rlhf-ops/stage"] == "rlhf"  # selectors rely on the rlhf-ops labels: they win
        assert meta["annotations"] == {"owner": "nlp"}
    assert job["spec"]["template"]["spec"]["priorityClassName"] == "training-low"
    assert job["spec"]["podFailurePolicy"]["rules"][0]["onExitCodes"]["values"] == [2, 65]


@pytest.mark.parametrize("kw,match", [
    ({"labels": {"bad key!": "x"}}, "labels: 'bad key!' is not a valid key"),
    ({"labels": {"team": "a b"}}, "labels: team='a b' is not a valid label value"),
    ({"annotations": {"owner": 3}}, "annotations: owner=3 must be a string"),
    ({"queue": "Team_A"}, "queue 'Team_A' is not a valid Kubernetes name"),
])
def test_bad_labels_queue_and_annotations_are_refused(kw, match):
    with pytest.raises(ValueError, match=re.escape(match)):
        StageJobOptions("sft", **kw)


def test_flow_k8s_parameters_are_typed_validated_and_labelled():
    """``k8s`` / ``k8s_stages`` flow parameters: a typed schema for the Prefect UI, every stage's options
    validated before anything runs (the error names stage and key), the flow run's label on each Job."""
    from flows.pipeline import rlhf_pipeline, stage_job_options
    from tasks.k8s.options import StageJobSettings

    props = rlhf_pipeline.parameters.model_dump()["properties"]
    assert {"k8s", "k8s_stages"} <= set(props)
    defs = rlhf_pipeline.parameters.model_dump()["definitions"]["StageJobSettings"]
    assert defs["additionalProperties"] is False and defs["properties"]["gpus"]["anyOf"][0]["type"] == "integer"
    options = stage_job_options(["sft", "rlhf"], StageJobSettings(gpus=8, queue="q"), {"rlhf": {"nnodes": 2}},
                                "run-1")
    assert options["rlhf"] == {"gpus": 8, "queue": "q", "nnodes": 2, "labels": {names.FLOW_RUN_LABEL: "run-1"}}
    assert "nnodes" not in options["sft"]
    with pytest.raises(ValueError, match=r"stage 'rlhf'.*\n?gpu\n"):
        stage_job_options(["rlhf"], None, {"rlhf": {"gpu": 2}}, None)
    with pytest.raises(ValueError, match=r"stage 'prepare': the prepare stage runs in one process"):
        stage_job_options(["prepare"], StageJobSettings(nnodes=2), None, None)
    with pytest.raises(ValueError, match=r"k8s_stages: unknown stages \['train'\]"):
        stage_job_options(["sft"], None, {"train": {}}, None)


def test_the_idle_round_0_feedback_stage_asks_for_no_gpu():
    """Round 0's feedback stage writes an empty manifest: its Job requests no GPU and lands on any node, whatever
    ``k8s`` sets for every stage; a feedback round (>= 1) samples the champion and keeps its GPUs, and
    ``k8s_stages.feedback.gpus`` wins at round 0 too."""
    from flows.pipeline import stage_job_options
    from tasks.k8s.options import StageJobSettings

    common = StageJobSettings(gpus=8, queue="q")

    def feedback_job(round_: int, per_stage: dict | None = None) -> dict:
        options = stage_job_options(["feedback", "rlhf"], common, per_stage, None, feedback_round=round_)
        assert options["rlhf"]["gpus"] == 8
        return render_stage_job(StageJobOptions.from_dict("feedback", options["feedback"]))

    idle = feedback_job(0)
    assert names.GPU_RESOURCE not in json.dumps(idle) and "nodeSelector" not in idle["spec"]["template"]["spec"]
    assert idle["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == "q"  # the rest of the settings stay
    for job, gpus in ((feedback_job(1), "8"), (feedback_job(0, {"feedback": {"gpus": 1}}), "1")):
        assert _container(job)["resources"]["limits"][names.GPU_RESOURCE] == gpus


def test_prefect_yaml_deployment_parameters_validate_against_the_flow():
    """Every deployment's parameters in prefect.yaml pass the flow's own validation, and the Kubernetes one
    yields valid stage Jobs (so a typo there fails here, not at 3 am on the cluster)."""
    from flows.pipeline import rlhf_pipeline, stage_job_options
    from flows.rounds import rlhf_rounds

    flows = {"flows/pipeline.py:rlhf_pipeline": rlhf_pipeline, "flows/rounds.py:rlhf_rounds": rlhf_rounds}
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    for dep in deployments:
        params = flows[dep["entrypoint"]].validate_parameters(dict(dep.get("parameters") or {}))
        assert dep["concurrency_limit"]["limit"] == 1, dep["name"]
        if params.get("backend") == "kubernetes":
            options = stage_job_options(list(STAGE_NAMES), params.get("k8s"), params.get("k8s_stages"), "r")
            rlhf_job = render_stage_job(StageJobOptions.from_dict("rlhf", options["rlhf"]))
            assert rlhf_job["spec"]["completions"] == 2
            # nothing the project does not create: a missing PriorityClass or LocalQueue stops the Job silently
            assert names.KUEUE_QUEUE_LABEL not in rlhf_job["metadata"]["labels"]
            assert "priorityClassName" not in rlhf_job["spec"]["template"]["spec"]
    bad = {**deployments[-1]["parameters"], "k8s": {"gpu": 8}}
    with pytest.raises(Exception, match="gpu"):
        rlhf_pipeline.validate_parameters(bad)


def test_lineage_without_git_reads_the_image(tmp_path, monkeypatch):
    """In a stage pod (no .git): the commit baked into the image, the image reference and its pinned digest."""
    from rlhf_core.ops.meta import code_lineage

    image = "registry.example.com/rlhf-ops@sha256:" + "a" * 64
    env = {e["name"]: e.get("value") for e in _container(render_stage_job(StageJobOptions("sft", image=image)))["env"]}
    assert env["RLHF_IMAGE"] == image
    monkeypatch.setenv("RLHF_GIT_SHA", "0123abcd")
    monkeypatch.setenv("RLHF_IMAGE", image)
    lineage = code_lineage(tmp_path)  # not a git checkout
    assert lineage["git_sha"] == "0123abcd" and lineage["image_digest"] == "sha256:" + "a" * 64
    assert lineage["image"] == image and lineage["version"] != "unknown"
    monkeypatch.setenv("RLHF_GIT_SHA", "unknown")
    monkeypatch.delenv("RLHF_IMAGE")
    assert code_lineage(tmp_path) == {"git_sha": "unknown", "version": lineage["version"]}
    monkeypatch.setenv("RLHF_IMAGE", "registry.example.com/rlhf-ops:0.1.0-gpu")  # a tag: which build is unknown
    with pytest.warns(UserWarning, match="names a tag, not a digest"):
        tagged = code_lineage(tmp_path)
    assert tagged["image"] == "registry.example.com/rlhf-ops:0.1.0-gpu" and "image_digest" not in tagged


def test_the_flow_run_pod_names_its_image_and_the_ui_url_a_browser_opens():
    """The flow-run pod (it registers the models) carries RLHF_IMAGE from the deployment's image variable, and
    every pod may read the MLflow UI URL from the endpoints ConfigMap (optional: absent, links use the tracking
    URI)."""
    template = json.loads((REPO / "k8s/prefect/base-job-template.json").read_text())
    env = template["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]["containers"][0]["env"]
    assert {"name": "RLHF_IMAGE", "value": "{{ image }}"} in env
    ui = next(e for e in env if e["name"] == "RLHF_MLFLOW_UI_URL")["valueFrom"]["configMapKeyRef"]
    assert ui == {"name": names.ENDPOINTS_CONFIGMAP, "key": "RLHF_MLFLOW_UI_URL", "optional": True}


JS_RUNNING = {"restarts": 0, "replicatedJobsStatus": [{"name": "node", "active": 1}]}
JS_COMPLETED = {"restarts": 1, "conditions": [{"type": "Completed", "status": "True", "reason": "AllJobsCompleted"}]}
JS_FAILED = {"restarts": 0, "conditions": [{"type": "Failed", "status": "True", "reason": "FailedJobs",
                                            "message": "jobset failed due to matching failure policy rule "
                                                       "permanentExit"}]}


def test_multinode_as_a_jobset_is_created_watched_and_explained():
    """multinode=jobset: the real CustomObjectsApi posts render_jobset's object (no Job, no Service of ours),
    rank 0's logs are followed, the JobSet's Completed condition ends the wait; a Failed one is explained."""
    from tasks.k8s.render_operators import render_jobset

    cluster = FakeCluster(job_states=[RUNNING], jobset_states=[JS_RUNNING, JS_COMPLETED],
                          pods=[pod("rlhf-rlhf-j1-node-0-1-x", index="1"), pod("rlhf-rlhf-j1-node-0-0-y", index="0")],
                          logs=["2025-01-01T00:00:02Z rank0 step 1\n"])
    batch, core = apis(cluster)
    lines: list[str] = []
    result = submit.submit_stage_job("rlhf", name="rlhf-rlhf-j1", nnodes=2, gpus=8, multinode="jobset",
                                     batch_api=batch, core_api=core, poll_s=0, log=lines.append)
    assert result["status"] == "succeeded" and "rank0 step 1" in lines
    (posted,) = [r for r in cluster.requests if r.method == "POST"]
    assert posted.path == f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets"
    expected = render_jobset(StageJobOptions.from_dict("rlhf", {"name": "rlhf-rlhf-j1", "nnodes": 2, "gpus": 8,
                                                                "multinode": "jobset", "seed_params": False,
                                                                "env": None, "namespace": NS}))
    assert posted.body == json.loads(json.dumps(expected))
    logged = [r.path for r in cluster.requests if r.path.endswith("/log")]
    assert logged == [f"/api/v1/namespaces/{NS}/pods/rlhf-rlhf-j1-node-0-0-y/log"] * len(logged)  # rank 0 only

    failing = FakeCluster(job_states=[RUNNING], jobset_states=[JS_FAILED], pods=[pod(
        "rlhf-rlhf-j2-node-0-0-z", index="0", phase="Failed", terminated={"exitCode": 65, "reason": "Error"})])
    batch, core = apis(failing)
    with pytest.raises(submit.StageJobFailed, match=r"jobset rlhf/rlhf-rlhf-j2: FailedJobs \(jobset failed due to "
                                                    r"matching failure policy rule permanentExit\).*exit code 65"):
        submit.submit_stage_job("rlhf", name="rlhf-rlhf-j2", nnodes=2, multinode="jobset", batch_api=batch,
                                core_api=core, poll_s=0, log=lambda _: None)
    with pytest.raises(ValueError, match="multinode must be one of job, jobset"):
        StageJobOptions("rlhf", nnodes=2, multinode="mpi")


def test_delete_flow_run_jobs_deletes_a_running_jobset_with_its_jobs():
    listed_js = {"metadata": {"name": "rlhf-rlhf-d1", "namespace": NS}, "status": JS_RUNNING}
    done_js = {"metadata": {"name": "rlhf-sft-d0", "namespace": NS}, "status": JS_COMPLETED}
    child = _listed("rlhf-rlhf-d1-node-0", RUNNING)
    child["metadata"]["ownerReferences"] = [{"apiVersion": "jobset.x-k8s.io/v1alpha2", "kind": "JobSet",
                                             "name": "rlhf-rlhf-d1", "uid": "u1"}]
    cluster = FakeCluster(job_states=[RUNNING], jobset_states=[JS_RUNNING], listed_jobsets=[listed_js, done_js],
                          listed_jobs=[child])
    batch, _ = apis(cluster)
    assert submit.delete_flow_run_jobs("run-2", NS, batch_api=batch, log=lambda _: None) == ["rlhf-rlhf-d1"]
    deletes = [r.path for r in cluster.requests if r.method == "DELETE"]
    assert deletes == [f"/apis/jobset.x-k8s.io/v1alpha2/namespaces/{NS}/jobsets/rlhf-rlhf-d1"]
    listing = [r for r in cluster.requests if r.method == "GET" and "jobset" in r.path]
    assert listing[0].query["labelSelector"] == f"{names.FLOW_RUN_LABEL}=run-2"


def test_stage_jobs_of_an_in_cluster_flow_run_are_owned_by_its_job(monkeypatch):
    """In the flow-run pod (the work pool's template sets RLHF_FLOW_JOB_* through the downward API) the stage Job
    and a JobSet name the flow-run Job as their owner, so deleting it garbage-collects them; a stage in another
    namespace cannot be owned across namespaces and gets no owner."""
    from tasks.k8s.work_pool import build_work_pool_template

    monkeypatch.setenv("RLHF_FLOW_JOB_NAME", "flow-run-job-x1")
    monkeypatch.setenv("RLHF_FLOW_JOB_UID", "0b5e2c3a-1111-4000-8000-00000000aaaa")
    monkeypatch.setenv("RLHF_FLOW_JOB_NAMESPACE", NS)
    owner = {"apiVersion": "batch/v1", "kind": "Job", "name": "flow-run-job-x1",
             "uid": "0b5e2c3a-1111-4000-8000-00000000aaaa", "blockOwnerDeletion": False}
    cluster = FakeCluster(job_states=[COMPLETE], jobset_states=[JS_COMPLETED])
    batch, core = apis(cluster)
    submit.submit_stage_job("sft", name="rlhf-sft-o1", batch_api=batch, core_api=core, poll_s=0, log=lambda _: None)
    submit.submit_stage_job("rlhf", name="rlhf-rlhf-o2", nnodes=2, multinode="jobset", batch_api=batch,
                            core_api=core, poll_s=0, log=lambda _: None)
    posts = [r for r in cluster.requests if r.method == "POST"]
    assert [r.body["kind"] for r in posts] == ["Job", "JobSet"]
    assert all(r.body["metadata"]["ownerReferences"] == [owner] for r in posts)
    assert submit.flow_job_owner("gpu") is None  # another namespace
    assert submit.flow_job_owner(NS, {"RLHF_FLOW_JOB_NAME": "", "RLHF_FLOW_JOB_UID": "",
                                      "RLHF_FLOW_JOB_NAMESPACE": NS}) is None  # not a Job's pod
    env = build_work_pool_template()["job_configuration"]["job_manifest"]["spec"]["template"]["spec"][
        "containers"][0]["env"]
    refs = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in env if "fieldRef" in e.get("valueFrom", {})}
    assert refs["RLHF_FLOW_JOB_UID"] == "metadata.labels['batch.kubernetes.io/controller-uid']"
    assert refs["RLHF_FLOW_JOB_NAMESPACE"] == "metadata.namespace"
