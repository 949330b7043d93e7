"""``python -m benchmarks.kill_register``: SIGKILL ``rlhf register`` at random moments, re-run it, check
the registry.

For a workspace holding trained models (``models/actor``, ``models/critic``, ``models/rm``) and an MLflow
server (``--tracking-uri``, a real one: the registry's own behaviour is what is measured):

1. the reference: ``rlhf register`` uninterrupted under its own registry prefix (its wall time ``T``);
2. ``--kills`` times, each under a fresh prefix: ``rlhf register`` in its own process group, SIGKILLed after a
   delay drawn uniformly in ``0 .. T`` (start-up, loading, uploading artifacts, creating versions, tagging,
   aliases), then
   * what the kill left: per kind, each version, whether it carries ``rlhf.registration=complete``, and whether
     its files are whole (downloaded from the registry: a reward model's or critic's copy of the model directory
     checks out against its ``rlhf_manifest.json``; the actor's weights equal the workspace actor's, tensor by
     tensor). A version whose files are not whole would be a defect;
   * the re-run to the end: per kind exactly one version (a doubled one would be a defect), complete, whole,
     and ``challenger`` on it.

One JSON line per kill goes to ``--out``, a summary table to stdout.

    mlflow server --backend-store-uri sqlite:///k/mlflow.db --default-artifact-root k/artifacts --port 5055 &
    python -m benchmarks.kill_register --workspace W --tracking-uri http://127.0.0.1:5055 --kills 10 \\
        --out k/kills-register.jsonl
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from benchmarks.kill_campaign import run_kills, sigkill_group_after

KINDS = {"actor": "models/actor", "critic": "models/critic", "reward": "models/rm"}


def run_dir_for(base: Path, run_dir: Path, prefix: str) -> list[str]:
    """``run_dir`` with copies of the workspace's models and a params.yaml registering under ``prefix``; returns
    the kinds present."""
    (run_dir / "models").mkdir(parents=True, exist_ok=True)
    kinds = []
    for kind, rel in KINDS.items():
        if (base / rel / "config.json").is_file():
            if not (run_dir / rel).exists():  # a copy: MLflow refuses artifacts behind a symlink
                shutil.copytree(base / rel, run_dir / rel)
            kinds.append(kind)
    params = yaml.safe_load((base / "params.yaml").read_text())
    params.setdefault("tracking", {})["registry_prefix"] = prefix
    (run_dir / "params.yaml").write_text(yaml.safe_dump(params))
    return kinds


def start(run_dir: Path, uri: str) -> subprocess.Popen:
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri}
    with open(run_dir / "register.log", "a") as log:
        return subprocess.Popen([sys.executable, "-m", "flows.cli", "register"], cwd=run_dir, env=env, stdout=log,
                                stderr=subprocess.STDOUT, start_new_session=True)


def files_whole(kind: str, version, workspace: Path) -> bool:
    """Download the version's files; whole when the model directory inside checks out (reward, critic) or the
    actor's weights equal the workspace actor's."""
    import mlflow
    import torch
    from safetensors.torch import load_file

    from rlhf_core.ops.integrity import MODEL_MANIFEST, check_manifest

    with tempfile.TemporaryDirectory() as tmp:
        try:
            local = Path(mlflow.artifacts.download_artifacts(f"models:/{version.name}/{version.version}", dst_path=tmp))
        except Exception:  # noqa: BLE001 - any failure to fetch the files means they are not whole
            return False
        if kind != "actor":
            manifests = list(local.rglob(MODEL_MANIFEST))
            return len(manifests) == 1 and check_manifest(manifests[0].parent, MODEL_MANIFEST) is None
        want = {}
        for f in sorted((workspace / KINDS["actor"]).glob("*.safetensors")):
            want |= load_file(f)
        got = {}
        for f in sorted(local.rglob("*.safetensors")):
            try:
                got |= load_file(f)
            except Exception:  # noqa: BLE001 - a truncated or garbled file
                return False
        shared = set(want) & set(got)
        return bool(shared) and shared == set(want) and all(torch.equal(want[k], got[k]) for k in shared)


def registry_state(prefix: str, kinds: list[str], workspace: Path) -> dict:
    """Per kind: its versions (number, complete tag, files whole) and the version ``challenger`` names."""
    from mlflow import MlflowClient
    from mlflow.exceptions import MlflowException

    client = MlflowClient()
    state = {}
    for kind in kinds:
        name = f"{prefix}-{kind}"
        try:
            versions = client.search_model_versions(f"name='{name}'")
        except MlflowException:
            versions = []
        try:
            challenger = client.get_model_version_by_alias(name, "challenger").version
        except MlflowException:
            challenger = None
        state[kind] = {"versions": [{"version": v.version, "complete": v.tags.get("rlhf.registration") == "complete",
                                     "files_whole": files_whole(kind, v, workspace)}
                                    for v in sorted(versions, key=lambda v: int(v.version))],
                       "challenger": challenger}
    return state


def one_kill(base: Path, out: Path, i: int, uri: str, seconds: float, rng: random.Random, tag: str) -> dict:
    prefix = f"kill-{tag}-{i:03d}"
    run_dir = out / prefix
    kinds = run_dir_for(base, run_dir, prefix)
    delay = rng.uniform(0.0, seconds)
    proc = start(run_dir, uri)
    killed = sigkill_group_after(proc, delay)
    after_kill = registry_state(prefix, kinds, base)
    rc = start(run_dir, uri).wait()
    after = registry_state(prefix, kinds, base)
    return {"kill": i, "delay_s": round(delay, 2), "killed": killed, "rerun_rc": rc,
            "after_kill": after_kill, "after_rerun": after,
            "incomplete_files_after_kill": sum(not v["files_whole"] for s in after_kill.values()
                                               for v in s["versions"]),
            "one_version_each": all(len(s["versions"]) == 1 for s in after.values()),
            "all_complete_and_whole": all(v["complete"] and v["files_whole"] for s in after.values()
                                          for v in s["versions"]),
            "challenger_on_it": all(s["versions"] and s["challenger"] == s["versions"][-1]["version"]
                                    for s in after.values())}


def summarise(rows: list[dict]) -> str:
    killed = sum(r["killed"] for r in rows)
    partial_versions = sum(len(s["versions"]) for r in rows for s in r["after_kill"].values())
    lines = ["| kills | re-run finished | versions left by the kill (incomplete files) | one version per kind after "
             "the re-run | all complete and whole | challenger on it |", "|---|---|---|---|---|---|"]
    lines.append(f"| {killed} (+{len(rows) - killed} finished first) | "
                 f"{sum(r['rerun_rc'] == 0 for r in rows)} / {len(rows)} | "
                 f"{partial_versions} ({sum(r['incomplete_files_after_kill'] for r in rows)}) | "
                 f"{sum(r['one_version_each'] for r in rows)} / {len(rows)} | "
                 f"{sum(r['all_complete_and_whole'] for r in rows)} / {len(rows)} | "
                 f"{sum(r['challenger_on_it'] for r in rows)} / {len(rows)} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workspace", type=Path, required=True, help="holds models/actor, models/critic, models/rm")
    ap.add_argument("--tracking-uri", required=True, help="a running MLflow server")
    ap.add_argument("--kills", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, required=True, help="JSONL of the kills; run directories beside it")
    a = ap.parse_args(argv)
    os.environ["MLFLOW_TRACKING_URI"] = a.tracking_uri
    work = a.out.with_suffix("")
    work.mkdir(parents=True, exist_ok=True)
    base = a.workspace.resolve()
    tag = f"{a.seed}-{int(time.time())}"
    ref_dir = work / f"reference-{tag}"
    kinds = run_dir_for(base, ref_dir, f"reference-{tag}")
    t0 = time.perf_counter()
    if start(ref_dir, a.tracking_uri).wait() != 0:
        raise SystemExit(f"the uninterrupted registration failed; see {ref_dir / 'register.log'}")
    seconds = time.perf_counter() - t0
    print(json.dumps({"reference": {"seconds": round(seconds, 1), "kinds": kinds}}), flush=True)
    return run_kills(a.kills, a.seed, a.out, lambda i, rng: one_kill(base, work, i, a.tracking_uri, seconds, rng,
                                                                     tag), summarise)


if __name__ == "__main__":
    main()
