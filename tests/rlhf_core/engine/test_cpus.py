"""The usable cores: the affinity capped by the cgroup's CPU quota, read from v1 and v2 trees and from a real
cgroup this test makes (root only)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.engine.cpus import cgroup_cpu_quota

REPO = Path(__file__).resolve().parents[3]


def _tree(root: Path, files: dict[str, str], proc_cgroup: str) -> Path:
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    (root / "self-cgroup").write_text(proc_cgroup)
    return root / "self-cgroup"


def test_v2_quota_is_the_smallest_along_the_path(tmp_path):
    """A pod limit of 4 CPUs on the pod's cgroup, none on the container's: 4.0 (400000 / 100000)."""
    me = _tree(tmp_path, {"cpu.max": "max 100000\n", "kubepods/pod1/cpu.max": "400000 100000\n",
                          "kubepods/pod1/ctr/cpu.max": "max 100000\n"}, "0::/kubepods/pod1/ctr\n")
    assert cgroup_cpu_quota(me, tmp_path) == 4.0
    (tmp_path / "kubepods/pod1/ctr/cpu.max").write_text("250000 100000\n")  # the tighter one wins
    assert cgroup_cpu_quota(me, tmp_path) == 2.5


def test_v1_quota_from_a_combined_cpu_cpuacct_mount(tmp_path):
    me = _tree(tmp_path, {"cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "150000\n",
                          "cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
                          "cpu,cpuacct/cpu.cfs_quota_us": "-1\n", "cpu,cpuacct/cpu.cfs_period_us": "100000\n"},
               "12:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n0::/\n")
    assert cgroup_cpu_quota(me, tmp_path) == 1.5


def test_no_quota_and_no_cgroup_file_mean_none(tmp_path):
    me = _tree(tmp_path, {"cpu.max": "max 100000\n", "cpu/cpu.cfs_quota_us": "-1\n",
                          "cpu/cpu.cfs_period_us": "100000\n"}, "1:cpu:/\n0::/\n")
    assert cgroup_cpu_quota(me, tmp_path) is None
    assert cgroup_cpu_quota(tmp_path / "absent", tmp_path) is None


CHILD = ("import torch; from rlhf_core.engine.cpus import usable_cores; from rlhf_core.engine import distributed as D;"
         " print(usable_cores(), D.set_num_threads(0))")


def _writable_v1_cpu() -> Path | None:
    cpu = Path("/sys/fs/cgroup/cpu")
    return cpu if (cpu / "cpu.cfs_quota_us").exists() and os.access(cpu, os.W_OK) else None


@pytest.mark.skipif(_writable_v1_cpu() is None or (os.cpu_count() or 1) < 2,
                    reason="needs a writable cgroup v1 cpu controller (root) and 2+ cores")
def test_a_process_in_a_one_cpu_cgroup_gets_one_torch_thread():
    """A real cgroup with a 1-CPU quota: a stage started in it uses one thread (before: every core of the node)."""
    group = _writable_v1_cpu() / f"rlhf-test-{os.getpid()}"
    group.mkdir()
    try:
        (group / "cpu.cfs_period_us").write_text("100000")
        (group / "cpu.cfs_quota_us").write_text("100000")
        env = {**os.environ, "PYTHONPATH": str(REPO), "CUDA_VISIBLE_DEVICES": ""}
        free = subprocess.run([sys.executable, "-c", CHILD], env=env, capture_output=True, text=True, check=True)
        cores = len(os.sched_getaffinity(0))
        assert free.stdout.split() == [str(cores), str(cores)]
        inside = subprocess.run(["sh", "-c", f'echo $$ > {group}/cgroup.procs && exec "$0" -c "$1"',
                                 sys.executable, CHILD], env=env, capture_output=True, text=True, check=True)
        assert inside.stdout.split() == ["1", "1"], inside.stderr
    finally:
        group.rmdir()
