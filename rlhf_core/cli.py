"""The stage CLI: ``rlhf stage NAME`` (also ``python -m rlhf_core.cli stage NAME`` under torchrun).

This module is Prefect-free so a training process starts fast; the full
``rlhf`` command (``flows.cli``) adds the orchestration verbs to this app.
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import signal
import sys
from contextlib import nullcontext
from pathlib import Path

import typer
import yaml
from rich.console import Console
from rich.markup import escape

from rlhf_core.config import DEFAULT_PARAMS, ConfigError, ParamsFileMissing, load_params
from rlhf_core.ops.dvc_remote import REMOTE_ENV
from rlhf_core.ops.launch import LAUNCH_ENV, record_stopped, relaunch_command
from rlhf_core.ops.telemetry import telemetry_off
from rlhf_core.stages import CHECKPOINTED_STAGES, IDLE, STAGES, exit_codes

app = typer.Typer(help="rlhf-ops: an RLHF pipeline (prepare, SFT, RM, PPO/GRPO, evaluate).",
                  no_args_is_help=True, pretty_exceptions_enable=False)
params_app = typer.Typer(help="Inspect and validate params.yaml.", no_args_is_help=True)
app.add_typer(params_app, name="params")
console = Console(stderr=True, soft_wrap=True)  # a path in a message stays one piece (logs, grep, copy)

SET_HELP = "Override a param, e.g. -S data.max_prompt_len=128 (repeatable; value parsed as YAML)."


def fail(message: str, code: int = exit_codes.BAD_CONFIG) -> None:
    console.print(f"[red]error:[/red] {escape(message)}", highlight=False)  # a message's [..] is text, not markup
    raise typer.Exit(code)


def fail_config(err: ConfigError) -> None:
    """Exit on a params problem: 65 for a params file that is not there (a missing input), else 2."""
    fail(str(err), code=exit_codes.BAD_INPUT if isinstance(err, ParamsFileMissing) else exit_codes.BAD_CONFIG)


def resolve_stage(name: str):
    if name not in STAGES:
        fail(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
    module, func = STAGES[name].split(":")
    return getattr(importlib.import_module(module), func)


def inject_fault(stage: str, step: int) -> None:
    """Resilience testing: ``RLHF_FAULT=STAGE:STEP:MARKER_FILE`` kills the stage once after logging STEP.

    The marker file records that the fault fired, so the retried stage runs through (and resumes).
    """
    spec = os.environ.get("RLHF_FAULT")
    if not spec:
        return
    fault_stage, fault_step, marker = spec.split(":", 2)
    if fault_stage == stage and step >= int(fault_step) and not Path(marker).exists():
        Path(marker).write_text(f"{stage} killed after step {step}\n")
        console.print(f"[red]fault injected[/red]: {stage} killed after step {step} (RLHF_FAULT)")
        os._exit(17)


@app.command("stage")
def stage_cmd(
    name: str = typer.Argument(..., help="Stage to run: prepare | sft | rm | rlhf | evaluate."),
    set_: list[str] = typer.Option([], "--set", "-S", help=SET_HELP),
    params_file: Path = typer.Option(DEFAULT_PARAMS, "--params", "-p", help="Params file (a profile)."),
) -> None:
    """Run one pipeline stage in this process.

    Example: rlhf stage prepare -S data.max_prompt_len=64
    """
    fn = resolve_stage(name)
    relaunch = relaunch_command(sys.argv[1:])
    if relaunch:  # $RLHF_LAUNCH: this stage runs as several processes under the launcher
        os.environ.pop(LAUNCH_ENV)  # its workers run the stage (never relaunch, whatever the launcher sets)
        sys.stdout.flush()
        os.execvp(relaunch[0], relaunch)
    try:
        params = load_params(params_file, set_)
    except ConfigError as err:
        fail_config(err)
    from rlhf_core.data.readers import DataError
    from rlhf_core.engine import stop
    from rlhf_core.ops import tracking
    from rlhf_core.ops.flow_watch import stop_when_flow_exits
    from rlhf_core.ops.locks import LockBusy, stage_lock
    from rlhf_core.ops.progress import StageProgress

    if name in CHECKPOINTED_STAGES:
        stop.install(params.compute.stop_grace_s)
    stop_when_flow_exits(Path(params.project.workspace) / "logs" / f"stage-{name}.log")

    try:
        idle = IDLE.get(name, lambda _: False)(params)
        run = nullcontext(lambda metrics, step: None) if idle else tracking.stage_run(name, params, Path("."))
        with stage_lock(params.project.workspace, name), run as mlflow_log, StageProgress(name, console) as show:

            def log(metrics: dict, step: int) -> None:
                show(metrics, step)
                mlflow_log(metrics, step)
                inject_fault(name, step)

            result = fn(params, Path("."), log)
    except LockBusy as err:
        fail(f"stage {name}: {err}", code=exit_codes.BUSY)
    except tracking.TrackingUnavailable as err:
        fail(str(err), code=exit_codes.TRACKING_UNAVAILABLE)
    except tracking.TrackingRefused as err:
        fail(str(err), code=exit_codes.BAD_CONFIG)
    except stop.StopRequested as err:
        record_stopped()
        fail(f"stage {name}: {err}", code=exit_codes.STOPPED)
    except (DataError, ConfigError, ValueError) as err:  # a retry would fail the same way
        fail(f"stage {name}: {err}", code=exit_codes.BAD_INPUT)
    if name == "prepare":
        from rlhf_core.stages.prepare import summary

        console.print(f"[green]{name} done[/green]: {summary(result)}", highlight=False)
    elif isinstance(result, dict) and "counts" in result:
        console.print(f"[green]{name} done[/green]: {json.dumps(result['counts'])}", highlight=False)


@params_app.command("check")
def params_check(
    set_: list[str] = typer.Option([], "--set", "-S", help=SET_HELP),
    params_file: Path = typer.Option(DEFAULT_PARAMS, "--params", "-p", help="Params file (a profile)."),
) -> None:
    """Validate a params file (and overrides); print the effective config as YAML.

    Example: rlhf params check -p configs/gpu.yaml
    """
    try:
        params = load_params(params_file, set_)
    except ConfigError as err:
        fail_config(err)
    sys.stdout.write(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))


@params_app.command("docs")
def params_docs() -> None:
    """Print the params reference (Markdown) generated from the pydantic models."""
    from rlhf_core.params_doc import render_params_reference

    sys.stdout.write(render_params_reference())


# --------------------------------------------------------------------------- the DVC cache
cache_app = typer.Typer(help="Check the DVC cache behind this workspace's outputs.", no_args_is_help=True)
app.add_typer(cache_app, name="cache")


@cache_app.command("verify")
def cache_verify(
    repair: bool = typer.Option(False, "--repair", help="Remove damaged entries (then `dvc pull` or "
                                                        "`dvc commit -f STAGE` puts good ones back)."),
) -> None:
    """Re-hash every DVC cache entry dvc.lock names; exit 65 naming each one whose content no longer matches
    its md5 (DVC itself trusts read-only entries). Run it before `dvc push`, or on a schedule.

    Example: rlhf cache verify --repair && dvc pull
    """
    from rlhf_core.ops.dvc_cache import verify_cache

    try:
        report = verify_cache(Path.cwd(), repair=repair)
    except ValueError as err:
        fail(str(err), code=exit_codes.BAD_INPUT)
    console.print(f"{report.checked} cache entries checked, {len(report.damaged)} damaged, {report.absent} not in "
                  f"the local cache" + (f", {len(report.skipped)} outputs skipped (not DVC 3 md5): "
                                        f"{', '.join(report.skipped)}" if report.skipped else ""), highlight=False)
    if report.damaged:
        fail("\n".join(report.damaged), code=exit_codes.BAD_INPUT)


@app.command("repro")
def repro_cmd(
    name: str = typer.Argument(..., help="Stage to run: prepare | sft | rm | rlhf | evaluate."),
    remote: str = typer.Option(..., "--remote", envvar=REMOTE_ENV,
                               help=f"DVC remote URL (s3://bucket/path, gs://..., a path); env {REMOTE_ENV}."),
    params_file: Path | None = typer.Option(None, "--params", "-p", help="Params file for this run (uploaded to "
                                                                         "the remote); default: the remote's."),
    force: bool = typer.Option(False, "--force", help="Run the stage even if DVC finds it up to date."),
) -> None:
    """Run one stage under DVC in this folder against a shared remote, with no git (a stage pod's command).

    Pulls dvc.lock, params and the stage's inputs from the remote, skips the stage when nothing it depends
    on changed, pushes its outputs and the new dvc.lock after a run (rlhf_core/ops/dvc_remote.py). Exits with
    the stage's own code (75: stopped on SIGTERM after a checkpoint; SIGTERM is passed on to the stage).

    Example: AWS_ENDPOINT_URL=http://minio:9000 rlhf repro sft --remote s3://ml/rlhf
    """
    from rlhf_core.ops.dvc_remote import RemoteStateError, repro
    from rlhf_core.ops.dvc_repro import signal_stage

    if params_file is not None and not params_file.is_file():
        fail(f"--params {params_file}: no such file")
    child = {}

    def forward(signum, _frame):
        if "proc" in child:
            signal_stage(child["proc"], signum)

    signal.signal(signal.SIGTERM, forward)
    try:
        outcome = repro(name, Path.cwd(), remote, params_file, force, echo=lambda line: print(line, flush=True),
                        started=lambda proc: child.update(proc=proc))
    except RemoteStateError as err:
        fail(str(err), code=exit_codes.BAD_CONFIG if err.missing_params else exit_codes.CRASHED)
    except OSError as err:  # the remote: unreachable, denied (fsspec, botocore raise OSError subclasses)
        fail(f"remote {remote}: {err}", code=exit_codes.CRASHED)
    if outcome.returncode != 0:
        code = outcome.stage_code
        fail(f"stage {name} failed ({exit_codes.describe(code)})", code=exit_codes.CRASHED if code is None
             else code if code >= 0 else 128 - code)
    console.print(f"[green]{name} {outcome.status}[/green] (remote {remote})", highlight=False)


def exit_lightly(command) -> None:
    """``command()``, then ``gc.freeze()`` on the way out, however it leaves (a return, ``sys.exit``, an error).

    The interpreter's last garbage collection walks every object torch, transformers and MLflow created: ~1.5 s
    of each stage process's exit (docs/results/demo.md). Frozen objects are skipped by it; they are still freed
    as the modules are cleared, and atexit handlers (logging's flush, MLflow's) run as before. What is lost is
    what no code may count on anyway: the finalizer of an object left in a reference cycle at exit."""
    try:
        command()
    finally:
        gc.freeze()


def main() -> None:
    telemetry_off()  # DVC, MLflow, Prefect, the Hub: off unless set (rlhf_core/ops/telemetry.py)
    exit_lightly(app)


if __name__ == "__main__":
    main()
