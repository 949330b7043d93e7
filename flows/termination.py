"""``rlhf run`` stops everything it started on SIGTERM, as it does on Ctrl-C.

Python's default SIGTERM ends the process on the spot: no ``finally``, no ``atexit``. Prefect's flow engine
turns a SIGTERM inside the flow into ``TerminationSignal`` (the flow ends Crashed, its stages are stopped), then
puts back the handler it found and sends the signal again; with the default handler the process ended there, and
the ephemeral API server (uvicorn, a child that Prefect stops from ``atexit``) outlived it, holding its port,
one per interrupted run. Under :func:`sigterm_unwinds` the signal raises :class:`Terminated` instead, which
unwinds like ``KeyboardInterrupt``: the run's ``finally`` stops the server, the workspace lock is released, and
the command exits ``128 + SIGTERM``.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import Iterator


class Terminated(BaseException):  # noqa: N818  (a signal, like KeyboardInterrupt, not an error)
    """SIGTERM arrived; ``signum`` is the signal's number."""

    def __init__(self, signum: int):
        super().__init__(f"stopped by {signal.Signals(signum).name}")
        self.signum = signum


def _raise_terminated(signum: int, _frame) -> None:
    raise Terminated(signum)


@contextlib.contextmanager
def sigterm_unwinds() -> Iterator[None]:
    """SIGTERM raises :class:`Terminated` in the main thread while inside; the previous handler comes back
    after."""
    previous = signal.signal(signal.SIGTERM, _raise_terminated)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
