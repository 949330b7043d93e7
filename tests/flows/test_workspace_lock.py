"""One ``rlhf run`` per workspace: a second one fails at once, naming the holder; a dead holder frees it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flows.workspace_lock import LOCK_FILE, WorkspaceBusy, workspace_lock

REPO = Path(__file__).resolve().parents[2]
HOLD = ("import sys, time; from flows.workspace_lock import workspace_lock\n"
        "with workspace_lock(sys.argv[1]):\n    print('held', flush=True); time.sleep(60)\n")


def _holder(ws: Path) -> subprocess.Popen:
    proc = subprocess.Popen([sys.executable, "-c", HOLD, str(ws)], cwd=REPO, stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    return proc


def test_second_holder_is_refused_with_the_holders_pid_and_a_dead_holder_frees_the_lock(tmp_path):
    ws = tmp_path / ".rlhf"
    proc = _holder(ws)
    try:
        busy = rf"another `rlhf run` is using this workspace .*\"pid\": {proc.pid}"
        with pytest.raises(WorkspaceBusy, match=busy), workspace_lock(ws):
            pass
    finally:
        proc.kill()  # SIGKILL: no cleanup code runs, the kernel drops the flock
        proc.wait()
    with workspace_lock(ws) as path:  # free again, and now it names us
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert (ws / LOCK_FILE).exists()


def test_rlhf_run_exits_5_while_another_run_holds_the_workspace(tmp_path):
    for name in ("params.yaml", "dvc.yaml"):
        (tmp_path / name).write_text((REPO / name).read_text())
    proc = _holder(tmp_path / ".rlhf")
    try:
        t0 = time.monotonic()
        run = subprocess.run([str(Path(sys.executable).parent / "rlhf"), "run", "--stage", "prepare"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "MLFLOW_TRACKING_URI": f"sqlite:///{tmp_path}/mlflow.db"})
    finally:
        proc.kill()
        proc.wait()
    assert run.returncode == 5, run.stderr[-2000:]
    assert "another `rlhf run` is using this workspace" in run.stderr and str(proc.pid) in run.stderr
    assert time.monotonic() - t0 < 120 and not (tmp_path / "data").exists()  # failed before any stage ran


STAGE_HOLD = ("import sys, time; from rlhf_core.ops.locks import stage_lock\n"
              "with stage_lock(sys.argv[1], 'sft'):\n    print('held', flush=True); time.sleep(60)\n")


def test_a_stage_rerun_while_its_previous_process_lives_exits_5_before_writing(tmp_path, monkeypatch):
    """`rlhf stage sft` while another `rlhf stage sft` process holds the workspace's stage lock: exit 5 naming
    the holder, nothing written; the other ranks of a torchrun (RANK > 0) do not take the lock."""
    from rlhf_core.ops.locks import stage_lock

    (tmp_path / "params.yaml").write_text((REPO / "params.yaml").read_text())
    proc = subprocess.Popen([sys.executable, "-c", STAGE_HOLD, str(tmp_path / ".rlhf")], cwd=REPO,
                            stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    assert proc.stdout.readline().strip() == "held"
    try:
        run = subprocess.run([str(Path(sys.executable).parent / "rlhf"), "stage", "sft"], cwd=tmp_path,
                             capture_output=True, text=True, timeout=300,
                             env={**os.environ, "RLHF_TRACKING": "off"})
        monkeypatch.setenv("RANK", "1")
        with stage_lock(tmp_path / ".rlhf", "sft"):  # a second rank of the holder's own run: no lock taken
            pass
    finally:
        proc.kill()
        proc.wait()
    said = " ".join(run.stderr.split())
    assert run.returncode == 5, run.stderr[-2000:]
    assert "stage sft is already running on this workspace" in said and f'"pid": {proc.pid}' in said
    assert not (tmp_path / "checkpoints").exists() and not (tmp_path / "models").exists()


def test_a_filesystem_without_locks_warns_and_goes_on(tmp_path, monkeypatch, capsys):
    """Some network volumes answer flock with ENOLCK: the work goes on, and stderr says it is unlocked. (No such
    filesystem here: the kernel's answer is substituted.)"""
    import errno
    import fcntl

    from rlhf_core.ops.locks import exclusive_lock

    def no_locks(fd, op):
        raise OSError(errno.ENOLCK, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_locks)
    with exclusive_lock(tmp_path / "x.lock", "busy") as path:
        assert json.loads(path.read_text())["pid"] == os.getpid()
    assert "does not support locks (No locks available); continuing without the lock" in capsys.readouterr().err

    def broken(fd, op):
        raise OSError(errno.EIO, "I/O error")

    monkeypatch.setattr(fcntl, "flock", broken)
    with pytest.raises(OSError, match="I/O error"), exclusive_lock(tmp_path / "y.lock", "busy"):
        pass
