"""Rendering for the cluster's training operators: a JobSet (gang restart), a Kubeflow PyTorchJob (Training
Operator v1) and a Kubeflow Trainer v2 TrainJob, built from the stage Job's pod (``tasks.k8s.render``); and the
dispatch behind ``rlhf k8s render STAGE --kind KIND``.
"""

from __future__ import annotations

import copy
from typing import Any

import yaml

from tasks.k8s.names import (
    MASTER_PORT,
    PARAMS_MOUNT_DIR,
    RENDER_KINDS,
    TORCHRUN_RESERVED_ENV,
    TRAINJOB_NODE,
    TRAINJOB_PATCH_MANAGER,
    TRAINJOB_RUNTIME,
)
from tasks.k8s.options import StageJobOptions
from tasks.k8s.render import (
    job_labels,
    launcher,
    object_meta,
    pod_spec,
    render_stage_job,
    render_stage_resources,
    stage_command,
    stage_env,
    wait_for_master,
)


def no_dvc_remote(opts: StageJobOptions) -> None:
    """The operators' kinds run torchrun in every pod; under DVC a stage runs in one pod (``kind: job``)."""
    if opts.dvc_remote:
        raise ValueError("dvc_remote runs a stage under DVC in one pod: render it as a Job (--kind job); the "
                         "multi-node kinds use the shared workspace volume")


def render_pytorchjob(opts: StageJobOptions) -> dict:
    """A Kubeflow ``PyTorchJob`` (kubeflow.org/v1, training operator) for a multi-node stage.

    The operator creates the Master/Worker pods and their service and sets ``MASTER_ADDR``,
    ``MASTER_PORT`` and ``RANK`` (the node rank) in each; torchrun takes them from there.
    The pod shape (security, volumes, /dev/shm, env) is the stage Job's.
    """
    no_dvc_remote(opts)
    if opts.stage == "prepare":
        raise ValueError("the prepare stage is not distributed; run it as a Job")
    name, nnodes = opts.job_name, opts.nnodes
    tail = ["stage", opts.stage] + ([] if opts.params_path == "params.yaml" else ["-p", opts.params_path])
    command = [*launcher(opts.termination_grace_s), f"--nnodes={nnodes}", f"--nproc_per_node={opts.procs_per_node}",
               "--node_rank=$(RANK)",
               "--master_addr=$(MASTER_ADDR)", "--master_port=$(MASTER_PORT)", "-m", "rlhf_core.cli", *tail]
    labels = job_labels(opts)
    pod = pod_spec(opts, command=command, env=stage_env(opts.env, opts.image), container_name="pytorch")
    # The operator's MASTER_PORT comes from the container port named pytorchjob-port.
    pod["containers"][0]["ports"] = [{"name": "pytorchjob-port", "containerPort": MASTER_PORT, "protocol": "TCP"}]
    template = {"metadata": object_meta(opts, labels), "spec": pod}
    replicas = {"Master": {"replicas": 1, "restartPolicy": "OnFailure", "template": template}}
    if nnodes > 1:
        replicas["Worker"] = {"replicas": nnodes - 1, "restartPolicy": "OnFailure",
                              "template": copy.deepcopy(template)}
    return {
        "apiVersion": "kubeflow.org/v1",
        "kind": "PyTorchJob",
        "metadata": {"name": name, "namespace": opts.namespace, **object_meta(opts, labels)},
        "spec": {
            "nprocPerNode": str(opts.procs_per_node),
            "runPolicy": {
                "cleanPodPolicy": "None",  # keep finished pods for `kubectl logs` until the TTL removes the job
                "backoffLimit": opts.backoff_limit,
                "activeDeadlineSeconds": opts.deadline_s,
                "ttlSecondsAfterFinished": opts.ttl_s,
            },
            "pytorchReplicaSpecs": replicas,
        },
    }


JOBSET_NODES = "node"  # the JobSet's one replicated Job: its pods are <jobset>-node-0-<rank>.<jobset>


