"""``python -m benchmarks.kill_flow``: SIGKILL ``rlhf run`` at random moments, re-run it, compare.

For a project directory ``--project P`` that has not run yet (a checkout of this repository with the
params.yaml to run, e.g. tiny params):

1. the reference: ``rlhf run`` on the embedded default (Prefect's ephemeral API, MLflow on SQLite, DVC local
   remote, all under ``.rlhf``) in a fresh copy of ``P``: its wall time ``T``, its models' weights, its registry;
2. ``--kills`` times, in a fresh copy: ``rlhf run`` in its own process group, SIGKILLed (the whole group: the
   flow and what runs in its session; the stages run in sessions of their own and must stop by themselves,
   ``rlhf_core.ops.flow_watch``) after a delay drawn uniformly in ``--from-s .. T``, then
   * what the kill left: the stage running at the kill, how long it took to stop and what it said (one
     still running after ``--stop-timeout`` seconds would be a defect, and is killed), every model directory
     absent, whole or partial (against its manifest; partial would be a defect);
   * the re-run to the end: its exit code, each model's weights equal to the reference's bit for bit or not,
     and the registry: one version per kind (a doubled one would be a defect), every version complete
     (``rlhf.registration``), ``champion`` where the reference has one.

One JSON line per kill goes to ``--out``, a summary table to stdout. Needs no server and no network.

    python -m benchmarks.kill_flow --project P --kills 5 --seed 1 --out kills-flow.jsonl
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.kill_campaign import run_kills, sigkill_group_after, weights_hash
from rlhf_core.ops.integrity import MODEL_MANIFEST, check_manifest

MODELS = {"sft": "models/sft", "rm": "models/rm", "actor": "models/actor", "critic": "models/critic"}
KINDS = ("actor", "critic", "reward")


def fresh_copy(project: Path, dst: Path) -> None:
    """The project's files as git sees them (tracked and untracked, not ignored) in a new git repository."""
    shutil.rmtree(dst, ignore_errors=True)
    listed = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=project,
                            capture_output=True, text=True, check=True).stdout.split()
    for rel in listed:
        if (project / rel).is_file():
            (dst / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(project / rel, dst / rel)
    subprocess.run(["git", "init", "-q"], cwd=dst, check=True)


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k not in ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI")}  # the copy's own embedded default
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    return env


def start(run_dir: Path) -> subprocess.Popen:
    with open(run_dir / "flow.log", "a") as log:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "run"], cwd=run_dir, env=_env(), stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def processes_in(run_dir: Path) -> list[int]:
    """Processes whose working directory is ``run_dir`` (the stages, DVC, anything the flow left)."""
    pids = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit() and int(proc.name) != os.getpid():
            try:
                if Path(os.readlink(proc / "cwd")) == run_dir:
                    pids.append(int(proc.name))
            except OSError:
                continue
    return pids


def stage_running(pids: list[int]) -> str | None:
    """The stage one of ``pids`` runs (``rlhf stage NAME`` in its command line), if any."""
    for pid in pids:
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        words = [a.decode(errors="replace") for a in argv]
        if "stage" in words and words.index("stage") + 1 < len(words) and any("rlhf" in w for w in words):
            return words[words.index("stage") + 1]
    return None


def model_states(run_dir: Path) -> dict[str, str]:
    out = {}
    for name, rel in MODELS.items():
        d = run_dir / rel
        if not d.exists():
            out[name] = "absent"
        elif (d / MODEL_MANIFEST).exists():
            out[name] = "whole" if check_manifest(d, MODEL_MANIFEST) is None else "partial"
        else:
            out[name] = "whole" if not any(d.glob("*.safetensors")) else "unsealed"
    return out


def registry(run_dir: Path) -> dict:
    """Per kind: versions (number, complete) and the versions ``champion`` / ``challenger`` name."""
    code = ("import json, sys; from mlflow import MlflowClient; from rlhf_core.config import load_params; "
            "from rlhf_core.ops import tracking; p = load_params('params.yaml'); "
            "c = MlflowClient(tracking.tracking_uri(p)); pre = tracking.registry_prefix(p); out = {}\n"
            "for k in sys.argv[1:]:\n"
            "    vs = c.search_model_versions(f\"name='{pre}-{k}'\")\n"
            "    al = {}\n"
            "    for a in ('champion', 'challenger'):\n"
            "        try: al[a] = c.get_model_version_by_alias(f'{pre}-{k}', a).version\n"
            "        except Exception: al[a] = None\n"
            "    out[k] = {'versions': sorted((v.version, v.tags.get('rlhf.registration') == 'complete') "
            "for v in vs), **al}\n"
            "print(json.dumps(out))")
    proc = subprocess.run([sys.executable, "-c", code, *KINDS], cwd=run_dir, env=_env(), capture_output=True,
                          text=True)
    return json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-500:]}


