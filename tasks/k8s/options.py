"""``StageJobOptions``: everything a stage Job (or Kubeflow PyTorchJob) can be configured with, validated once.

The renderers (``tasks.k8s.render``), the submitter (``tasks.k8s.submit``) and the CLI all take this one
object; ``StageJobOptions.from_dict`` builds it from keyword options (a flow's ``k8s`` parameter) and names
an unknown key.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path

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
    check_name,
    default_job_name,
)


@dataclass(frozen=True)
class StageJobOptions:
    """How one stage runs on the cluster (defaults: the shipped manifests)."""

    stage: str  # one of rlhf_core.stages.STAGE_NAMES
    params_path: str = "params.yaml"  # where the stage reads its params, relative to the workspace
    image: str = DEFAULT_GPU_IMAGE
    gpus: int | None = None  # per node; None: 0 for prepare, 1 for the others
    nnodes: int = 1  # > 1: an Indexed Job (or a PyTorchJob) over that many nodes
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
        if self.stage == "prepare" and (self.nnodes > 1 or nproc > 1):
            raise ValueError("the prepare stage runs in one process (nnodes=1, nproc_per_node=1)")
        if Path(self.params_path).is_absolute() or ".." in Path(self.params_path).parts:
            raise ValueError(f"params_path must be relative to the workspace, got {self.params_path!r}")
        check_name("job name", self.job_name)
        check_name("namespace", self.namespace)

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
