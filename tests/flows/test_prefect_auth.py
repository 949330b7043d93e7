"""A Prefect server behind its auth string (``PREFECT_SERVER_API_AUTH_STRING``) refuses a client without it:
nobody starts a pipeline run (or moves ``champion`` through one) unauthenticated. The flow-run pods take the
client's string from the ``rlhf-credentials`` Secret."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import prefect_server, project_copy

pytestmark = pytest.mark.slow
AUTH = "rlhf-admin:a-long-test-secret"


def test_an_unauthenticated_deployment_run_is_refused_and_an_authenticated_one_starts(tmp_path):
    project = project_copy(tmp_path / "project")
    with prefect_server(tmp_path, {"PREFECT_SERVER_API_AUTH_STRING": AUTH}) as (api, server_env):
        env = {**os.environ, **server_env, "PREFECT_API_URL": api, "RLHF_PROJECT_DIR": str(project),
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
        env.pop("PREFECT_SERVER_API_AUTH_STRING")
        authed = {**env, "PREFECT_API_AUTH_STRING": AUTH}

        def run(*args: str, environ: dict) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", *args], cwd=project, env=environ, capture_output=True,
                                  text=True, timeout=300)

        made = run("prefect", "--no-prompt", "work-pool", "create", "rlhf-process", "--type", "process",
                   environ=authed)
        assert made.returncode == 0, made.stdout + made.stderr
        deploy = run("flows.cli", "deploy", "--name", "rlhf-nightly", environ=authed)
        assert deploy.returncode == 0, deploy.stdout + deploy.stderr

        refused = run("prefect", "--no-prompt", "deployment", "run", "rlhf-pipeline/rlhf-nightly", environ=env)
        said = refused.stdout + refused.stderr
        assert refused.returncode != 0 and ("401" in said or "Unauthorized" in said), said[-3000:]
        wrong = run("prefect", "--no-prompt", "deployment", "run", "rlhf-pipeline/rlhf-nightly",
                    environ={**env, "PREFECT_API_AUTH_STRING": "rlhf-admin:guess"})
        assert wrong.returncode != 0, wrong.stdout

        started = run("prefect", "--no-prompt", "deployment", "run", "rlhf-pipeline/rlhf-nightly", environ=authed)
        assert started.returncode == 0 and "UUID" in started.stdout, started.stdout + started.stderr
        count = ("from prefect.client.orchestration import get_client\n"
                 "with get_client(sync_client=True) as client: print(len(client.read_flow_runs()))")
        listed = subprocess.run([sys.executable, "-c", count], env=authed, capture_output=True, text=True,
                                timeout=120)
        assert listed.stdout.strip() == "1", listed.stdout + listed.stderr  # only the authenticated run exists


def test_the_flow_run_pod_takes_the_prefect_auth_string_from_the_secret():
    from tasks.k8s.names import CREDENTIALS_SECRET
    from tasks.k8s.work_pool import build_work_pool_template

    pod = build_work_pool_template()["job_configuration"]["job_manifest"]["spec"]["template"]["spec"]
    env = pod["containers"][0]["env"]
    ref = next(e for e in env if e["name"] == "PREFECT_API_AUTH_STRING")
    assert ref["valueFrom"]["secretKeyRef"] == {"name": CREDENTIALS_SECRET, "key": "PREFECT_API_AUTH_STRING",
                                                "optional": True}
