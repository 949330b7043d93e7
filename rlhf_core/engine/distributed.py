"""Process-group setup and small collectives: the same code runs 1 process bare, or N under ``torchrun``.

Without a launcher (no ``RANK``/``WORLD_SIZE`` in the environment) a world of one is set up on
``127.0.0.1`` with a free port (without writing rendezvous variables into ``os.environ``).  On a
machine without CUDA the DeepSpeed CPU accelerator is selected (``DS_ACCELERATOR=cpu``) and the
backend is gloo; with CUDA it is nccl.
"""

from __future__ import annotations

import atexit
import contextlib
import importlib
import os
import socket
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from rlhf_core.engine.cpus import usable_cores
from rlhf_core.engine.jit_ops import op_build_guard


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def configure_environment() -> None:
    """Environment DeepSpeed needs before it is imported: CPU accelerator when there is no GPU."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed() -> None:
    """Initialise torch.distributed through DeepSpeed (idempotent).

    Under ``torchrun`` the launcher's env is used; otherwise a single-process world is created. The group is
    destroyed when the process exits (``shutdown``), as torch asks of NCCL ("destroy_process_group() was not
    called before program exit, which can leak resources").
    """
    configure_environment()
    if dist.is_available() and dist.is_initialized():
        return
    import deepspeed

    atexit.register(shutdown)

    if torch.cuda.is_available():
        torch.cuda.set_device(local_rank())
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        # No launcher: a world of one on a free local port.  The environment is left untouched, so
        # subprocesses this process starts (e.g. torchrun) do not inherit a stale rendezvous.
        os.environ.setdefault("LOCAL_RANK", "0")  # deepspeed.initialize insists on it
        dist.init_process_group(backend(), init_method=f"tcp://127.0.0.1:{_free_port()}", rank=0, world_size=1)
        with without_shm_op():
            deepspeed.init_distributed(dist_backend=backend(), auto_mpi_discovery=False, verbose=False)
        return
    if int(os.environ["WORLD_SIZE"]) == 1:
        with without_shm_op():
            deepspeed.init_distributed(dist_backend=backend(), verbose=False)
        return
    load_comm_ops()
    deepspeed.init_distributed(dist_backend=backend(), verbose=False)


def shutdown() -> None:
    """Destroy the default process group, if there is one (idempotent)."""
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()


def load_comm_ops() -> None:
    """Load the compiled op ``deepspeed.init_distributed`` loads (the CPU shared-memory collectives) under the
    build-lock guard; DeepSpeed keeps it, so ``init_distributed`` does not load it again. The guard must not
    span a collective (the rendezvous): a rank holding it would wait for ranks that wait for it."""
    with op_build_guard():
        from deepspeed.comm.torch import build_shm_op

        build_shm_op()


@contextlib.contextmanager
def without_shm_op() -> Iterator[None]:
    """Keep DeepSpeed from compiling and loading its CPU shared-memory collectives in a world of one.

    ``deepspeed.comm.torch.TorchBackend.__init__`` calls the module's ``build_shm_op`` whatever the world size;
    the op serves collectives between local ranks, which a single process never runs, and its first build is a
    C++ compile of about a minute on a fresh machine. Inside this block that name returns None (what DeepSpeed
    itself returns where the op is incompatible), so the backend falls back to torch.distributed; it is restored
    on exit.
    """
    ds_torch_comm = importlib.import_module("deepspeed.comm.torch")  # ``deepspeed.comm.torch`` is torch itself

    original = ds_torch_comm.build_shm_op
    ds_torch_comm.build_shm_op = lambda: None
    try:
        yield
    finally:
        ds_torch_comm.build_shm_op = original


def rank() -> int:
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def local_world_size() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("WORLD_SIZE", "1")))


def is_main() -> bool:
    return rank() == 0


def device() -> torch.device:
    return torch.device("cuda", local_rank()) if torch.cuda.is_available() else torch.device("cpu")


def barrier() -> None:
    if world_size() > 1:
        dist.barrier()


def all_reduce_sum(values: torch.Tensor) -> torch.Tensor:
    """Sum of a float64 tensor over ranks (returns a new CPU tensor)."""
    t = values.detach().to(torch.float64)
    if world_size() > 1:
        t = t.to(device())
        dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.cpu()


def all_agree(*flags: bool) -> tuple[bool, ...]:
    """Each flag True only where it is True on every rank (a MIN all-reduce; as given in a world of one)."""
    t = torch.tensor(flags, dtype=torch.int64)
    if world_size() > 1:
        t = t.to(device())
        dist.all_reduce(t, op=dist.ReduceOp.MIN)
    return tuple(bool(v) for v in t.tolist())


def all_max(value: int) -> int:
    """The largest ``value`` over ranks (as given in a world of one)."""
    if world_size() == 1:
        return value
    t = torch.tensor([value], dtype=torch.int64, device=device())
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return int(t.item())


def forwards_in_lockstep(model) -> bool:
    """True when every rank must make the same forward passes through ``model`` (or the module it wraps as
    ``.module``): several ranks and its parameters partitioned by ZeRO-3, whose every forward all-gathers them
    (a rank that runs one pass more than the others waits for them forever)."""
    for _ in range(4):
        if hasattr(model, "parameters"):
            param = next(iter(model.parameters()), None)
            return world_size() > 1 and param is not None and hasattr(param, "ds_id")
        model = getattr(model, "module", None)
    return False


@contextlib.contextmanager
def full_param(param: torch.Tensor) -> Iterator[torch.Tensor]:
    """The parameter itself, gathered (and re-partitioned from rank 0) when ZeRO-3 partitioned it."""
    if not hasattr(param, "ds_id"):
        yield param
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters([param], modifier_rank=0):
        yield param


def broadcast_object(obj: Any, src: int = 0) -> Any:
    if world_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]


def set_num_threads(requested: int) -> int:
    """``compute.num_threads`` or, when 0, the usable cores (the affinity, capped by the cgroup's CPU quota:
    :mod:`rlhf_core.engine.cpus`) split evenly over this node's processes."""
    n = requested or max(1, usable_cores() // max(1, local_world_size()))
    if not torch.cuda.is_available() or requested:
        torch.set_num_threads(n)
    return torch.get_num_threads()
