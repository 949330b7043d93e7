"""``python -m rlhf_core.ops.launch [torchrun args] -m rlhf_core.cli stage NAME``: torchrun, made safe to preempt.

torchrun alone loses a preempted stage's checkpoint and its exit code:

- on SIGTERM it forwards the signal to its workers and SIGKILLs them ``--shutdown-timeout`` seconds later
  (``TORCH_ELASTIC_SHUTDOWN_TIMEOUT``, default 30 s), while a rank may need ``compute.stop_grace_s`` (600 s) to
  reach its next step boundary and write the checkpoint;
- it then exits 1 ("crashed") whatever its workers exited with, so the Job counts a preemption as a failure.

This launcher is torchrun (``torch.distributed.run``, its own parser and agent) with two changes:

- the shutdown timeout defaults to ``DEFAULT_SHUTDOWN_TIMEOUT_S`` (rendered Jobs pass their pod's
  ``terminationGracePeriodSeconds`` less ``KUBELET_MARGIN_S``);
- each rank that stops on SIGTERM after its checkpoint records it (``record_stopped``), and when torchrun ends on
  a signal the launcher exits 75 (``exit_codes.STOPPED``) if every local rank did so, else 128 + the signal
  (143: no checkpoint within the grace, the retry resumes from the previous one), as one process would;
- when a worker fails, the launcher exits with that worker's code (torchrun: 1), so bad input (65) and bad
  params (2) stay permanent for the retry policy.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.run import parse_args, run

from rlhf_core.stages import exit_codes

DEFAULT_SHUTDOWN_TIMEOUT_S = 870  # above compute.stop_grace_s (600) plus a checkpoint write
KUBELET_MARGIN_S = 30  # torchrun's own SIGKILL comes this long before the kubelet's
STOPPED_DIR_ENV = "RLHF_LAUNCH_STOPPED_DIR"
LAUNCH_ENV = "RLHF_LAUNCH"  # a launcher command line `rlhf stage` re-executes itself under (a pod under DVC)


def relaunch_command(argv: list[str]) -> list[str] | None:
    """Where ``$RLHF_LAUNCH`` names a launcher (``python -m rlhf_core.ops.launch --standalone --nproc_per_node=4``)
    and this process is not one of its workers (no ``LOCAL_RANK``): the command running ``rlhf ARGV`` under it,
    ``LAUNCHER -m rlhf_core.cli ARGV``. DVC can then run a multi-process stage through the one command in
    ``dvc.yaml``. ``None``: run here."""
    launch = os.environ.get(LAUNCH_ENV, "").split()
    if not launch or "LOCAL_RANK" in os.environ:
        return None
    return [*launch, "-m", "rlhf_core.cli", *argv]


def record_stopped() -> None:
    """Called by a rank that saved its checkpoint after SIGTERM and is about to exit 75 (no-op without the
    launcher)."""
    where = os.environ.get(STOPPED_DIR_ENV)
    if where:
        Path(where, f"rank-{os.environ.get('LOCAL_RANK', '0')}").touch()


def exit_code_after_signal(signum: int, stopped_dir: Path, nproc_per_node: int) -> int:
    """75 when every local rank recorded a checkpointed stop, else ``128 + signum``."""
    recorded = {p.name for p in stopped_dir.glob("rank-*")}
    every = {f"rank-{r}" for r in range(nproc_per_node)}
    return exit_codes.STOPPED if signum == signal.SIGTERM and every <= recorded else 128 + signum


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    if args.shutdown_timeout is None and "TORCH_ELASTIC_SHUTDOWN_TIMEOUT" not in os.environ:
        args.shutdown_timeout = DEFAULT_SHUTDOWN_TIMEOUT_S
    with tempfile.TemporaryDirectory(prefix="rlhf-launch-") as stopped_dir:
        os.environ[STOPPED_DIR_ENV] = stopped_dir  # the workers inherit it
        try:
            run(args)
        except SignalException as err:
            nproc = int(args.nproc_per_node) if str(args.nproc_per_node).isdigit() else 1
            code = exit_code_after_signal(int(err.sigval), Path(stopped_dir), nproc)
            print(f"rlhf launch: {signal.Signals(err.sigval).name}; {exit_codes.describe(code)}", file=sys.stderr,
                  flush=True)
            return code
        except ChildFailedError as err:
            _, first = err.get_first_failure()
            code = first.exitcode if first.exitcode > 0 else 128 - first.exitcode
            print(f"rlhf launch: rank {first.local_rank} failed; {exit_codes.describe(code)}", file=sys.stderr,
                  flush=True)
            return code
    return 0


if __name__ == "__main__":
    sys.exit(main())