def weights(run_dir: Path) -> dict[str, str | None]:
    return {name: weights_hash(run_dir / rel) for name, rel in MODELS.items()}


def run_reference(project: Path, work: Path) -> dict:
    ref = work / "reference"
    fresh_copy(project, ref)
    t0 = time.perf_counter()
    if start(ref).wait() != 0:
        raise SystemExit(f"the uninterrupted flow failed; see {ref / 'flow.log'}")
    return {"seconds": time.perf_counter() - t0, "weights": weights(ref), "registry": registry(ref)}


def one_kill(project: Path, work: Path, i: int, reference: dict, rng: random.Random, stop_timeout: float,
             from_s: float = 0.0) -> dict:
    run_dir = work / f"kill_{i:03d}"
    fresh_copy(project, run_dir)
    delay = rng.uniform(from_s, reference["seconds"])
    proc = start(run_dir)
    outside: list[int] = []  # what runs outside the flow's process group at the kill (the stage under DVC)
    killed = sigkill_group_after(proc, delay, before=lambda: outside.extend(
        p for p in processes_in(run_dir) if _pgid(p) not in (None, proc.pid)))
    t0 = time.perf_counter()
    stage = stage_running(outside)
    while processes_in(run_dir) and time.perf_counter() - t0 < stop_timeout:
        time.sleep(0.1)
    stragglers = processes_in(run_dir)
    for pid in stragglers:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    stage_log = run_dir / ".rlhf" / "logs" / f"stage-{stage}.log"
    row = {"kill": i, "delay_s": round(delay, 1), "killed": killed, "stage_at_kill": stage,
           "processes_outside_the_flow_at_kill": len(outside),
           "seconds_until_they_stopped": round(time.perf_counter() - t0, 1), "stragglers": len(stragglers),
           "stage_said": stage_log.read_text().strip().splitlines()[-1][:300] if stage_log.exists() else None,
           "models_after_kill": model_states(run_dir)}
    rc = start(run_dir).wait()
    row["rerun_rc"] = rc
    if rc == 0:
        got, want = weights(run_dir), reference["weights"]
        reg = registry(run_dir)
        row |= {"identical_weights": {k: got[k] == want[k] for k in want if want[k]},
                "models_after_rerun": model_states(run_dir), "registry": reg,
                "registry_as_reference": _shape(reg) == _shape(reference["registry"])}
    return row


def _pgid(pid: int) -> int | None:
    try:
        return os.getpgid(pid)
    except ProcessLookupError:
        return None


def _shape(reg: dict) -> dict:
    """What must match the reference: per kind, how many versions, all complete, champion set or not."""
    return {k: (len(v["versions"]), all(c for _, c in v["versions"]), v["champion"] is not None)
            for k, v in reg.items() if isinstance(v, dict)}


def summarise(rows: list[dict]) -> str:
    killed = sum(r["killed"] for r in rows)
    ok = [r for r in rows if r.get("rerun_rc") == 0]
    states = [s for r in rows for s in r["models_after_kill"].values()]
    lines = ["| kills (during a stage) | stages stopped by themselves / stragglers | re-run finished | "
             "identical final weights (every model) | registry as the reference's | model dirs after the kill "
             "(absent / whole / partial) |", "|---|---|---|---|---|---|"]
    lines.append(f"| {killed} ({sum(r['stage_at_kill'] is not None for r in rows)}; +{len(rows) - killed} finished "
                 f"first) | {sum(r['stage_at_kill'] is not None and not r['stragglers'] for r in rows)} / "
                 f"{sum(r['stragglers'] for r in rows)} | {len(ok)} / {len(rows)} | "
                 f"{sum(all(r['identical_weights'].values()) for r in ok)} / {len(ok)} | "
                 f"{sum(r['registry_as_reference'] for r in ok)} / {len(ok)} | "
                 f"{states.count('absent')} / {states.count('whole')} / {states.count('partial')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--project", type=Path, required=True, help="a project checkout that has not run yet")
    ap.add_argument("--kills", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--stop-timeout", type=float, default=120.0, help="seconds the stages get to stop by themselves")
    ap.add_argument("--from-s", type=float, default=0.0, help="earliest kill, seconds after the start (e.g. past "
                                                              "the Prefect server's start-up)")
    ap.add_argument("--out", type=Path, required=True, help="JSONL of the kills; run directories beside it")
    a = ap.parse_args(argv)
    work = a.out.with_suffix("").resolve()
    work.mkdir(parents=True, exist_ok=True)
    project = a.project.resolve()
    reference = run_reference(project, work)
    print(json.dumps({"reference": reference}), flush=True)
    return run_kills(a.kills, a.seed, a.out, lambda i, rng: one_kill(project, work, i, reference, rng,
                                                                     a.stop_timeout, a.from_s), summarise)


if __name__ == "__main__":
    main()
