"""The main command's embedded Prefect API starts on a cold, busy machine (issue: a first start timed out
after Prefect's default 20 s while two cores were busy)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.local_pipeline import EPHEMERAL_STARTUP_TIMEOUT_S, embedded_environment

REPO = Path(__file__).resolve().parents[2]

FLOW = """
import time
from pathlib import Path
from flows.local_pipeline import embedded_environment

embedded_environment(Path({root!r}), "ws")  # as `rlhf run` does: before Prefect is imported
from prefect import flow
from prefect.settings import get_current_settings
assert get_current_settings().server.ephemeral.startup_timeout_seconds == {timeout}

@flow
def hello() -> str:
    return "ok"

t0 = time.perf_counter()
print("result", hello(), round(time.perf_counter() - t0, 1))
"""


def test_embedded_environment_gives_the_ephemeral_server_time_and_the_user_wins(tmp_path, monkeypatch):
    for key in ("PREFECT_HOME", "PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"):
        monkeypatch.setenv(key, "recorded")  # so monkeypatch restores the key's absence afterwards: delenv of an
        monkeypatch.delenv(key)              # absent key records nothing, and the values set below would leak
    embedded_environment(tmp_path, "ws")
    assert os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == str(EPHEMERAL_STARTUP_TIMEOUT_S)
    assert os.environ["PREFECT_HOME"] == str((tmp_path / "ws" / "prefect").resolve())
    monkeypatch.setenv("PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS", "45")
    embedded_environment(tmp_path, "ws")
    assert os.environ["PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS"] == "45"


def test_the_embedded_environment_is_set_before_prefect_reads_its_settings():
    """Prefect caches its settings at import: importing the module that sets them must not import Prefect."""
    code = "import sys, flows.local_pipeline; print('prefect' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def _burn(seconds: float) -> None:  # pragma: no cover - runs in a child process
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


@pytest.mark.slow
def test_cold_start_of_the_embedded_prefect_server_under_cpu_load(tmp_path):
    """A fresh Prefect home (its database restored from the schema dump, flows/prefect_schema.py) while every
    core is busy: the flow runs."""
    import multiprocessing as mp

    burners = [mp.Process(target=_burn, args=(240.0,), daemon=True) for _ in range(os.cpu_count() or 2)]
    for b in burners:
        b.start()
    try:
        env = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
        env["PYTHONPATH"] = str(REPO)
        code = FLOW.format(root=str(tmp_path), timeout=EPHEMERAL_STARTUP_TIMEOUT_S)
        proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True,
                              timeout=EPHEMERAL_STARTUP_TIMEOUT_S + 120)
    finally:
        for b in burners:
            b.terminate()
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "result ok" in proc.stdout
    assert (tmp_path / "ws" / "prefect" / "prefect.db").is_file()  # the home the embedded default chose, made cold


EARLY = """
import sys
from pathlib import Path
from flows.local_pipeline import EarlyAPI, embedded_environment

embedded_environment(Path({root!r}), "ws")
api = EarlyAPI()
try:
    url = api.join()
except RuntimeError as err:
    sys.exit(f"start failed: {{err}}"[:300])
if url is None:
    sys.exit("none started")
from prefect import flow, get_client
from prefect.server.api.server import SubprocessASGIServer

@flow
def which_api() -> str:
    return str(get_client(sync_client=True).api_url)

print("early", url, "flow", which_api(), "servers", len(SubprocessASGIServer._instances))
"""


def _early(root: Path, **env: str) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PREFECT_")}
    return subprocess.run([sys.executable, "-c", EARLY.format(root=str(root))], cwd=root, capture_output=True,
                          text=True, timeout=EPHEMERAL_STARTUP_TIMEOUT_S + 60,
                          env={**clean, "PYTHONPATH": str(REPO), **env})


@pytest.mark.slow
def test_the_api_started_early_is_the_one_the_flow_uses(tmp_path):
    """`rlhf run` boots Prefect's temporary server while the workspace is set up: the flow's client talks to
    that server and no second one starts; a server named by PREFECT_API_URL starts nothing; a start that fails
    is raised at join()."""
    ok = _early(tmp_path)
    assert ok.returncode == 0, ok.stderr[-3000:]
    early, flow_api, servers = re.search(r"early (\S+) flow (\S+) servers (\d+)", ok.stdout).groups()
    assert early.startswith("http://127.0.0.1:") and flow_api.rstrip("/") == early and servers == "1"
    named = _early(tmp_path, PREFECT_API_URL="http://127.0.0.1:9/api")
    assert named.returncode == 1 and "none started" in named.stderr
    (tmp_path / "cold").mkdir()
    too_short = _early(tmp_path / "cold", PREFECT_SERVER_EPHEMERAL_STARTUP_TIMEOUT_SECONDS="1")
    assert too_short.returncode == 1 and "start failed: Timed out" in too_short.stderr, too_short.stderr[-2000:]
