"""``rlhf init DIR``: a workspace for a user's own model and files; ``rlhf run`` outside one says what to do."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

from tests.conftest import rlhf_cli, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def rlhf(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    return rlhf_cli(*args, cwd=cwd, unset=("PREFECT_API_URL", "MLFLOW_TRACKING_URI"))


def user_files(tmp_path: Path) -> dict[str, Path]:
    files = {
        "sft": tmp_path / "mine" / "sft.jsonl",
        "pairs": tmp_path / "mine" / "pairs.jsonl",
        "prompts": tmp_path / "mine" / "prompts.jsonl",
    }
    files["sft"].parent.mkdir()
    write_jsonl(
        files["sft"],
        [{"messages": [{"role": "user", "content": "Antonym of hot?"}, {"role": "assistant", "content": "cold"}]}],
    )
    write_jsonl(files["pairs"], [{"prompt": "Antonym of up?", "chosen": "down", "rejected": "up"}])
    write_jsonl(files["prompts"], [{"prompt": "Antonym of big?"}])
    return files


def test_init_lays_out_a_workspace_that_params_check_accepts(tmp_path, user_model_dir):
    files = user_files(tmp_path)
    ws = tmp_path / "my-rlhf"
    done = rlhf(
        "init", str(ws), "--model", str(user_model_dir), *(f"--{k}={v}" for k, v in files.items()), cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout
    assert f"workspace laid out in {ws}" in done.stdout
    params = yaml.safe_load((ws / "params.yaml").read_text())
    assert params["project"]["name"] == "my-rlhf"
    assert params["model"]["name_or_path"] == str(Path(user_model_dir).resolve())
    assert params["data"]["source"] == "per_phase"
    assert {k: v["path"] for k, v in params["data"]["files"].items()} == {k: str(v) for k, v in files.items()}
    assert (ws / "dvc.yaml").read_text() == (REPO / "dvc.yaml").read_text()
    assert (
        (ws / "rlhf_core").resolve() == (REPO / "rlhf_core").resolve()
        and (ws / ".dvc").is_dir()
        and (ws / ".git").is_dir()
    )
    check = rlhf("params", "check", cwd=ws)
    assert check.returncode == 0, check.stdout
    assert "per_phase" in check.stdout and str(files["sft"]) in check.stdout
    dvc = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=ws, capture_output=True, text=True)
    assert dvc.returncode == 0 and "prepare" in dvc.stdout, dvc.stdout + dvc.stderr  # the graph resolves there

    again = rlhf("init", str(ws), cwd=tmp_path)
    assert again.returncode == 65 and "is not empty" in again.stdout


def test_init_refuses_a_missing_file_before_writing_anything(tmp_path):
    ws = tmp_path / "ws"
    done = rlhf("init", str(ws), "--sft", str(tmp_path / "nope.jsonl"), cwd=tmp_path)
    assert done.returncode == 65, done.stdout
    assert f"--sft {tmp_path / 'nope.jsonl'}: no such file or folder" in done.stdout
    assert not ws.exists()


def test_run_outside_a_workspace_says_what_a_workspace_is(tmp_path):
    done = rlhf("run", cwd=tmp_path)
    assert done.returncode == 2, done.stdout
    assert "is not an rlhf-ops workspace (no dvc.yaml)" in done.stdout and "rlhf init DIR" in done.stdout
    assert list(tmp_path.iterdir()) == []  # nothing written where it refused
