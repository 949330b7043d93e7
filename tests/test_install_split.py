"""The training core without the orchestration extra (a stage image): stages run, the orchestration verbs and the
local MLflow store say what to install. The extra's packages are hidden from a child interpreter
(``sys.modules[name] = None`` makes ``import name`` fail, as it does where the package is not installed)."""

from __future__ import annotations

import os
import subprocess
import sys

import yaml

from tests.conftest import REPO

HIDE = "import sys; [sys.modules.__setitem__(m, None) for m in ('prefect', 'sqlalchemy', 'alembic')]; "


def core_rlhf(cwd, *argv: str, env: dict | None = None) -> subprocess.CompletedProcess:
    code = HIDE + f"sys.argv = ['rlhf', *{list(argv)!r}]; from flows.cli import main; main()"
    return subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})


def test_orchestration_verbs_name_the_extra(tmp_path):
    proc = core_rlhf(tmp_path, "run")
    assert proc.returncode == 2
    assert "needs the orchestration extra (prefect, sqlalchemy" in proc.stdout + proc.stderr
    assert "pip install 'rlhf-ops[orchestration]'" in proc.stdout + proc.stderr


def test_a_stage_runs_on_the_training_core_and_the_local_store_names_the_fix(tmp_path):
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"]["demo"]["n_rows"] = 300
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    env = {k: "" for k in ("MLFLOW_TRACKING_URI",)}
    proc = core_rlhf(tmp_path, "stage", "prepare", env={**env, "RLHF_TRACKING": "off"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert (tmp_path / "data/prepared/sft.parquet").is_file()
    proc = core_rlhf(tmp_path, "stage", "prepare", env={**env, "RLHF_TRACKING": "on"})
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert "set MLFLOW_TRACKING_URI to a server, RLHF_TRACKING=off, or install rlhf-ops[orchestration]" in \
        " ".join((proc.stdout + proc.stderr).split())


def test_the_check_does_not_import_prefect_before_the_embedded_settings(tmp_path):
    """Prefect reads its settings when first imported; `rlhf run` sets them after this check (a check that
    imported Prefect made the ephemeral server time out at Prefect's 20 s default, in CI)."""
    code = ("import sys; sys.argv = ['rlhf', 'run']; import flows.cli as cli; cli.app = lambda: None; cli.main(); "
            "print('prefect imported:', 'prefect' in sys.modules)")
    proc = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.returncode == 0 and "prefect imported: False" in proc.stdout, proc.stdout + proc.stderr
