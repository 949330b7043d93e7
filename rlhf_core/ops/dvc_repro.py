"""``dvc repro --single-item STAGE`` as a child process group: its output streamed, its outcome read back.

Shared by the Prefect stage task (``tasks.stages``, local backend) and ``rlhf repro`` (a stage pod running
under DVC against a remote, ``rlhf_core.ops.dvc_remote``). DVC and the stage run in their own process group, so
whoever started them can stop all of it: :func:`stop_process_group` sends SIGTERM (the stage checkpoints and
exits 75), then SIGKILL after ``STOP_GRACE_S``.

Outcome, from DVC's own lines:

- ``ran``: DVC printed ``Running stage 'NAME':`` (it prints it for every stage it executes, ``--force`` too) or
  restored the stage's outputs from its run-cache (``Stage 'NAME' is cached - skipping run``: params 1 -> 2 -> 1
  brings back the outputs of 1, which downstream stages and the remote must see as new); otherwise the stage
  was up to date. (``--pull`` of an up-to-date stage prints "Data and pipelines are up to
  date." without the usual "didn't change, skipping", so the absence of the run line is what counts.)
- the stage's own exit code: DVC exits 255 for any failed stage and prints ``failed to run: CMD, exited
  with N``; :func:`stage_exit_code` reads N back (``None`` when DVC failed before running anything).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.ops.input_links import sync_from_params_file
from rlhf_core.ops.telemetry import telemetry_off

DVC_EXIT = re.compile(r"failed to run: .*, exited with (-?\d+)")
STOP_GRACE_S = 30.0  # an interrupted caller gives its stage process this long to exit after SIGTERM
TAIL_LINES = 20
SHELLS = frozenset({"sh", "dash", "bash", "zsh", "ksh", "mksh", "fish"})  # what DVC runs a cmd under


def stage_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment with this interpreter's bin dir first on PATH (so DVC's ``rlhf stage`` resolves)."""
    env = telemetry_off(dict(os.environ))  # no DVC analytics daemon after each repro (ops.telemetry)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.update(extra or {})
    return env


def reports_run(stage: str, line: str) -> bool:
    """Whether DVC's output ``line`` says it ran ``stage`` or restored it from the run-cache (module docstring)."""
    return f"Running stage '{stage}'" in line or f"Stage '{stage}' is cached - skipping run" in line


def stage_exit_code(lines: Sequence[str]) -> int | None:
    """The stage command's exit code from DVC's ``failed to run: CMD, exited with N`` line (DVC itself exits 255)."""
    for line in reversed(lines):
        found = DVC_EXIT.search(line)
        if found:
            return int(found.group(1))
    return None


@dataclass
class ReproOutcome:
    status: str  # "ran" | "skipped" (meaningful when returncode == 0)
    returncode: int  # DVC's
    tail: list[str]  # the last output lines

    @property
    def stage_code(self) -> int | None:
        """The stage's own exit code when it failed; ``None`` when DVC failed without running it."""
        return stage_exit_code(self.tail)


def run_repro(stage: str, root: Path, env: dict[str, str], echo: Callable[[str], None], force: bool = False,
              extra_args: Sequence[str] = (), started: Callable[[subprocess.Popen], None] | None = None
              ) -> ReproOutcome:
    """Run ``dvc repro --single-item STAGE [--force] [extra_args]`` in ``root``, echoing each output line.

    ``started(proc)`` is called once the process group exists (e.g. to forward a signal to it). When this call
    is interrupted (an exception, a KeyboardInterrupt) the group is stopped before the exception propagates.
    """
    sync_from_params_file(root)  # inputs/: what DVC hashes of the files params.yaml names
    cmd = [sys.executable, "-m", "dvc", "repro", "--single-item", stage, *(["--force"] if force else []),
           *extra_args]
    proc = subprocess.Popen(cmd, cwd=root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            bufsize=1, start_new_session=True)
    if started:
        started(proc)
    tail: list[str] = []
    ran = False
    assert proc.stdout is not None
    try:
        for line in proc.stdout:
            line = line.rstrip()
            if not line:
                continue
            echo(line)
            ran |= reports_run(stage, line)
            tail = (tail + [line])[-TAIL_LINES:]
        proc.wait()
    finally:
        if proc.poll() is None:
            stop_process_group(proc, echo)
    return ReproOutcome("ran" if ran else "skipped", proc.returncode, tail)


def signal_stage(proc: subprocess.Popen, signum: int) -> int:
    """Send ``signum`` to the stage's processes in ``proc``'s group: every member but DVC itself (``proc``; DVC
    dies on SIGTERM without a word, alive it reports the stage's exit code) and but the shells DVC runs the
    command under (``$SHELL -c CMD``; dash forks rather than execs, and a shell killed by SIGTERM hides the
    stage's own exit 75: it exits with its child's code instead). A group of only shells gets it whole.
    Returns how many got it."""
    members = [pid for pid in _group_members(proc.pid) if pid != proc.pid]
    stage = [pid for pid in members if _command_name(pid) not in SHELLS] or members
    sent = 0
    for pid in stage:
        try:
            os.kill(pid, signum)
            sent += 1
        except ProcessLookupError:
            continue
    return sent


def _group_members(pgid: int) -> list[int]:
    members = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            if os.getpgid(int(entry)) == pgid:
                members.append(int(entry))
        except (ProcessLookupError, PermissionError):
            continue
    return members


def _command_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def stop_process_group(proc: subprocess.Popen, echo: Callable[[str], None]) -> None:
    """SIGTERM ``proc``'s process group, SIGKILL it after :data:`STOP_GRACE_S`."""
    echo(f"stopping stage process group {proc.pid} (SIGTERM, SIGKILL after {STOP_GRACE_S:.0f}s)")
    for sig, wait_s in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
        try:
            os.killpg(proc.pid, sig)
            proc.wait(timeout=wait_s)
            return
        except ProcessLookupError:
            return
        except subprocess.TimeoutExpired:
            continue
