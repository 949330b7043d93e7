"""The embedded default: DVC initialised with a local remote, Prefect home and MLflow under ``.rlhf/``.

Importing this module does not import Prefect: Prefect reads its settings once, when it is first imported,
so ``embedded_environment`` must run before that (``flows.cli`` calls it first).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

from flows.prefect_schema import restore
from rlhf_core.ops.dvc_repro import stage_env
from rlhf_core.ops.telemetry import telemetry_off

EPHEMERAL_STARTUP_TIMEOUT_S = 300  # Prefect's default is 20 s
DATABASE_URL_KEYS = ("PREFECT_SERVER_DATABASE_CONNECTION_URL", "PREFECT_API_DATABASE_CONNECTION_URL")


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
    analytics = subprocess.run([sys.executable, "-m", "dvc", "config", "core.analytics"], cwd=root,
                               capture_output=True, text=True, env=stage_env())
    if analytics.stdout.strip() != "false":  # DVC's own switch, in the workspace (telemetry_off sets the env one)
        subprocess.run([sys.executable, "-m", "dvc", "config", "--local", "core.analytics", "false"], cwd=root,
                       check=True, env=stage_env())


def embedded_environment(root: Path, workspace: str) -> None:
    """Defaults for a run with no servers: Prefect's home (ephemeral API) in the workspace folder, its new
    database restored from the installed Prefect's schema dump (``flows.prefect_schema``) unless a database URL is
    set.

    A first start that migrates its database (a Prefect version without a dump) took longer than Prefect's default
    20 s on two busy cores and the run failed ("Timed out while attempting to connect to ephemeral Prefect API
    server"), so the server gets ``EPHEMERAL_STARTUP_TIMEOUT_S``. ``PREFECT_API_URL`` / ``MLFLOW_TRACKING_URI`` and any
    of these settings the user set win; nothing else changes.
    """
    state = (root / workspace).resolve()
    state.mkdir(parents=True, exist_ok=True)
    if "PREFECT_HOME" not in os.environ:  # ours: its database is restored, not migrated (flows.prefect_schema)
        os.environ["PREFECT_HOME"] = str(state / "prefect")
        if not any(k in os.environ for k in DATABASE_URL_KEYS):
            restore(state / "prefect" / "prefect.db")
    os.environ.setdefault("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", str(EPHEMERAL_STARTUP_TIMEOUT_S))
    telemetry_off()  # rlhf_core.ops.telemetry: the tools' own switches, a value set by the user wins
    os.environ.setdefault("MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING", "false")


class EarlyAPI:
    """The temporary Prefect API server the flow would start on its first call, started now in a thread.

    Its boot (a new ``PREFECT_HOME``'s database migrated, then the app) takes ~25 s on two cores
    (docs/results/demo.md); started here it overlaps the workspace's set-up instead of following it. It is
    Prefect's own ``SubprocessASGIServer``, one per process, so the flow's client finds it running and starts no
    other. Nothing starts when ``PREFECT_API_URL`` names a server or ephemeral mode is off. ``join()`` before the
    flow: it re-raises the start's error.
    """

    def __init__(self) -> None:
        from prefect.server.api.server import SubprocessASGIServer  # after embedded_environment (see above)
        from prefect.settings import PREFECT_API_URL, PREFECT_SERVER_EPHEMERAL_ENABLED

        self.error: BaseException | None = None
        self.server = SubprocessASGIServer() if not PREFECT_API_URL.value() and \
            PREFECT_SERVER_EPHEMERAL_ENABLED.value() else None
        self._thread = threading.Thread(target=self._start, name="prefect-api-start", daemon=True)
        if self.server is not None:
            self._thread.start()

    def _start(self) -> None:
        try:
            self.server.start()
        except Exception as err:  # handed to join()
            self.error = err

    def stop(self) -> None:
        """Stop the server, started or still starting (a run that ends early must not leave it behind), once the
        flow's logs and events have gone to it: a log worker left with records for a stopped server retried for a
        minute before the process could exit."""
        if self.server is None:
            return
        from prefect.events.worker import EventsWorker
        from prefect.logging.handlers import APILogWorker

        for worker in (APILogWorker, EventsWorker):
            worker.drain_all(timeout=5)
        self.server.stop()
        self._thread.join(timeout=5)  # a start under way may have spawned it after the first stop
        self.server.stop()

    def join(self) -> str | None:
        """The server's API URL once it answers (None: none was started here)."""
        if self.server is None:
            return None
        self._thread.join()
        if self.error is not None:
            raise self.error
        return self.server.api_url
