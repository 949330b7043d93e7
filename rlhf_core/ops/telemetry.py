"""Usage telemetry of the tools we run, off unless you turn it on.

DVC starts an analytics daemon after each command (``dvc daemon analytics``), Prefect's server and MLflow's
client send usage events, huggingface_hub sends a user agent; on an offline cluster each costs a process or a
timeout, on any other it sends data nobody here agreed to. ``telemetry_off`` sets each tool's own switch in
the environment of this process (every child inherits it: DVC, the stages, the Prefect server); a value you
set yourself wins, so ``DVC_NO_ANALYTICS=`` (empty) or ``MLFLOW_DISABLE_TELEMETRY=false`` turns one back on.
The images set the same variables, and ``rlhf init`` / the embedded default also write DVC's
``core.analytics false`` into the workspace's ``.dvc/config``.
"""

from __future__ import annotations

import os
from collections.abc import MutableMapping

OFF = {
    "DVC_NO_ANALYTICS": "1",  # dvc/analytics.py: any non-empty value
    "MLFLOW_DISABLE_TELEMETRY": "true",  # mlflow.telemetry (DO_NOT_TRACK counts only when it is "true")
    "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
    "HF_HUB_DISABLE_TELEMETRY": "1",
    "DO_NOT_TRACK": "1",  # the cross-tool convention (consoledonottrack.com)
}


def telemetry_off(env: MutableMapping[str, str] | None = None) -> MutableMapping[str, str]:
    """``OFF`` into ``env`` (default ``os.environ``) where not set already; returns ``env``."""
    env = os.environ if env is None else env
    for key, value in OFF.items():
        env.setdefault(key, value)
    return env
