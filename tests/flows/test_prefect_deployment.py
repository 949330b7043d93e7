"""A real Prefect server and process worker run the deployment from prefect.yaml."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import background, prefect_server, project_copy

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_scheduled_deployment_runs_on_a_process_worker(tmp_path):
    project = project_copy(tmp_path / "project", {"data": {"demo": {"n_rows": 300}}})
    bin_dir = str(Path(sys.executable).parent)
    with prefect_server(tmp_path) as (api, server_env):
        env = {**os.environ, **server_env, "PREFECT_API_URL": api, "RLHF_PROJECT_DIR": str(project),
               "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}", "RLHF_TRACKING": "on",
               "MLFLOW_ENABLE_SYSTEM_METRICS_LOGGING": "false"}
        env.pop("MLFLOW_TRACKING_URI", None)  # the embedded SQLite store of the project

        def prefect(*args, check=True):
            proc = subprocess.run([sys.executable, "-m", "prefect", "--no-prompt", *args], cwd=project, env=env,
                                  capture_output=True, text=True, timeout=300)
            assert not check or proc.returncode == 0, f"prefect {args}: {proc.stdout}\n{proc.stderr}"
            return proc.stdout

        prefect("work-pool", "create", "rlhf-process", "--type", "process")
        deploy = subprocess.run([sys.executable, "-m", "flows.cli", "deploy", "--name", "rlhf-nightly"], cwd=project,
                                env=env, capture_output=True, text=True, timeout=300)
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr
        listed = prefect("deployment", "ls")
        assert "rlhf-pipeline/rlhf-nightly" in listed

        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            dep = client.read_deployment_by_name("rlhf-pipeline/rlhf-nightly")
            assert dep.schedules and dep.schedules[0].schedule.cron == "0 2 * * *"
            assert dep.schedules[0].schedule.timezone == "Europe/Amsterdam"
            assert dep.work_pool_name == "rlhf-process" and dep.parameters["backend"] == "local"
            assert dep.global_concurrency_limit and dep.global_concurrency_limit.limit == 1
            assert dep.concurrency_options.collision_strategy == "ENQUEUE"

        out = prefect("deployment", "run", "rlhf-pipeline/rlhf-nightly", "--param", 'stages=["prepare"]')
        run_id = next(line.split()[-1] for line in out.splitlines() if "UUID" in line)
        with background([sys.executable, "-m", "prefect", "worker", "start", "--pool", "rlhf-process",
                         "--run-once", "--type", "process"], tmp_path / "worker.log", env=env, cwd=project) as worker:
            worker.wait(timeout=400)
        state = json.loads(prefect("flow-run", "inspect", run_id, "--output", "json"))["state"]
        assert state["type"] == "COMPLETED", (tmp_path / "worker.log").read_text()[-4000:]
        assert (project / "data/prepared/manifest.json").exists()
        assert (project / ".rlhf/mlflow.db").exists()
