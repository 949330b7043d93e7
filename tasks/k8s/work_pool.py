"""The Prefect Kubernetes work pool's base job template (``k8s/prefect/base-job-template.json``): the flow-run
pod, with GPU, scheduling, /dev/shm and workspace variables a deployment can set."""

from __future__ import annotations

import copy

from tasks.k8s.names import (
    CREDENTIALS_SECRET,
    DEFAULT_CPU_IMAGE,
    FLOW_JOB_ENV,
    FLOW_RUN_POD_LABELS,
    FLOW_SERVICE_ACCOUNT,
    GPU_RESOURCE,
    NAMESPACE,
    PARAMS_CONFIGMAP,
    PARAMS_MOUNT_DIR,
    TTL_AFTER_FINISHED_S,
    WORKSPACE_DIR,
    WORKSPACE_PVC,
)
from tasks.k8s.render import security_context_container, security_context_pod, stage_env

WORK_POOL_VARIABLES: dict[str, dict] = {
    "gpu_count": {
        "title": "GPU count", "type": "integer", "minimum": 0, "default": 0,
        "description": "nvidia.com/gpu requested and limited for the flow-run pod. 0 for a pipeline flow that "
                       "submits each stage as its own GPU Job.",
    },
    "node_selector": {
        "title": "Node selector", "type": "object", "additionalProperties": {"type": "string"}, "default": {},
        "description": "Node labels the flow-run pod must match, e.g. {\"nvidia.com/gpu.present\": \"true\"}.",
    },
    "tolerations": {
        "title": "Tolerations", "type": "array", "items": {"type": "object"}, "default": [],
        "description": "Pod tolerations, e.g. [{\"key\": \"nvidia.com/gpu\", \"operator\": \"Exists\", "
                       "\"effect\": \"NoSchedule\"}].",
    },
    "shm_size": {
        "title": "/dev/shm size", "type": "string", "default": "1Gi",
        "description": "Size limit of the memory-backed emptyDir mounted at /dev/shm (counts against memory).",
    },
    "workspace_pvc": {
        "title": "Workspace PVC", "type": "string", "default": WORKSPACE_PVC,
        "description": "PersistentVolumeClaim (ReadWriteMany) mounted at /workspace: data, models, checkpoints.",
    },
}


FLOW_RUN_CPU_REQUEST = "1"
FLOW_RUN_MEMORY_REQUEST = "4Gi"


def build_work_pool_template(default_template: dict | None = None) -> dict:
    """prefect-kubernetes' default base job template plus GPU, scheduling, /dev/shm and workspace variables.

    Every added variable is referenced by a ``{{ var }}`` placeholder in ``job_configuration.job_manifest``
    (Prefect silently drops variables nothing references).  The flow-run pod runs as uid 1000 with the
    workspace PVC at /workspace, the params ConfigMap copied onto it by an init container, and the
    ``rlhf-flow-runner`` service account (allowed to create the stage Jobs).
    """
    if default_template is None:
        from prefect_kubernetes.worker import KubernetesWorker

        default_template = KubernetesWorker.get_default_base_job_template()
    template = copy.deepcopy(default_template)
    props = template["variables"]["properties"]
    props.update(copy.deepcopy(WORK_POOL_VARIABLES))
    props["namespace"]["default"] = NAMESPACE
    props["image"]["default"] = DEFAULT_CPU_IMAGE
    props["service_account_name"]["default"] = FLOW_SERVICE_ACCOUNT
    props["finished_job_ttl"]["default"] = TTL_AFTER_FINISHED_S
    # Requests, so the flow-run pod is not BestEffort (the first evicted under node pressure); no limits: the
    # registration step loads the trained models in this pod, whose size the template cannot know.
    props["cpu_request"]["default"] = FLOW_RUN_CPU_REQUEST
    props["memory_request"]["default"] = FLOW_RUN_MEMORY_REQUEST

    manifest = template["job_configuration"]["job_manifest"]
    # the label the MLflow NetworkPolicy admits (flow runs register models)
    manifest["spec"]["template"].setdefault("metadata", {}).setdefault("labels", {}).update(FLOW_RUN_POD_LABELS)
    pod = manifest["spec"]["template"]["spec"]
    container = pod["containers"][0]
    # The image's ENTRYPOINT is `rlhf`; the worker puts `prefect flow-run execute` in args, so run args as-is.
    container["command"] = ["/usr/bin/env"]
    container["workingDir"] = WORKSPACE_DIR
    # A hard-coded env list: the worker prepends its own variables (the `env` job variable) to it.
    # RLHF_IMAGE: the flow-run pod's own image, for the lineage tags of the versions it registers (ops/meta.py)
    # PREFECT_API_AUTH_STRING: a Prefect server behind its auth string (docs/kubernetes.md) is reached with it
    container["env"] = [{"name": "RLHF_IMAGE", "value": "{{ image }}"}] + [
        e for e in stage_env(None) if e["name"] != "PREFECT_API_URL"] + [
        {"name": "PREFECT_API_AUTH_STRING", "valueFrom": {"secretKeyRef": {
            "name": CREDENTIALS_SECRET, "key": "PREFECT_API_AUTH_STRING", "optional": True}}}] + [
        {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}} for name, path in FLOW_JOB_ENV.items()]
    container["resources"]["requests"][GPU_RESOURCE] = "{{ gpu_count }}"
    container["resources"]["limits"][GPU_RESOURCE] = "{{ gpu_count }}"
    container["securityContext"] = security_context_container()
    # The params ConfigMap read-only, not copied onto the workspace by an init container: that overwrote
    # /workspace/params.yaml before the flow took the workspace's slot, under a run still using it. The
    # deployment's params_file (prefect.yaml: /etc/rlhf/params.yaml) names the mounted file; the flow writes
    # it over params.yaml once it holds the slot (flows/params_file.py:use_profile).
    container["volumeMounts"] = [{"name": "workspace", "mountPath": WORKSPACE_DIR},
                                 {"name": "dshm", "mountPath": "/dev/shm"},
                                 {"name": "params", "mountPath": PARAMS_MOUNT_DIR, "readOnly": True}]
    pod["securityContext"] = security_context_pod()
    pod["nodeSelector"] = "{{ node_selector }}"
    pod["tolerations"] = "{{ tolerations }}"
    pod["volumes"] = [
        {"name": "workspace", "persistentVolumeClaim": {"claimName": "{{ workspace_pvc }}"}},
        {"name": "dshm", "emptyDir": {"medium": "Memory", "sizeLimit": "{{ shm_size }}"}},
        {"name": "params", "configMap": {"name": PARAMS_CONFIGMAP,
                                         "items": [{"key": "params.yaml", "path": "params.yaml"}]}},
    ]
    return template
