"""``python -m benchmarks.learning``: held-out learning figures over seeds, variants side by side.

A training-reward curve proves nothing (it is what reward hacking looks like), so this runner reports what
the reward does not control: the greedy held-out accuracy judged by the task's checker, over several seeds,
with the spread, next to the proxy reward and the KL. Every (variant, seed) pair is one ``rlhf stage rlhf``
process in its own run directory that links the base workspace's prepared data and models (the SFT start,
the RM), so all variants start from the identical SFT model, prompts and budget. Pairs run ``--jobs`` at a
time, interleaved across variants (on a shared machine a variant does not get the quiet slot).

``variant`` is ``NAME=KEY=VALUE[,KEY=VALUE...]`` (the overrides of ``rlhf stage -S``); ``NAME`` alone is the
base params. A NAME starting with ``trl`` runs TRL's ``GRPOTrainer`` on the same budget instead
(``benchmarks.trl_grpo``; needs the ``bench`` extra). Results go to ``OUT/results.jsonl`` (one line per
run, appended as runs finish, with the RM and SFT builds, the params digest and the overrides it ran with:
:func:`provenance`; a re-run skips the pairs already there) and
the summary table to stdout. ``--judge K`` also judges every run's actor and the SFT start on every held-out
question, greedy and ``K`` sampled answers each (``benchmarks.heldout``), and adds the gains over SFT paired
over the questions (``heldout_*`` keys; the SFT start's verdicts in ``OUT/heldout-sft.jsonl``). A run that
finished before it was judged is not judged by a re-run: give the re-run another ``--out``. A finished run's
resumable state (its ``checkpoints/``, some 570 MB per SmolLM2 run) is removed as soon as it has finished (and been
judged), since a re-run skips that pair; ``--keep-checkpoints`` keeps it, and a failed run always keeps it to resume
from.

    python -m benchmarks.learning --workspace W --seeds 1,2,3,4 --out runs \\
        ours_grpo=rlhf.algorithm=grpo trl
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from rlhf_core.ops import paths

LINKED = ("data", "models/sft", "models/rm", "models/base", "params.yaml")
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "CROSS_RANK",
                "CROSS_SIZE", "GROUP_RANK")
SFT_VERDICTS = "heldout-sft.jsonl"
REPORTED = ("sft_accuracy", "accuracy", "accuracy_gain", "proxy_reward", "sft_proxy_reward", "kl_to_reference",
            "eos_share", "train_time_s", "wall_time_s", "sft_step_accuracy", "step_accuracy", "sft_seen_accuracy",
            "seen_accuracy")


@dataclass(frozen=True)
class Variant:
    name: str
    overrides: tuple[str, ...] = ()

    @staticmethod
    def parse(spec: str) -> Variant:
        """``NAME`` or ``NAME=key=value,key=value``; a value may not contain ``,`` (use several variants)."""
        name, _, rest = spec.partition("=")
        if not name:
            raise ValueError(f"variant {spec!r}: empty name")
        return Variant(name, tuple(o for o in rest.split(",") if o) if rest else ())


def link_workspace(base: Path, run_dir: Path) -> None:
    """A run directory that reads the base workspace's data and models (symlinks) and writes its own outputs."""
    for rel in LINKED:
        src, dst = base / rel, run_dir / rel
        if not src.exists():
            if rel in ("models/rm", "models/base"):
                continue
            raise FileNotFoundError(f"{src}: the base workspace lacks it (run prepare, sft and rm there first)")
        dst.parent.mkdir(parents=True, exist_ok=True)
        if not dst.exists():
            dst.symlink_to(src.resolve(), target_is_directory=src.is_dir())


def weights_digest(model_dir: Path, also: tuple[str, ...] = ()) -> str | None:
    """12 hex digits of a sha256 over the ``*.safetensors`` files under ``model_dir`` and the files named in
    ``also``, each with its relative path; None when there are none. Metadata (timestamps) does not count, so an
    identical retraining (training is deterministic on one thread) gets the same digest and any other another."""
    from rlhf_core.ops.integrity import sha256_file

    files = sorted(p for p in model_dir.rglob("*") if p.suffix == ".safetensors" or p.name in also) \
        if model_dir.is_dir() else []
    if not files:
        return None
    digest = hashlib.sha256()
    for path in files:
        digest.update(f"{path.relative_to(model_dir)}\0{sha256_file(path)}\n".encode())
    return digest.hexdigest()[:12]


