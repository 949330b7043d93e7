"""The ``rlhf`` console script: the stage CLI plus the orchestration verbs.

``rlhf stage NAME`` comes from :mod:`rlhf_core.cli` (Prefect-free); this module
adds ``run`` and the other pipeline-level commands.
"""

from __future__ import annotations

from pathlib import Path

import typer

from rlhf_core.cli import SET_HELP, app, console
from rlhf_core.config import DEFAULT_PARAMS


@app.command("run")
def run_cmd(
    set_: list[str] = typer.Option([], "--set", "-S", help=SET_HELP),
    params_file: Path = typer.Option(DEFAULT_PARAMS, "--params", "-p", help="Params file (a profile)."),
    force: bool = typer.Option(False, "--force", help="Re-run stages even when DVC finds them up to date."),
) -> None:
    """Run the whole pipeline on the embedded default (offline, no servers).

    Example: rlhf run -S sft.epochs=2
    """
    from flows.local_pipeline import run_local_pipeline

    code = run_local_pipeline(params_file=params_file, overrides=set_, force=force, console=console)
    raise typer.Exit(code)


def main() -> None:
    app()


if __name__ == "__main__":
    main()
