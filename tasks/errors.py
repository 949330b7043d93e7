"""The exception a stage task raises when its stage fails: raised by ``tasks.stages``, judged by
``tasks.retry_policy``."""

from __future__ import annotations


class StageFailed(RuntimeError):
    """A stage exited non-zero; the message carries its last output lines, ``exit_code`` the stage's code
    (``rlhf_core.stages.exit_codes``; negative: killed by that signal; None: DVC did not say)."""

    def __init__(self, message: str, exit_code: int | None = None):
        super().__init__(message)
        self.exit_code = exit_code

    def __reduce__(self):  # picklable with its code (Prefect persists task exceptions)
        return self.__class__, (self.args[0], self.exit_code)
