"""The stage CLI: ``rlhf stage NAME`` (also ``python -m rlhf_core.cli stage NAME`` under torchrun).

This module is Prefect-free so a training process starts fast; the full
``rlhf`` command (``flows.cli``) adds the orchestration verbs to this app.
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

import typer
from rich.console import Console

from rlhf_core.config import DEFAULT_PARAMS, ConfigError, load_params

# stage name -> "module:function" taking (params, root, log)
STAGES: dict[str, str] = {
    "prepare": "rlhf_core.stages.prepare:run",
    "evaluate": "rlhf_core.stages.evaluate:run",
}

app = typer.Typer(help="rlhf-ops: an RLHF pipeline (prepare, SFT, RM, PPO/GRPO, evaluate).",
                  no_args_is_help=True, pretty_exceptions_enable=False)
params_app = typer.Typer(help="Inspect and validate params.yaml.", no_args_is_help=True)
app.add_typer(params_app, name="params")
console = Console(stderr=True)

SET_HELP = "Override a param, e.g. -S data.max_prompt_len=128 (repeatable; value parsed as YAML)."


def _fail(message: str, code: int = 2) -> None:
    console.print(f"[red]error:[/red] {message}", highlight=False)
    raise typer.Exit(code)


def resolve_stage(name: str):
    if name not in STAGES:
        _fail(f"unknown stage {name!r}; stages: {', '.join(STAGES)}")
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
    try:
        params = load_params(params_file, set_)
    except ConfigError as err:
        _fail(str(err))
    from rlhf_core import tracking
    from rlhf_core.data.readers import DataError
    from rlhf_core.progress import StageProgress

    try:
        with tracking.stage_run(name, params, Path(".")) as mlflow_log, StageProgress(name, console) as show:

            def log(metrics: dict, step: int) -> None:
                show(metrics, step)
                mlflow_log(metrics, step)
                inject_fault(name, step)

            result = fn(params, Path("."), log)
    except tracking.TrackingUnavailable as err:
        _fail(str(err), code=3)
    except (DataError, ConfigError, ValueError) as err:
        _fail(f"stage {name}: {err}", code=1)
    if isinstance(result, dict) and "counts" in result:
        console.print(f"[green]{name} done[/green]: {json.dumps(result['counts'])}", highlight=False)


@params_app.command("check")
def params_check(
    set_: list[str] = typer.Option([], "--set", "-S", help=SET_HELP),
    params_file: Path = typer.Option(DEFAULT_PARAMS, "--params", "-p", help="Params file (a profile)."),
) -> None:
    """Validate a params file (and overrides); print the effective config as YAML.

    Example: rlhf params check -p configs/gpu.yaml
    """
    import yaml

    try:
        params = load_params(params_file, set_)
    except ConfigError as err:
        _fail(str(err))
    sys.stdout.write(yaml.safe_dump(params.model_dump(mode="json"), sort_keys=False))


@params_app.command("docs")
def params_docs() -> None:
    """Print the params reference (Markdown) generated from the pydantic models."""
    from rlhf_core.params_doc import render_params_reference

    sys.stdout.write(render_params_reference())


def main() -> None:
    app()


if __name__ == "__main__":
    main()
