"""A stage whose flow process dies while the stage is writing: the line that meets the dead pipe is not lost and
does not kill the stage; it goes to the log file with everything after it, and the stage stops on its SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from tests.conftest import REPO

STAGE = """
import sys
from pathlib import Path
from rlhf_core.engine import stop
from rlhf_core.ops.flow_watch import stop_when_flow_exits
stop.install(30.0)  # as `rlhf stage` does for a training stage
stop_when_flow_exits(Path(sys.argv[1]))
i = 0
while not stop.stop_requested():  # a line at every step, flat out: the first write after the flow dies meets EPIPE
    print(f"line {i}", flush=True)
    print(f"err {i}", file=sys.stderr, flush=True)
    i += 1
print(f"stopped after line {i - 1}", flush=True)
sys.exit(75)
"""

FLOW = """
import os, subprocess, sys
env = {**os.environ, "RLHF_FLOW_PID": str(os.getpid())}
stage = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, start_new_session=True)
print(stage.pid, flush=True)
for n, _ in enumerate(stage.stdout):
    if n == 2000:
        print("reading", flush=True)
"""


def _gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1].split()[0] == "Z"  # a zombie under init: it has exited
    except FileNotFoundError:
        return True


def test_the_line_that_meets_the_dead_pipe_goes_to_the_log_and_the_stage_stops_cleanly(tmp_path):
    log = tmp_path / "logs" / "stage-x.log"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    for _ in range(3):  # before the fix the stage died at its first write after the kill, every time
        log.unlink(missing_ok=True)
        flow = subprocess.Popen([sys.executable, "-c", FLOW, STAGE, str(log)], env=env, stdout=subprocess.PIPE,
                                text=True)
        stage_pid = int(flow.stdout.readline())
        assert flow.stdout.readline().strip() == "reading"  # the stage is writing flat out
        flow.send_signal(signal.SIGKILL)
        flow.wait()
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not _gone(stage_pid):
            time.sleep(0.05)
        assert _gone(stage_pid)
        said = log.read_text() if log.exists() else ""
        assert f"the flow process {flow.pid} that started this stage is gone: stopping" in said, said[-2000:]
        assert "SIGTERM: checkpointing at the next step boundary" in said, said[-2000:]
        assert "stopped after line" in said, said[-2000:]  # the loop ended on its SIGTERM, not on a BrokenPipeError
        assert "BrokenPipeError" not in said, said[-2000:]
        last = int(said.split("stopped after line ")[1].split()[0])
        for tag in ("line", "err"):  # from the first line that met the dead pipe to the last, every line is there
            logged = [int(x.split()[1]) for x in said.splitlines() if x.startswith(f"{tag} ")]
            # none logged: every line went into the pipe before its reader's exit closed it (a loaded machine can
            # switch and stop the stage before its next write), and no write met EPIPE
            if logged:
                assert logged == list(range(logged[0], last + 1)), (tag, logged[:5], last)
