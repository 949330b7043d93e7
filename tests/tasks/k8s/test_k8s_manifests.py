"""Kubernetes manifests: strict schema validation and the properties the cluster relies on.

What is rendered: every overlay (``kubectl kustomize k8s/overlays/<name>``), every stage kustomization,
``render_stage_job`` for every stage and shape, and the Prefect work-pool template rendered by Prefect's
own code.  Schemas: kubernetes-validate's strict schemas for Kubernetes ``K8S_VERSION`` (additional
properties are errors).  The custom resources (JobSet, Kubeflow PyTorchJob, Kubeflow TrainJob) are validated
against their published CRDs' schemas, vendored in ``k8s/crds/`` (unknown fields refused), and the pods in them
strictly as Kubernetes objects.
"""

from __future__ import annotations

import asyncio
import copy
import functools
import json
import re
import shutil
import subprocess
import uuid
from pathlib import Path

import pytest
import yaml

from rlhf_core.stages import STAGE_NAMES
from tasks.k8s import manifests, names, work_pool
from tasks.k8s.options import StageJobOptions
from tasks.k8s.render import render_stage_job, render_stage_resources
from tasks.k8s.render_operators import render_jobset, render_pytorchjob, render_trainjob

REPO = Path(__file__).resolve().parents[3]
K8S = REPO / "k8s"
OVERLAYS = ("gpu", "cpu-smoke", "multi-node", "pytorchjob", "trainjob")
GPU_OVERLAYS = ("gpu", "multi-node", "pytorchjob", "trainjob")
# The newest schema set kubernetes-validate ships that is not newer than the kubectl used here (1.32).
K8S_VERSION = "1.32"
SECRETISH = re.compile(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|(^|_)KEY($|_)|PRIVATE", re.IGNORECASE)

kv = pytest.importorskip("kubernetes_validate", reason="kubernetes-validate is in the [dev] extra")


@pytest.fixture(scope="module", autouse=True)
def _cache_schemas():
    """kubernetes-validate re-reads its JSON schemas on every call; read each once (speed only)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(kv.utils, "schema_contents", functools.cache(kv.utils.schema_contents))
        yield


def validate_strict(doc: dict) -> None:
    kv.validate(doc, K8S_VERSION, strict=True)


def test_schema_version_is_shipped():
    versions = kv.utils.all_versions()
    assert any(v.startswith(K8S_VERSION + ".") for v in versions), versions


# ------------------------------------------------------------------------------------------------------------------
# Rendering helpers
# ------------------------------------------------------------------------------------------------------------------
@functools.cache
def _kustomize(path: str) -> tuple:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: overlays are rendered with `kubectl kustomize`")
    proc = subprocess.run([kubectl, "kustomize", str(K8S / path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, f"kubectl kustomize k8s/{path} failed:\n{proc.stderr}"
    return tuple(d for d in yaml.safe_load_all(proc.stdout) if d)


def kustomize(path: str) -> list[dict]:
    return copy.deepcopy(list(_kustomize(path)))


def of_kind(docs, kind):
    return [d for d in docs if d["kind"] == kind]


def trainjob_pod_template(doc: dict) -> dict:
    """The trainer pod a TrainJob yields on the torch-distributed runtime, as far as this repository decides it:
    the runtime's ``node`` container given ``spec.trainer``'s image, command, env and resources, then our runtime
    patch (pod metadata and spec, the container's security context and mounts) merged in. Left out: what the
    Trainer adds itself (the ``PET_*`` env, container port 29500, the JobSet's hostname and subdomain)."""
    trainer = doc["spec"]["trainer"]
    (patch,) = [p for p in doc["spec"]["runtimePatches"] if p["manager"] == names.TRAINJOB_PATCH_MANAGER]
    (node,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    template = copy.deepcopy(node["template"]["spec"]["template"])
    container = {"name": names.TRAINJOB_NODE, "image": trainer["image"], "command": trainer["command"],
                 "env": trainer["env"], "resources": trainer["resourcesPerNode"]}
    for c in template["spec"].get("containers", []):
        if c["name"] == names.TRAINJOB_NODE:
            container.update(c)
    template["spec"]["containers"] = [container]
    return template


def pod_templates(doc: dict) -> list[dict]:
    """(pod template spec dicts) of a workload: Job, Deployment, PyTorchJob replicas, the TrainJob's trainer pod."""
    if doc["kind"] in ("Job", "Deployment"):
        return [doc["spec"]["template"]]
    if doc["kind"] == "PyTorchJob":
        return [r["template"] for r in doc["spec"]["pytorchReplicaSpecs"].values()]
    if doc["kind"] == "TrainJob":
        return [trainjob_pod_template(doc)]
    return []


def stage_containers(doc: dict) -> list[dict]:
    return [c for t in pod_templates(doc) for c in t["spec"]["containers"]
            if c["name"] in ("rlhf", "pytorch", names.TRAINJOB_NODE)]


def stage_workloads(docs) -> list[dict]:
    return [d for d in docs if d["kind"] in ("Job", "PyTorchJob", "TrainJob")]


CRDS = K8S / "crds"
JOBSET_SCHEMA = CRDS / "jobset-v0.12.0.schema.json"
PYTORCHJOB_SCHEMA = CRDS / "pytorchjob-v1.9.4.schema.json"
TRAINJOB_SCHEMA = CRDS / "trainjob-v2.3.0.schema.json"


@functools.cache
def crd_validator(path: Path):
    """A validator for a vendored CRD's openAPIV3Schema (k8s/crds/, its source in the file), with unknown fields
    refused as the API server's structural pruning would drop them (so a typo cannot pass). Not checked: the
    CEL rules (``x-kubernetes-validations``) and the controllers' admission webhooks."""
    import jsonschema

    def closed(node):
        if isinstance(node, dict):
            node = {k: closed(v) for k, v in node.items()}
            if node.get("type") == "object" and "properties" in node and not node.get(
                    "x-kubernetes-preserve-unknown-fields"):
                node.setdefault("additionalProperties", False)
            return node
        return [closed(x) for x in node] if isinstance(node, list) else node

    schema = closed(json.loads(path.read_text())["openAPIV3Schema"])
    cls = jsonschema.validators.validator_for(schema)
    cls.check_schema(schema)
    return cls(schema)


def validate_crd(doc: dict, path: Path) -> None:
    """Raises ``jsonschema.ValidationError`` (the best match among all errors) when ``doc`` does not fit."""
    import jsonschema

    error = jsonschema.exceptions.best_match(crd_validator(path).iter_errors(doc))
    if error is not None:
        raise error


def test_vendored_crds_name_their_source():
    for path, crd in [(JOBSET_SCHEMA, "jobsets.jobset.x-k8s.io"), (PYTORCHJOB_SCHEMA, "pytorchjobs.kubeflow.org"),
                      (TRAINJOB_SCHEMA, "trainjobs.trainer.kubeflow.org")]:
        vendored = json.loads(path.read_text())
        release = path.name.split("-")[-1].removesuffix(".schema.json")
        assert vendored["crd"] == crd and vendored["source"].startswith("https://github.com/")
        assert f"/blob/{release}/" in vendored["source"], (path.name, vendored["source"])
        assert '"description"' not in json.dumps(vendored["openAPIV3Schema"])
    assert json.loads(PYTORCHJOB_SCHEMA.read_text())["version"] == "v1"
    assert json.loads(TRAINJOB_SCHEMA.read_text())["version"] == "v1alpha1"


def validate_pytorchjob(doc: dict) -> None:
    """A kubeflow.org/v1 PyTorchJob against the Training Operator v1.9.4 CRD (vendored), the operator's own rules
    (one Master, a container named ``pytorch``, the enums it accepts), and its pod templates strictly."""
    assert doc["apiVersion"] == "kubeflow.org/v1" and doc["kind"] == "PyTorchJob"
    assert doc["metadata"]["name"] and doc["metadata"]["namespace"]
    validate_crd(doc, PYTORCHJOB_SCHEMA)
    spec = doc["spec"]
    assert spec["runPolicy"]["cleanPodPolicy"] in ("None", "All", "Running")
    replicas = spec["pytorchReplicaSpecs"]
    assert set(replicas) <= {"Master", "Worker"} and replicas["Master"]["replicas"] == 1
    for role, rs in replicas.items():
        assert rs["restartPolicy"] in ("Always", "OnFailure", "Never", "ExitCode")
        names = [c["name"] for c in rs["template"]["spec"]["containers"]]
        assert "pytorch" in names, f"{role}: the training operator requires a container named 'pytorch'"
        validate_strict({"apiVersion": "v1", "kind": "PodTemplate",
                         "metadata": {"name": f"{doc['metadata']['name']}-{role.lower()}"},
                         "template": rs["template"]})


def validate_any(doc: dict) -> None:
    if doc["kind"] == "PyTorchJob":
        validate_pytorchjob(doc)
    elif doc["kind"] == "TrainJob":
        validate_trainjob(doc)
    else:
        validate_strict(doc)


RENDER_VARIANTS = {
    "default": {},
    "cpu": {"gpus": 0, "image": names.DEFAULT_CPU_IMAGE},
    "4gpu": {"gpus": 4},
    "2x8gpu": {"nnodes": 2, "gpus": 8},
    "custom": {"gpus": 2, "nproc_per_node": 2, "params_path": "configs/gpu.yaml", "name": "my-sft",
               "node_selector": {"gpu": "a100"}, "tolerations": [], "env": {"RLHF_PARENT_RUN_ID": "abc"},
               "seed_params": False, "queue": "team-a", "priority_class": "training-low",
               "labels": {"team": "nlp", "rlhf-ops/flow-run": "0c9e4f0a-1b2c-4d5e-8f90-0123456789ab"},
               "annotations": {"example.com/owner": "Team NLP <nlp@example.com>"}},
}


def render_variant(stage: str, variant: str) -> list[dict]:
    kw = dict(RENDER_VARIANTS[variant])
    if stage == "prepare":
        kw = {k: v for k, v in kw.items() if k not in ("nnodes", "nproc_per_node")}
    return render_stage_resources(StageJobOptions(stage, **kw))


# ------------------------------------------------------------------------------------------------------------------
# Strict schema validation
# ------------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("overlay", OVERLAYS)
def test_overlay_validates_strictly(overlay):
    docs = kustomize(f"overlays/{overlay}")
    assert docs
    for doc in docs:
        validate_any(doc)


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_stage_kustomization_validates_strictly(stage):
    docs = kustomize(f"stages/{stage}")
    assert [d["kind"] for d in docs] == ["Job"]
    validate_strict(docs[0])


def test_base_validates_strictly():
    for doc in kustomize("base"):
        validate_strict(doc)


@pytest.mark.parametrize("variant", RENDER_VARIANTS)
@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_render_stage_job_validates_strictly(stage, variant):
    for doc in render_variant(stage, variant):
        validate_strict(doc)


@pytest.mark.parametrize("stage", ["sft", "rm", "rlhf", "evaluate"])
def test_render_pytorchjob_validates(stage):
    validate_pytorchjob(render_pytorchjob(StageJobOptions(stage, nnodes=3, gpus=4)))


def validate_jobset(doc: dict) -> None:
    """The JobSet against the published CRD's openAPIV3Schema (vendored: k8s/crds/, its source in the file), with
    unknown fields refused as the API server's structural pruning would drop them; its child Job strictly
    against Kubernetes' own batch/v1 schema."""
    validate_crd(doc, JOBSET_SCHEMA)
    for rj in doc["spec"]["replicatedJobs"]:
        validate_strict({"apiVersion": "batch/v1", "kind": "Job",
                         "metadata": {"name": f"{doc['metadata']['name']}-{rj['name']}-0",
                                      "namespace": doc["metadata"]["namespace"], **rj["template"]["metadata"]},
                         "spec": rj["template"]["spec"]})


@pytest.mark.parametrize("stage", ["sft", "rm", "rlhf"])
def test_render_jobset_validates_against_the_published_crd(stage):
    doc = render_jobset(StageJobOptions(stage, nnodes=3, gpus=8, queue="team-a", priority_class="training-low"))
    validate_jobset(doc)
    job = doc["spec"]["replicatedJobs"][0]["template"]["spec"]
    assert job["backoffLimit"] == 0 and job["completions"] == job["parallelism"] == 3  # a failed pod fails the Job
    assert [r["action"] for r in job["podFailurePolicy"]["rules"]] == ["FailJob", "FailJob", "FailJob"]
    rules = doc["spec"]["failurePolicy"]["rules"]
    assert [(r["action"], r["onJobFailureMessagePatterns"]) for r in rules] == [
        ("FailJobSet", ["matching FailJob rule at index 0"]),  # exit 2 / 65: permanent
        ("RestartJobSetAndIgnoreMaxRestarts", ["matching FailJob rule at index 1",  # preemption
                                               "matching FailJob rule at index 2"])]  # a rank's exit 75
    pod = job["template"]["spec"]
    name = doc["metadata"]["name"]
    cmd = pod["containers"][0]["command"]
    assert f"--master_addr={name}-node-0-0.{name}" in cmd and "--node_rank=$(JOB_COMPLETION_INDEX)" in cmd
    assert "subdomain" not in pod and doc["spec"]["network"] == {"enableDNSHostnames": True, "subdomain": name,
                                                                  "publishNotReadyAddresses": True}
    wait = next(c for c in pod["initContainers"] if c["name"] == "wait-for-master")
    assert f"getent hosts {name}-node-0-0.{name}" in wait["command"][-1]
    assert doc["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == "team-a"


def test_jobset_schema_check_refuses_what_the_crd_does_not_allow():
    import jsonschema

    bad = render_jobset(StageJobOptions("rlhf", nnodes=2))
    bad["spec"]["failurePolicy"]["rules"][0]["action"] = "Explode"
    with pytest.raises(jsonschema.ValidationError, match="Explode"):
        validate_jobset(bad)
    bad = render_jobset(StageJobOptions("rlhf", nnodes=2))
    bad["spec"]["replicatedJobs"][0]["replica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        validate_jobset(bad)
    with pytest.raises(ValueError, match="not distributed"):
        render_jobset(StageJobOptions("prepare"))


# The torch-distributed ClusterTrainingRuntime of Kubeflow Trainer v2.3.0
# (manifests/base/runtimes/torch_distributed.yaml): replicated Job -> its containers, its init containers.
TORCH_DISTRIBUTED_RUNTIME = {"node": ({"node"}, set())}
_DOMAIN_PREFIXED_PATH = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"  # DNS-1123
                                   r"/[A-Za-z0-9/\-._~%!$&'()*+,;=:]+$")  # k8s.io/apimachinery IsDomainPrefixedPath


def validate_trainjob(doc: dict) -> None:
    """A trainer.kubeflow.org/v1alpha1 TrainJob against the Kubeflow Trainer v2.3.0 CRD (vendored, unknown fields
    refused), the CRD's CEL rules on the name, the rules of the Trainer's admission webhook this object can break
    (pkg/runtime/framework/plugins/jobset/jobset.go and torch/torch.go at v2.3.0: a runtime patch names only Jobs
    and containers the runtime has, sets no env on ``node``, has a domain-prefixed manager; ``spec.trainer.env``
    has no ``PET_*`` reserved name), and the trainer pod strictly as a Kubernetes ``PodTemplate``."""
    assert doc["apiVersion"] == "trainer.kubeflow.org/v1alpha1" and doc["kind"] == "TrainJob"
    validate_crd(doc, TRAINJOB_SCHEMA)
    name = doc["metadata"]["name"]
    assert re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) and len(name) <= 63, f"{name!r}: not an RFC 1035 label"
    spec = doc["spec"]
    assert spec["runtimeRef"] == {"name": names.TRAINJOB_RUNTIME, "kind": "ClusterTrainingRuntime",
                                  "apiGroup": "trainer.kubeflow.org"}
    reserved = {e["name"] for e in spec["trainer"].get("env", [])} & set(names.TORCHRUN_RESERVED_ENV)
    assert not reserved, f"spec.trainer.env must not set {sorted(reserved)} (the torch plugin's)"
    managers = [p["manager"] for p in spec.get("runtimePatches", [])]
    assert len(managers) == len(set(managers)), "runtimePatches is a map keyed by manager"
    for patch in spec.get("runtimePatches", []):
        assert _DOMAIN_PREFIXED_PATH.match(patch["manager"]), f"manager {patch['manager']!r} not domain-prefixed"
        for rj in patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]:
            assert rj["name"] in TORCH_DISTRIBUTED_RUNTIME, f"the runtime has no replicated Job {rj['name']!r}"
            containers, init_containers = TORCH_DISTRIBUTED_RUNTIME[rj["name"]]
            pod = rj["template"]["spec"]["template"]["spec"]
            for c in pod.get("containers", []):
                assert c["name"] in containers, f"the runtime's {rj['name']} Job has no container {c['name']!r}"
                assert not (c["name"] == names.TRAINJOB_NODE and c.get("env")), "env of node: spec.trainer.env"
            for c in pod.get("initContainers", []):
                assert c["name"] in init_containers, f"the runtime has no init container {c['name']!r}"
    validate_strict({"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": f"{name}-node"},
                     "template": trainjob_pod_template(doc)})


@pytest.mark.parametrize("stage", ["sft", "rm", "rlhf"])
def test_render_trainjob_validates_against_the_published_crd(stage):
    opts = StageJobOptions(stage, nnodes=3, gpus=8, queue="team-a", labels={"team": "nlp"},
                           annotations={"example.com/owner": "nlp"}, env={"RLHF_PARENT_RUN_ID": "abc"})
    doc = render_trainjob(opts)
    validate_trainjob(doc)
    trainer = doc["spec"]["trainer"]
    assert (trainer["numNodes"], trainer["numProcPerNode"]) == (3, 8)
    assert trainer["resourcesPerNode"]["limits"][names.GPU_RESOURCE] == "8"
    # torchrun takes nnodes, nproc_per_node, node_rank, master_addr and master_port from the torch plugin's PET_*
    assert trainer["command"] == ["python", "-m", "rlhf_core.ops.launch", "--shutdown-timeout=870", "-m",
                                  "rlhf_core.cli", "stage", stage, "-p", "/etc/rlhf/params.yaml"]
    assert {"name": "RLHF_PARENT_RUN_ID", "value": "abc"} in trainer["env"]
    assert doc["metadata"]["labels"][names.KUEUE_QUEUE_LABEL] == "team-a"  # Kueue admits the TrainJob
    assert doc["spec"]["activeDeadlineSeconds"] == names.STAGE_DEADLINE_S[stage]
    pod = trainjob_pod_template(doc)
    job_pod = render_stage_job(opts)["spec"]["template"]
    assert pod["metadata"] == job_pod["metadata"]  # labels (rlhf-ops/job selects the pods) and annotations
    assert pod["spec"]["terminationGracePeriodSeconds"] == 900
    (params,) = [v for v in pod["spec"]["volumes"] if v["name"] == "params"]
    assert params["configMap"]["name"] == names.PARAMS_CONFIGMAP
    assert {"name": "params", "mountPath": "/etc/rlhf", "readOnly": True} in pod["spec"]["containers"][0][
        "volumeMounts"]


def test_trainjob_pod_is_the_stage_jobs_less_what_a_trainjob_cannot_carry():
    """Everything of the stage Job's pod arrives in the TrainJob's trainer pod, except: the seed-params init
    container (the stage reads the mounted ConfigMap instead), the container name (the runtime's ``node``),
    workingDir (the image's WORKDIR), imagePullPolicy (IfNotPresent, the default for a pinned tag),
    automountServiceAccountToken (off on the rlhf-stage ServiceAccount) and enableServiceLinks."""
    opts = StageJobOptions("rlhf", nnodes=2, gpus=4, node_selector={"gpu": "h100"},
                           tolerations=[{"key": "dedicated", "operator": "Equal", "value": "gpu"}])
    job_pod = copy.deepcopy(render_stage_job(opts)["spec"]["template"]["spec"])
    pod = trainjob_pod_template(render_trainjob(opts))["spec"]
    (job_c,), (c,) = job_pod.pop("containers"), pod.pop("containers")
    for key in ("initContainers", "automountServiceAccountToken", "enableServiceLinks", "restartPolicy", "subdomain"):
        job_pod.pop(key)
    assert pod == job_pod
    for key in ("name", "workingDir", "imagePullPolicy", "command"):
        job_c.pop(key)
    for key in ("name", "command"):
        c.pop(key)
    c["volumeMounts"].remove({"name": "params", "mountPath": "/etc/rlhf", "readOnly": True})
    job_c["env"] = [e for e in job_c["env"] if e["name"] != "JOB_COMPLETION_INDEX"]  # the Indexed Job's own
    assert c == job_c
    assert render_stage_job(opts)["spec"]["template"]["spec"]["containers"][0]["workingDir"] == names.WORKSPACE_DIR
    dockerfile = (REPO / "docker/Dockerfile.gpu").read_text()
    assert re.findall(r"^WORKDIR (\S+)", dockerfile, re.M)[-1] == names.WORKSPACE_DIR  # the TrainJob's cwd


def test_trainjob_check_refuses_what_the_crd_or_the_trainer_does_not_allow():
    import jsonschema

    def bad(edit):
        doc = render_trainjob(StageJobOptions("rlhf", nnodes=2, gpus=8))
        edit(doc)
        return doc

    patch_pod = lambda d: d["spec"]["runtimePatches"][0]["trainingRuntimeSpec"]["template"]["spec"][  # noqa: E731
        "replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    for edit, match in [
        (lambda d: d["spec"]["trainer"].update(numNode=2), "numNode"),  # a typo: structural pruning would drop it
        (lambda d: d["spec"]["trainer"].update(numProcPerNode="auto"), "auto"),  # int32 in v2.3.0
        (lambda d: patch_pod(d).update(priorityClassName="x"), "priorityClassName"),  # no such patch field
        (lambda d: patch_pod(d)["containers"][0].update(image="x"), "image"),  # a container patch has no image
        (lambda d: d["spec"].update(podTemplateOverrides=[]), "podTemplateOverrides"),  # v2.1's, gone
    ]:
        with pytest.raises(jsonschema.ValidationError, match=match):
            validate_trainjob(bad(edit))
    for edit, match in [
        (lambda d: d["metadata"].update(name="1-sft"), "RFC 1035"),
        (lambda d: d["spec"]["trainer"]["env"].append({"name": "PET_NNODES", "value": "2"}), "PET_NNODES"),
        (lambda d: patch_pod(d)["containers"][0].update(env=[{"name": "A", "value": "1"}]), "env of node"),
        (lambda d: patch_pod(d).update(initContainers=[{"name": "seed-params"}]), "no init container"),
        (lambda d: d["spec"]["runtimePatches"][0].update(manager="rlhf-ops"), "domain-prefixed"),
    ]:
        with pytest.raises(AssertionError, match=match):
            validate_trainjob(bad(edit))
    doc = bad(lambda d: patch_pod(d)["containers"][0]["securityContext"].update(runAsUser="me"))
    with pytest.raises(jsonschema.ValidationError, match="me"):
        validate_trainjob(doc)


@pytest.mark.parametrize("kw,match", [
    ({"stage": "prepare"}, "not distributed"),
    ({"stage": "sft", "priority_class": "training-low"}, "priorityClassName"),
    ({"stage": "sft", "image_pull_policy": "Always"}, "imagePullPolicy"),
    ({"stage": "sft", "env": {"PET_MASTER_ADDR": "x"}}, "PET_MASTER_ADDR"),
    ({"stage": "sft", "name": "1sft"}, "RFC 1035"),
])
def test_render_trainjob_refuses_what_it_cannot_carry(kw, match):
    with pytest.raises(ValueError, match=match):
        render_trainjob(StageJobOptions(**kw))


def test_trainjob_without_seed_params_reads_the_workspace_params():
    doc = render_trainjob(StageJobOptions("sft", seed_params=False, params_path="configs/gpu.yaml"))
    validate_trainjob(doc)
    assert doc["spec"]["trainer"]["command"][-2:] == ["-p", "configs/gpu.yaml"]
    pod = trainjob_pod_template(doc)["spec"]
    assert "params" not in {v["name"] for v in pod["volumes"]}
    assert doc["spec"]["trainer"]["numNodes"] == 1 and doc["spec"]["trainer"]["numProcPerNode"] == 1


def test_pytorchjob_check_refuses_what_the_crd_does_not_allow():
    import jsonschema

    bad = render_pytorchjob(StageJobOptions("sft", nnodes=2))
    bad["spec"]["nprocPerNode"] = 8  # a string in kubeflow.org/v1
    with pytest.raises(jsonschema.ValidationError, match="8"):
        validate_pytorchjob(bad)
    bad = render_pytorchjob(StageJobOptions("sft", nnodes=2))
    bad["spec"]["runPolicy"]["cleanPodPolicies"] = "None"
    with pytest.raises(jsonschema.ValidationError, match="cleanPodPolicies"):
        validate_pytorchjob(bad)
    bad = render_pytorchjob(StageJobOptions("sft", nnodes=2))
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["replica"] = 1
    with pytest.raises(jsonschema.ValidationError, match="replica"):
        validate_pytorchjob(bad)


def test_strict_validation_rejects_unknown_fields():
    """Guard: the validator really is strict (a typo'd field fails), so the passes above mean something."""
    job = render_stage_job(StageJobOptions("sft"))
    job["spec"]["template"]["spec"]["containers"][0]["gpuLimit"] = 1
    with pytest.raises(kv.ValidationError):
        validate_strict(job)
    job = render_stage_job(StageJobOptions("sft"))
    job["spec"]["template"]["spec"]["volumes"][0]["emptyDir"] = {"medium": "Memory", "size": "1Gi"}
    with pytest.raises(kv.ValidationError):
        validate_strict(job)
    bad = render_pytorchjob(StageJobOptions("sft", nnodes=2))
    bad["spec"]["pytorchReplicaSpecs"]["Worker"]["template"]["spec"]["containers"][0]["name"] = "trainer"
    with pytest.raises(AssertionError, match="pytorch"):
        validate_pytorchjob(bad)


# ------------------------------------------------------------------------------------------------------------------
# One source for the Job shape: kustomize output == render_stage_job
# ------------------------------------------------------------------------------------------------------------------
def _normalised(doc: dict) -> dict:
    """Volumes by name (a strategic-merge patch may reorder that list; order carries no meaning there)."""
    doc = copy.deepcopy(doc)
    for t in pod_templates(doc):
        t["spec"]["volumes"] = sorted(t["spec"].get("volumes", []), key=lambda v: v["name"])
    return doc


@pytest.mark.parametrize("stage", STAGE_NAMES)
def test_stage_kustomization_equals_render(stage):
    assert kustomize(f"stages/{stage}") == [render_stage_job(StageJobOptions(stage))]


def test_gpu_overlay_job_equals_render():
    assert of_kind(kustomize("overlays/gpu"), "Job") == [render_stage_job(StageJobOptions(names.GPU_OVERLAY_STAGE))]


def test_cpu_smoke_overlay_job_equals_render():
    """The hand-written CPU patch yields exactly what render_stage_job renders for gpus=0 and the CPU image."""
    kw = {k: v for k, v in names.CPU_SMOKE.items() if k != "stage"}
    (job,) = of_kind(kustomize("overlays/cpu-smoke"), "Job")
    assert _normalised(job) == _normalised(render_stage_job(StageJobOptions(names.CPU_SMOKE["stage"], **kw)))


def test_multi_node_overlay_equals_render():
    docs = kustomize("overlays/multi-node")
    expected = manifests.multi_node_resources()
    assert of_kind(docs, "Job") == of_kind(expected, "Job")
    assert [s for s in of_kind(docs, "Service") if s["spec"].get("clusterIP") == "None"] == of_kind(expected,
                                                                                                      "Service")


def test_pytorchjob_overlay_equals_render():
    assert of_kind(kustomize("overlays/pytorchjob"), "PyTorchJob") == [manifests.pytorchjob_resource()]


def test_trainjob_overlay_equals_render():
    assert of_kind(kustomize("overlays/trainjob"), "TrainJob") == [manifests.trainjob_resource()]


def test_trainjob_overlay_image_follows_the_images_transformer(tmp_path):
    """``kustomize edit set image`` reaches the TrainJob's spec.trainer.image (kustomizeconfig.yaml): kustomize's
    images transformer alone only knows containers[].image."""
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed")
    shutil.copytree(K8S, tmp_path / "k8s")
    kustomization = tmp_path / "k8s/overlays/trainjob/kustomization.yaml"
    text = kustomization.read_text()
    assert text.count("newTag: 0.1.0-gpu") == 1
    kustomization.write_text(text.replace("newTag: 0.1.0-gpu", "newTag: 9.9.9-test"))
    proc = subprocess.run([kubectl, "kustomize", str(tmp_path / "k8s/overlays/trainjob")], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    (tj,) = of_kind([d for d in yaml.safe_load_all(proc.stdout) if d], "TrainJob")
    assert tj["spec"]["trainer"]["image"] == f"{names.IMAGE_REPO}:9.9.9-test"


def test_generated_files_are_current():
    pytest.importorskip("prefect_kubernetes", reason="the work-pool template is built from prefect-kubernetes")
    stale = manifests.write_manifests(REPO, check=True)
    assert not stale, ("stale generated files (run `python -m tasks.k8s write-manifests`): "
                       + ", ".join(str(p.relative_to(REPO)) for p in stale))


@pytest.mark.parametrize("src,copy_", sorted(manifests.PARAMS_COPIES.items()))
def test_params_copies_identical(src, copy_):
    if not (REPO / src).is_file():
        pytest.skip(f"{src} does not exist (yet)")
    assert (REPO / copy_).read_text() == (REPO / src).read_text(), (
        f"{copy_} differs from {src}; re-copy with `python -m tasks.k8s write-manifests`")


def test_overlay_params_configmaps():
    def params_of(overlay):
        (cm,) = [c for c in of_kind(kustomize(f"overlays/{overlay}"), "ConfigMap")
                 if c["metadata"]["name"] == names.PARAMS_CONFIGMAP]
        return yaml.safe_load(cm["data"]["params.yaml"])

    assert params_of("cpu-smoke") == yaml.safe_load((K8S / "base/params.yaml").read_text())
    gpu = yaml.safe_load((K8S / "components/gpu-params/params.yaml").read_text())
    for overlay in GPU_OVERLAYS:
        assert params_of(overlay) == gpu


# ------------------------------------------------------------------------------------------------------------------
# Semantics
# ------------------------------------------------------------------------------------------------------------------
RENDERED = ([f"overlay:{o}" for o in OVERLAYS] + [f"render:{s}:{v}" for s in STAGE_NAMES for v in RENDER_VARIANTS]
            + ["render:pytorchjob", "render:trainjob"])


def rendered(label: str) -> list[dict]:
    """Docs for a RENDERED label: an overlay, a render_stage_job variant, a PyTorchJob or a TrainJob."""
    kind, _, rest = label.partition(":")
    if kind == "overlay":
        return kustomize(f"overlays/{rest}")
    if rest == "pytorchjob":
        return [render_pytorchjob(StageJobOptions("rlhf", nnodes=4, gpus=8))]
    if rest == "trainjob":
        return [render_trainjob(StageJobOptions("rlhf", nnodes=4, gpus=8, env={"RLHF_PARENT_RUN_ID": "abc"}))]
    stage, _, variant = rest.partition(":")
    return render_variant(stage, variant)


@pytest.mark.parametrize("overlay", GPU_OVERLAYS)
def test_gpu_overlays_request_gpus(overlay):
    workloads = stage_workloads(kustomize(f"overlays/{overlay}"))
    assert workloads
    for doc in workloads:
        for t in pod_templates(doc):
            (c,) = [c for c in t["spec"]["containers"] if c["name"] in ("rlhf", "pytorch", names.TRAINJOB_NODE)]
            limits, requests = c["resources"]["limits"], c["resources"]["requests"]
            assert int(limits[names.GPU_RESOURCE]) >= 1 and limits[names.GPU_RESOURCE] == requests[names.GPU_RESOURCE]
            assert t["spec"]["nodeSelector"] and t["spec"]["tolerations"]
            assert any(tol.get("key") == names.GPU_RESOURCE for tol in t["spec"]["tolerations"])


def test_cpu_smoke_has_no_gpu_anything():
    docs = kustomize("overlays/cpu-smoke")
    assert names.GPU_RESOURCE not in json.dumps(docs), "nvidia.com/gpu found in the cpu-smoke overlay"
    for doc in stage_workloads(docs):
        for t in pod_templates(doc):
            assert "nodeSelector" not in t["spec"] and "tolerations" not in t["spec"]
            for c in t["spec"]["containers"]:
                assert int(c["resources"]["requests"]["cpu"]) <= 4
                assert c["image"].endswith("-cpu")


@pytest.mark.parametrize("label", RENDERED)
def test_stage_pods_mount_memory_backed_shm(label):
    docs = rendered(label)
    for doc in stage_workloads(docs):
        for t in pod_templates(doc):
            volumes = {v["name"]: v for v in t["spec"]["volumes"]}
            for c in stage_containers({"kind": "Job", "spec": {"template": t}}):
                (mount,) = [m for m in c["volumeMounts"] if m["mountPath"] == "/dev/shm"]
                assert volumes[mount["name"]]["emptyDir"]["medium"] == "Memory"
                assert volumes[mount["name"]]["emptyDir"]["sizeLimit"]


@pytest.mark.parametrize("label", RENDERED)
def test_pods_run_as_non_root(label):
    docs = rendered(label)
    for doc in docs:
        for t in pod_templates(doc):
            pod_sc = t["spec"].get("securityContext", {})
            assert pod_sc.get("seccompProfile", {}).get("type") == "RuntimeDefault", doc["metadata"]["name"]
            for c in t["spec"]["containers"] + t["spec"].get("initContainers", []):
                sc = c.get("securityContext", {})
                run_as_non_root = sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot"))
                uid = sc.get("runAsUser", pod_sc.get("runAsUser"))
                assert run_as_non_root is True and uid == names.RUN_AS_UID, (label, c["name"])
                assert sc.get("allowPrivilegeEscalation") is False, (label, c["name"])
                assert sc.get("capabilities", {}).get("drop") == ["ALL"], (label, c["name"])
                assert not sc.get("privileged", False)


@pytest.mark.parametrize("label", RENDERED)
def test_no_secret_values(label):
    docs = rendered(label)
    assert not [d for d in docs if d["kind"] == "Secret"], "manifests must reference Secrets, not contain them"
    for doc in docs:
        for t in pod_templates(doc):
            for c in t["spec"]["containers"] + t["spec"].get("initContainers", []):
                for e in c.get("env", []):
                    if SECRETISH.search(e["name"]):
                        assert "value" not in e, f"{label}: env {e['name']} has a literal value"
                        assert "secretKeyRef" in e["valueFrom"], f"{label}: {e['name']} not from a Secret"
                    value = str(e.get("value", ""))
                    assert not re.search(r"://[^/\s:@]+:[^/\s@]+@", value), f"{label}: credentials in URL {value}"
                    assert not re.fullmatch(r"[A-Za-z0-9+/_=-]{32,}", value), f"{label}: {e['name']} looks like a key"


def test_secret_references_are_the_documented_keys():
    documented = set(re.findall(r"^#?\s?([A-Z][A-Z0-9_]+)=", (K8S / "base/secrets.example.env").read_text(), re.M))
    for label in RENDERED:
        for doc in rendered(label):
            for t in pod_templates(doc):
                for c in t["spec"]["containers"]:
                    for e in c.get("env", []):
                        ref = e.get("valueFrom", {}).get("secretKeyRef")
                        if ref:
                            assert ref["name"] == names.CREDENTIALS_SECRET
                            assert ref["key"] in documented, f"{ref['key']} missing from secrets.example.env"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_one_image_tag_per_overlay(overlay):
    images = [c["image"] for d in kustomize(f"overlays/{overlay}") for t in pod_templates(d)
              for c in t["spec"]["containers"] + t["spec"].get("initContainers", [])]
    for image in images:
        name, _, tag = image.rpartition(":")
        assert name and tag and tag != "latest" and "/" not in tag, f"unpinned image {image}"
    ours = {i for i in images if i.startswith(names.IMAGE_REPO + ":")}
    assert len(ours) == 1, f"{overlay}: several rlhf-ops images {ours}"
    assert ours == {names.DEFAULT_CPU_IMAGE if overlay == "cpu-smoke" else names.DEFAULT_GPU_IMAGE}


@pytest.mark.parametrize("label", RENDERED)
def test_container_command_is_the_stage_cli(label):
    docs = rendered(label)
    for doc in stage_workloads(docs):
        stage = doc["metadata"]["labels"]["rlhf-ops/stage"]
        for c in stage_containers(doc):
            cmd = c["command"]
            tail = cmd[cmd.index("stage"):] if "stage" in cmd else []
            assert tail[:2] == ["stage", stage], cmd
            assert tail[2:] in ([], ["-p", tail[-1]]), cmd
            head = cmd[:len(cmd) - len(tail)]
            assert head == ["rlhf"] or (head[:3] == ["python", "-m", "rlhf_core.ops.launch"]
                                        and head[-2:] == ["-m", "rlhf_core.cli"]), cmd
            if head != ["rlhf"]:  # torchrun SIGKILLs its ranks this long after SIGTERM: above the stop grace (600 s),
                assert 600 < int(_flag(cmd, "shutdown-timeout")) <= 900 - 30, cmd  # below the pod's (900 s)
            assert "args" not in c, "the command is complete; args would be appended to it"


def _flag(cmd: list[str], name: str) -> str:
    (value,) = [a.split("=", 1)[1] for a in cmd if a.startswith(f"--{name}=")]
    return value


def _check_indexed_job(job: dict, services: list[dict]) -> None:
    spec, pod = job["spec"], job["spec"]["template"]["spec"]
    (c,) = stage_containers(job)
    cmd = c["command"]
    assert cmd[:3] == ["python", "-m", "rlhf_core.ops.launch"]
    assert int(_flag(cmd, "shutdown-timeout")) == pod["terminationGracePeriodSeconds"] - 30
    nnodes = int(_flag(cmd, "nnodes"))
    assert nnodes > 1 and spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == nnodes
    assert _flag(cmd, "node_rank") == "$(JOB_COMPLETION_INDEX)"
    (idx,) = [e for e in c["env"] if e["name"] == "JOB_COMPLETION_INDEX"]
    assert idx["valueFrom"]["fieldRef"]["fieldPath"] == \
        "metadata.annotations['batch.kubernetes.io/job-completion-index']"
    # rendezvous at pod 0: Indexed pods are named <job>-<index>; the subdomain is the headless Service
    assert _flag(cmd, "master_addr") == f"{job['metadata']['name']}-0.{pod['subdomain']}"
    (svc,) = [s for s in services if s["metadata"]["name"] == pod["subdomain"]]
    assert svc["spec"]["clusterIP"] == "None" and svc["spec"]["publishNotReadyAddresses"] is True
    assert svc["metadata"]["namespace"] == job["metadata"]["namespace"]
    labels = job["spec"]["template"]["metadata"]["labels"]
    assert svc["spec"]["selector"] and all(labels.get(k) == v for k, v in svc["spec"]["selector"].items())
    assert int(_flag(cmd, "master_port")) in [p["port"] for p in svc["spec"]["ports"]]
    assert int(_flag(cmd, "nproc_per_node")) == int(c["resources"]["limits"][names.GPU_RESOURCE])
    assert pod["restartPolicy"] == "Never"


def test_multi_node_overlay_wiring():
    docs = kustomize("overlays/multi-node")
    (job,) = of_kind(docs, "Job")
    _check_indexed_job(job, of_kind(docs, "Service"))
    assert job["spec"]["completions"] == names.MULTI_NODE["nnodes"]


@pytest.mark.parametrize("nnodes,gpus", [(2, 1), (3, 8), (16, 4)])
def test_render_multi_node_wiring(nnodes, gpus):
    docs = render_stage_resources(StageJobOptions("rlhf", nnodes=nnodes, gpus=gpus, name="rlhf-x"))
    (job,) = of_kind(docs, "Job")
    _check_indexed_job(job, of_kind(docs, "Service"))


def test_pytorchjob_overlay_wiring():
    (pj,) = of_kind(kustomize("overlays/pytorchjob"), "PyTorchJob")
    replicas = pj["spec"]["pytorchReplicaSpecs"]
    nnodes = sum(r["replicas"] for r in replicas.values())
    assert nnodes == names.PYTORCHJOB["nnodes"]
    for r in replicas.values():
        (c,) = [c for c in r["template"]["spec"]["containers"] if c["name"] == "pytorch"]
        cmd = c["command"]
        assert int(_flag(cmd, "nnodes")) == nnodes
        assert _flag(cmd, "node_rank") == "$(RANK)" and _flag(cmd, "master_addr") == "$(MASTER_ADDR)"
        assert int(_flag(cmd, "nproc_per_node")) == int(c["resources"]["limits"][names.GPU_RESOURCE]) \
            == int(pj["spec"]["nprocPerNode"])
        assert {"name": "pytorchjob-port", "containerPort": names.MASTER_PORT, "protocol": "TCP"} in c["ports"]


def test_trainjob_overlay_wiring():
    """The Trainer's torch plugin gives the trainer container PET_NNODES = numNodes, PET_NPROC_PER_NODE =
    numProcPerNode, PET_NODE_RANK, PET_MASTER_ADDR, PET_MASTER_PORT; the command must leave those to it."""
    (tj,) = of_kind(kustomize("overlays/trainjob"), "TrainJob")
    trainer = tj["spec"]["trainer"]
    assert trainer["numNodes"] == names.TRAINJOB["nnodes"]
    assert trainer["numProcPerNode"] == int(trainer["resourcesPerNode"]["limits"][names.GPU_RESOURCE]) \
        == names.TRAINJOB["gpus"]
    cmd = trainer["command"]
    assert not [a for a in cmd if re.match(r"--(nnodes|nproc_per_node|node_rank|master_addr|master_port|"
                                           r"standalone|rdzv)", a)], cmd
    grace = trainjob_pod_template(tj)["spec"]["terminationGracePeriodSeconds"]
    assert int(_flag(cmd, "shutdown-timeout")) == grace - 30


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_job_lifecycle_fields(overlay):
    docs = kustomize(f"overlays/{overlay}")
    accounts = {d["metadata"]["name"]: d for d in of_kind(docs, "ServiceAccount")}
    for doc in stage_workloads(docs):
        spec = doc["spec"] if doc["kind"] in ("Job", "TrainJob") else doc["spec"]["runPolicy"]
        assert 0 < spec["activeDeadlineSeconds"] <= 7 * 24 * 3600
        if doc["kind"] != "TrainJob":  # a TrainJob's restarts and TTL are its runtime's (torch-distributed: none)
            assert 0 <= spec["backoffLimit"] <= 3
            assert spec["ttlSecondsAfterFinished"] > 0
        for t in pod_templates(doc):
            # a TrainJob's runtime patch has no automountServiceAccountToken: the ServiceAccount's own applies
            token = t["spec"].get("automountServiceAccountToken", accounts[t["spec"]["serviceAccountName"]].get(
                "automountServiceAccountToken"))
            assert token is False
            assert t["spec"]["serviceAccountName"] == names.STAGE_SERVICE_ACCOUNT
        if doc["kind"] == "Job":
            rules = doc["spec"]["podFailurePolicy"]["rules"]
            assert {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]} in rules
            assert {"action": "Ignore", "onExitCodes": {"containerName": names.CONTAINER, "operator": "In",
                                                        "values": [75]}} in rules  # resumable, not a failure


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_references_resolve_within_overlay(overlay):
    """Every ConfigMap, PVC and ServiceAccount a pod references is part of the overlay (Secrets: user-made)."""
    docs = kustomize(f"overlays/{overlay}")
    have = {(d["kind"], d["metadata"]["name"]) for d in docs}
    namespaces = {d["metadata"].get("namespace") for d in docs if d["kind"] != "Namespace"}
    assert namespaces == {names.NAMESPACE} and ("Namespace", names.NAMESPACE) in have
    for doc in docs:
        for t in pod_templates(doc):
            spec = t["spec"]
            assert ("ServiceAccount", spec["serviceAccountName"]) in have
            for v in spec.get("volumes", []):
                if "configMap" in v:
                    assert ("ConfigMap", v["configMap"]["name"]) in have
                if "persistentVolumeClaim" in v:
                    assert ("PersistentVolumeClaim", v["persistentVolumeClaim"]["claimName"]) in have
            for c in spec["containers"] + spec.get("initContainers", []):
                for e in c.get("env", []):
                    ref = e.get("valueFrom", {}).get("configMapKeyRef")
                    if ref:
                        (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == ref["name"]]
                        assert ref["key"] in cm["data"]
                mounts = {m["name"] for m in c.get("volumeMounts", [])}
                assert mounts <= {v["name"] for v in spec.get("volumes", [])}
    if stage_workloads(docs):
        (pvc,) = [d for d in docs
                  if d["kind"] == "PersistentVolumeClaim" and d["metadata"]["name"] == names.WORKSPACE_PVC]
        assert pvc["spec"]["accessModes"] == ["ReadWriteMany"]
        for doc in stage_workloads(docs):
            for c in stage_containers(doc):
                assert {"name": "workspace", "mountPath": "/workspace"} in c["volumeMounts"]


def test_stage_params_come_from_the_configmap():
    job = render_stage_job(StageJobOptions("rm"))
    pod = job["spec"]["template"]["spec"]
    (seed,) = pod["initContainers"]
    assert "/etc/rlhf/params.yaml" in seed["command"][-1] and '"/workspace/params.yaml"' in seed["command"][-1]
    (params,) = [v for v in pod["volumes"] if v["name"] == "params"]
    assert params["configMap"]["name"] == names.PARAMS_CONFIGMAP
    assert pod["containers"][0]["workingDir"] == "/workspace"


def test_rbac():
    docs = kustomize("base")
    roles = {d["metadata"]["name"]: d for d in of_kind(docs, "Role")}
    bindings = of_kind(docs, "RoleBinding")

    def allowed(role, group, resource, verb):
        return any(group in r["apiGroups"] and resource in r["resources"] and verb in r["verbs"]
                   for r in roles[role]["rules"])

    need = [("batch", "jobs", v) for v in ("create", "get", "list", "watch", "delete")]
    need += [("", "pods", v) for v in ("get", "list", "watch")] + [("", "pods/log", "get")]
    need += [("", "events", v) for v in ("list", "watch")]
    for role in ("prefect-worker", names.FLOW_SERVICE_ACCOUNT):
        for group, resource, verb in need:
            assert allowed(role, group, resource, verb), (role, group, resource, verb)
    assert allowed(names.FLOW_SERVICE_ACCOUNT, "", "services", "create")  # headless Service of multi-node stages
    for role in roles.values():
        for rule in role["rules"]:
            assert "*" not in rule["verbs"] + rule["resources"] + rule["apiGroups"]
            assert "secrets" not in rule["resources"]
    bound = {(b["roleRef"]["name"], s["name"]) for b in bindings for s in b["subjects"]}
    assert bound == {("prefect-worker", "prefect-worker"), (names.FLOW_SERVICE_ACCOUNT, names.FLOW_SERVICE_ACCOUNT)}
    accounts = {d["metadata"]["name"]: d for d in of_kind(docs, "ServiceAccount")}
    assert accounts[names.STAGE_SERVICE_ACCOUNT]["automountServiceAccountToken"] is False


def test_mlflow_server():
    docs = kustomize("base")
    (dep,) = of_kind(docs, "Deployment")
    (c,) = dep["spec"]["template"]["spec"]["containers"]
    name, _, tag = c["image"].rpartition(":")
    assert name == "ghcr.io/mlflow/mlflow" and re.fullmatch(r"v\d+\.\d+\.\d+(-full)?", tag)
    constraints = REPO / "constraints.txt"
    if constraints.is_file():
        pin = re.search(r"^mlflow==(\S+)$", constraints.read_text(), re.M)
        assert pin and tag.removeprefix("v").removesuffix("-full") == pin.group(1), "server != client version"
    env = {e["name"]: e for e in c["env"]}
    # `mlflow server` reads --backend-store-uri from MLFLOW_BACKEND_STORE_URI; it comes from the Secret
    assert env["MLFLOW_BACKEND_STORE_URI"]["valueFrom"]["secretKeyRef"]["name"] == names.CREDENTIALS_SECRET
    assert "--artifacts-destination=$(MLFLOW_ARTIFACTS_DESTINATION)" in c["args"] and "--serve-artifacts" in c["args"]
    assert any(a.startswith("--allowed-hosts=rlhf-mlflow") for a in c["args"])
    (svc,) = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == "rlhf-mlflow"]
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert all(labels[k] == v for k, v in svc["spec"]["selector"].items())
    (cm,) = [d for d in docs if d["kind"] == "ConfigMap" and d["metadata"]["name"] == names.ENDPOINTS_CONFIGMAP]
    assert cm["data"]["MLFLOW_TRACKING_URI"] == f"http://rlhf-mlflow:{svc['spec']['ports'][0]['port']}"


# ------------------------------------------------------------------------------------------------------------------
# Prefect work-pool base job template
# ------------------------------------------------------------------------------------------------------------------
SAMPLE_VALUES = {
    "gpu_count": 4,
    "node_selector": {"nvidia.com/gpu.product": "NVIDIA-H100-80GB-HBM3"},
    "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoSchedule"}],
    "shm_size": "32Gi",
    "workspace_pvc": "team-a-workspace",
    "image": "registry.example.com/rlhf-ops:0.1.0-gpu",
    "cpu_request": "16",
    "memory_limit": "200Gi",
    "env": {"RLHF_EXAMPLE": "1"},
}
# Where each added variable must land in the Job manifest.
LANDING = {
    "gpu_count": lambda m: [m["spec"]["template"]["spec"]["containers"][0]["resources"][k][names.GPU_RESOURCE]
                            for k in ("limits", "requests")],
    "node_selector": lambda m: [m["spec"]["template"]["spec"]["nodeSelector"]],
    "tolerations": lambda m: [m["spec"]["template"]["spec"]["tolerations"]],
    "shm_size": lambda m: [v["emptyDir"]["sizeLimit"] for v in m["spec"]["template"]["spec"]["volumes"]
                           if v["name"] == "dshm"],
    "workspace_pvc": lambda m: [v["persistentVolumeClaim"]["claimName"]
                                for v in m["spec"]["template"]["spec"]["volumes"] if v["name"] == "workspace"],
}
# Fields prefect-kubernetes' validator insists on in the *pod* spec (they belong to the Job spec); the API
# server drops unknown fields with a warning (fieldValidation=Warn is the default for API clients).
PREFECT_QUIRK_FIELDS = ("completions", "parallelism")


