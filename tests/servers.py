"""Start real servers (MLflow, Prefect) on free loopback ports for tests; stop them afterwards."""

from __future__ import annotations

import copy
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from contextlib import contextmanager
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout_s: float, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited early ({proc.returncode}):\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url, timeout=2) as resp:
                if resp.status < 500:
                    return
        except urllib.error.HTTPError as err:  # e.g. 401 from a server behind its auth string: it is up
            if err.code < 500:
                return
            time.sleep(0.5)
        except OSError:
            time.sleep(0.5)
    raise TimeoutError(f"{url} did not answer in {timeout_s}s:\n{log.read_text()[-3000:]}")


@contextmanager
def background(cmd: list[str], log: Path, env: dict | None = None, cwd: Path | None = None):
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})},
                                cwd=cwd, start_new_session=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 15)
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)


@contextmanager
def mlflow_server(tmp: Path, auth: dict[str, str] | None = None):
    """A real ``mlflow server``: SQLite backend, artifacts in ``tmp``; yields its URI.

    ``auth`` (``{"username", "password"}``) runs MLflow's basic-auth app with that admin and the shipped
    ``k8s/base/mlflow-auth.ini`` (its auth database moved into ``tmp``).
    """
    port = free_port()
    env = None
    extra: list[str] = []
    if auth:
        ini = (REPO / "k8s/base/mlflow-auth.ini").read_text().replace("sqlite:////mlflow/basic_auth.db",
                                                                       f"sqlite:///{tmp / 'basic_auth.db'}")
        (tmp / "basic_auth.ini").write_text(ini)
        env = {"MLFLOW_AUTH_CONFIG_PATH": str(tmp / "basic_auth.ini"), "MLFLOW_AUTH_ADMIN_USERNAME": auth["username"],
               "MLFLOW_AUTH_ADMIN_PASSWORD": auth["password"], "MLFLOW_FLASK_SERVER_SECRET_KEY": "test-secret-key"}
        extra = ["--app-name", "basic-auth"]
    log = tmp / "mlflow-server.log"
    cmd = [sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port),
           "--backend-store-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--artifacts-destination", str(tmp / "artifacts"),
           "--workers", "1", *extra]
    with background(cmd, log, env=env) as proc:
        uri = f"http://127.0.0.1:{port}"
        wait_http(f"{uri}/health", 90, proc, log)
        yield uri


@contextmanager
def prefect_server(tmp: Path, extra_env: dict | None = None):
    """A real ``prefect server start`` with its own PREFECT_HOME (and ``extra_env``, e.g. its auth string);
    yields its API URL and the environment it runs with."""
    port = free_port()
    log = tmp / "prefect-server.log"
    env = {"PREFECT_HOME": str(tmp / "prefect-home"), "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
           "PREFECT_UI_ENABLED": "false", "DO_NOT_TRACK": "1", **(extra_env or {})}
    cmd = [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", str(port)]
    with background(cmd, log, env=env) as proc:
        api = f"http://127.0.0.1:{port}/api"
        wait_http(f"{api}/health", 120, proc, log)
        yield api, env


# what every flow test runs with unless it says otherwise: one reward model (the demo's ensemble would train
# several in every test; tests/flows/test_pipeline_e2e.py runs a small ensemble through the flow)
# one thread per training: the test workers share the cores (two threads each on two busy cores spin)
TEST_DEFAULTS = {"rm": {"ensemble": 1}, "compute": {"num_threads": 1}}


@contextmanager
def s3_server(tmp: Path, bucket: str = "rlhf-test"):
    """A real S3-compatible server, ``moto_server`` on a loopback port, with ``bucket`` created; yields the
    environment that points boto3, s3fs and DVC's S3 remote at it (``AWS_ENDPOINT_URL`` and dummy keys)."""
    port = free_port()
    env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}", "AWS_ACCESS_KEY_ID": "testing",
           "AWS_SECRET_ACCESS_KEY": "testing", "AWS_DEFAULT_REGION": "us-east-1"}
    log = tmp / "moto.log"
    with background([str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
                    log) as proc:
        wait_http(f"{env['AWS_ENDPOINT_URL']}/moto-api/", 60, proc, log)
        import boto3

        boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], aws_access_key_id="testing",
                     aws_secret_access_key="testing", region_name="us-east-1").create_bucket(Bucket=bucket)
        yield env


def project_copy(dst: Path, params: dict | None = None) -> Path:
    """A git checkout of this project (tracked + untracked files) with ``TEST_DEFAULTS``, then ``params``, merged
    into params.yaml."""
    from benchmarks.kill_flow import fresh_copy

    fresh_copy(REPO, dst)
    current = yaml.safe_load((dst / "params.yaml").read_text())

    def merge(a: dict, b: dict) -> dict:
        for k, v in b.items():
            a[k] = merge(a.get(k) or {}, v) if isinstance(v, dict) and not k.endswith("reward_fns") else v
        return a

    merged = merge(merge(current, copy.deepcopy(TEST_DEFAULTS)), params or {})
    (dst / "params.yaml").write_text(yaml.safe_dump(merged, sort_keys=False))
    return dst
