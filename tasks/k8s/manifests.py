"""The generated files under ``k8s/``: one Job per stage, the multi-node, PyTorchJob and TrainJob overlays, the
work-pool template and the params copies; ``write_manifests`` writes them, or with ``check`` reports the stale ones."""

from __future__ import annotations

import json
from pathlib import Path

from rlhf_core.stages import STAGE_NAMES
from tasks.k8s.names import GENERATED_HEADER, MULTI_NODE, NAMESPACE, PYTORCHJOB, TRAINJOB
from tasks.k8s.options import StageJobOptions
from tasks.k8s.render import render_stage_job, render_stage_resources
from tasks.k8s.render_operators import render_pytorchjob, render_trainjob, to_yaml
from tasks.k8s.work_pool import build_work_pool_template

# Copies of params profiles kept next to the kustomizations that turn them into the rlhf-params ConfigMap.
PARAMS_COPIES = {"params.yaml": "k8s/base/params.yaml", "configs/gpu.yaml": "k8s/components/gpu-params/params.yaml"}


def multi_node_resources() -> list[dict]:
    """What ``k8s/overlays/multi-node`` adds: headless Service + Indexed Job for :data:`MULTI_NODE`."""
    return render_stage_resources(StageJobOptions(**MULTI_NODE))


def pytorchjob_resource() -> dict:
    """What ``k8s/overlays/pytorchjob`` adds: the PyTorchJob for :data:`PYTORCHJOB`."""
    return render_pytorchjob(StageJobOptions(**PYTORCHJOB))


def trainjob_resource() -> dict:
    """What ``k8s/overlays/trainjob`` adds: the TrainJob for :data:`TRAINJOB`."""
    return render_trainjob(StageJobOptions(**TRAINJOB))


def generated_files(root: Path, work_pool_template: dict | None = None) -> dict[Path, str]:
    """Every generated file under ``root`` with its expected content."""
    files: dict[Path, str] = {}
    for stage in STAGE_NAMES:
        d = root / "k8s" / "stages" / stage
        files[d / "job.yaml"] = GENERATED_HEADER + to_yaml(render_stage_job(StageJobOptions(stage)))
        files[d / "kustomization.yaml"] = GENERATED_HEADER + to_yaml({
            "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization",
            "namespace": NAMESPACE, "resources": ["job.yaml"]})
    files[root / "k8s/overlays/multi-node/job.yaml"] = GENERATED_HEADER + to_yaml(multi_node_resources())
    files[root / "k8s/overlays/pytorchjob/pytorchjob.yaml"] = GENERATED_HEADER + to_yaml(pytorchjob_resource())
    files[root / "k8s/overlays/trainjob/trainjob.yaml"] = GENERATED_HEADER + to_yaml(trainjob_resource())
    files[root / "k8s/prefect/base-job-template.json"] = json.dumps(
        build_work_pool_template(work_pool_template), indent=2) + "\n"
    # Copies of params profiles (kustomize cannot read files outside a kustomization's directory).
    for src, dst in PARAMS_COPIES.items():
        if (root / src).is_file():
            files[root / dst] = (root / src).read_text()
    return files


def write_manifests(root: Path | str = ".", check: bool = False) -> list[Path]:
    """Write (or with ``check``, only compare) the generated files; returns those that were stale."""
    stale = []
    for path, text in generated_files(Path(root)).items():
        if not path.is_file() or path.read_text() != text:
            stale.append(path)
            if not check:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)
    return stale
