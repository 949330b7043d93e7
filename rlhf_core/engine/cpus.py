"""How many CPUs this process may use: its affinity, capped by its cgroup's CPU quota.

``os.cpu_count()`` is the node's cores. In a pod with ``resources.limits.cpu: 4`` on a 64-core node, torch then
starts 64 threads that share 4 CPUs' worth of time: the kernel's CFS throttles the cgroup each period and every
thread waits at each parallel region's barrier for the throttled ones. The quota is what the pod was granted:

    quota_cores = cfs_quota / cfs_period      (cgroup v2: ``cpu.max`` "QUOTA PERIOD"; v1: ``cpu.cfs_quota_us`` and
                                              ``cpu.cfs_period_us``; "max" / -1: no quota)
    usable      = max(1, min(len(sched_getaffinity), floor(min quota_cores over the cgroup and its parents)))

Rounded down, as Go's automaxprocs does: a 1.5-CPU limit gets one thread, which the quota never throttles.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
V1_CPU_DIRS = ("cpu", "cpu,cpuacct", "cpuacct,cpu")


def _quota_v2(folder: Path) -> float | None:
    try:
        quota, period = (folder / "cpu.max").read_text().split()
    except (OSError, ValueError):
        return None
    return None if quota == "max" else int(quota) / int(period)


def _quota_v1(folder: Path) -> float | None:
    try:
        quota = int((folder / "cpu.cfs_quota_us").read_text())
        period = int((folder / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return None if quota <= 0 or period <= 0 else quota / period


def _ancestors(mount: Path, path: str) -> list[Path]:
    """``mount/path`` and each parent up to ``mount`` (a limit set on a parent bounds the children too)."""
    parts = [p for p in path.strip().split("/") if p]
    return [mount.joinpath(*parts[:i]) for i in range(len(parts), -1, -1)]


def cgroup_cpu_quota(proc_cgroup: Path = Path("/proc/self/cgroup"), root: Path = CGROUP_ROOT) -> float | None:
    """The CPU quota in cores of this process's cgroup (the smallest along its path), or None without one."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    quotas: list[float] = []
    for line in lines:
        _, controllers, path = line.split(":", 2)
        if controllers == "":  # cgroup v2, the unified hierarchy (mounted at the root, or at unified/ in hybrid)
            for mount in (root, root / "unified"):
                quotas += [q for f in _ancestors(mount, path) if (q := _quota_v2(f)) is not None]
        elif "cpu" in controllers.split(","):
            for mount in (root / d for d in V1_CPU_DIRS):
                quotas += [q for f in _ancestors(mount, path) if (q := _quota_v1(f)) is not None]
    return min(quotas) if quotas else None


def usable_cores() -> int:
    """The CPUs this process may run on, capped by its cgroup's quota (module docstring)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    quota = cgroup_cpu_quota()
    return max(1, min(cores, math.floor(quota))) if quota is not None else cores
