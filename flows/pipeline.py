"""The pipeline flow: stages (through DVC or as Kubernetes Jobs) -> register -> gate -> promote.

MLflow: one parent run per flow run; every stage logs a child run under it
(``RLHF_PARENT_RUN_ID``).  A gate failure is a decided outcome: the flow run
completes, the summary says ``promoted: false`` with the failing gates, and
the champion stays where it was; the Prefect event ``rlhf.gate.failed`` (``tasks.events``) is what an
automation alerts on.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger
from prefect.artifacts import create_table_artifact
from prefect.runtime import flow_run
from prefect.tasks import exponential_backoff

from flows.params_file import set_params, use_profile
from flows.workspace_slot import workspace_slot
from rlhf_core.config import DEFAULT_PARAMS, load_params
from rlhf_core.ops import paths, tracking
from rlhf_core.ops.dvc_remote import publish_params, pull_outputs, read_stages
from rlhf_core.stages import STAGE_NAMES, STAGE_TIMEOUT_S
from tasks.events import emit_gate_event, emit_promoted_event
from tasks.gates import evaluation_gate
from tasks.k8s.names import FLOW_RUN_LABEL
from tasks.k8s.options import StageJobSettings, flow_stage_options, job_namespaces, pipeline_dvc_remote
from tasks.k8s.submit import delete_flow_run_jobs
from tasks.links import publish_links, stage_run_ids
from tasks.registry import (
    CHAMPION,
    alias_version,
    log_model_evaluation,
    promote_task,
    record_gate,
    register_models,
)
from tasks.stages import run_stage

EVAL_REPORT = paths.REPORTS / "eval.json"
# a stage task may run as long as its Job's activeDeadlineSeconds on a cluster; locally 4 h
MODEL_DIRS = {"actor": paths.ACTOR_MODEL, "critic": paths.CRITIC_MODEL, "reward": paths.RM_MODEL}
TRAINED_BY = {"actor": "rlhf", "critic": "rlhf", "reward": "rm"}  # the stage whose run logs each model


def pipeline_stages(root: Path) -> list[str]:
    """The stages ``dvc.yaml`` defines, in pipeline order (all of them where there is no dvc.yaml, e.g. on k8s)."""
    if not (root / "dvc.yaml").exists():
        return list(STAGE_NAMES)
    defined = read_stages(root)
    return [s for s in STAGE_NAMES if s in defined]


def champion_changed(root: Path, champion_uri: str | None) -> bool:
    """True when the last eval report compared against another champion than the current one.

    DVC cannot see the registry, so the flow forces ``evaluate`` when the champion moved.
    """
    report = root / EVAL_REPORT
    if not report.exists():
        return False
    return json.loads(report.read_text()).get("champion_label") != champion_uri


def _run_name() -> str:
    return f"pipeline-{flow_run.get_name() or 'local'}"


def _metric_rows(results: list[dict]) -> list[dict]:
    rows = []
    for r in results:
        flat = tracking.flatten(r.get("metrics", {}))
        keys = sorted(k for k in flat if not k.startswith("counts."))[:12]
        rows.append({"stage": r["stage"], "status": r["status"], "seconds": r["seconds"],
                     "metrics": ", ".join(f"{k}={flat[k]}" for k in keys)})
    return rows


def stage_job_options(wanted: list[str], k8s, k8s_stages: dict | None, flow_run_id: str | None,
                      feedback_round: int = 0) -> dict[str, dict]:
    """Every wanted stage's Job options, validated before anything runs, labelled with the flow run.

    Round 0's feedback stage has nothing to collect (it writes its empty manifest and exits): it runs as one
    process with no GPU, whatever ``k8s`` asks of every stage, unless ``k8s_stages.feedback`` sets ``gpus``."""
    unknown = sorted(set(k8s_stages or {}) - set(STAGE_NAMES))
    if unknown:
        raise ValueError(f"k8s_stages: unknown stages {unknown}; expected some of {list(STAGE_NAMES)}")
    options = {stage: flow_stage_options(stage, k8s, k8s_stages) for stage in wanted}
    if "feedback" in options and feedback_round == 0 and "gpus" not in ((k8s_stages or {}).get("feedback") or {}):
        idle = {k: v for k, v in options["feedback"].items() if k not in ("nnodes", "nproc_per_node", "multinode")}
        options["feedback"] = {**idle, "gpus": 0}
    if flow_run_id:
        for opts in options.values():
            opts["labels"] = {**(opts.get("labels") or {}), FLOW_RUN_LABEL: flow_run_id}
    return options


def stop_stage_jobs(flow, run, state) -> None:
    """``on_cancellation`` / ``on_crashed``: delete the stage Jobs this flow run left running on the cluster.

    (An interrupted stage task already deletes its own Job; this catches a flow-run process that died.)
    """
    params = run.parameters or {}
    if params.get("backend") != "kubernetes":
        return
    logger = logging.getLogger("rlhf.flow")
    for namespace in job_namespaces(params.get("k8s"), params.get("k8s_stages")):
        try:
            delete_flow_run_jobs(str(run.id), namespace, log=logger.warning)
        except Exception as err:  # one unreachable namespace must not keep the others' Jobs alive
            logger.error("could not delete the stage Jobs of flow run %s in namespace %s: %s", run.id, namespace, err)


@flow(name="rlhf-pipeline", flow_run_name="rlhf-{backend}", log_prints=True,
      on_cancellation=[stop_stage_jobs], on_crashed=[stop_stage_jobs])
def rlhf_pipeline(
    stages: list[str] | None = None,
    overrides: list[str] | None = None,
    backend: Literal["local", "kubernetes"] = "local",
    promote: bool = True,
    force: bool = False,
    root: str = ".",
    params_file: str = DEFAULT_PARAMS,
    retries: int = 2,
    retry_delay_s: float = 10.0,
    k8s: StageJobSettings | None = None,
    k8s_stages: dict[str, StageJobSettings] | None = None,
) -> dict:
    """Run the RLHF pipeline and return a summary dict (stages, registered versions, gate, promoted).

    ``k8s`` sets every stage Job (image, gpus, nnodes, queue, priority_class, ...: ``StageJobSettings``),
    ``k8s_stages`` one stage's (e.g. ``{"rlhf": {"nnodes": 2}}``); both only with ``backend="kubernetes"``.
    With ``k8s.dvc_remote`` the stage Jobs run under DVC against that remote (``rlhf_core/ops/dvc_remote.py``): this
    flow publishes its params there and pulls the models to register from there, not from a shared volume.
    Only transient stage failures are retried (``retries`` times, ``tasks.retry_policy``). The whole run holds
    its project directory's slot of a global concurrency limit, and its DVC remote's (``flows/workspace_slot.py``):
    runs of any deployment on one workspace, or on one remote, go one at a time.
    """
    remote = pipeline_dvc_remote(k8s, k8s_stages) if backend == "kubernetes" else None
    with workspace_slot(root, remote) as slots:
        get_run_logger().info(f"holding the concurrency slots {', '.join(slots)}")
        return _pipeline(stages, overrides, backend, promote, force, root, params_file, retries, retry_delay_s, k8s,
                         k8s_stages, remote)


def _pipeline(stages: list[str] | None, overrides: list[str] | None, backend: str, promote: bool, force: bool,
              root: str, params_file: str, retries: int, retry_delay_s: float, k8s: StageJobSettings | None,
              k8s_stages: dict[str, StageJobSettings] | None, remote: str | None) -> dict:
    import mlflow

    logger = get_run_logger()
    tracking.quiet_library_logs()  # registration loads and saves models in this process too
    root_path = Path(root).resolve()
    if use_profile(root_path, params_file):
        logger.info(f"{DEFAULT_PARAMS} <- {params_file} (the params DVC's stages read)")
    if overrides:
        set_params(root_path / DEFAULT_PARAMS, overrides)
    params = load_params(root_path / DEFAULT_PARAMS)
    experiment_id = tracking.setup(params, root_path)  # fails fast when MLflow is unreachable
    prefix = tracking.registry_prefix(params)
    wanted = [s for s in (stages or pipeline_stages(root_path))]
    unknown = sorted(set(wanted) - set(STAGE_NAMES))
    if unknown:
        raise ValueError(f"unknown stages {unknown}; expected a subset of {list(STAGE_NAMES)}")
    if backend != "kubernetes" and (k8s or k8s_stages):
        raise ValueError("k8s / k8s_stages set Kubernetes stage Jobs; they need backend='kubernetes'")
    job_options = stage_job_options(wanted, k8s, k8s_stages, flow_run.get_id(), params.feedback.round) \
        if backend == "kubernetes" else {}
    if remote:  # the stage pods run `rlhf repro` with the params the flow publishes to the remote's state
        publish_params(root_path, remote)
        logger.info(f"stages run under DVC against {remote}; params published")

    summary: dict = {"stages": [], "registered": {}, "gate": None, "promoted": False,
                     "tracking_uri": mlflow.get_tracking_uri(), "experiment_id": experiment_id}
    with mlflow.start_run(experiment_id=experiment_id, run_name=_run_name(),
                          tags=tracking.lineage_tags(params, "pipeline", root_path)) as parent:
        summary["parent_run_id"] = parent.info.run_id
        env = {tracking.ENV_PARENT: parent.info.run_id, "MLFLOW_TRACKING_URI": mlflow.get_tracking_uri(),
               tracking.ENV_TRACKING: "on"}
        champion = alias_version(f"{prefix}-actor", CHAMPION)
        if champion:
            env[tracking.ENV_CHAMPION] = f"models:/{prefix}-actor/{champion}"
        stage_task = run_stage.with_options(retries=retries, retry_delay_seconds=exponential_backoff(retry_delay_s),
                                            timeout_seconds=STAGE_TIMEOUT_S[backend])
        for stage in STAGE_NAMES:
            if stage in wanted:
                rerun = force or (stage == "evaluate" and champion_changed(root_path, env.get(tracking.ENV_CHAMPION)))
                summary["stages"].append(stage_task(stage, root=str(root_path), backend=backend, env=env,
                                                    force=rerun, k8s=job_options.get(stage)))
        create_table_artifact(_metric_rows(summary["stages"]), key="stage-metrics",
                              description="Per-stage status, wall time and metrics")

        if remote:  # the models come from the remote, not from the pods' volume
            pull_outputs(root_path, remote, sorted(set(TRAINED_BY.values())), echo=logger.info)
        # a model directory counts once it holds a config (GRPO leaves models/critic with its meta file only)
        kinds = [k for k in ("reward", "critic", "actor") if (root_path / MODEL_DIRS[k] / "config.json").is_file()]
        try:
            stage_runs = stage_run_ids(experiment_id, parent.info.run_id)
        except Exception as err:  # registration below retries on its own; the models then land in the parent
            logger.warning("could not list the stage runs: %s", err)
            stage_runs = {}
        if kinds:
            lineage = tracking.lineage_tags(params, "register", root_path)
            lineage["rlhf.pipeline_run_id"] = parent.info.run_id
            # each model is logged in the run that trained it (a stage DVC skipped has none here: the parent)
            runs = {k: stage_runs[TRAINED_BY[k]] for k in kinds if TRAINED_BY[k] in stage_runs}
            summary["registered"] = register_models(kinds, {k: str(root_path / MODEL_DIRS[k]) for k in kinds},
                                                    prefix, lineage, runs)
        actor = summary["registered"].get("actor")
        report_path = root_path / EVAL_REPORT
        if actor and report_path.exists():
            report = json.loads(report_path.read_text())
            gate = evaluation_gate(report, params.gates.model_dump())
            summary["gate"] = gate
            record_gate(actor["name"], actor["version"], gate)
            if actor.get("model_id"):  # a new version: link the evaluation's figures to its logged model
                log_model_evaluation(actor["model_id"], report["candidate"], stage_runs.get("evaluate"))
            emit_gate_event(actor["name"], actor["version"], gate, report)
            mlflow.log_dict(gate, "gate.json")
            current = alias_version(actor["name"], CHAMPION)
            if promote and gate["passed"] and current != actor["version"]:
                reason = f"passed evaluation gate (judge: {gate.get('judge') or 'none'})"
                promote_task(actor["name"], actor["version"], reason=reason)
                emit_promoted_event(actor["name"], actor["version"], current, reason)
                summary["promoted"] = True
            elif gate["passed"] and current == actor["version"]:
                logger.info("%s v%s is already the champion", actor["name"], actor["version"])
            summary["champion"] = alias_version(actor["name"], CHAMPION)
        publish_links(summary["tracking_uri"], experiment_id, parent.info.run_id, summary["registered"])
    os.environ.pop(tracking.ENV_PARENT, None)
    return summary
