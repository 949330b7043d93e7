"""Errors the training engine raises; each names what went wrong and where."""

from __future__ import annotations


class TrainingInputError(ValueError):
    """Bad model/tokenizer/data input for training (vocab mismatch, missing pad, prompt too long, empty split)."""


class NonFiniteLossError(RuntimeError, ValueError):
    """A NaN/inf loss or gradient norm: the stage stops; the last good checkpoint stays on disk.

    Also a ``ValueError`` so ``rlhf stage`` reports it like other stage errors (message, exit code 1).
    """

    def __init__(self, step: int, what: str, value: float, checkpoint: str | None):
        self.step = step
        self.what = what
        self.value = value
        self.checkpoint = checkpoint
        kept = f"last good checkpoint kept at {checkpoint}" if checkpoint else "no checkpoint was written yet"
        super().__init__(f"non-finite {what} ({value}) at optimizer step {step}; training stopped, {kept}. "
                         "Lower the learning rate or check the data.")

    def __reduce__(self):  # raised in a worker process (rm.parallel), re-raised in the stage's
        return type(self), (self.step, self.what, self.value, self.checkpoint)
