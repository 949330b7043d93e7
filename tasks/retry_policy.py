"""Which stage failures a retry can fix: a pure decision, and the Prefect ``retry_condition_fn`` around it.

``transient(exc)`` is ``(True, why)`` for failures worth another attempt (a crash or kill the retry resumes
from its checkpoint, an evicted or lost pod, an API server that did not answer) and ``(False, why)`` for those
that fail the same way again: a stage exit code in :data:`rlhf_core.stages.exit_codes.PERMANENT` (bad
params, bad input), a Job the cluster failed on such an exit code or stopped at its deadline, the task's own
timeout, a request the API server refused (4xx other than 408/429), bad options (``ValueError``).
"""

from __future__ import annotations

from rlhf_core.stages import exit_codes
from tasks.errors import StageFailed
from tasks.k8s.submit import StageJobFailed, StageJobTimeout

RETRYABLE_HTTP = frozenset({408, 429, 500, 502, 503, 504})


def transient(exc: BaseException | None) -> tuple[bool, str]:
    """``(retry?, reason)`` for an exception a stage task raised."""
    if exc is None:
        return True, "no exception recorded"
    if isinstance(exc, StageJobTimeout):
        return False, "the Job outlived the task's timeout (deleted)"
    if isinstance(exc, StageJobFailed):
        if not exit_codes.retryable(exc.exit_code):
            return False, f"stage {exit_codes.describe(exc.exit_code)}"
        if exc.reason == "DeadlineExceeded":
            return False, "the Job reached its activeDeadlineSeconds"
        return True, f"job {exc.reason or 'failed'}; pod {exc.pod_reason or '?'}, {exit_codes.describe(exc.exit_code)}"
    if isinstance(exc, StageFailed):
        return exit_codes.retryable(exc.exit_code), f"stage {exit_codes.describe(exc.exit_code)}"
    status = getattr(exc, "status", None)
    if type(exc).__name__ == "ApiException" and isinstance(status, int):
        return status in RETRYABLE_HTTP, f"Kubernetes API answered {status} {getattr(exc, 'reason', '')}".rstrip()
    if type(exc).__name__ == "TaskRunTimeoutError":  # Prefect's task timeout (a socket timeout is transient)
        return False, "the task's timeout"
    if isinstance(exc, (ValueError, TypeError)):
        return False, f"{type(exc).__name__}: bad options"
    return True, f"{type(exc).__name__}"


def retry_transient(task, task_run, state) -> bool:
    """Prefect ``retry_condition_fn``: retry only :func:`transient` failures, and log the decision."""
    from prefect.logging.loggers import task_run_logger

    exc = state.data if isinstance(state.data, BaseException) else None
    retry, why = transient(exc)
    task_run_logger(task_run, task).warning("%s: %s", "retrying" if retry else "not retrying", why)
    return retry
