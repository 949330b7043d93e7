"""MLflow behind its basic-auth app, as the cluster runs it (k8s/base/mlflow.yaml, mlflow-auth.ini): anonymous
requests are refused, the pipeline's identity works, and wrong or missing credentials stop a stage before any
training with exit 2 and a message that names the user but never the password."""

from __future__ import annotations

import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from rlhf_core.ops import tracking
from rlhf_core.stages import exit_codes
from tests.conftest import make_params
from tests.servers import mlflow_server

REPO = Path(__file__).resolve().parents[3]
ADMIN = {"username": "rlhf-pipeline", "password": "correct-horse-battery"}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def auth_uri(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow-auth"), auth=ADMIN) as uri:
        yield uri


def test_anonymous_requests_are_refused_and_health_stays_open(auth_uri):
    with urllib.request.urlopen(f"{auth_uri}/health", timeout=10) as resp:  # the probes need no credentials
        assert resp.status == 200
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(f"{auth_uri}/api/2.0/mlflow/experiments/search?max_results=1", timeout=10)
    assert err.value.code == 401


def test_credentials_are_checked_before_training(auth_uri, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_USERNAME", raising=False)
    monkeypatch.delenv("MLFLOW_TRACKING_PASSWORD", raising=False)
    with pytest.raises(tracking.TrackingRefused, match="needs credentials: set MLFLOW_TRACKING_USERNAME"):
        tracking.check_reachable(auth_uri)
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", ADMIN["username"])
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", "wrong-password-123")
    with pytest.raises(tracking.TrackingRefused, match=r"refused the request \(401\): user 'rlhf-pipeline'") as err:
        tracking.check_reachable(auth_uri)
    assert "wrong-password-123" not in str(err.value)

    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN["password"])
    monkeypatch.setenv("MLFLOW_TRACKING_URI", auth_uri)
    tracking.check_reachable(auth_uri)
    import mlflow

    exp_id = tracking.setup(make_params("tracking.experiment=auth-test"))
    with mlflow.start_run(experiment_id=exp_id) as run:
        mlflow.log_metric("x", 1.0)
    assert mlflow.get_run(run.info.run_id).data.metrics == {"x": 1.0}


def test_stage_with_wrong_credentials_exits_2_naming_the_user(auth_uri, tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLHF_TRACKING": "on", "MLFLOW_TRACKING_URI": auth_uri,
           "MLFLOW_TRACKING_USERNAME": ADMIN["username"], "MLFLOW_TRACKING_PASSWORD": "not-the-password-9"}
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "stage", "prepare", "-S", "data.demo.n_rows=200"],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == exit_codes.BAD_CONFIG, proc.stderr[-2000:]
    assert "refused the request (401): user 'rlhf-pipeline'" in " ".join(proc.stderr.split())  # rich wraps
    assert "not-the-password-9" not in proc.stdout + proc.stderr
    assert not (tmp_path / "data/prepared").exists()  # stopped before the stage ran
