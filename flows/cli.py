"""The ``rlhf`` console script: the stage CLI plus the orchestration verbs.

``rlhf stage NAME`` comes from :mod:`rlhf_core.cli` (Prefect-free); this module
adds ``run``, ``register``, ``promote``, ``rollback``, ``export``, ``deploy`` and ``init``, and ``bench`` from
:mod:`benchmarks.cli`.

Exit codes: 0 done (also when the gate rejected the candidate, unless
``--strict-gate``), 1 a stage or task failed, 2 bad usage or config,
3 MLflow unreachable, 4 gate rejected with ``--strict-gate``, 5 another ``rlhf run`` holds the workspace,
130 / 143 stopped by SIGINT / SIGTERM (everything the run started is stopped first),
65 input refused (``init``: a non-empty folder, a missing file; ``export``: no such model, alias or version, a
push the Hub refused).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import typer
from rich.table import Table

import flows.cli_workspace  # noqa: F401  (registers `rlhf init` and `rlhf export`)
from benchmarks.cli import bench_app
from flows.local_pipeline import EarlyAPI, embedded_environment, ensure_dvc
from flows.termination import Terminated, sigterm_unwinds
from rlhf_core.cli import SET_HELP, app, console, exit_lightly, fail, fail_config
from rlhf_core.config import DEFAULT_PARAMS, ConfigError, load_params
from rlhf_core.ops.telemetry import telemetry_off
from rlhf_core.ops.tracking import importable

app.add_typer(bench_app, name="bench")

STAGES_HELP = "Stages to run (repeatable); default: every stage in dvc.yaml."


def _prepare_environment(params_file: Path):
    try:
        params = load_params(params_file)
    except ConfigError as err:
        fail_config(err)
    embedded_environment(Path("."), params.project.workspace)
    return params


def print_rounds(done: list[dict]) -> None:
    table = Table(title="rlhf-ops feedback rounds")
    cols = ("judge_accuracy", "proxy_reward", "kl_to_reference", "rm_fresh_pairs_accuracy_before", "pairs_labelled")
    for col in ("round", *cols, "gate", "champion"):
        table.add_column(col)
    for r in done:
        f = r["figures"]
        table.add_row(str(r["round"]), *("-" if f.get(c) is None else f"{f[c]:.4g}" for c in cols),
                      "passed" if r.get("gate_passed") else "failed", f"v{r.get('champion')}")
    console.print(table)


def print_summary(summary: dict) -> None:
    table = Table(title="rlhf-ops pipeline")
    for col in ("stage", "status", "seconds", "key metrics"):
        table.add_column(col)
    for r in summary["stages"]:
        flat = {k: v for k, v in r.get("metrics", {}).items() if isinstance(v, int | float)}
        table.add_row(r["stage"], r["status"], str(r["seconds"]),
                      ", ".join(f"{k}={v:.4g}" for k, v in list(flat.items())[:6]))
    console.print(table)
    for kind, reg in summary.get("registered", {}).items():
        console.print(f"registered {kind}: {reg['name']} v{reg['version']}"
                      f"{'' if reg['new'] else ' (unchanged, already registered)'}")
    gate = summary.get("gate")
    if gate is not None:
        failing = [f"{c['name']}={c['value']}" for c in gate["checks"] if not c["passed"]]
        verdict = "[green]PASSED[/green]" if gate["passed"] else f"[red]FAILED[/red] ({', '.join(failing)})"
        console.print(f"gate: {verdict}; judge: {gate.get('judge') or 'none'}; promoted: {summary['promoted']}; "
                      f"champion: v{summary.get('champion')}", highlight=False)
        for c in gate["checks"]:
            if not c["passed"] and c.get("note"):
                console.print(f"  {c['name']}: {c['note']}", highlight=False)
    uri = summary.get("tracking_uri", "")
    console.print(f"MLflow UI: mlflow ui --backend-store-uri {uri}" if uri.startswith("sqlite")
                  else f"MLflow UI: {uri}")


@app.command("run")
def run_cmd(
    set_: list[str] = typer.Option([], "--set", "-S", help=SET_HELP + " Written to params.yaml, like dvc exp run."),
    params_file: str = typer.Option(DEFAULT_PARAMS, "--params", "-p",
                                    help="A params profile (e.g. configs/smollm2.yaml), written over params.yaml "
                                         "(the file DVC's stages read) before the run."),
    stages: list[str] = typer.Option([], "--stage", help=STAGES_HELP),
    backend: str = typer.Option("local", help="local (dvc repro) or kubernetes (one Job per stage)."),
    promote: bool = typer.Option(True, "--promote/--no-promote", help="Move `champion` when the gate passes."),
    force: bool = typer.Option(False, "--force", help="Re-run stages even when DVC finds them up to date."),
    strict_gate: bool = typer.Option(False, "--strict-gate", help="Exit 4 when the gate rejects the candidate."),
    rounds: int = typer.Option(0, "--rounds", min=0, help="Run this many feedback rounds (continuous RLHF, "
                                                          "docs/rounds.md), after the base pipeline if it never "
                                                          "finished; 0: the pipeline once."),
) -> None:
    """Run the whole pipeline as a Prefect flow (embedded default: offline, no servers).

    Example: rlhf run -S sft.epochs=2 --stage prepare --stage sft; rlhf run --rounds 3;
    rlhf run -p configs/smollm2.yaml
    """
    if rounds and stages:
        fail("--rounds runs every stage of each round; it takes no --stage")
    from flows.workspace_init import NOT_A_WORKSPACE, is_workspace

    if backend == "local" and not is_workspace(Path(".")):  # before anything is written here
        fail(NOT_A_WORKSPACE.format(cwd=Path.cwd()))
    if params_file != DEFAULT_PARAMS and not Path(params_file).is_file():  # no params.yaml: every default
        fail(f"params file {params_file} not found", code=65)
    params = _prepare_environment(Path(params_file))
    from rlhf_core.ops.tracking import TrackingUnavailable, check_reachable, tracking_uri

    try:
        check_reachable(tracking_uri(params))  # before anything else: no training without tracking
    except TrackingUnavailable as err:
        fail(str(err), code=3)
    except ConfigError as err:  # TrackingRefused: the server refused our credentials
        fail(str(err))
    from flows.workspace_lock import WorkspaceBusy, workspace_lock

    try:
        with sigterm_unwinds(), workspace_lock(params.project.workspace):
            api = EarlyAPI()  # boots while the workspace is set up
            try:
                if backend == "local":
                    ensure_dvc(Path("."), params.project.workspace)
                from flows.pipeline import rlhf_pipeline

                api.join()

                if rounds:
                    from flows.rounds import rlhf_rounds

                    done = rlhf_rounds(rounds=rounds, overrides=set_ or None, backend=backend, promote=promote,
                                       params_file=params_file)
                    print_rounds(done)
                    return
                summary = rlhf_pipeline(stages=stages or None, overrides=set_ or None, backend=backend,
                                        promote=promote, force=force, params_file=params_file)
            finally:
                api.stop()
    except (Terminated, KeyboardInterrupt) as err:  # flows.termination: the server is stopped, the lock freed
        signum = err.signum if isinstance(err, Terminated) else signal.SIGINT
        fail(f"stopped by {signal.Signals(signum).name}; `rlhf run` again resumes from the last checkpoint",
             code=128 + signum)
    except WorkspaceBusy as err:
        fail(str(err), code=5)
    except TrackingUnavailable as err:
        fail(str(err), code=3)
    except ConfigError as err:
        fail(str(err))
    except Exception as err:  # a failed stage or task: Prefect has logged the details
        fail(f"pipeline failed: {err}", code=1)
    print_summary(summary)
    if strict_gate and summary.get("gate") and not summary["gate"]["passed"]:
        raise typer.Exit(4)


@app.command("register")
def register_cmd(
    kinds: list[str] = typer.Option(["reward", "critic", "actor"], "--kind", help="actor | critic | reward."),
) -> None:
    """Register the trained models in the workspace (e.g. after an MLflow outage); skips what is registered.

    Example: rlhf register --kind actor
    """
    params = _prepare_environment(Path(DEFAULT_PARAMS))
    from flows.pipeline import MODEL_DIRS
    from rlhf_core.ops import tracking
    from tasks.registry import model_lineage, register_model_dir

    try:
        tracking.setup(params)
    except tracking.TrackingUnavailable as err:
        fail(str(err), code=3)
    prefix = tracking.registry_prefix(params)
    lineage = tracking.lineage_tags(params, "register")
    for kind in kinds:
        if kind not in MODEL_DIRS:
            fail(f"unknown kind {kind!r}; expected actor, critic or reward")
        if not MODEL_DIRS[kind].is_dir():
            console.print(f"skip {kind}: {MODEL_DIRS[kind]} does not exist")
            continue
        reg = register_model_dir(kind, MODEL_DIRS[kind], f"{prefix}-{kind}", model_lineage(MODEL_DIRS[kind], lineage))
        console.print(f"{kind}: {reg.name} v{reg.version} ({'new' if reg.new else 'already registered'})")


@app.command("promote")
def promote_cmd(
    version: str = typer.Argument(..., help="Version of <prefix>-actor to make champion."),
    reason: str = typer.Option("manual promotion", help="Recorded in the version's tags."),
    kind: str = typer.Option("actor", help="Registered model kind: actor | critic | reward."),
) -> None:
    """Move the `champion` alias to VERSION by hand (recorded in tags).

    Example: rlhf promote 3 --reason "approved after review"
    """
    params = _prepare_environment(Path(DEFAULT_PARAMS))
    from rlhf_core.ops import tracking
    from tasks.registry import promote

    tracking.setup(params)
    name = f"{tracking.registry_prefix(params)}-{kind}"
    previous = promote(name, version, reason, by="manual")
    console.print(f"{name}: champion v{previous or '-'} -> v{version}")


@app.command("rollback")
def rollback_cmd(
    reason: str = typer.Option("manual rollback", help="Recorded in the version's tags."),
    kind: str = typer.Option("actor", help="Registered model kind: actor | critic | reward."),
) -> None:
    """Move `champion` back to the version the current champion replaced.

    Example: rlhf rollback --reason "regression reported"
    """
    params = _prepare_environment(Path(DEFAULT_PARAMS))
    from rlhf_core.ops import tracking
    from tasks.registry import rollback

    tracking.setup(params)
    name = f"{tracking.registry_prefix(params)}-{kind}"
    try:
        current, previous = rollback(name, reason)
    except ValueError as err:
        fail(str(err), code=1)
    console.print(f"{name}: champion v{current} -> v{previous}")


@app.command("deploy")
def deploy_cmd(
    name: list[str] = typer.Option([], "--name", help="Deployment name(s) from prefect.yaml; default: every "
                                                      "deployment whose work pool exists on the server."),
) -> None:
    """Create the deployments in prefect.yaml (`prefect deploy`) against PREFECT_API_URL.

    Without --name, those whose work pool exists (flows/deploy.py); the others are named with the command that
    creates their pool. Example: PREFECT_API_URL=http://127.0.0.1:4200/api rlhf deploy --name rlhf-nightly
    """
    from flows.deploy import create_command, deployment_pools, server_pools, split_by_pool

    if not name:
        ready, skipped = split_by_pool(deployment_pools(Path("prefect.yaml")), server_pools())
        for dep, pool in skipped.items():
            console.print(f"skipped {dep}: work pool {pool!r} does not exist ({create_command(pool)})",
                          highlight=False)
        if not ready:
            fail("no deployment's work pool exists on this Prefect server; create one first")
        name = ready
    env = {**os.environ, "RLHF_PROJECT_DIR": os.environ.get("RLHF_PROJECT_DIR", str(Path.cwd()))}
    args = [a for n in name for a in ("--name", n)]
    proc = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", "deploy", *args], env=env)
    raise typer.Exit(proc.returncode)


@app.command("automations")
def automations_cmd(
    block: str = typer.Option(..., "--block", help="Notification block `<type-slug>/<name>`, e.g. "
                                                   "slack-webhook/rlhf-alerts (create it in the Prefect UI)."),
) -> None:
    """Create the Prefect automations that notify on a failed gate and on a promotion (replaces same-named ones).

    Example: PREFECT_API_URL=http://127.0.0.1:4200/api rlhf automations --block slack-webhook/rlhf-alerts
    """
    from flows.automations import create_automations

    try:
        ids = create_automations(block)
    except ValueError as err:
        fail(str(err))
    console.print(f"created {len(ids)} automations: rlhf-gate-failed, rlhf-model-promoted (notify via {block})")


k8s_app = typer.Typer(help="Kubernetes: render stage Jobs, regenerate the generated manifests.", no_args_is_help=True)
app.add_typer(k8s_app, name="k8s")


@k8s_app.command("render")
def k8s_render(
    stage: str = typer.Argument(..., help="prepare | sft | rm | rlhf | evaluate."),
    kind: str = typer.Option("job", help="job (a batch/v1 Job; Indexed + headless Service when nnodes > 1), "
                                         "jobset (a JobSet: gang restart; needs the JobSet controller), "
                                         "pytorchjob (a Kubeflow Training Operator v1 PyTorchJob) or "
                                         "trainjob (a Kubeflow Trainer v2 TrainJob on the torch-distributed runtime)."),
    gpus: int = typer.Option(None, help="GPUs per node (default: 0 for prepare, 1 otherwise)."),
    nnodes: int = typer.Option(1, help="Nodes (pods) for multi-node training."),
    nproc_per_node: int = typer.Option(None, help="Processes per node (default: gpus)."),
    image: str = typer.Option(None, help="Image (default: the pinned GPU image)."),
    namespace: str = typer.Option("rlhf", help="Namespace."),
    queue: str = typer.Option(None, help="Kueue LocalQueue (the kueue.x-k8s.io/queue-name label)."),
    priority_class: str = typer.Option(None, help="The pods' priorityClassName."),
    dvc_remote: str = typer.Option(None, help="Run the stage under DVC against this remote (`rlhf repro`), as the "
                                              "flow does with k8s.dvc_remote."),
) -> None:
    """Print the manifest that runs one stage (the same the kubernetes backend submits).

    Example: rlhf k8s render sft --gpus 8 --queue team-a | kubectl apply -f -
    """
    from tasks.k8s.render_operators import main_render

    kw = {k: v for k, v in {"gpus": gpus, "nproc_per_node": nproc_per_node, "image": image, "queue": queue,
                            "priority_class": priority_class, "dvc_remote": dvc_remote}.items() if v is not None}
    if kind == "job" or nnodes != 1:
        kw["nnodes"] = nnodes
    try:
        sys.stdout.write(main_render(stage, kind=kind, namespace=namespace, **kw))
    except ValueError as err:
        fail(str(err))


@k8s_app.command("write-manifests")
def k8s_write_manifests(check: bool = typer.Option(False, "--check", help="Only report stale files; exit 1.")) -> None:
    """Regenerate k8s/ files derived from params.yaml and the Job template (stage Jobs, work-pool template).

    Example: rlhf k8s write-manifests --check
    """
    from tasks.k8s.manifests import write_manifests

    stale = write_manifests(".", check=check)
    for path in stale:
        console.print(f"{'stale' if check else 'wrote'}: {path}")
    if check and stale:
        raise typer.Exit(1)


ORCHESTRATION_VERBS = ("run", "register", "promote", "rollback", "export", "deploy", "automations")


def main() -> None:
    """``rlhf``; the orchestration verbs say what to install where only the training core is (a stage image)."""
    telemetry_off()  # DVC, MLflow, Prefect, the Hub: off unless set (rlhf_core/ops/telemetry.py)
    verb = next((a for a in sys.argv[1:] if not a.startswith("-")), None)
    if verb in ORCHESTRATION_VERBS:
        missing = [m for m in ("prefect", "sqlalchemy") if not importable(m)]
        if missing:
            try:
                fail(f"`rlhf {verb}` needs the orchestration extra ({', '.join(missing)} not installed here: this "
                     "is the training core): pip install 'rlhf-ops[orchestration]'")
            except typer.Exit as stop:  # outside the app: exit with its code, no traceback
                sys.exit(stop.exit_code)
    exit_lightly(app)


if __name__ == "__main__":
    main()



