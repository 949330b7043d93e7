"""The stage launcher (rlhf_core/ops/launch.py): torchrun whose preempted ranks keep their checkpoint and exit 75."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.ops.launch import STOPPED_DIR_ENV, exit_code_after_signal, record_stopped
from rlhf_core.stages import exit_codes
from tests.stage_signals import sigterm_at_step
from tests.tiny import TINY_DEMO, tiny_params

REPO = Path(__file__).resolve().parents[3]
SFT = [*TINY_DEMO, "sft.epochs=40", "sft.max_steps=40", "sft.log_every=1", "sft.save_every=0",
       "eval.max_prompts=2"]


def test_exit_code_after_a_signal_by_hand(tmp_path, monkeypatch):
    monkeypatch.setenv(STOPPED_DIR_ENV, str(tmp_path))
    monkeypatch.setenv("LOCAL_RANK", "1")
    record_stopped()
    assert exit_code_after_signal(signal.SIGTERM, tmp_path, 2) == 128 + 15  # rank 0 ran out of grace
    monkeypatch.setenv("LOCAL_RANK", "0")
    record_stopped()
    assert exit_code_after_signal(signal.SIGTERM, tmp_path, 2) == exit_codes.STOPPED  # both checkpointed
    assert exit_code_after_signal(signal.SIGINT, tmp_path, 2) == 128 + 2
    monkeypatch.delenv(STOPPED_DIR_ENV)
    record_stopped()  # without the launcher: nothing to record, no error


def _launch(root: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLHF_TRACKING": "off", "OMP_NUM_THREADS": "1"}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    args = [a for o in overrides for a in ("-S", o)]
    return subprocess.Popen([sys.executable, "-m", "rlhf_core.ops.launch", "--standalone", "--nproc_per_node=2", "-m",
                             "rlhf_core.cli", "stage", "sft", *args], cwd=root, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    from rlhf_core.stages.prepare import prepare

    root = tmp_path_factory.mktemp("launch")
    prepare(tiny_params(SFT), root)
    return root


def test_a_ranks_permanent_failure_is_the_launchers_exit_code(prepared):
    """Bad params make every rank exit 2; torchrun alone exits 1 (retried as a crash), the launcher 2."""
    proc = _launch(prepared, *SFT, "sft.micro_batch_size=0")
    _, err = proc.communicate(timeout=300)
    assert proc.returncode == exit_codes.BAD_CONFIG, err[-3000:]
    assert "micro_batch_size" in err and "rlhf launch: rank" in err


@pytest.mark.slow
def test_sigterm_to_the_launcher_checkpoints_both_ranks_exits_75_and_the_rerun_matches(prepared, tmp_path):
    """A real SIGTERM to a two-rank launch (what the kubelet sends the pod's process): torchrun forwards it,
    both ranks finish their step, checkpoint it and exit 75, and so does the launcher (torchrun alone: 1). The
    re-run resumes there and ends with the weights of a two-rank run that was never interrupted."""
    ws, full = tmp_path / "ws", tmp_path / "full"
    shutil.copytree(prepared, ws)
    shutil.copytree(prepared, full)
    proc = _launch(ws, *SFT)
    err = sigterm_at_step(proc, 3)
    assert proc.wait(timeout=300) == exit_codes.STOPPED, err[-3000:]
    assert "rlhf launch: SIGTERM; exit 75" in err
    stopped_at = int((ws / "checkpoints/sft/latest").read_text().strip().removeprefix("step_"))
    assert 3 <= stopped_at < 40 and f"stopped on SIGTERM after step {stopped_at}" in err, err[-3000:]

    again = _launch(ws, *SFT)
    _, err2 = again.communicate(timeout=600)
    assert again.returncode == 0, err2[-3000:]
    metrics = json.loads((ws / "metrics/sft.json").read_text())
    assert metrics["resumed_from_step"] == stopped_at and metrics["steps"] == 40 and metrics["world_size"] == 2

    uninterrupted = _launch(full, *SFT)
    _, err3 = uninterrupted.communicate(timeout=600)
    assert uninterrupted.returncode == 0, err3[-3000:]
    a, b = (load_file(r / "models/sft/model.safetensors") for r in (ws, full))
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
