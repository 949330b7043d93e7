"""Rendering: a stage's ``StageJobOptions`` -> the Kubernetes objects (plain dicts, ready for YAML or the API).

Every stage Job runs the one stage command, ``rlhf stage NAME`` (or ``torchrun ... -m rlhf_core.cli stage NAME``
for several processes), in the image, on the shared workspace volume mounted at ``/workspace``; the pod runs as
uid 1000 with no privilege escalation and no service-account token.
"""

from __future__ import annotations

import copy
from typing import Any

from rlhf_core.ops.launch import KUBELET_MARGIN_S, LAUNCH_ENV
from rlhf_core.stages import exit_codes
from tasks.k8s.names import (
    COMPLETION_INDEX_ANNOTATION,
    CONTAINER,
    CREDENTIALS_SECRET,
    ENDPOINTS_CONFIGMAP,
    GPU_NODE_SELECTOR,
    GPU_RESOURCE,
    GPU_TOLERATIONS,
    KUEUE_QUEUE_LABEL,
    MASTER_PORT,
    NAMESPACE,
    PARAMS_MOUNT_DIR,
    RUN_AS_UID,
    WORKSPACE_DIR,
    default_job_name,
    master_addr,
    stage_labels,
)
from tasks.k8s.options import StageJobOptions


def launcher(termination_grace_s: int) -> list[str]:
    """torchrun's command line through ``rlhf_core.ops.launch``: its workers get the pod's grace less the kubelet's
    margin to checkpoint after a SIGTERM (torchrun's own default is 30 s)."""
    return ["python", "-m", "rlhf_core.ops.launch", f"--shutdown-timeout={termination_grace_s - KUBELET_MARGIN_S}"]


def single_node_launcher(nproc_per_node: int, termination_grace_s: int) -> list[str]:
    """The launcher of ``nproc_per_node`` processes on one node (torchrun ``--standalone``)."""
    return [*launcher(termination_grace_s), "--standalone", f"--nproc_per_node={nproc_per_node}"]


def repro_command(stage: str, remote: str, params_path: str | None) -> list[str]:
    """Under DVC against a remote: ``rlhf repro NAME --remote URL [--params FILE]`` (``rlhf_core/ops/dvc_remote.py``);
    without ``params_path`` the params come from the remote (the flow uploads them)."""
    return ["rlhf", "repro", stage, "--remote", remote, *(["--params", params_path] if params_path else [])]


def launch_env(nproc_per_node: int, termination_grace_s: int) -> dict[str, str]:
    """``RLHF_LAUNCH`` for several processes under DVC: DVC runs ``rlhf stage NAME``, which re-executes itself
    under this launcher (``rlhf_core.ops.launch.relaunch_command``)."""
    if nproc_per_node == 1:
        return {}
    return {LAUNCH_ENV: " ".join(single_node_launcher(nproc_per_node, termination_grace_s))}


def stage_command(stage: str, params_path: str = "params.yaml", nnodes: int = 1, nproc_per_node: int = 1,
                  job_name: str | None = None, service: str | None = None,
                  termination_grace_s: int = StageJobOptions.termination_grace_s) -> list[str]:
    """The container command: ``rlhf stage NAME``, or torchrun running the same CLI module.

    One process: ``rlhf stage NAME``.  Several on one node: ``python -m rlhf_core.ops.launch --standalone
    --nproc_per_node=N -m rlhf_core.cli stage NAME`` (torchrun with a shutdown timeout above the stop grace, and
    the ranks' exit 75 kept: ``rlhf_core/ops/launch.py``).  Several nodes (an Indexed Job): static rendezvous at pod 0
    (``<job>-0.<service>``), this node's rank from the Job completion index.
    """
    tail = ["stage", stage] + ([] if params_path == "params.yaml" else ["-p", params_path])
    if nnodes == 1 and nproc_per_node == 1:
        return ["rlhf", *tail]
    if nnodes == 1:
        return [*single_node_launcher(nproc_per_node, termination_grace_s), "-m", "rlhf_core.cli", *tail]
    job_name = job_name or default_job_name(stage)
    service = service or job_name
    return [*launcher(termination_grace_s), f"--nnodes={nnodes}", f"--nproc_per_node={nproc_per_node}",
            "--node_rank=$(JOB_COMPLETION_INDEX)", f"--master_addr={master_addr(job_name, service)}",
            f"--master_port={MASTER_PORT}", "-m", "rlhf_core.cli", *tail]


