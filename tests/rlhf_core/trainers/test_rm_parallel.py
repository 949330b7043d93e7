"""RM trainings side by side (rlhf_core/trainers/rm_parallel.py): the same weights and log rows as one after
another, a worker's error is the stage's, SIGTERM stops every worker at a checkpoint, SIGKILL leaves no orphan."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rlhf_core.engine.errors import NonFiniteLossError
from rlhf_core.trainers import rm_parallel
from rlhf_core.trainers.rm import PROXY, fit_reward_model, member_params, member_role, train_rm
from rlhf_core.trainers.rm_parallel import fit_side_by_side, worker_count
from tests.rlhf_core.trainers.test_rm import TINY, tiny_params, with_sft, ws  # noqa: F401  (fixtures)

REPO = Path(__file__).resolve().parents[3]
OUTPUTS = ("models/rm", "models/rm/members/1", "models/rm/members/2", "models/judge")


def test_worker_count_by_hand(monkeypatch):
    monkeypatch.setattr(rm_parallel, "usable_cores", lambda: 16)
    assert worker_count(0, 1, 8, 1, False) == 8  # 16 cores, 1 thread each, 8 jobs
    assert worker_count(0, 4, 8, 1, False) == 4  # 16 // 4
    assert worker_count(0, 0, 8, 1, False) == 1  # num_threads 0: each takes every core
    assert worker_count(3, 1, 8, 1, False) == 3 and worker_count(12, 1, 8, 1, False) == 8  # asked; capped by jobs
    assert worker_count(0, 1, 8, 2, False) == 1 and worker_count(0, 1, 8, 1, True) == 1  # torchrun; a GPU
    assert worker_count(0, 1, 1, 1, False) == 1


def _weights(d: Path) -> dict[str, torch.Tensor]:
    return load_file(d / "model.safetensors")


FRESH_PROCESS = """
import json, sys
from pathlib import Path
from rlhf_core.trainers import rm_parallel
from rlhf_core.trainers.rm import train_rm
from tests.rlhf_core.trainers.test_rm import tiny_params
chosen, choose = [], rm_parallel.start_method
rm_parallel.start_method = lambda threads: chosen.append(choose(threads)) or chosen[-1]  # records the choice
rows = []
metrics = train_rm(tiny_params(*sys.argv[2:]), Path(sys.argv[1]), lambda m, step: rows.append((step, m)))
print(json.dumps({"start_method": chosen, "metrics": metrics, "rows": rows}))
"""


def train_rm_in_a_fresh_process(root: Path, *overrides: str) -> dict:
    """``train_rm`` as the stage runs it: in a process with no process group yet, whose workers are forked."""
    out = subprocess.run([sys.executable, "-c", FRESH_PROCESS, str(root), *overrides], cwd=REPO, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_workers_are_forked_only_on_one_thread_each_and_without_a_process_group():
    code = ("import torch.distributed as dist\n"
            "from rlhf_core.trainers.rm_parallel import start_method\n"
            "before = [start_method(t) for t in (1, 2, 0)]\n"
            "dist.init_process_group('gloo', init_method='tcp://127.0.0.1:0', rank=0, world_size=1)\n"
            "print(*before, start_method(1))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.split() == ["fork", "spawn", "spawn", "spawn"]


def test_side_by_side_trains_the_same_models_and_logs_the_same_rows(ws, tmp_path):  # noqa: F811
    """Three members and the judge, two forked workers in a fresh process (as the stage runs them) vs one after
    another in this process: bit-identical weights, the same metrics (but time), and the same (step, key) log
    rows, each member's under its prefix."""
    serial = tmp_path / "serial"
    shutil.copytree(ws, serial)
    run = ["rm.ensemble=3", "rm.judge=true", "rm.max_steps=6", "rm.log_every=2"]
    rows: dict[int, list] = {1: []}
    got = {1: train_rm(tiny_params(*run, "rm.parallel=1"), serial, lambda m, step: rows[1].append((step, m)))}
    side_by_side = train_rm_in_a_fresh_process(ws, *run, "rm.parallel=2")  # one thread each (TINY's)
    assert side_by_side["start_method"] == ["fork"]
    got[2], rows[2] = side_by_side["metrics"], side_by_side["rows"]
    got[1] = json.loads(json.dumps(got[1]))  # as the other came: through JSON
    for sub in OUTPUTS:
        a, b = _weights(serial / sub), _weights(ws / sub)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), sub
        meta = [json.loads((r / sub / "rlhf_meta.json").read_text()) for r in (serial, ws)]
        assert [{k: m.get(k) for k in ("role", "trained_on", "ensemble_member", "init_from")} for m in meta] == [
            {k: meta[0].get(k) for k in ("role", "trained_on", "ensemble_member", "init_from")}] * 2, sub
    assert json.loads((ws / "models/judge/rlhf_meta.json").read_text())["role"] == "judge"
    timing = ("time", "per_s")
    same = {k: v for k, v in got[1].items() if not any(t in k for t in timing)}
    assert same == {k: got[2][k] for k in same} and got[2]["ensemble_size"] == 3
    for name in ("rm.json", "rm_judge.json"):
        a, b = (json.loads((r / "metrics" / name).read_text()) for r in (serial, ws))
        assert {k: v for k, v in a.items() if not any(t in k for t in timing)} == {
            k: v for k, v in b.items() if not any(t in k for t in timing)}, name

    def keys(n):
        return sorted({(step, k) for step, m in rows[n] for k in m if not any(t in k for t in timing)})

    assert keys(1) == keys(2)
    assert {k.split(".")[0] for _, k in keys(2) if "." in k} == {"member1", "member2", "judge"}
    assert json.loads((ws / "models/rm/ensemble.json").read_text())["members"][2]["path"] == "members/2"


