"""Signalling a running stage process at a given training step (the preemption tests)."""

from __future__ import annotations

import json
import signal
import subprocess


def sigterm_at_step(proc: subprocess.Popen, step: int) -> str:
    """SIGTERM ``proc`` once a JSON log row on its stderr reaches ``step``; returns its whole stderr after it
    exits (the caller waits for the exit code)."""
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("{") and json.loads(line).get("step", 0) >= step:
            proc.send_signal(signal.SIGTERM)
            break
    return "".join(lines) + proc.stderr.read()