def _work_pool_template() -> dict:
    return json.loads((K8S / "prefect/base-job-template.json").read_text())


def _render_work_pool(values: dict) -> dict:
    """Render the template exactly as a Prefect Kubernetes worker does for a flow run (no API calls)."""
    pytest.importorskip("prefect_kubernetes")
    from prefect.client.schemas.objects import FlowRun
    from prefect_kubernetes.worker import KubernetesWorkerJobConfiguration

    class NoClient:  # the template has no block/variable placeholders, so Prefect must not need its API
        def __getattr__(self, name):
            raise AssertionError(f"template rendering used the Prefect API ({name})")

    config = asyncio.run(KubernetesWorkerJobConfiguration.from_template_and_values(
        _work_pool_template(), values, client=NoClient()))
    config.prepare_for_flow_run(FlowRun(flow_id=uuid.uuid4(), name="sample-run"))
    return config.job_manifest


def test_the_flow_run_pod_requests_cpu_and_memory_by_default():
    """Not BestEffort (first evicted): requests by default, no limits (registration loads the models)."""
    c = _render_work_pool({})["spec"]["template"]["spec"]["containers"][0]
    assert c["resources"]["requests"]["cpu"] == work_pool.FLOW_RUN_CPU_REQUEST == "1"
    assert c["resources"]["requests"]["memory"] == work_pool.FLOW_RUN_MEMORY_REQUEST == "4Gi"
    assert "cpu" not in c["resources"].get("limits", {}) and "memory" not in c["resources"].get("limits", {})


