"""Continuous RLHF: one feedback round per scheduled run (``rlhf run --rounds K``; docs/rounds.md).

A round is the pipeline flow (``flows.pipeline.rlhf_pipeline``) with ``feedback.round = n``: the feedback stage
collects comparisons on the champion's answers, the rm stage retrains on them (with a replay of earlier pairs),
the rlhf stage continues from the champion, evaluate and the gate decide whether the new actor is promoted. A
round whose gate fails leaves the champion in place; the next round starts from it again.

The ledger ``<workspace>/rounds.json`` records each round as ``started`` and then ``finished`` (with its
figures). ``rlhf_rounds(rounds=K)`` first finishes a round that was started and not finished (a killed round
resumes: DVC skips its finished stages, the training stages resume from their checkpoints), then runs new rounds
until K were run; a finished round is never run again. Round 0 is the base pipeline; it runs first when the
ledger has no finished round 0. Each finished round appends a row to ``plots/rounds.csv`` (a DVC plot) and logs
its figures as ``round.*`` metrics at step ``n`` in its pipeline run (MLflow).
"""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Literal

from prefect import flow, get_run_logger

from flows.pipeline import rlhf_pipeline
from rlhf_core.config import DEFAULT_PARAMS, load_params
from rlhf_core.ops import paths
from rlhf_core.ops.atomic import write_json_atomic, write_text_atomic
from tasks.k8s.options import StageJobSettings

ROUNDS_PLOT = paths.PLOTS / "rounds.csv"
FIGURES = ("judge_accuracy", "judge_mean", "proxy_reward", "kl_to_reference", "rm_accuracy",
           "rm_fresh_pairs_accuracy_before", "pairs_labelled", "label_agreement_with_checker", "promoted")


def ledger_path(root: Path, workspace: str) -> Path:
    return root / workspace / "rounds.json"


def load_ledger(path: Path) -> list[dict]:
    return json.loads(path.read_text())["rounds"] if path.exists() else []


def plan_rounds(ledger: list[dict], k: int) -> list[int]:
    """The rounds to run for ``k`` more feedback rounds: round 0 first when it never finished (not counted), then
    rounds started but not finished (resumed, counted), then new rounds after the highest one seen."""
    finished = {r["round"] for r in ledger if r["status"] == "finished"}
    unfinished = sorted(r["round"] for r in ledger if r["status"] == "started" and r["round"] not in finished
                        and r["round"] > 0)
    rounds = unfinished[:k]
    nxt = max(finished | set(unfinished) | {0}) + 1
    while len(rounds) < k:
        rounds.append(nxt)
        nxt += 1
    return ([] if 0 in finished else [0]) + rounds


def record(path: Path, entry: dict) -> list[dict]:
    """Replace the ledger's entry for ``entry["round"]`` (atomic write)."""
    ledger = [r for r in load_ledger(path) if r["round"] != entry["round"]] + [entry]
    ledger.sort(key=lambda r: r["round"])
    write_json_atomic(path, {"rounds": ledger})
    return ledger


def round_figures(root: Path, summary: dict) -> dict:
    """What a round changed, from its outputs: the candidate's judge accuracy and proxy reward, its KL, the RM's
    accuracy (held-out pairs; the previous RM on this round's fresh pairs), the labels, and the gate's outcome."""
    def read(rel: Path) -> dict:
        return json.loads((root / rel).read_text()) if (root / rel).exists() else {}

    cand = (read(paths.REPORTS / "eval.json").get("candidate") or {})
    rm, fb = read(paths.METRICS / "rm.json"), read(paths.METRICS / "feedback.json")
    return {"judge_accuracy": cand.get("accuracy"), "judge_mean": cand.get("judge_mean"),
            "proxy_reward": cand.get("reward_mean"), "kl_to_reference": cand.get("kl_to_reference"),
            "rm_accuracy": rm.get("accuracy"),
            "rm_fresh_pairs_accuracy_before": rm.get("fresh_pairs_accuracy_before"),
            "pairs_labelled": fb.get("labelled"),
            "label_agreement_with_checker": fb.get("label_agreement_with_checker"),
            "promoted": float(bool(summary.get("promoted")))}


def write_rounds_plot(root: Path, ledger: list[dict]) -> None:
    rows = [{"round": r["round"], **{k: r.get("figures", {}).get(k) for k in FIGURES}}
            for r in ledger if r["status"] == "finished"]
    lines = [",".join(("round", *FIGURES))]
    for row in rows:
        lines.append(",".join("" if row[k] is None else str(row[k]) for k in ("round", *FIGURES)))
    write_text_atomic(root / ROUNDS_PLOT, "\n".join(lines) + "\n")


@flow(name="rlhf-rounds", flow_run_name="rlhf-rounds-{rounds}", log_prints=True)
def rlhf_rounds(
    rounds: int = 1,
    overrides: list[str] | None = None,
    backend: Literal["local", "kubernetes"] = "local",
    promote: bool = True,
    root: str = ".",
    params_file: str = DEFAULT_PARAMS,
    retries: int = 2,
    retry_delay_s: float = 10.0,
    k8s: StageJobSettings | None = None,
    k8s_stages: dict[str, StageJobSettings] | None = None,
) -> list[dict]:
    """Run ``rounds`` feedback rounds (after the base pipeline, when it never finished); returns their ledger
    entries. ``overrides`` apply to every round (e.g. ``feedback.label_noise=0.2``)."""
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1 (got {rounds})")
    logger = get_run_logger()
    root_path = Path(root).resolve()
    params = load_params(root_path / params_file, list(overrides or []))
    ledger_file = ledger_path(root_path, params.project.workspace)
    done = []
    for n in plan_rounds(load_ledger(ledger_file), rounds):
        logger.info("round %d: started", n)
        record(ledger_file, {"round": n, "status": "started", "started_at": time.time()})
        summary = rlhf_pipeline(overrides=[*(overrides or []), f"feedback.round={n}"], backend=backend,
                                promote=promote, root=str(root_path), params_file=params_file, retries=retries,
                                retry_delay_s=retry_delay_s, k8s=k8s, k8s_stages=k8s_stages)
        entry = {"round": n, "status": "finished", "finished_at": time.time(),
                 "figures": round_figures(root_path, summary), "champion": summary.get("champion"),
                 "registered": {k: v.get("version") for k, v in summary.get("registered", {}).items()},
                 "gate_passed": (summary.get("gate") or {}).get("passed"),
                 "pipeline_run_id": summary.get("parent_run_id")}
        ledger = record(ledger_file, entry)
        write_rounds_plot(root_path, ledger)
        log_round(summary.get("parent_run_id"), n, entry["figures"])
        logger.info("round %d: %s", n, json.dumps(entry["figures"]))
        done.append(entry)
    return done


def log_round(run_id: str | None, n: int, figures: dict) -> None:
    """``round.*`` metrics at step ``n`` in the round's pipeline run: MLflow's chart of a metric across runs
    (or the experiment's runs tagged ``rlhf.round``) is the round-over-round curve."""
    if not run_id:
        return
    import mlflow

    client = mlflow.MlflowClient()
    client.set_tag(run_id, "rlhf.round", str(n))
    for k, v in figures.items():
        if isinstance(v, (int, float)):
            client.log_metric(run_id, f"round.{k}", float(v), step=n)