def render_jobset(opts: StageJobOptions) -> dict:
    """A ``JobSet`` (jobset.x-k8s.io/v1alpha2) for a multi-node stage: the stage's Indexed Job as its one
    replicated Job, restarted as a group.

    * Gang restart: the child Job has ``backoffLimit: 0``, so a failed pod fails it, and the JobSet recreates all
      pods (``failurePolicy.maxRestarts`` = ``backoff_limit``); every rank resumes from the shared checkpoint,
      instead of the survivors hanging in NCCL until the deadline.
    * The child Job's pod failure policy stays the stage Job's: a permanent exit (bad params or input,
      rule 0) fails the JobSet at once (``FailJobSet``); a disruption (preemption, eviction, node drain: rule 1)
      fails the child Job too, as does a rank's exit 75 (stopped on SIGTERM, checkpointed: rule 2), so the whole
      group restarts, not counted against ``maxRestarts``. The rules
      match the Job controller's failure message ``... matching FailJob rule at index N``.
    * Rendezvous: JobSet publishes the pods under a headless Service named after it; rank 0 is
      ``<name>-node-0-0.<name>``.
    """
    no_dvc_remote(opts)
    if opts.stage == "prepare":
        raise ValueError("the prepare stage is not distributed; run it as a Job")
    name = opts.job_name
    job = render_stage_job(opts)
    first_job = f"{name}-{JOBSET_NODES}-0"  # the replicated Job's name; its pod i is <first_job>-<i>
    pod = job["spec"]["template"]["spec"]
    pod["containers"][0]["command"] = stage_command(opts.stage, opts.params_path, opts.nnodes, opts.procs_per_node,
                                                    job_name=first_job, service=name,
                                                    termination_grace_s=opts.termination_grace_s)
    pod.pop("subdomain", None)  # JobSet sets each pod's hostname and subdomain
    pod["initContainers"] = [c for c in pod.get("initContainers", []) if c["name"] != "wait-for-master"] + (
        [wait_for_master(first_job, opts.image, opts.image_pull_policy, service=name)] if opts.nnodes > 1 else [])
    spec = job["spec"]
    spec["backoffLimit"] = 0
    rules = spec["podFailurePolicy"]["rules"]
    for i in (1, 2):  # a disrupted pod or a rank stopped on SIGTERM (exit 75) restarts the group, not itself
        rules[i] = {**rules[i], "action": "FailJob"}
    spec.pop("ttlSecondsAfterFinished", None)  # the JobSet's TTL removes its Jobs
    return {
        "apiVersion": "jobset.x-k8s.io/v1alpha2",
        "kind": "JobSet",
        "metadata": job["metadata"],
        "spec": {
            "failurePolicy": {"maxRestarts": opts.backoff_limit, "rules": [
                {"name": "permanentExit", "action": "FailJobSet", "onJobFailureReasons": ["PodFailurePolicy"],
                 "onJobFailureMessagePatterns": ["matching FailJob rule at index 0"]},
                {"name": "disruption", "action": "RestartJobSetAndIgnoreMaxRestarts",
                 "onJobFailureReasons": ["PodFailurePolicy"],
                 "onJobFailureMessagePatterns": ["matching FailJob rule at index 1",
                                                 "matching FailJob rule at index 2"]},
            ]},
            "network": {"enableDNSHostnames": True, "subdomain": name, "publishNotReadyAddresses": True},
            "replicatedJobs": [{"name": JOBSET_NODES, "replicas": 1,
                                "template": {"metadata": copy.deepcopy(job["spec"]["template"]["metadata"]),
                                             "spec": spec}}],
            "ttlSecondsAfterFinished": opts.ttl_s,
        },
    }


TRAINER_API_GROUP = "trainer.kubeflow.org"