def test_work_pool_template_extends_prefect_default():
    pytest.importorskip("prefect_kubernetes")
    from prefect_kubernetes.worker import KubernetesWorker

    default = KubernetesWorker.get_default_base_job_template()
    ours = _work_pool_template()
    assert set(default["variables"]["properties"]) < set(ours["variables"]["properties"])
    added = set(ours["variables"]["properties"]) - set(default["variables"]["properties"])
    assert added == set(work_pool.WORK_POOL_VARIABLES)
    assert set(ours["job_configuration"]) == set(default["job_configuration"])


def test_every_work_pool_variable_is_used():
    """Prefect silently drops a variable nothing in job_configuration references."""
    from prefect.utilities.templating import find_placeholders

    template = _work_pool_template()
    used = {p.name for p in find_placeholders(json.dumps(template["job_configuration"]))}
    manifest_used = {p.name for p in find_placeholders(json.dumps(template["job_configuration"]["job_manifest"]))}
    assert set(template["variables"]["properties"]) <= used
    assert set(work_pool.WORK_POOL_VARIABLES) <= manifest_used


def test_the_flow_run_pod_reads_its_params_only_after_taking_the_workspace_slot(tmp_path):
    """No init container copies the params ConfigMap over /workspace/params.yaml before the flow holds the
    workspace's slot (an earlier run on that workspace may still be reading it): the ConfigMap is mounted
    read-only, the Kubernetes deployment names the mounted file as its params_file, and the flow writes it over
    params.yaml inside the slot (flows.pipeline: workspace_slot, then use_profile)."""
    import inspect

    import flows.pipeline
    from flows.params_file import use_profile

    pod = _render_work_pool(SAMPLE_VALUES)["spec"]["template"]["spec"]
    assert "initContainers" not in pod
    assert {"name": "params", "mountPath": names.PARAMS_MOUNT_DIR, "readOnly": True} in \
        pod["containers"][0]["volumeMounts"]
    deployments = yaml.safe_load((REPO / "prefect.yaml").read_text())["deployments"]
    (k8s,) = [d for d in deployments if d["parameters"].get("backend") == "kubernetes"]
    assert k8s["parameters"]["params_file"] == f"{names.PARAMS_MOUNT_DIR}/params.yaml"
    flow_src = inspect.getsource(flows.pipeline.rlhf_pipeline) + inspect.getsource(flows.pipeline._pipeline)
    assert flow_src.index("workspace_slot(") < flow_src.index("use_profile(")
    mounted = tmp_path / "etc" / "params.yaml"  # an absolute params_file outside the workspace
    mounted.parent.mkdir()
    mounted.write_text("sft: {epochs: 3}\n")
    (tmp_path / "ws").mkdir()
    assert use_profile(tmp_path / "ws", mounted)
    assert yaml.safe_load((tmp_path / "ws" / "params.yaml").read_text())["sft"]["epochs"] == 3


