"""The cluster quickstart's Prefect steps (docs/kubernetes.md, "Quickstart"), on a real Prefect server: with
only the Kubernetes work pool (created from the shipped template), `rlhf deploy` creates the Kubernetes
deployment and names the ones it skipped; a run of it is scheduled. (Executing it needs a cluster.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import prefect_server, project_copy

pytestmark = pytest.mark.slow


def test_a_kubernetes_only_prefect_server_gets_the_kubernetes_deployment(tmp_path):
    project = project_copy(tmp_path / "project")
    with prefect_server(tmp_path) as (api, server_env):
        env = {**os.environ, **server_env, "PREFECT_API_URL": api,
               "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}

        def run(*args: str) -> subprocess.CompletedProcess:
            return subprocess.run([sys.executable, "-m", *args], cwd=project, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.STDOUT, text=True, timeout=300)

        bare = run("flows.cli", "deploy")
        assert bare.returncode == 2 and "no deployment's work pool exists" in bare.stdout, bare.stdout
        pool = run("prefect", "--no-prompt", "work-pool", "create", "rlhf-kubernetes", "--type", "kubernetes",
                   "--base-job-template", "k8s/prefect/base-job-template.json")
        assert pool.returncode == 0, pool.stdout
        deploy = run("flows.cli", "deploy")
        assert deploy.returncode == 0, deploy.stdout[-4000:]
        assert "skipped rlhf-nightly: work pool 'rlhf-process' does not exist (prefect work-pool create " \
               "rlhf-process --type process)" in " ".join(deploy.stdout.split())
        started = run("prefect", "--no-prompt", "deployment", "run", "rlhf-pipeline/rlhf-kubernetes-weekly")
        assert started.returncode == 0 and "UUID" in started.stdout, started.stdout

        from prefect.client.orchestration import get_client
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings(updates={PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            names = {f"{d.name}" for d in client.read_deployments()}
            assert names == {"rlhf-kubernetes-weekly"}, names
            dep = client.read_deployment_by_name("rlhf-pipeline/rlhf-kubernetes-weekly")
            assert dep.work_pool_name == "rlhf-kubernetes" and dep.parameters["params_file"] == "/etc/rlhf/params.yaml"
            shipped = json.loads((project / "k8s/prefect/base-job-template.json").read_text())
            assert client.read_work_pool("rlhf-kubernetes").base_job_template == shipped
