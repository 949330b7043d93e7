"""Build locks of JIT-compiled ops that a killed process left behind.

torch's extension loader (``torch.utils.cpp_extension.load``; DeepSpeed uses it for every op it did not
prebuild: the CPU shared-memory collectives that ``deepspeed.init_distributed`` loads on CPU, CPU Adam, ...)
creates ``<extensions dir>/<op>/lock`` with ``O_EXCL`` before it builds or loads the op and removes it after;
every other loader waits while that file exists, without a limit. A process killed in between (SIGKILL, the OOM
killer, a node drain) leaves it behind, and every later stage on that machine waits forever.

Our processes load ops inside ``op_build_guard`` (never around a collective: a rank holding it would wait for
the ranks waiting for it): an ``flock`` on ``<extensions dir>/.rlhf-ops.lock``, so the
holder knows that no other rlhf-ops process is inside torch's lock. A ``lock`` it still finds is then either
stale or held by a process outside rlhf-ops (another project sharing ``~/.cache/torch_extensions``). torch's
holder keeps the file open until it removes it, so: when ``/proc`` shows that no process has it open, and
still none a moment later (``CLOSE_TO_REMOVE_S``: torch's holder closes the file before it removes it, and
removing it in between would make the holder's own ``os.remove`` fail), it is stale and removed; when a
process has it open, the guard waits for it; when ``/proc`` cannot tell (no
``/proc``, or a process of the lock owner's user whose descriptors it may not read), the guard waits until the
file is ``stale_after_s`` old (longer than a build) and then removes it. Each removal is named on stderr. The
kernel drops an ``flock`` with its process, so the guard itself never goes stale.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

from torch.utils.cpp_extension import _get_build_directory  # torch's own rule; the public API has none

STALE_AFTER_S = 180.0
CLOSE_TO_REMOVE_S = 1.0
GUARD_FILE = ".rlhf-ops.lock"


def extensions_root() -> Path:
    """The directory torch builds JIT ops in (``TORCH_EXTENSIONS_DIR``, else the per-Python/CUDA cache folder)."""
    return Path(_get_build_directory("deepspeed_shm_comm", verbose=False)).parent


def open_by_a_process(path: Path, proc: Path = Path("/proc")) -> bool | None:
    """Whether some process has ``path`` open (its ``/proc/<pid>/fd`` links); None when that cannot be told: no
    ``/proc``, or a process of the file owner's user whose descriptors cannot be read (only such a process could
    have created the lock)."""
    if not (proc / "self" / "fd").is_dir():
        return None
    target, owner, unsure = os.path.realpath(path), path.stat().st_uid, False
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            for fd in fd_dir.iterdir():
                if os.readlink(fd) == target:
                    return True
        except FileNotFoundError:  # the process ended meanwhile
            continue
        except PermissionError:
            with contextlib.suppress(OSError):
                unsure = unsure or fd_dir.parent.stat().st_uid == owner
    return None if unsure else False


def clear_stale_build_locks(root: Path, stale_after_s: float = STALE_AFTER_S, poll_s: float = 1.0,
                            proc: Path = Path("/proc"), close_to_remove_s: float = CLOSE_TO_REMOVE_S) -> list[Path]:
    """Wait for each ``root/*/lock`` to go away; remove one that no process has had open for
    ``close_to_remove_s``, or (when that cannot be told) one ``stale_after_s`` old that none was seen to have
    open for ``close_to_remove_s``. Returns those removed.

    Call only while holding the guard: then no rlhf-ops process is inside these locks."""
    removed = []
    for lock in sorted(root.glob("*/lock")):
        said, unopened_since = False, None
        while True:
            try:
                age = time.time() - lock.stat().st_mtime
            except FileNotFoundError:
                break
            held = open_by_a_process(lock, proc)
            unopened_since = None if held else (unopened_since or time.monotonic())
            settled = unopened_since is not None and time.monotonic() - unopened_since >= close_to_remove_s
            if settled and (held is False or age >= stale_after_s):
                lock.unlink(missing_ok=True)
                removed.append(lock)
                why = "no process has it open" if held is False else f"untouched for {age:.0f} s"
                print(f"{lock}: removed a build lock left by a process killed while it loaded a compiled op "
                      f"({why})", file=sys.stderr, flush=True)
                break
            if not said and (held or (held is None and age < stale_after_s)):
                print(f"{lock}: waiting for another process to finish building this op", file=sys.stderr,
                      flush=True)
                said = True
            time.sleep(poll_s if held else min(poll_s, close_to_remove_s))
    return removed


def use_one_ninja() -> None:
    """Build with the ninja installed beside this Python (the ``ninja`` wheel), whatever ``PATH`` says. ninja
    1.13 hashes commands in its build log differently from 1.11, so processes alternating between a system
    ninja and the wheel's rebuild the op every time they alternate (found in CI: the CPU comm op rebuilt six
    times in one test run, ~35 s each; a stage started by hand and one started by the flow alternate the same
    way)."""
    here = Path(sys.executable).parent
    path = os.environ.get("PATH", "")
    if (here / "ninja").exists() and path.split(os.pathsep)[0] != str(here):
        os.environ["PATH"] = f"{here}{os.pathsep}{path}"


@contextlib.contextmanager
def op_build_guard(root: Path | None = None, stale_after_s: float = STALE_AFTER_S) -> Iterator[None]:
    """Hold the rlhf-ops build guard (waiting for it) with stale torch build locks cleared and one ninja on
    ``PATH``; load ops inside."""
    use_one_ninja()
    root = extensions_root() if root is None else Path(root)
    root.mkdir(parents=True, exist_ok=True)
    fd = os.open(root / GUARD_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError as err:  # no flock on this filesystem: another of ours may be building; leave locks be
            if err.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS):
                raise
        else:
            clear_stale_build_locks(root, stale_after_s)
        yield
    finally:
        os.close(fd)
