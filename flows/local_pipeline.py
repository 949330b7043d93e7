"""Run the DVC pipeline in this workspace (the embedded default) and summarise it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from rlhf_core import paths
from rlhf_core.config import DEFAULT_PARAMS, ConfigError, load_params


def stage_env() -> dict[str, str]:
    """Environment for stage subprocesses: this interpreter's bin dir first on PATH (so ``rlhf`` resolves)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def ensure_dvc(root: Path, workspace: str) -> None:
    """``dvc init`` (if needed) and a default local remote inside the ignored workspace folder."""
    if not (root / ".dvc").is_dir():
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, check=True, env=stage_env())
    remote = (root / workspace / "dvc-remote").resolve()
    remote.mkdir(parents=True, exist_ok=True)
    listed = subprocess.run([sys.executable, "-m", "dvc", "remote", "list"], cwd=root, capture_output=True,
                            text=True, env=stage_env())
    if "local" not in listed.stdout.split():
        subprocess.run([sys.executable, "-m", "dvc", "remote", "add", "--local", "-d", "local", str(remote)],
                       cwd=root, check=True, env=stage_env())


def run_local_pipeline(params_file: Path | str = DEFAULT_PARAMS, overrides: list[str] | None = None,
                       force: bool = False, console: Console | None = None, root: Path | str = ".") -> int:
    console = console or Console(stderr=True)
    root = Path(root)
    try:
        params = load_params(root / params_file, overrides)
    except ConfigError as err:
        console.print(f"[red]error:[/red] {err}")
        return 2
    if overrides or Path(params_file) != Path(DEFAULT_PARAMS):
        console.print("[red]error:[/red] `rlhf run` reads params.yaml (DVC tracks it); edit it or use "
                      "`dvc exp run -S key=value` for a sweep")
        return 2
    ensure_dvc(root, params.project.workspace)
    cmd = [sys.executable, "-m", "dvc", "repro"] + (["--force"] if force else [])
    proc = subprocess.run(cmd, cwd=root, env=stage_env())
    if proc.returncode != 0:
        console.print(f"[red]pipeline failed[/red] (dvc repro exit {proc.returncode})")
        return proc.returncode
    table = Table(title="rlhf-ops pipeline")
    table.add_column("stage")
    table.add_column("metrics")
    for metrics_file in sorted((root / paths.METRICS).glob("*.json")):
        table.add_row(metrics_file.stem, json.dumps(json.loads(metrics_file.read_text()))[:200])
    console.print(table)
    return 0
