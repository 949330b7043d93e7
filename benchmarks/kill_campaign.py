"""``python -m benchmarks.kill_campaign``: SIGKILL a training stage at random moments, re-run it, compare.

For a stage (``sft``, ``rm``, ``rlhf``) of a base workspace (``data/prepared`` and the models the stage reads):

1. the reference: the stage uninterrupted in a copy of the workspace (its wall time ``T``, its final weights);
2. ``--kills`` times: a fresh copy, the stage started as ``rlhf stage NAME`` in its own process group and killed
   with SIGKILL at a random point: a step drawn uniformly in ``0 .. steps``; for step 0 a moment drawn
   uniformly in the reference's start-up (imports, DeepSpeed loading its compiled ops, model loading: the time
   to its first logged step), else a delay drawn uniformly in 0-0.3 s after the stage logged that step (inside
   the forward, backward, optimizer step or checkpoint write; at ``steps``: in the final evaluation and save;
   steps are counted, not seconds, so a busy machine moves the point less), then
   * what the kill left: the newest step the stage had logged, the checkpoint ``latest`` names, and whether the
     model directory is absent or whole (a half-written model directory would be a defect),
   * the re-run to the end: the step it resumed from, the steps lost (logged before the kill, not in the
     checkpoint), and whether its final weights equal the reference's, bit for bit.

One JSON line per kill goes to ``--out`` and a summary table to stdout. Each run uses ``--threads`` torch
threads; the stage logs every step (``<stage>.log_every=1``) so the last logged step is exact.

    python -m benchmarks.kill_campaign --workspace W --stage sft --kills 10 --out kills.jsonl \\
        -S sft.max_steps=40 -S sft.save_every=10
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

MODEL_DIR = {"sft": "models/sft", "rm": "models/rm", "rlhf": "models/actor"}
COPIED = ("data", "models", "params.yaml")


def weights_hash(model_dir: Path) -> str | None:
    """sha256 over the ``*.safetensors`` files of a model directory (what the weights are, nothing else)."""
    files = sorted(model_dir.glob("*.safetensors")) if model_dir.is_dir() else []
    if not files:
        return None
    h = hashlib.sha256()
    for f in files:
        h.update(f.name.encode())
        h.update(f.read_bytes())
    return h.hexdigest()


def model_state(model_dir: Path) -> str:
    """``absent``, ``whole`` (config, weights and the stage's meta file all there) or ``partial`` (a defect)."""
    if not model_dir.exists():
        return "absent"
    has = {p.name for p in model_dir.iterdir()}
    if "config.json" in has and "rlhf_meta.json" in has and any(n.endswith(".safetensors") for n in has):
        return "whole"
    return "partial"


def fresh_copy(base: Path, run_dir: Path, stage: str) -> None:
    shutil.rmtree(run_dir, ignore_errors=True)
    run_dir.mkdir(parents=True)
    for rel in COPIED:
        src = base / rel
        if src.is_dir():
            shutil.copytree(src, run_dir / rel, ignore=shutil.ignore_patterns(Path(MODEL_DIR[stage]).name)
                            if rel == "models" else None)
        elif src.exists():
            shutil.copy2(src, run_dir / rel)


def start(run_dir: Path, stage: str, sets: list[str], threads: int) -> subprocess.Popen:
    env = {**os.environ, "RLHF_TRACKING": "off", "OMP_NUM_THREADS": str(threads)}
    args = [a for s in [*sets, f"compute.num_threads={threads}", f"{stage}.log_every=1"] for a in ("-S", s)]
    with open(run_dir / "run.log", "a") as log:  # the child keeps its own copy of the descriptor
        return subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", "stage", stage, *args], cwd=run_dir,
                                env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def last_logged_step(log: Path, stage: str) -> int:
    step = 0
    for line in log.read_text(errors="replace").splitlines():
        if line.startswith("{") and f'"stage": "{stage}"' in line:
            try:
                step = max(step, int(json.loads(line).get("step", 0)))
            except ValueError:
                continue
    return step


def finished_metrics(run_dir: Path, stage: str) -> dict:
    return json.loads((run_dir / "metrics" / f"{stage}.json").read_text())


def run_reference(base: Path, out: Path, stage: str, sets: list[str], threads: int) -> dict:
    ref = out / "reference"
    fresh_copy(base, ref, stage)
    t0 = time.perf_counter()
    proc = start(ref, stage, sets, threads)
    startup = None
    while proc.poll() is None:
        if startup is None and last_logged_step(ref / "run.log", stage) >= 1:
            startup = time.perf_counter() - t0  # imports, compiled ops, model loading: the step-0 kill window
        time.sleep(0.05)
    if proc.returncode != 0:
        raise SystemExit(f"the uninterrupted run failed (exit {proc.returncode}); see {ref / 'run.log'}")
    seconds = time.perf_counter() - t0
    return {"seconds": seconds, "startup_s": startup or seconds, "weights": weights_hash(ref / MODEL_DIR[stage]),
            "steps": finished_metrics(ref, stage)["steps"]}


def sigkill_group_after(proc: subprocess.Popen, delay: float, before: Callable[[], None] | None = None) -> bool:
    """SIGKILL ``proc``'s process group ``delay`` seconds from now (``before`` runs just ahead of the kill); False
    when it finished first."""
    try:
        proc.wait(timeout=delay)
        return False
    except subprocess.TimeoutExpired:
        if before is not None:
            before()
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        return True


def run_kills(kills: int, seed: int, out: Path, one: Callable[[int, random.Random], dict],
              summarise: Callable[[list[dict]], str]) -> list[dict]:
    """``one(i, rng)`` for each kill: its row appended to ``out`` (JSONL) and printed; then the summary table."""
    rng = random.Random(seed)
    rows = []
    for i in range(kills):
        row = one(i, rng)
        rows.append(row)
        with open(out, "a") as fh:
            fh.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    print(summarise(rows))
    return rows


def one_kill(base: Path, out: Path, i: int, stage: str, sets: list[str], threads: int, reference: dict,
             rng: random.Random) -> dict:
    run_dir = out / f"kill_{i:03d}"
    fresh_copy(base, run_dir, stage)
    # step 0: during start-up (imports, DeepSpeed loading its compiled ops, model loading), a random moment
    # within the uninterrupted run's time to its first logged step
    target = rng.randint(0, reference["steps"])
    delay = rng.uniform(0.0, reference["startup_s"]) if target == 0 else rng.uniform(0.0, 0.3)  # else within a step
    proc = start(run_dir, stage, sets, threads)
    while target and proc.poll() is None and last_logged_step(run_dir / "run.log", stage) < target:
        time.sleep(0.05)
    killed = sigkill_group_after(proc, delay)
    ckpt_latest = run_dir / "checkpoints" / stage / "latest"
    row = {"kill": i, "stage": stage, "after_step": target, "delay_s": round(delay, 3), "killed": killed,
           "logged_step_at_kill": last_logged_step(run_dir / "run.log", stage),
           "latest_checkpoint": ckpt_latest.read_text().strip() if ckpt_latest.exists() else None,
           "model_after_kill": model_state(run_dir / MODEL_DIR[stage])}
    rc = start(run_dir, stage, sets, threads).wait()
    row["rerun_rc"] = rc
    if rc == 0:
        m = finished_metrics(run_dir, stage)
        resumed = int(m.get("resumed_from_step", 0))
        row |= {"resumed_from_step": resumed, "steps": m["steps"],
                "steps_lost": max(0, row["logged_step_at_kill"] - resumed) if killed else 0,
                "identical_weights": weights_hash(run_dir / MODEL_DIR[stage]) == reference["weights"],
                "model_after_rerun": model_state(run_dir / MODEL_DIR[stage])}
    return row


def summarise(rows: list[dict]) -> str:
    killed = [r for r in rows if r["killed"]]
    ok = [r for r in rows if r.get("rerun_rc") == 0]
    lost = [r["steps_lost"] for r in ok if r["killed"]]
    lines = ["| stage | kills | resumed and finished | identical final weights | steps lost: mean / max | "
             "model dir after the kill (absent / whole / partial) |", "|---|---|---|---|---|---|"]
    states = [r["model_after_kill"] for r in rows]
    lines.append(f"| {rows[0]['stage']} | {len(killed)} (+{len(rows) - len(killed)} finished first) | "
                 f"{len(ok)} / {len(rows)} | {sum(r['identical_weights'] for r in ok)} / {len(ok)} | "
                 f"{(sum(lost) / len(lost)) if lost else 0:.1f} / {max(lost, default=0)} | "
                 f"{states.count('absent')} / {states.count('whole')} / {states.count('partial')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, required=True)
    ap.add_argument("--stage", choices=sorted(MODEL_DIR), required=True)
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, required=True, help="JSONL of the kills; run directories beside it")
    ap.add_argument("-S", "--set", dest="sets", action="append", default=[])
    a = ap.parse_args(argv)
    work = a.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    base = a.workspace.resolve()
    reference = run_reference(base, work, a.stage, a.sets, a.threads)
    print(json.dumps({"reference": reference}), flush=True)
    return run_kills(a.kills, a.seed, a.out, lambda i, rng: one_kill(base, work, i, a.stage, a.sets, a.threads,
                                                                     reference, rng), summarise)


if __name__ == "__main__":
    main()
