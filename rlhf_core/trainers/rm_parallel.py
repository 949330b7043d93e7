"""Reward models trained side by side, one worker process each (``rm.parallel``).

The members of an ensemble (``rm.ensemble``) and the judge (``rm.judge``) are independent trainings. On a CPU
one of them keeps ``compute.num_threads`` cores busy and leaves the rest idle; a tiny model gains little from
more threads (its matmuls are too small to split), much from running K trainings at once. So, in a world of one
process on a CPU, up to ``workers`` of them run at once, each in a process forked from the stage's that makes
exactly the call the serial path makes (``fit_reward_model`` with the same params and role): a member's weights
do not depend on which path trained it (tests/rlhf_core/trainers/test_rm_parallel.py compares them).

Forked, not spawned, where that is safe (``start_method``): a spawned worker imports torch, transformers and
DeepSpeed again, ~10 s before its first step (docs/results/demo.md). Two things make a forked copy hang, and
with either the workers are spawned:

- a worker with more than one thread, when this process has started its OpenMP thread pool (a tensor
  operation on several threads): the copy waits in its first parallel region for threads it does not have
  (measured: a 2-thread matmul in the parent, then one in the child, hangs; one thread in the child does not);
- a torch.distributed process group in this process (a caller that trained in-process before, as the tests
  do): the copy hangs in its first collective, DeepSpeed's broadcast of the model.

No CUDA exists here (``worker_count``). ``before_start`` runs before the fork and may import (the model's
transformers modules, which the workers then inherit), never compute.

The stage's process stays the one that logs and answers signals:

- every worker's log rows come back through a queue and go to the stage's ``log`` (MLflow, the console, fault
  injection) with the serial path's prefixes (``member<k>.``, ``judge.``);
- a SIGTERM to the stage is forwarded: each worker checkpoints at its next step and stops, and the stage exits
  75 (``StopRequested``); a re-run resumes every member from its own checkpoint;
- a worker that fails makes the others checkpoint and stop, and its error is the stage's;
- a worker dies with the stage (``PR_SET_PDEATHSIG``): a killed stage leaves no process writing into its
  outputs while the retry starts.

The first job saves first: the proxy RM's atomic save replaces ``models/rm`` whole, and the other members live
under it (``models/rm/members/<k>``), so each other job waits after its last checkpoint until the first has
saved (one after another, this is the order anyway).
"""

from __future__ import annotations

import ctypes
import multiprocessing as mp
import os
import queue as queue_mod
import signal
from collections.abc import Callable
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import torch
import torch.distributed as dist

from rlhf_core.config import Params
from rlhf_core.engine import distributed as D
from rlhf_core.engine import stop
from rlhf_core.engine.cpus import usable_cores
from rlhf_core.engine.loop import Hooks, LogFn

PR_SET_PDEATHSIG = 1
DONE = "done"

Job = tuple[Params, object, str]  # (params, RMRole, the prefix of its logged metrics)
FitFn = Callable[..., dict]  # fit_reward_model: (params, root, role, log, hooks=None, before_save=None)
_log_queue = None
_first_saved = None  # an Event: the first job has saved its model


def worker_count(requested: int, threads: int, jobs: int, world_size: int, cuda: bool) -> int:
    """How many trainings run at once: ``requested`` (``rm.parallel``) or, when 0, the cores over each
    training's threads (``compute.num_threads``; 0 means all cores: one at a time); never more than the jobs.
    One under a launcher (the ranks already share the work) or with CUDA (one device, one training)."""
    if world_size > 1 or cuda or jobs <= 1:
        return 1
    n = requested or usable_cores() // max(1, threads or usable_cores())
    return max(1, min(n, jobs))


def start_method(threads_per_worker: int) -> str:
    """``fork`` (the workers inherit this process's imports) when each worker trains on one thread and this
    process has no torch.distributed group; ``spawn`` otherwise (the module's docstring says why)."""
    grouped = dist.is_available() and dist.is_initialized()
    return "fork" if threads_per_worker == 1 and not grouped else "spawn"


def with_prefix(log: LogFn | None, prefix: str) -> LogFn | None:
    """``log`` with ``prefix`` on every metric's name (``member<k>.``, ``judge.``)."""
    if log is None or not prefix:
        return log
    return lambda metrics, step: log({f"{prefix}{k}": v for k, v in metrics.items()}, step)


def _die_with_parent() -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() == 1:  # the stage died before prctl took effect
        os._exit(1)


