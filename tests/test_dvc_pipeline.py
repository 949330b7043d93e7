"""DVC: `dvc repro prepare` runs the stage, skips when nothing changed, and push/pull use the local remote."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.local_pipeline import ensure_dvc
from tasks.stages import stage_env

REPO = Path(__file__).resolve().parents[1]
pytestmark = pytest.mark.slow


def _run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=stage_env())
    assert proc.returncode == 0, f"{cmd}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.fixture
def dvc_repo(tmp_path):
    """A git + DVC repo holding this project's pipeline files and a small demo params.yaml."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(REPO / "rlhf_core", root / "rlhf_core", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"]["demo"]["n_rows"] = 300
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    _run(["git", "init", "-q"], root)
    ensure_dvc(root, ".rlhf")
    return root


def dvc(root, *args):
    return _run([sys.executable, "-m", "dvc", *args], root)


def test_repro_skips_unchanged_and_reruns_on_param_change(dvc_repo):
    out = dvc(dvc_repo, "repro", "prepare")
    assert "Running stage 'prepare'" in out
    assert (dvc_repo / "data/prepared/sft.parquet").exists()
    out = dvc(dvc_repo, "repro", "prepare")
    assert "Stage 'prepare' didn't change, skipping" in out
    params = yaml.safe_load((dvc_repo / "params.yaml").read_text())
    params["data"]["demo"]["wrong_share"] = 0.1
    (dvc_repo / "params.yaml").write_text(yaml.safe_dump(params))
    assert "Running stage 'prepare'" in dvc(dvc_repo, "repro", "prepare")


def test_push_and_pull_against_local_remote(dvc_repo):
    dvc(dvc_repo, "repro", "prepare")
    digest = (dvc_repo / "data/prepared/sft.parquet").read_bytes()
    dvc(dvc_repo, "push", "prepare")
    remote = dvc_repo / ".rlhf" / "dvc-remote"
    assert any(p.is_file() for p in remote.rglob("*")), "nothing reached the local remote"
    shutil.rmtree(dvc_repo / "data" / "prepared")
    shutil.rmtree(dvc_repo / ".dvc" / "cache")
    dvc(dvc_repo, "pull", "prepare")
    assert (dvc_repo / "data/prepared/sft.parquet").read_bytes() == digest
    assert os.path.exists(dvc_repo / "models/base/tokenizer.json")


def test_every_stage_declares_the_sections_it_logs_and_the_stage_command():
    """dvc.yaml must name each params section a stage reads (else a changed key would not re-run it)."""
    from rlhf_core.stages import STAGE_NAMES
    from rlhf_core.tracking import STAGE_SECTIONS

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    produced = {o if isinstance(o, str) else next(iter(o)) for s in stages.values() for o in s["outs"]}
    assert list(stages) == list(STAGE_NAMES) == ["prepare", "sft", "feedback", "rm", "rlhf", "evaluate"]
    for name, stage in stages.items():
        assert stage["cmd"] == f"rlhf stage {name}"
        declared = {p.split(".")[0] for p in stage["params"] if "." not in p}
        missing = set(STAGE_SECTIONS[name]) - declared
        assert not missing, f"dvc.yaml stage {name} lacks params sections {sorted(missing)}"
        for dep in set(stage["deps"]) - produced:
            assert (REPO / dep).exists(), f"dvc.yaml stage {name}: dep {dep} does not exist"