def security_context_pod() -> dict:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_UID,
        "runAsGroup": RUN_AS_UID,
        "fsGroup": RUN_AS_UID,
        "fsGroupChangePolicy": "OnRootMismatch",  # no recursive chown of a big workspace on every start
        "seccompProfile": {"type": "RuntimeDefault"},
    }


def security_context_container() -> dict:
    return {
        "runAsNonRoot": True,
        "runAsUser": RUN_AS_UID,
        "allowPrivilegeEscalation": False,
        "capabilities": {"drop": ["ALL"]},
    }


def stage_env(extra: dict[str, str] | None, image: str | None = None, object_store: bool = False) -> list[dict]:
    """Endpoints from the ``rlhf-endpoints`` ConfigMap, credentials as optional Secret references, and
    ``RLHF_IMAGE`` (the image reference, for lineage: the image has no ``.git``). ``object_store``: also the
    S3 credentials and endpoint a DVC remote needs (``AWS_ENDPOINT_URL``: MinIO or another S3-compatible server).

    ``extra`` (plain values, e.g. the flow's parent MLflow run id) replaces entries of the same name.
    """
    def cm(name: str, optional: bool = False) -> dict:
        ref = {"name": ENDPOINTS_CONFIGMAP, "key": name, **({"optional": True} if optional else {})}
        return {"name": name, "valueFrom": {"configMapKeyRef": ref}}

    def secret(name: str) -> dict:
        return {"name": name, "valueFrom": {"secretKeyRef": {"name": CREDENTIALS_SECRET, "key": name,
                                                             "optional": True}}}

    env = [
        *([{"name": "RLHF_IMAGE", "value": image}] if image else []),  # first: where a kustomize patch puts it
        cm("MLFLOW_TRACKING_URI"),
        cm("PREFECT_API_URL"),
        cm("RLHF_MLFLOW_UI_URL", optional=True),  # the MLflow UI a browser opens (tasks/links.py)
        secret("MLFLOW_TRACKING_USERNAME"),
        secret("MLFLOW_TRACKING_PASSWORD"),
        secret("HF_TOKEN"),
        *([secret("AWS_ACCESS_KEY_ID"), secret("AWS_SECRET_ACCESS_KEY"), cm("AWS_ENDPOINT_URL", optional=True),
           cm("AWS_DEFAULT_REGION", optional=True)] if object_store else []),
        {"name": "HF_HOME", "value": f"{WORKSPACE_DIR}/.cache/huggingface"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    for key, value in (extra or {}).items():
        env = [e for e in env if e["name"] != key] + [{"name": key, "value": str(value)}]
    return env


def pod_spec(opts: StageJobOptions, *, command: list[str], env: list[dict], container_name: str = CONTAINER) -> dict:
    """The pod of a stage: security context, the workspace volume, /dev/shm, GPUs and their scheduling."""
    gpus = opts.gpus_per_node
    cpu, memory, shm_size = opts.requests
    image, image_pull_policy = opts.image, opts.image_pull_policy
    resources: dict[str, dict] = {"requests": {"cpu": cpu, "memory": memory}, "limits": {"memory": memory}}
    if gpus:
        resources["requests"][GPU_RESOURCE] = str(gpus)
        resources["limits"][GPU_RESOURCE] = str(gpus)
    node_selector = (dict(GPU_NODE_SELECTOR) if gpus else {}) if opts.node_selector is None else opts.node_selector
    tolerations = (copy.deepcopy(GPU_TOLERATIONS) if gpus else []) if opts.tolerations is None else opts.tolerations
    container = {
        "name": container_name,
        "image": image,
        "imagePullPolicy": image_pull_policy,
        "command": command,
        "workingDir": WORKSPACE_DIR,
        "env": env,
        "resources": resources,
        "securityContext": security_context_container(),
        "volumeMounts": [
            {"name": "workspace", "mountPath": WORKSPACE_DIR},
            {"name": "dshm", "mountPath": "/dev/shm"},
        ],
    }
    volumes = [
        {"name": "workspace", "persistentVolumeClaim": {"claimName": opts.pvc_claim}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": shm_size}},
    ]
    spec: dict[str, Any] = {
        "serviceAccountName": opts.service_account,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "securityContext": security_context_pod(),
        "terminationGracePeriodSeconds": opts.termination_grace_s,  # a SIGTERMed stage checkpoints, then exits 75
    }
    if opts.seed_params:
        # Copy the params ConfigMap onto the workspace, so the stage reads ./params.yaml like `dvc repro` does.
        spec["initContainers"] = [{
            "name": "seed-params",
            "image": image,
            "imagePullPolicy": image_pull_policy,
            "command": seed_params_command(opts.params_path),
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "64Mi"}},
            "securityContext": security_context_container(),
            "volumeMounts": [
                {"name": "workspace", "mountPath": WORKSPACE_DIR},
                {"name": "params", "mountPath": PARAMS_MOUNT_DIR, "readOnly": True},
            ],
        }]
        volumes.append({"name": "params", "configMap": {"name": opts.params_configmap,
                                                        "items": [{"key": "params.yaml", "path": "params.yaml"}]}})
    spec["containers"] = [container]
    if node_selector:
        spec["nodeSelector"] = node_selector
    if tolerations:
        spec["tolerations"] = tolerations
    if opts.priority_class:
        spec["priorityClassName"] = opts.priority_class
    spec["volumes"] = volumes
    return spec


def render_stage_job(opts: StageJobOptions) -> dict:
    """The ``batch/v1`` Job that runs ``opts.stage`` (a plain dict, ready for YAML or the API).

    ``nnodes > 1`` makes an Indexed Job whose pods find pod 0 through the headless Service
    :func:`render_headless_service` (same name as the Job). With ``seed_params`` an init container first
    copies the ``rlhf-params`` ConfigMap to ``params_path`` on the workspace (the kubectl workflow); a Prefect
    flow that has already written the workspace's params passes ``seed_params=False``.
    """
    name, nnodes = opts.job_name, opts.nnodes
    if opts.dvc_remote:
        command = repro_command(opts.stage, opts.dvc_remote, opts.params_path if opts.seed_params else None)
        pod_env = stage_env({**launch_env(opts.procs_per_node, opts.termination_grace_s), **(opts.env or {})},
                            opts.image, object_store=True)
    else:
        command = stage_command(opts.stage, opts.params_path, nnodes, opts.procs_per_node, job_name=name,
                                service=name, termination_grace_s=opts.termination_grace_s)
        pod_env = stage_env(opts.env, opts.image)
    if nnodes > 1:
        # Declared explicitly (the Job controller injects the same) so $(JOB_COMPLETION_INDEX) expands in `command`.
        pod_env = [{"name": "JOB_COMPLETION_INDEX", "valueFrom": {"fieldRef": {
            "fieldPath": f"metadata.annotations['{COMPLETION_INDEX_ANNOTATION}']"}}}] + pod_env
    labels = job_labels(opts)
    pod = pod_spec(opts, command=command, env=pod_env)
    pod["restartPolicy"] = "Never"
    if nnodes > 1:
        pod["subdomain"] = name  # pod hostnames <job>-<index> resolve as <job>-<index>.<service>
        pod.setdefault("initContainers", []).append(wait_for_master(name, opts.image, opts.image_pull_policy))
    spec: dict[str, Any] = {
        "backoffLimit": opts.backoff_limit,
        "activeDeadlineSeconds": opts.deadline_s,
        "ttlSecondsAfterFinished": opts.ttl_s,
        "podFailurePolicy": {"rules": [
            # Bad params or bad input (rlhf_core.stages.exit_codes.PERMANENT): fail now, a retry cannot help.
            {"action": "FailJob", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                  "values": sorted(exit_codes.PERMANENT)}},
            # Preemption, eviction, node drain: retry without counting against backoffLimit; the new pod
            # resumes from checkpoints/ on the workspace volume.
            {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
            # Exit 75: stopped on SIGTERM after a checkpoint (a sibling rank's stop, a kubelet's SIGTERM without
            # the condition): a resumable stop, not a failure; the new pod resumes, backoffLimit untouched.
            {"action": "Ignore", "onExitCodes": {"containerName": CONTAINER, "operator": "In",
                                                 "values": [exit_codes.STOPPED]}},
        ]},
    }
    if nnodes > 1:
        spec.update({"completionMode": "Indexed", "completions": nnodes, "parallelism": nnodes})
    spec["template"] = {"metadata": object_meta(opts, labels), "spec": pod}
    return {"apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": name, "namespace": opts.namespace, **object_meta(opts, labels)}, "spec": spec}


