"""The embedded default: DVC initialised with a local remote, Prefect home and MLflow under ``.rlhf/``.

Importing this module does not import Prefect: Prefect reads its settings once, when it is first imported,
so ``embedded_environment`` must run before that (``flows.cli`` calls it first).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlhf_core.ops.dvc_repro import stage_env

EPHEMERAL_STARTUP_TIMEOUT_S = 300  # Prefect's default is 20 s


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


def embedded_environment(root: Path, workspace: str) -> None:
    """Defaults for a run with no servers: Prefect's home (ephemeral API) in the workspace folder.

    The ephemeral API server's first start migrates its database; on two busy cores that took longer than
    Prefect's default 20 s and the run failed ("Timed out while attempting to connect to ephemeral Prefect API
    server"), so it gets ``EPHEMERAL_STARTUP_TIMEOUT_S``. ``PREFECT_API_URL`` / ``MLFLOW_TRACKING_URI`` and any
    of these settings the user set win; nothing else changes.
    """
    state = (root / workspace).resolve()
    state.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("PREFECT_HOME", str(state / "prefect"))
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(EPHEMERAL_STARTUP_TIMEOUT_S))
    os.environ.setdefault("PREFECT_SERVER_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")