def _init_worker(log_queue, first_saved, grace_s: float) -> None:
    global _log_queue, _first_saved
    _die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C reaches the stage, which stops the workers
    stop.install(grace_s)
    _log_queue, _first_saved = log_queue, first_saved


def _wait_for_the_first(step: int, checkpoint: str | None) -> None:
    while not _first_saved.wait(0.5):
        if stop.signalled():  # checkpointed already: a re-run resumes at the end and saves
            raise stop.StopRequested(step, checkpoint)


def _train(fit: FitFn, job: Job, root: Path, index: int) -> dict:
    params, role, prefix = job
    try:
        result = fit(params, root, role, with_prefix(lambda m, step: _log_queue.put((index, m, step)), prefix),
                     before_save=None if index == 0 else _wait_for_the_first)
        if index == 0:
            _first_saved.set()
        return result
    finally:
        _log_queue.put((index, DONE, 0))


def fit_side_by_side(fit: FitFn, jobs: list[Job], root: Path, log: LogFn | None, workers: int,
                     grace_s: float) -> list[dict]:
    """Run ``fit(params, root, role, log)`` for each of ``jobs`` in ``workers`` processes (``fit``: a module-level
    function, which the workers import by name); their metrics in job order. Raises the first job's error (after
    the other workers checkpointed and stopped) or, after a SIGTERM, ``StopRequested``."""
    ctx = mp.get_context(start_method(max(p.compute.num_threads for p, _, _ in jobs)))  # 0: every core
    log_queue, first_saved = ctx.Queue(), ctx.Event()
    finished: set[int] = set()

    def forward_logs(timeout: float) -> None:
        try:
            while True:
                index, metrics, step = log_queue.get(timeout=timeout)
                timeout = 0.0
                if metrics == DONE:
                    finished.add(index)
                elif log is not None:
                    log(metrics, step)
        except queue_mod.Empty:
            return

    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=_init_worker,
                             initargs=(log_queue, first_saved, grace_s)) as pool:
        futures = [pool.submit(_train, fit, job, root, i) for i, job in enumerate(jobs)]
        stopping = False
        while not all(f.done() for f in futures):
            forward_logs(0.5)
            failed = any(f.done() and f.exception() is not None for f in futures)
            if (stop.signalled() or failed) and not stopping:
                stopping = True
                for f in futures:
                    f.cancel()  # those not started
                _signal_workers(pool)
        for _ in range(20):  # the rows a worker queued before its result came back
            if finished >= {i for i, f in enumerate(futures) if _ran(f)}:
                break
            forward_logs(0.5)
    errors = [f.exception() for f in futures if not f.cancelled() and f.exception() is not None]
    cause = next((e for e in errors if not isinstance(e, stop.StopRequested)), errors[0] if errors else None)
    if cause is not None:
        raise cause
    if any(f.cancelled() for f in futures):
        raise stop.StopRequested(0, None)
    return [f.result() for f in futures]


def _ran(f: Future) -> bool:
    return not f.cancelled() and not isinstance(f.exception(), BrokenProcessPool)


def _signal_workers(pool: ProcessPoolExecutor) -> None:
    for proc in list(getattr(pool, "_processes", {}).values()):  # the executor's own table; no public one
        if proc.is_alive():
            os.kill(proc.pid, signal.SIGTERM)


def fit_all(fit: FitFn, jobs: list[Job], root: Path, log: LogFn | None, requested: int, threads: int,
            grace_s: float, hooks: Hooks | None = None, before_start: Callable[[], None] | None = None
            ) -> list[dict]:
    """Each job's metrics: ``fit`` in this process one after another (with ``hooks``, which are in-process
    callbacks, always), or side by side (``worker_count``), after ``before_start()`` (imports that forked
    workers inherit; no tensor operation)."""
    launched = max(D.world_size(), int(os.environ.get("WORLD_SIZE", "1")))  # before or after the group is made
    workers = 1 if hooks is not None else worker_count(requested, threads, len(jobs), launched,
                                                        torch.cuda.is_available())
    if workers == 1:
        return [fit(params, root, role, with_prefix(log, prefix), hooks) for params, role, prefix in jobs]
    if not threads:  # each worker's share of the cores
        jobs = [(p.model_copy(update={"compute": p.compute.model_copy(
            update={"num_threads": max(1, usable_cores() // workers)})}), role, prefix) for p, role, prefix in jobs]
    if before_start is not None:
        before_start()
    return fit_side_by_side(fit, jobs, root, log, workers, grace_s)