def job_labels(opts: StageJobOptions) -> dict[str, str]:
    """The user's labels, the Kueue queue label, then the rlhf-ops labels (which selectors rely on, so they win)."""
    labels = dict(opts.labels or {})
    if opts.queue:
        labels[KUEUE_QUEUE_LABEL] = opts.queue
    return {**labels, **stage_labels(opts.stage, opts.job_name)}


def object_meta(opts: StageJobOptions, labels: dict[str, str]) -> dict:
    meta: dict[str, Any] = {"labels": dict(labels)}
    if opts.annotations:
        meta["annotations"] = dict(opts.annotations)
    return meta


def wait_for_master(job_name: str, image: str, image_pull_policy: str, service: str | None = None) -> dict:
    """Init container: wait (up to 10 min) until pod 0's DNS name resolves, so torchrun connects on first try."""
    host = master_addr(job_name, service)
    script = (f"for i in $(seq 300); do getent hosts {host} && exit 0; sleep 2; done; "
              f"echo 'rendezvous host {host} did not resolve in 600 s' >&2; exit 1")
    return {
        "name": "wait-for-master",
        "image": image,
        "imagePullPolicy": image_pull_policy,
        "command": ["sh", "-c", script],
        "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "64Mi"}},
        "securityContext": security_context_container(),
    }