def test_work_pool_variables_land_in_the_manifest():
    manifest = _render_work_pool(SAMPLE_VALUES)
    for var, where in LANDING.items():
        found = where(manifest)
        assert found and all(v == SAMPLE_VALUES[var] for v in found), (var, found)
        default = work_pool.WORK_POOL_VARIABLES[var]["default"]
        assert default != SAMPLE_VALUES[var], f"sample for {var} equals the default: the check would prove nothing"
    pod = manifest["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == SAMPLE_VALUES["image"]
    assert c["resources"]["requests"]["cpu"] == "16" and c["resources"]["limits"]["memory"] == "200Gi"
    assert {"name": "RLHF_EXAMPLE", "value": "1"} in c["env"]
    assert c["command"] == ["/usr/bin/env"] and c["args"][:2] == ["prefect", "flow-run"]
    assert {"name": "dshm", "mountPath": "/dev/shm"} in c["volumeMounts"]


@pytest.mark.parametrize("values", [{}, SAMPLE_VALUES], ids=["defaults", "sample"])
def test_work_pool_manifest_validates_strictly(values):
    manifest = _render_work_pool(values)
    pod = manifest["spec"]["template"]["spec"]
    assert all(pod.get(f) == 1 for f in PREFECT_QUIRK_FIELDS)
    with pytest.raises(kv.ValidationError, match="|".join(PREFECT_QUIRK_FIELDS)):
        validate_strict(manifest)
    for f in PREFECT_QUIRK_FIELDS:  # the only strict-schema deviation: Prefect's own required quirk
        del pod[f]
    validate_strict(manifest)
    namespace = manifest["metadata"]["namespace"]
    assert namespace == names.NAMESPACE and pod["serviceAccountName"] == names.FLOW_SERVICE_ACCOUNT
    if not values:
        assert pod["containers"][0]["resources"]["limits"][names.GPU_RESOURCE] == 0
        assert pod["nodeSelector"] == {} and pod["tolerations"] == []
