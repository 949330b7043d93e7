"""Exit codes of ``rlhf stage NAME``, and which of them a retry can fix.

=====  ==========================================================  =========================================
code   meaning                                                      retried (Prefect task, Kubernetes Job)
=====  ==========================================================  =========================================
0      done                                                         -
1      crashed: an uncaught exception (OOM, NCCL, a lost file)      yes: the retry resumes from its checkpoint
2      bad usage or invalid params; the message names the key       no: it fails the same way again
3      the MLflow tracking server did not answer                    yes
5      the same stage is already running on this workspace         yes: once that process has ended
       (``rlhf_core.ops.locks``; the message names its pid and host)
65     input the stage refuses: data, a model directory, params     no
       that contradict the inputs (``EX_DATAERR``); the message
       names the file, line or key
75     stopped by SIGTERM after saving a checkpoint (preemption,    yes: the retry resumes from that checkpoint
       eviction; ``EX_TEMPFAIL``)
143    SIGTERM, but no step boundary within ``compute.stop_grace_s``  yes: from the previous checkpoint
<0     killed by a signal (``-9``: OOM killer or node loss; DVC     yes
       reports ``-N`` where its shell execs the command, ``128 + N``
       where the shell forks it, as a container does)
=====  ==========================================================  =========================================

Everything not listed as permanent is retried: a retry that cannot help costs one more attempt, a missed
retry costs a night's run.
"""

from __future__ import annotations

DONE = 0
CRASHED = 1
BAD_CONFIG = 2
TRACKING_UNAVAILABLE = 3
BUSY = 5
BAD_INPUT = 65
STOPPED = 75

PERMANENT: frozenset[int] = frozenset({BAD_CONFIG, BAD_INPUT})
MEANING: dict[int, str] = {
    DONE: "done",
    CRASHED: "crashed",
    BAD_CONFIG: "bad usage or invalid params",
    TRACKING_UNAVAILABLE: "MLflow unreachable",
    BUSY: "the stage is already running on this workspace",
    BAD_INPUT: "bad input",
    STOPPED: "stopped on SIGTERM, checkpointed",
}


def retryable(code: int | None) -> bool:
    """False only for the permanent codes (bad params, bad input); an unknown code (None) is retryable."""
    return code not in PERMANENT


def describe(code: int | None) -> str:
    """``"exit 65 (bad input)"``, ``"killed by signal 9"``, ``"exit 137 (killed by signal 9)"``."""
    if code is None:
        return "no exit code"
    if code < 0:
        return f"killed by signal {-code}"
    if code > 128:
        return f"exit {code} (killed by signal {code - 128})"
    return f"exit {code} ({MEANING.get(code, 'unknown')})"
