"""A torch build lock left by a killed process no longer hangs every later stage (rlhf_core/engine/jit_ops.py)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

from rlhf_core.engine.jit_ops import clear_stale_build_locks, extensions_root, open_by_a_process, use_one_ninja

REPO = Path(__file__).resolve().parents[3]


def _plant(root: Path, op: str, age_s: float) -> Path:
    lock = root / op / "lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    lock.touch()
    os.utime(lock, (time.time() - age_s, time.time() - age_s))
    return lock


def _proc_table(root: Path, open_files: dict[int, list[Path]]) -> Path:
    """A /proc-shaped directory: ``<pid>/fd/<n>`` links to each open file (this machine's /proc has a process
    whose descriptors root may not read, its init, so "nobody has it open" cannot be seen in the real one)."""
    (root / "self" / "fd").mkdir(parents=True)
    for pid, files in open_files.items():
        (root / str(pid) / "fd").mkdir(parents=True)
        for n, f in enumerate(files):
            (root / str(pid) / "fd" / str(n)).symlink_to(f)
    return root


def test_a_lock_no_process_has_open_is_removed_at_once_and_named(tmp_path, capsys):
    young = _plant(tmp_path / "ext", "deepspeed_shm_comm", age_s=0)  # a stage killed a moment ago
    proc = _proc_table(tmp_path / "proc", {7: [tmp_path / "ext" / "other"], 8: []})
    assert open_by_a_process(young, proc) is False
    assert open_by_a_process(young, _proc_table(tmp_path / "proc2", {9: [young]})) is True
    t0 = time.monotonic()
    assert clear_stale_build_locks(tmp_path / "ext", stale_after_s=180, proc=proc) == [young]
    assert time.monotonic() - t0 < 5 and not young.exists()
    assert (f"{young}: removed a build lock left by a process killed while it loaded a compiled op (no process has "
            "it open)") in capsys.readouterr().err


def test_a_lock_its_owner_holds_open_is_waited_for_and_left_to_it(tmp_path, capsys):
    lock = _plant(tmp_path, "cpu_adam", age_s=3600)  # old, but a live process (this one) holds it
    fd = os.open(lock, os.O_RDONLY)

    def owner_finishes():
        os.close(fd)
        lock.unlink()

    threading.Timer(0.5, owner_finishes).start()
    assert open_by_a_process(lock) is True
    assert clear_stale_build_locks(tmp_path, stale_after_s=0.1, poll_s=0.05) == []
    err = capsys.readouterr().err
    assert f"{lock}: waiting for another process to finish building this op" in err and "removed" not in err


def test_a_lock_its_owner_has_closed_but_not_yet_removed_is_left_to_it(tmp_path, capsys):
    """torch's holder closes the lock and then removes it (``FileBaton.release``): removing it in between would
    make the holder's own ``os.remove`` fail. Seen unopened, it is left for ``close_to_remove_s`` first (the
    race CI hit: a scan of /proc that began before the close and ended after it)."""
    lock = _plant(tmp_path / "ext", "cpu_adam", age_s=3600)
    nobody = _proc_table(tmp_path / "proc", {7: []})
    threading.Timer(0.3, lock.unlink).start()  # the owner's os.remove, 0.3 s after its close
    assert clear_stale_build_locks(tmp_path / "ext", poll_s=0.05, proc=nobody, close_to_remove_s=1.0) == []
    assert "removed" not in capsys.readouterr().err


def test_without_proc_a_lock_is_removed_only_once_it_is_stale(tmp_path, capsys):
    young = _plant(tmp_path / "ext", "cpu_adam", age_s=0)
    no_proc = tmp_path / "no-proc"  # where /proc cannot tell (no /proc at all)
    assert open_by_a_process(young, no_proc) is None
    t0 = time.monotonic()
    assert clear_stale_build_locks(tmp_path / "ext", stale_after_s=0.5, poll_s=0.05, proc=no_proc) == [young]
    assert 0.4 <= time.monotonic() - t0 < 5
    assert f"{young}: removed a build lock" in capsys.readouterr().err and not young.exists()


def test_loading_the_comm_op_goes_on_past_a_lock_a_killed_process_left(tmp_path):
    """The hazard the kill campaign found: DeepSpeed's CPU shm op is loaded under torch's build lock (by
    ``init_distributed`` for a world of several ranks); with a stale ``lock`` in its build directory, it used to
    wait forever.

    The lock is planted in a build directory of this test's own (``TORCH_EXTENSIONS_DIR``): in the machine's
    shared one, another process loading the op (a stage of the other test worker) could remove it first. The
    op is copied in already built when this machine has it (ninja finds nothing to do: seconds, not the ~75 s
    of a build); without it, the subprocess builds it."""
    ext = tmp_path / "ext"
    built = extensions_root() / "deepspeed_shm_comm"
    if (built / "deepspeed_shm_comm.so").exists():
        shutil.copytree(built, ext / built.name, symlinks=True, ignore=shutil.ignore_patterns("lock", ".ninja_lock"))
    lock = _plant(ext, "deepspeed_shm_comm", age_s=3600)
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_EXTENSIONS_DIR": str(ext)}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    code = "from rlhf_core.engine import distributed as D; D.load_comm_ops(); print('loaded')"
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "loaded" in proc.stdout
    assert f"{lock}: removed a build lock" in proc.stderr
    assert (ext / "deepspeed_shm_comm" / "deepspeed_shm_comm.so").exists()  # the op loaded from this directory


def test_ops_are_built_with_the_ninja_beside_this_python(monkeypatch):
    """A system ninja (1.11) and the wheel's (1.13) hash the build log differently: alternating between them
    rebuilt the op every time. Whatever PATH a stage starts with, the wheel's ninja is found first."""
    import shutil

    venv_bin = Path(sys.executable).parent
    assert (venv_bin / "ninja").exists(), "the ninja wheel comes with deepspeed (constraints.txt pins it)"
    monkeypatch.setenv("PATH", "/usr/local/bin:/usr/bin:/bin")  # a stage started without the venv on PATH
    use_one_ninja()
    assert shutil.which("ninja") == str(venv_bin / "ninja")
    use_one_ninja()  # idempotent
    assert os.environ["PATH"].split(os.pathsep).count(str(venv_bin)) == 1