def proxy_last(params, root, role, log=None, before_save=None):
    """fit_reward_model with the proxy (job 0) started last: its save must still come first."""
    if role.member == 0:
        time.sleep(8)
    return fit_reward_model(params, root, role, log, before_save=before_save)


def test_a_member_trained_before_the_proxy_is_not_lost_by_the_proxys_save(ws):  # noqa: F811
    """The proxy's atomic save replaces models/rm, under which the members live: a member that finishes first
    waits for it (without the wait, members/1 was deleted: test_side_by_side failed so in 2 runs of 4)."""
    p = tiny_params("rm.ensemble=2", "rm.max_steps=3")
    jobs = [(p, PROXY, ""), (member_params(p, 1), member_role(1), "member1.")]
    fit_side_by_side(proxy_last, jobs, ws, None, 2, 60.0)
    assert (ws / "models/rm/model.safetensors").exists()
    assert (ws / "models/rm/members/1/model.safetensors").exists()


def test_a_workers_error_is_the_stages(ws):  # noqa: F811
    """A member that diverges raises its own NonFiniteLossError (step, value, checkpoint) in the stage's
    process, as the serial path does, and the other workers stop."""
    with pytest.raises(NonFiniteLossError, match="non-finite") as err:
        train_rm(tiny_params("rm.ensemble=2", "rm.max_steps=20", "rm.lr=1e30", "rm.warmup_steps=0",
                             "rm.parallel=2"), ws)
    assert err.value.step >= 1 and err.value.what in ("loss", "gradient norm")


def _stage(root: Path, *overrides: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLHF_TRACKING": "off"}
    args = [a for o in [*TINY, *overrides] for a in ("-S", o)]
    return subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", "stage", "rm", *args], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _children(pid: int) -> set[int]:
    kids = set()
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            kids.add(int(stat.parent.name))
    return kids


def _wait_for_member_rows(proc: subprocess.Popen, step: int) -> list[str]:
    lines = []
    for line in proc.stderr:
        lines.append(line)
        if line.startswith("{") and "member1.loss" in line and json.loads(line).get("step", 0) >= step:
            return lines
    raise AssertionError("".join(lines)[-3000:])


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
def test_sigterm_stops_every_worker_at_a_checkpoint_and_sigkill_leaves_no_orphan(ws, tmp_path):  # noqa: F811
    from rlhf_core.stages import exit_codes

    run = ["rm.ensemble=2", "rm.max_steps=400", "rm.log_every=1", "rm.save_every=0", "rm.parallel=2"]
    killed = tmp_path / "killed"
    shutil.copytree(ws, killed)
    proc = _stage(killed, *run)
    _wait_for_member_rows(proc, 2)
    workers = _children(proc.pid)
    assert len(workers) >= 2  # two workers (and the executor's helpers, if any)
    proc.kill()
    proc.wait(timeout=30)
    deadline = time.monotonic() + 20
    while any(_alive(w) for w in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(w) for w in workers), "a worker outlived the SIGKILLed stage"

    proc = _stage(ws, *run)
    lines = _wait_for_member_rows(proc, 3)
    proc.send_signal(signal.SIGTERM)
    err = "".join(lines) + proc.stderr.read()
    assert proc.wait(timeout=300) == exit_codes.STOPPED, err[-3000:]
    assert "stopped on SIGTERM after step" in err
    for stage in ("rm", "rm_member1"):  # each worker saved the step it was on
        latest = (ws / f"checkpoints/{stage}/latest").read_text().strip()
        assert 1 <= int(latest.removeprefix("step_")) < 400, stage
    assert not (ws / "models/rm/members/1/model.safetensors").exists()