def rm_build(base: Path) -> str | None:
    """Which reward-model build the runs on ``base`` score with: :func:`weights_digest` of ``models/rm`` (the RM,
    or every ensemble member) and its ``ensemble.json``, so rows from several builds can be told apart."""
    from rlhf_core.models.scorer import ENSEMBLE_FILE

    return weights_digest(base / paths.RM_MODEL, (ENSEMBLE_FILE,))


def provenance(base: Path, extra: tuple[str, ...]) -> dict:
    """What every row of one invocation shares: the RM and SFT builds, a digest of the workspace's
    ``params.yaml``, and the ``-S`` overrides given to every variant (a row's own are in ``overrides``)."""
    from rlhf_core.ops.integrity import sha256_file

    params = base / "params.yaml"
    return {"rm_build": rm_build(base), "sft_build": weights_digest(base / paths.SFT_MODEL),
            "params_sha": sha256_file(params)[:12] if params.is_file() else None, "common_overrides": list(extra)}


def run_env(threads: int) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_ENV}  # each run is its own world of one
    return env | {"RLHF_TRACKING": "off", "OMP_NUM_THREADS": str(threads)}


def judge_command(workspace: Path, samples: int, rows: Path, model: Path) -> list[str]:
    return [sys.executable, "-m", "benchmarks.heldout", "judge", "--workspace", str(workspace), "--samples",
            str(samples), "--out", str(rows), str(model)]


def judge_sft(base: Path, out: Path, samples: int, threads: int) -> Path:
    """The SFT start's verdicts on every held-out question (``OUT/heldout-sft.jsonl``), judged once per ``OUT``."""
    rows = out / SFT_VERDICTS
    if not rows.exists():
        partial = rows.with_suffix(".partial")
        partial.unlink(missing_ok=True)
        with open(out / "heldout-sft.log", "w") as logf:
            subprocess.run(judge_command(base, samples, partial, base / paths.SFT_MODEL), env=run_env(threads),
                           stdout=logf, stderr=subprocess.STDOUT, check=True)
        partial.rename(rows)
    return rows


def check_sft_verdicts(out: Path, samples: int) -> None:
    """An ``OUT`` whose SFT start was judged with another number of sampled answers cannot pair with new runs."""
    from benchmarks.heldout import read_verdicts

    rows = out / SFT_VERDICTS
    for verdicts in (read_verdicts(rows) if rows.exists() else {}).values():
        if verdicts.sampled.shape[1] != samples:
            raise ValueError(f"{rows}: the SFT start was judged with {verdicts.sampled.shape[1]} sampled answers per "
                             f"question, not --judge {samples}; judge into another --out")


def judged(run_dir: Path, samples: int, threads: int, sft_judged: Future) -> dict:
    """``heldout_*``: the actor's greedy and sampled accuracy on every held-out question, and its gains over the
    SFT start paired over the questions (``benchmarks.heldout.compare``); where either judge or the pairing
    fails, ``heldout_error`` says why and where to look, and the run's own row is kept."""
    try:
        return _judged(run_dir, samples, threads, sft_judged)
    except subprocess.CalledProcessError as e:
        return {"heldout_error": f"the SFT start's judge failed (rc {e.returncode}): see "
                                 f"{run_dir.parent / 'heldout-sft.log'}"}
    except Exception as e:  # noqa: BLE001 -- a finished run's row must not be lost to its judge
        return {"heldout_error": f"{type(e).__name__}: {e}"}