def seed_params_command(params_path: str = "params.yaml") -> list[str]:
    """Copy the params ConfigMap onto the workspace atomically (nodes of a multi-node Job all run it)."""
    dst = f"{WORKSPACE_DIR}/{params_path}"
    return ["sh", "-c", f't=$(mktemp "{dst}.XXXXXX") && cp {PARAMS_MOUNT_DIR}/params.yaml "$t" '
                        f'&& chmod 0644 "$t" && mv -f "$t" "{dst}"']


def render_headless_service(job_name: str, stage: str, namespace: str = NAMESPACE) -> dict:
    """Headless Service publishing the Indexed Job's pods (``<job>-<i>.<job>``), even before they are ready."""
    return {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": job_name, "namespace": namespace, "labels": stage_labels(stage, job_name)},
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,  # pod 0 must resolve while it is still initialising
            "selector": {"rlhf-ops/job": job_name},
            "ports": [{"name": "c10d", "port": MASTER_PORT, "targetPort": MASTER_PORT, "protocol": "TCP"}],
        },
    }


def render_stage_resources(opts: StageJobOptions) -> list[dict]:
    """The objects to create for a stage: the Job, preceded by its headless Service when ``nnodes > 1``."""
    job = render_stage_job(opts)
    if job["spec"].get("completionMode") == "Indexed":
        return [render_headless_service(job["metadata"]["name"], opts.stage, job["metadata"]["namespace"]), job]
    return [job]
