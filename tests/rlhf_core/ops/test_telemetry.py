"""Telemetry of DVC, MLflow, Prefect and the Hub is off where rlhf runs, by each tool's own reading of it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from rlhf_core.ops.dvc_repro import stage_env
from rlhf_core.ops.telemetry import OFF, telemetry_off

REPO = Path(__file__).resolve().parents[3]
CI_MARKERS = ("PYTEST_CURRENT_TEST", "CI", "GITHUB_ACTIONS", "DVC_TEST")  # each tool turns itself off under these
PROBE = """
from rlhf_core.ops.telemetry import telemetry_off
telemetry_off()
import dvc.analytics, mlflow.telemetry.utils as m
from prefect.settings import get_current_settings
print(dvc.analytics.is_enabled(), not m.is_telemetry_disabled(), get_current_settings().server.analytics_enabled)
"""


def probe(cwd: Path, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k not in (*CI_MARKERS, *OFF)}
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**clean, "PYTHONPATH": str(REPO), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    return done.stdout.split("\n")[-2]


def test_each_tool_reads_its_switch_as_off_and_a_users_value_wins(tmp_path):
    assert probe(tmp_path) == "False False False"  # DVC analytics, MLflow telemetry, Prefect server analytics
    assert probe(tmp_path, MLFLOW_DISABLE_TELEMETRY="false", DO_NOT_TRACK="0") == "False True False"
    env = telemetry_off({"DVC_NO_ANALYTICS": ""})
    assert env["DVC_NO_ANALYTICS"] == "" and env["MLFLOW_DISABLE_TELEMETRY"] == "true"


def test_dvc_children_and_the_images_get_it(tmp_path):
    assert all(stage_env().get(k) is not None for k in OFF)  # what `dvc repro` of a stage runs under
    for name in ("Dockerfile.cpu", "Dockerfile.gpu"):
        text = (REPO / "docker" / name).read_text()
        assert all(f"{k}={v}" in text for k, v in OFF.items()), name


def test_the_embedded_workspace_turns_dvc_analytics_off_in_its_config(tmp_path):
    from flows.local_pipeline import ensure_dvc

    subprocess.run(["git", "init", "-q"], cwd=tmp_path, check=True)
    ensure_dvc(tmp_path, ".rlhf")
    config = subprocess.run([sys.executable, "-m", "dvc", "config", "core.analytics"], cwd=tmp_path,
                            capture_output=True, text=True)
    assert config.stdout.strip() == "false"
    clean = {k: v for k, v in os.environ.items() if k not in (*CI_MARKERS, *OFF)}
    direct = subprocess.run([sys.executable, "-c", "import dvc.analytics as a; print(a.is_enabled())"], cwd=tmp_path,
                            capture_output=True, text=True, env=clean)
    assert direct.stdout.strip() == "False"  # a bare `dvc` there, without our environment
