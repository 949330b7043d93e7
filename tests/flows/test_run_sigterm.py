"""SIGTERM (and SIGINT) to ``rlhf run`` under a running stage: the run exits 143 (130) saying so, and no
process it started, the embedded Prefect API server included, is alive 30 s later (flows.termination)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from benchmarks.kill_flow import _env, processes_in
from tests.servers import project_copy

pytestmark = pytest.mark.slow

SMALL = {"data": {"demo": {"n_rows": 200}},
         "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                            "num_attention_heads": 2, "num_key_value_heads": 2}},
         "sft": {"epochs": 50, "max_steps": 5000, "save_every": 1000, "micro_batch_size": 8, "log_every": 1},
         "tracking": {"system_metrics": False}}


def _cmdlines(pids: list[int]) -> list[str]:
    out = []
    for pid in pids:
        try:
            out.append(Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace"))
        except OSError:
            continue
    return out


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_rlhf_run_stops_everything_it_started(tmp_path, sig):
    project = project_copy(tmp_path / "p", SMALL).resolve()
    proc = subprocess.Popen([sys.executable, "-m", "flows.cli", "run", "--stage", "prepare", "--stage", "sft"],
                            cwd=project, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)  # the test's own handle on the group, for the cleanup below
    said = []
    try:
        for line in proc.stdout:  # the flow echoes the stage's lines: signal it once SFT is training
            said.append(line)
            if '"step": 2,' in line:
                break
        running = _cmdlines(processes_in(project))
        assert any("uvicorn" in c for c in running) and any("stage sft" in c for c in running), running
        proc.send_signal(sig)  # the run's process only, as `kill` or a process manager sends it
        said.append(proc.communicate(timeout=60)[0])  # it stopped a log worker retrying for a minute
        assert proc.returncode == 128 + sig, "".join(said)[-4000:]
        assert f"stopped by {sig.name}" in said[-1], said[-1][-4000:]
        deadline, left = time.monotonic() + 30, running
        while left and time.monotonic() < deadline:
            time.sleep(0.5)
            left = _cmdlines(processes_in(project))
        assert not left, f"alive 30 s after {sig.name}: {left}"
    finally:
        for pid in processes_in(project):
            os.kill(pid, signal.SIGKILL)
        if proc.poll() is None:
            proc.kill()
