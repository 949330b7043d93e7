"""What a person sees while a stage runs: a rich progress line on a terminal, JSON lines otherwise.

The trainers call ``log(metrics, step)``; a ``total_steps`` key (when a trainer
knows it) turns the spinner into a bar with an ETA.  When stderr is not a
terminal (CI, Prefect, Kubernetes logs) every call prints one JSON line, so
the same figures reach the Prefect logs.
"""

from __future__ import annotations

import json
import sys

from rich.console import Console
from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

SHOWN = ("loss", "reward_mean", "kl", "accuracy", "lr")


class StageProgress:
    """``log(metrics, step)`` sink; use as a context manager around the stage."""

    def __init__(self, stage: str, console: Console | None = None, interactive: bool | None = None):
        self.stage = stage
        self.console = console or Console(stderr=True)
        self.interactive = sys.stderr.isatty() if interactive is None else interactive
        self.progress: Progress | None = None
        self.task = None

    def __enter__(self) -> StageProgress:
        if self.interactive:
            self.progress = Progress(SpinnerColumn(), TextColumn("[bold]{task.description}"), BarColumn(),
                                     TextColumn("{task.completed}/{task.total} steps"), TextColumn("{task.fields[m]}"),
                                     TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                     console=self.console, transient=False)
            self.progress.start()
            self.task = self.progress.add_task(self.stage, total=None, m="")
        return self

    def __exit__(self, *exc) -> None:
        if self.progress is not None:
            self.progress.stop()

    def __call__(self, metrics: dict, step: int) -> None:
        if self.progress is None:
            self.console.print(json.dumps({"stage": self.stage, "step": step, **metrics}, default=float),
                               highlight=False, markup=False, soft_wrap=True)
            return
        shown = "  ".join(f"{k}={metrics[k]:.4g}" for k in SHOWN if isinstance(metrics.get(k), int | float))
        total = metrics.get("total_steps")
        self.progress.update(self.task, completed=step, m=shown, **({"total": total} if total else {}))
