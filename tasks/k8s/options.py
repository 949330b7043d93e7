"""``StageJobOptions``: everything a stage Job (JobSet, PyTorchJob, TrainJob) can be configured with, validated once.

The renderers (``tasks.k8s.render``), the submitter (``tasks.k8s.submit``) and the CLI all take this one
object; ``StageJobOptions.from_dict`` builds it from keyword options and names an unknown key.
``StageJobSettings`` is the typed flow parameter / deployment value derived from it.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import get_type_hints

from pydantic import BaseModel, ConfigDict, ValidationError, create_model

from rlhf_core.ops.launch import KUBELET_MARGIN_S
from rlhf_core.stages import STAGE_NAMES
from tasks.k8s.names import (
    BACKOFF_LIMIT,
    DEFAULT_GPU_IMAGE,
    NAMESPACE,
    PARAMS_CONFIGMAP,
    STAGE_DEADLINE_S,
    STAGE_DEFAULT_GPUS,
    STAGE_SERVICE_ACCOUNT,
    TTL_AFTER_FINISHED_S,
    WORKSPACE_PVC,
    check_labels,
    check_name,
    default_job_name,
)

MULTINODE_KINDS = ("job", "jobset")  # jobset needs the JobSet controller (jobset.x-k8s.io) on the cluster


@dataclass(frozen=True)
class StageJobOptions:
    """How one stage runs on the cluster (defaults: the shipped manifests)."""

    stage: str  # one of rlhf_core.stages.STAGE_NAMES
    params_path: str = "params.yaml"  # where the stage reads its params, relative to the workspace
    image: str = DEFAULT_GPU_IMAGE
    gpus: int | None = None  # per node; None: 0 for prepare, 1 for the others
    nnodes: int = 1  # > 1: an Indexed Job (or a JobSet, or a PyTorchJob) over that many nodes
    multinode: str = "job"  # nnodes > 1 as "job" (Indexed Job + headless Service) or "jobset" (gang restart)
    nproc_per_node: int | None = None  # None: one process per GPU (1 without GPUs)
    namespace: str = NAMESPACE
    name: str | None = None  # the Job's name; None: rlhf-<stage>
    cpu: str | None = None  # CPU request; None: 4 per GPU (2 without)
    memory: str | None = None  # memory request = limit; None: 24Gi per GPU (8Gi without)
    shm_size: str | None = None  # /dev/shm (memory-backed); None: 4Gi per GPU (1Gi without)
    node_selector: dict[str, str] | None = None  # None: GPU nodes when gpus > 0
    tolerations: list[dict] | None = None  # None: tolerate the GPU taint when gpus > 0
    env: dict[str, str] | None = None  # plain values; replace the defaults of the same name
    pvc_claim: str = WORKSPACE_PVC  # the ReadWriteMany workspace volume
    params_configmap: str = PARAMS_CONFIGMAP
    seed_params: bool = True  # an init container copies the params ConfigMap onto the workspace first
    service_account: str = STAGE_SERVICE_ACCOUNT
    active_deadline_s: int | None = None  # None: the stage's STAGE_DEADLINE_S
    backoff_limit: int = BACKOFF_LIMIT
    ttl_s: int = TTL_AFTER_FINISHED_S  # finished Jobs are deleted after this
    image_pull_policy: str = "IfNotPresent"
    labels: dict[str, str] | None = None  # on the Job and its pods (after the rlhf-ops labels, which win)
    annotations: dict[str, str] | None = None  # on the Job and its pods
    queue: str | None = None  # Kueue LocalQueue: the kueue.x-k8s.io/queue-name label (Kueue admits the Job)
    priority_class: str | None = None  # the pods' priorityClassName (preemption order)
    # SIGTERM -> SIGKILL: above compute.stop_grace_s (600) plus one checkpoint write, so a preempted stage saves
    termination_grace_s: int = 900
    # A DVC remote (s3://bucket/path, gs://..., an S3-compatible server through AWS_ENDPOINT_URL in rlhf-endpoints):
    # the stage runs under DVC against it, `rlhf repro NAME` (pull, skip when unchanged, push; ops/dvc_remote.py)
    dvc_remote: str | None = None

    def __post_init__(self) -> None:
        if self.stage not in STAGE_NAMES:
            raise ValueError(f"unknown stage {self.stage!r}; stages: {', '.join(STAGE_NAMES)}")
        gpus = self.gpus_per_node
        if gpus < 0 or self.nnodes < 1:
            raise ValueError(f"gpus must be >= 0 and nnodes >= 1 (got gpus={gpus}, nnodes={self.nnodes})")
        nproc = self.procs_per_node
        if nproc < 1:
            raise ValueError(f"nproc_per_node must be >= 1 (got {nproc})")
        if gpus and nproc > gpus:
            raise ValueError(f"nproc_per_node={nproc} exceeds gpus={gpus} per node (one process per GPU)")
        if self.multinode not in MULTINODE_KINDS:
            raise ValueError(f"multinode must be one of {', '.join(MULTINODE_KINDS)} (got {self.multinode!r})")
        if self.stage == "prepare" and (self.nnodes > 1 or nproc > 1):
            raise ValueError("the prepare stage runs in one process (nnodes=1, nproc_per_node=1)")
        if Path(self.params_path).is_absolute() or ".." in Path(self.params_path).parts:
            raise ValueError(f"params_path must be relative to the workspace, got {self.params_path!r}")
        check_name("job name", self.job_name)
        check_name("namespace", self.namespace)
        check_labels("labels", self.labels or {})
        check_labels("annotations", self.annotations or {}, values=False)
        if self.termination_grace_s < 0:
            raise ValueError(f"termination_grace_s must be >= 0 (got {self.termination_grace_s})")
        if (self.nnodes > 1 or nproc > 1) and self.termination_grace_s <= KUBELET_MARGIN_S:
            raise ValueError(f"termination_grace_s {self.termination_grace_s} leaves the launcher's workers no "
                             "time to checkpoint after a SIGTERM: it gets the grace less the kubelet's "
                             f"{KUBELET_MARGIN_S} s "
                             f"(--shutdown-timeout={self.termination_grace_s - KUBELET_MARGIN_S}); give more than "
                             f"{KUBELET_MARGIN_S} s, and more than compute.stop_grace_s + {KUBELET_MARGIN_S} for the "
                             "stage to reach its checkpoint")
        if self.queue is not None:
            check_name("queue", self.queue)
        if self.priority_class is not None:
            check_name("priority_class", self.priority_class)
        if self.dvc_remote is not None and self.nnodes > 1:
            raise ValueError("dvc_remote runs the stage under DVC in one pod; with nnodes > 1 use the shared "
                             "workspace volume without a remote (docs/kubernetes.md)")

    @classmethod
    def from_dict(cls, stage: str, options: dict) -> StageJobOptions:
        """``StageJobOptions(stage, **options)``; an unknown key is a ``ValueError`` that names it."""
        known = {f.name for f in fields(cls)} - {"stage"}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown Kubernetes stage option(s) {unknown}; known: {', '.join(sorted(known))}")
        return cls(stage, **options)

    @property
    def gpus_per_node(self) -> int:
        return STAGE_DEFAULT_GPUS[self.stage] if self.gpus is None else int(self.gpus)

    @property
    def procs_per_node(self) -> int:
        default = 1 if self.stage == "prepare" else max(1, self.gpus_per_node)
        return default if self.nproc_per_node is None else int(self.nproc_per_node)

    @property
    def as_jobset(self) -> bool:
        """Several nodes run as a JobSet (``multinode: jobset``), else as an Indexed Job."""
        return self.nnodes > 1 and self.multinode == "jobset"

    @property
    def job_name(self) -> str:
        return self.name or default_job_name(self.stage)

    @property
    def requests(self) -> tuple[str, str, str]:
        """(cpu request, memory request = limit, /dev/shm size): the given values, else scaled by GPUs."""
        gpus = self.gpus_per_node
        cpu, memory, shm = ("2", "8Gi", "1Gi") if gpus == 0 else (str(4 * gpus), f"{24 * gpus}Gi", f"{4 * gpus}Gi")
        return self.cpu or cpu, self.memory or memory, self.shm_size or shm

    @property
    def deadline_s(self) -> int:
        return self.active_deadline_s or STAGE_DEADLINE_S[self.stage]


# What a flow run or a deployment may not set: the flow names each Job and sets its params itself. ``env`` may be
# set (NCCL_*, proxies, ...): the flow's own variables (tracking, lineage) are added over it (tasks/stages.py).
_FLOW_SET = ("stage", "name", "seed_params", "params_path")


def _settings_model() -> type[BaseModel]:
    """``StageJobSettings``: the fields of :class:`StageJobOptions` a flow parameter sets, typed from the
    dataclass (one declaration), unknown keys refused. Prefect shows it as a form and validates a run's value."""
    hints = get_type_hints(StageJobOptions)
    declared = {f.name: (hints[f.name], f.default) for f in fields(StageJobOptions) if f.name not in _FLOW_SET}
    return create_model("StageJobSettings", __config__=ConfigDict(extra="forbid"), **declared)