def render_trainjob(opts: StageJobOptions) -> dict:
    """A Kubeflow Trainer v2 ``TrainJob`` (trainer.kubeflow.org/v1alpha1, checked against v2.3.0) running the
    stage on the ``torch-distributed`` ClusterTrainingRuntime.

    * ``spec.trainer``: the image, the command, the env, ``numNodes``, ``numProcPerNode`` and
      ``resourcesPerNode`` (the stage Job container's requests and limits, GPUs included).
    * Rendezvous: the Trainer's torch plugin sets ``PET_NNODES``, ``PET_NPROC_PER_NODE``, ``PET_NODE_RANK`` (the
      Job completion index), ``PET_MASTER_ADDR`` (``<name>-node-0-0.<name>``) and ``PET_MASTER_PORT`` (29500) in
      the trainer container, and torchrun's parser takes every option it is not given from ``PET_<OPTION>``;
      so the command is the launcher without rendezvous flags:
      ``python -m rlhf_core.ops.launch --shutdown-timeout=<grace - 30> -m rlhf_core.cli stage NAME -p ...``.
    * The rest of the stage Job's pod goes in as one ``runtimePatches`` entry on the runtime's ``node`` Job:
      pod labels and annotations, service account, pod and container security context, the workspace,
      ``/dev/shm`` and params volumes and their mounts, node selector, tolerations, termination grace.
    * Params: the runtime has no init container to patch (a patch may only change containers the runtime has),
      so with ``seed_params`` the stage reads the params ConfigMap where it is mounted
      (``-p /etc/rlhf/params.yaml``) instead of a copy on the workspace; without, ``params_path`` as the Job.

    What a TrainJob cannot carry is refused rather than dropped: a pod ``priorityClassName`` and an
    ``imagePullPolicy`` other than ``IfNotPresent`` (no field for either). Not carried, and the same in effect:
    ``automountServiceAccountToken: false`` (the ``rlhf-stage`` ServiceAccount already disables it),
    ``workingDir`` (the image's ``WORKDIR`` is ``/workspace``). The lifecycle (restarts, failure policy, TTL)
    is the runtime's: ``backoff_limit`` and ``ttl_s`` do not apply; ``activeDeadlineSeconds`` does.
    """
    no_dvc_remote(opts)
    if opts.stage == "prepare":
        raise ValueError("the prepare stage is not distributed; run it as a Job")
    name = opts.job_name
    if not name[0].isalpha():
        raise ValueError(f"a TrainJob's name must start with a letter (RFC 1035), got {name!r}")
    if opts.priority_class:
        raise ValueError("a TrainJob cannot set the pods' priorityClassName (Trainer v2.3.0's runtimePatches "
                         "have no such field); render a Job or JobSet, or use a runtime that sets it")
    if opts.image_pull_policy != "IfNotPresent":
        raise ValueError(f"a TrainJob cannot set imagePullPolicy (got {opts.image_pull_policy!r}); the "
                         f"Kubernetes default for a pinned tag is IfNotPresent")
    reserved = sorted(set(opts.env or {}) & set(TORCHRUN_RESERVED_ENV))
    if reserved:
        raise ValueError(f"env {reserved}: the Trainer's torch plugin sets these (its webhook refuses them)")
    params = f"{PARAMS_MOUNT_DIR}/params.yaml" if opts.seed_params else opts.params_path
    command = [*launcher(opts.termination_grace_s), "-m", "rlhf_core.cli", "stage", opts.stage,
               *([] if params == "params.yaml" else ["-p", params])]
    pod = pod_spec(opts, command=command, env=stage_env(opts.env, opts.image), container_name=TRAINJOB_NODE)
    (container,) = pod["containers"]
    mounts = container["volumeMounts"]
    if opts.seed_params:
        mounts = [*mounts, {"name": "params", "mountPath": PARAMS_MOUNT_DIR, "readOnly": True}]
    pod_patch: dict[str, Any] = {
        "serviceAccountName": pod["serviceAccountName"],
        "securityContext": pod["securityContext"],
        "terminationGracePeriodSeconds": pod["terminationGracePeriodSeconds"],
        "volumes": pod["volumes"],
        "containers": [{"name": TRAINJOB_NODE, "securityContext": container["securityContext"],
                        "volumeMounts": mounts}],
    }
    for key in ("nodeSelector", "tolerations"):
        if key in pod:
            pod_patch[key] = pod[key]
    labels = job_labels(opts)
    node_patch = {"name": TRAINJOB_NODE, "template": {"spec": {"template": {
        "metadata": object_meta(opts, labels), "spec": pod_patch}}}}
    return {
        "apiVersion": f"{TRAINER_API_GROUP}/v1alpha1",
        "kind": "TrainJob",
        "metadata": {"name": name, "namespace": opts.namespace, **object_meta(opts, labels)},
        "spec": {
            "runtimeRef": {"name": TRAINJOB_RUNTIME, "kind": "ClusterTrainingRuntime", "apiGroup": TRAINER_API_GROUP},
            "activeDeadlineSeconds": opts.deadline_s,
            "trainer": {
                "image": opts.image,
                "command": command,
                "env": container["env"],
                "numNodes": opts.nnodes,
                "numProcPerNode": opts.procs_per_node,
                "resourcesPerNode": container["resources"],
            },
            "runtimePatches": [{"manager": TRAINJOB_PATCH_MANAGER, "trainingRuntimeSpec": {"template": {"spec": {
                "replicatedJobs": [node_patch]}}}}],
        },
    }


def to_yaml(docs: list[dict] | dict) -> str:
    docs = docs if isinstance(docs, list) else [docs]
    return "---\n".join(yaml.safe_dump(d, sort_keys=False, default_flow_style=False, width=120) for d in docs)


def main_render(stage: str, kind: str = "job", **kw) -> str:
    """YAML for ``rlhf k8s render STAGE``: the stage's Job (and headless Service when multi-node), with
    ``kind="jobset"`` a JobSet (gang restart), with ``kind="pytorchjob"`` a Kubeflow PyTorchJob (Training
    Operator v1), with ``kind="trainjob"`` a Kubeflow Trainer v2 TrainJob.  Pipe it to ``kubectl apply -f -``."""
    if kind not in RENDERERS:
        raise ValueError(f"unknown kind {kind!r}; expected one of {', '.join(RENDER_KINDS)}")
    return to_yaml(RENDERERS[kind](StageJobOptions.from_dict(stage, kw)))


# names.RENDER_KINDS (what the CLIs offer, without importing this module) -> the renderer
RENDERERS = {"job": render_stage_resources, "jobset": render_jobset, "pytorchjob": render_pytorchjob,
             "trainjob": render_trainjob}