def _judged(run_dir: Path, samples: int, threads: int, sft_judged: Future) -> dict:
    from benchmarks.heldout import compare, read_verdicts

    sft_rows = sft_judged.result()
    rows = run_dir / "heldout.jsonl"
    rows.unlink(missing_ok=True)
    with open(run_dir / "heldout.log", "w") as logf:
        rc = subprocess.run(judge_command(run_dir, samples, rows, run_dir / paths.ACTOR_MODEL), env=run_env(threads),
                            stdout=logf, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        return {"heldout_error": f"the actor's judge failed (rc {rc}): see {run_dir / 'heldout.log'}"}
    (actor,), (sft,) = read_verdicts(rows).values(), read_verdicts(sft_rows).values()
    summary, sft_summary = actor.summary(), sft.summary()
    out = {"heldout_questions": summary["questions"], "heldout_samples": samples,
           "heldout_greedy": summary["greedy_accuracy"], "heldout_sampled": summary.get("sampled_accuracy"),
           "heldout_sft_greedy": sft_summary["greedy_accuracy"],
           "heldout_sft_sampled": sft_summary.get("sampled_accuracy")}
    return out | {f"heldout_{k}": v for k, v in compare(sft, actor).items()}


def run_one(base: Path, out: Path, variant: Variant, seed: int, threads: int, extra: tuple[str, ...],
            judge_samples: int | None = None, sft_judged: Future | None = None, keep_checkpoints: bool = False) -> dict:
    run_dir = out / f"{variant.name}-s{seed}"
    run_dir.mkdir(parents=True, exist_ok=True)
    link_workspace(base, run_dir)
    env = run_env(threads)
    if variant.name.startswith("trl"):
        cmd = [sys.executable, "-m", "benchmarks.trl_grpo", "--seed", str(seed), "--threads", str(threads),
               *[a for o in (*extra, *variant.overrides) for a in ("-S", o)]]
    else:
        sets = [f"project.seed={seed}", f"compute.num_threads={threads}", *extra, *variant.overrides]
        cmd = [sys.executable, "-m", "rlhf_core.cli", "stage", "rlhf", *[a for o in sets for a in ("-S", o)]]
    t0 = time.perf_counter()
    with open(run_dir / "run.log", "w") as logf:
        rc = subprocess.run(cmd, cwd=run_dir, env=env, stdout=logf, stderr=subprocess.STDOUT).returncode
    row = {"variant": variant.name, "seed": seed, "overrides": list(variant.overrides), "rc": rc,
           "command_wall_s": round(time.perf_counter() - t0, 1)}
    metrics_file = run_dir / "metrics" / "rlhf.json"
    if rc == 0 and metrics_file.exists():
        m = json.loads(metrics_file.read_text())
        row |= {k: m.get(k) for k in REPORTED}
        if judge_samples is not None:
            row |= judged(run_dir, judge_samples, threads, sft_judged)
        if not keep_checkpoints:
            shutil.rmtree(run_dir / paths.CHECKPOINTS, ignore_errors=True)
    return row


def mean_spread(values: list[float]) -> tuple[float, float, float, float]:
    """(mean, sample std, min, max)."""
    n = len(values)
    mean = sum(values) / n
    std = math.sqrt(sum((v - mean) ** 2 for v in values) / (n - 1)) if n > 1 else 0.0
    return mean, std, min(values), max(values)


def summarise(rows: list[dict]) -> list[dict]:
    """One line per variant: held-out accuracy mean/std/min/max over seeds, mean gain, proxy, KL, time."""
    out = []
    for name in dict.fromkeys(r["variant"] for r in rows):
        ok = [r for r in rows if r["variant"] == name and r["rc"] == 0 and r.get("accuracy") is not None]
        if not ok:
            out.append({"variant": name, "runs": 0, "failed": sum(r["variant"] == name for r in rows)})
            continue
        acc = mean_spread([100 * r["accuracy"] for r in ok])
        line = {"variant": name, "runs": len(ok), "acc_mean": acc[0], "acc_std": acc[1], "acc_min": acc[2],
                "acc_max": acc[3], "seeds": [r["seed"] for r in ok],
                "acc_by_seed": [round(100 * r["accuracy"], 1) for r in ok]}
        for key in ("sft_accuracy", "accuracy_gain", "proxy_reward", "sft_proxy_reward", "kl_to_reference",
                    "train_time_s", "sft_step_accuracy", "step_accuracy"):
            vals = [r[key] for r in ok if r.get(key) is not None]
            if vals:
                line[key] = sum(vals) / len(vals) * (1 if key in ("proxy_reward", "sft_proxy_reward",
                                                                   "kl_to_reference", "train_time_s") else 100)
        out.append(line | judged_summary(ok))
    return out


def judged_summary(rows: list[dict]) -> dict:
    """Over the seeds judged by ``--judge``: the mean and the standard error over seeds (std / sqrt(n)) of the
    greedy and sampled gains over SFT on every held-out question, in points; the mean flips."""
    rows = [r for r in rows if r.get("heldout_greedy_gain") is not None]
    if not rows:
        return {}
    out = {"judged": len(rows), "heldout_questions": rows[0]["heldout_questions"],
           "heldout_sft_greedy": 100 * rows[0]["heldout_sft_greedy"]}
    for key in ("heldout_greedy", "heldout_greedy_gain", "heldout_sampled_gain"):
        vals = [100 * r[key] for r in rows if r.get(key) is not None]
        if vals:
            mean, std, _, _ = mean_spread(vals)
            out[key], out[f"{key}_se"] = mean, std / math.sqrt(len(vals)) if len(vals) > 1 else None
    out["heldout_flips"] = (sum(r["heldout_right_to_wrong"] for r in rows) / len(rows),
                            sum(r["heldout_wrong_to_right"] for r in rows) / len(rows))
    return out


def _gain(line: dict, key: str) -> str:
    """``+1.0 ± 0.5`` (mean ± SE over seeds), ``± — (1 seed)`` where one seed gives no spread, ``—`` without."""
    if line.get(key) is None:
        return "—"
    se = line.get(f"{key}_se")
    return f"{line[key]:+.1f} ± {'— (1 seed)' if se is None else f'{se:.1f}'}"


def render(summary: list[dict]) -> str:
    head = ("| variant | runs | held-out acc. mean ± std (min-max) | per seed | gain | proxy (SFT -> actor) | KL | "
            "train s | step acc. (SFT -> actor) |")
    lines = [head, "|" + "---|" * 9]

    def f(x, p=1):
        return "—" if x is None else f"{x:.{p}f}"

    for s in summary:
        if not s["runs"]:
            lines.append(f"| {s['variant']} | 0 ({s['failed']} failed) | | | | | | | |")
            continue
        proxy = f"{f(s.get('sft_proxy_reward'), 2)} -> {f(s.get('proxy_reward'), 2)}"
        lines.append(f"| {s['variant']} | {s['runs']} | {s['acc_mean']:.1f} ± {s['acc_std']:.1f} "
                     f"({s['acc_min']:.1f}-{s['acc_max']:.1f}) | {' / '.join(map(str, s['acc_by_seed']))} | "
                     f"{f(s.get('accuracy_gain'))} | {proxy} | {f(s.get('kl_to_reference'), 2)} | "
                     f"{f(s.get('train_time_s'), 0)} | "
                     f"{f(s.get('sft_step_accuracy'))} -> {f(s.get('step_accuracy'))} |")
    judged = [s for s in summary if s.get("judged")]
    if judged:
        lines += ["", "| variant | judged | every held-out question: greedy (SFT) | greedy gain ± SE over seeds | "
                      "sampled gain ± SE over seeds | flips right->wrong / wrong->right |", "|" + "---|" * 6]
        for s in judged:
            greedy, sampled = (_gain(s, key) for key in ("heldout_greedy_gain", "heldout_sampled_gain"))
            lines.append(f"| {s['variant']} | {s['judged']} x {s['heldout_questions']} | {s['heldout_greedy']:.1f} "
                         f"({s['heldout_sft_greedy']:.1f}) | {greedy} | {sampled} | {s['heldout_flips'][0]:.1f} / "
                         f"{s['heldout_flips'][1]:.1f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("variants", nargs="+", help="NAME or NAME=key=value,key=value (or `trl`)")
    ap.add_argument("--workspace", type=Path, required=True, help="base workspace with data/prepared, models/sft|rm")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--seeds", default="1,2,3")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per run")
    ap.add_argument("-S", "--set", dest="extra", action="append", default=[], help="override for every variant")
    ap.add_argument("--judge", type=int, default=None, metavar="K",
                    help="judge every actor and the SFT start on every held-out question, greedy and K sampled "
                         "answers each, paired over the questions (benchmarks.heldout)")
    ap.add_argument("--keep-checkpoints", action="store_true",
                    help="keep a finished run's checkpoints/ (removed by default: a re-run skips finished pairs)")
    a = ap.parse_args(argv)
    variants = [Variant.parse(v) for v in a.variants]
    seeds = [int(s) for s in a.seeds.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    results = a.out / "results.jsonl"
    done = [json.loads(line) for line in results.read_text().splitlines()] if results.exists() else []
    have = {(r["variant"], r["seed"]) for r in done if r["rc"] == 0}
    todo = [(v, s) for s in seeds for v in variants if (v.name, s) not in have]
    base, out, extra = a.workspace.resolve(), a.out.resolve(), tuple(a.extra)
    if a.judge is not None:
        check_sft_verdicts(out, a.judge)
    shared = provenance(base, extra)  # one workspace: hashed once, named on every row
    with ThreadPoolExecutor(max_workers=a.jobs) as pool:
        sft_judged = pool.submit(judge_sft, base, out, a.judge, a.threads) if a.judge is not None and todo else None
        futures = [pool.submit(run_one, base, out, v, s, a.threads, extra, a.judge, sft_judged, a.keep_checkpoints)
                   for v, s in todo]
        for fut in futures:
            row = fut.result() | shared
            with open(results, "a") as fh:
                fh.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    rows = [json.loads(line) for line in results.read_text().splitlines()]
    rows = [r for r in rows if any(r["variant"] == v.name for v in variants) and r["seed"] in seeds]
    print(render(summarise(rows)))


if __name__ == "__main__":
    main()