StageJobSettings = _settings_model()


def flow_stage_options(stage: str, common: BaseModel | dict | None, per_stage: dict | None) -> dict:
    """The ``StageJobOptions`` keywords of one stage: the flow's ``k8s`` settings, then its ``k8s_stages[stage]``
    (only keys that were set; a dict is validated as :data:`StageJobSettings` first). Raises ``ValueError``
    naming the stage and the bad key."""
    merged: dict = {}
    for layer in (common, (per_stage or {}).get(stage)):
        if layer is None:
            continue
        if isinstance(layer, dict):
            try:
                layer = StageJobSettings.model_validate(layer)
            except ValidationError as err:
                raise ValueError(f"Kubernetes options for stage {stage!r}: {err}") from None
        merged.update(layer.model_dump(exclude_unset=True))
    try:
        StageJobOptions.from_dict(stage, merged)
    except ValueError as err:
        raise ValueError(f"Kubernetes options for stage {stage!r}: {err}") from None
    return merged


def _setting(layer: BaseModel | dict | None, key: str):
    """One key of a ``k8s`` / ``k8s_stages`` value, raw (a dict) or validated (``StageJobSettings``)."""
    return layer.get(key) if isinstance(layer, dict) else getattr(layer, key, None)


def job_namespaces(common: BaseModel | dict | None, per_stage: dict | None) -> list[str]:
    """The namespaces a flow's stage Jobs run in (its ``k8s`` / ``k8s_stages`` values, raw or validated)."""
    found = {_setting(layer, "namespace") for layer in [common, *(per_stage or {}).values()] if layer is not None}
    return sorted((found - {None}) | ({NAMESPACE} if _setting(common, "namespace") is None else set()))


def pipeline_dvc_remote(common: BaseModel | dict | None, per_stage: dict | None) -> str | None:
    """The flow's DVC remote, ``k8s.dvc_remote``; setting it for one stage is refused: the stages share one state
    (``dvc.lock``) on the remote."""
    for stage, layer in (per_stage or {}).items():
        if _setting(layer, "dvc_remote") is not None:
            raise ValueError(f"k8s_stages[{stage!r}].dvc_remote: the DVC remote is the pipeline's, set it in k8s")
    return _setting(common, "dvc_remote")
