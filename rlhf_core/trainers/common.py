"""Pieces the SFT and RM trainers share: reading splits, fingerprints, resume-or-start, eval sharding, outputs."""

from __future__ import annotations

import csv
import functools
import io
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import torch

from rlhf_core.config import EpochConfig, OptimConfig, Params
from rlhf_core.data.readers import DataError
from rlhf_core.engine import distributed as D
from rlhf_core.engine.checkpoint import CheckpointManager
from rlhf_core.engine.engine import TrainEngine, model_init_context
from rlhf_core.engine.errors import TrainingInputError
from rlhf_core.engine.loop import LogFn, TrainState
from rlhf_core.engine.sampler import StepPlan
from rlhf_core.models.loading import check_vocab_fits, prepare_for_training
from rlhf_core.ops import paths
from rlhf_core.ops.atomic import commit_dir, make_temp_dir, write_json_atomic, write_text_atomic
from rlhf_core.ops.integrity import seal_model_dir
from rlhf_core.ops.meta import build_meta, dir_sha256, file_sha256, write_meta
from rlhf_core.ops.model_card import CARD_FILE, render_model_card

# Keys of a stage section that do not change what is trained (excluded from the resume fingerprint).
_NON_TRAINING_KEYS = ("save_every", "log_every", "resume", "keep_checkpoints")


def read_prepared_table(root: str | Path, rel: Path):
    """``data/prepared/<file>`` as a pyarrow Table. A file that is not readable parquet (truncated, overwritten),
    or that parses but no longer has the sha256 prepare recorded for it in ``data/prepared/manifest.json`` (a
    flipped bit inside a value), is a ``DataError`` naming it and the fix, never read as data. Files the
    manifest does not list (or a workspace without one) are read unchecked."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    path = Path(root) / rel
    if not path.exists():
        raise DataError(f"{rel}: not found; run `rlhf stage prepare` first")
    fix = (f"restore it with `rm {rel} && dvc checkout {paths.PREPARED}` (`rlhf cache verify` checks DVC's cache) "
           "or re-run `rlhf stage prepare`")
    try:
        table = pq.read_table(path)
    except (pa.ArrowInvalid, OSError) as err:
        raise DataError(f"{rel}: not a readable parquet file ({err}); {fix}") from None
    want = _prepared_hashes(Path(root)).get(Path(rel).name) if Path(rel).parent == paths.PREPARED else None
    if want is not None and _sha256_once(path) != want:
        raise DataError(f"{rel}: sha256 differs from the one {paths.MANIFEST} recorded when prepare wrote it "
                        f"(corrupted or edited since: it still parses, so it would train on altered rows); {fix}")
    return table


def _prepared_hashes(root: Path) -> dict[str, str]:
    """``hashes`` of ``data/prepared/manifest.json`` (file name -> sha256); empty when there is no manifest."""
    manifest = root / paths.MANIFEST
    if not manifest.exists():
        return {}
    try:
        return dict(json.loads(manifest.read_text())["hashes"])
    except (ValueError, KeyError, TypeError) as err:
        raise DataError(f"{paths.MANIFEST}: unreadable ({err}); re-run `rlhf stage prepare`") from None


@functools.cache
def _sha256_of(path: str, size: int, mtime_ns: int) -> str:
    return file_sha256(Path(path))


def _sha256_once(path: Path) -> str:
    """sha256 of ``path``, hashed once per process while its size and mtime stay the same (stages read a split
    several times)."""
    st = path.stat()
    return _sha256_of(str(path.resolve()), st.st_size, st.st_mtime_ns)


def read_split(root: str | Path, phase: str, eval_split: bool = False, columns: tuple[str, ...] = ()) -> dict:
    """Columns of ``data/prepared/[eval_]<phase>.parquet`` as lists (``read_prepared_table``: checked against the
    prepare manifest); a missing, corrupted or empty file is an error."""
    rel = paths.prepared_file(phase, eval_split)
    table = read_prepared_table(root, rel)
    missing = [c for c in columns if c not in table.column_names]
    if missing:
        raise DataError(f"{rel}: missing column(s) {missing}")
    if table.num_rows == 0:
        raise DataError(f"{rel}: empty split (0 rows); nothing to train or evaluate on — check the data and "
                        "re-run `rlhf stage prepare`")
    return {c: table.column(c).to_pylist() for c in (columns or table.column_names)}


def input_hashes(root: str | Path, files: list[Path], model_dirs: dict[str, str | Path]) -> dict[str, str]:
    """sha256 of the data files (hashed once per process with ``read_prepared_table``'s check) and of the init
    model (directory hash, or the HF id when remote)."""
    root = Path(root)
    out = {str(f): _sha256_once(root / f) for f in files}
    for name, src in model_dirs.items():
        p = Path(src) if Path(src).is_absolute() else root / src
        if p.is_dir():
            out[name] = dir_sha256(p)
        elif p.is_file():
            out[name] = file_sha256(p)
        else:
            out[name] = f"hf:{src}"
    return out


def fingerprint(params: Params, stage: str, section: OptimConfig, inputs: dict[str, str], ignore: tuple[str, ...] = (),
                **extra) -> dict:
    """What a checkpoint belongs to: a resumed run must train the same thing on the same data and world.

    The section's keys that do not change what is trained (``_NON_TRAINING_KEYS`` and ``ignore``) and the
    thread count are left out; ``extra`` adds what else the checkpointed state depends on.
    """
    sec = section.model_dump(mode="json", exclude=set(_NON_TRAINING_KEYS) | set(ignore))
    return {"stage": stage, "seed": params.project.seed, "section": sec,
            "model": params.model.model_dump(mode="json"),
            "compute": params.compute.model_dump(mode="json", exclude={"num_threads", "stop_grace_s"}),
            "data_limits": [params.data.max_prompt_len, params.data.max_response_len],
            "inputs": inputs, "world_size": D.world_size(), **extra}


def default_max_length(params: Params, value: int | None) -> int:
    return value or params.data.max_prompt_len + params.data.max_response_len + 2


def check_max_length(model, max_length: int, key: str) -> None:
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and max_length > limit:
        raise TrainingInputError(f"{key} is {max_length} but the model's max_position_embeddings is {limit}; "
                                 f"lower {key} (or data.max_prompt_len / data.max_response_len)")


def write_curve(path: Path, rows: list[dict], columns: tuple[str, ...]) -> None:
    """A DVC plot CSV, written atomically."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=list(columns), extrasaction="ignore", lineterminator="\n")
    w.writeheader()
    w.writerows(rows)
    write_text_atomic(path, buf.getvalue())


def save_final(engine: TrainEngine, target: Path, save_fn: Callable, tokenizer, meta: dict,
               card: str | None = None) -> None:
    """All ranks: gather the model; rank 0 writes model + tokenizer + ``rlhf_meta.json`` (+ the model card
    ``README.md``) and, last, its manifest ``rlhf_manifest.json`` into a temp dir next to ``target`` and renames
    it into place (a crash never leaves a half-written model; a later loss of a file is named at load)."""
    tmp = D.broadcast_object(str(make_temp_dir(target)) if D.is_main() else None)
    try:
        engine.save_model(tmp, save_fn)
        if D.is_main():
            tokenizer.save_pretrained(tmp)
            write_meta(tmp, meta)
            if card is not None:
                write_text_atomic(Path(tmp) / CARD_FILE, card)
            seal_model_dir(Path(tmp))
            commit_dir(tmp, target)
    finally:
        if D.is_main() and Path(tmp).exists():
            shutil.rmtree(tmp, ignore_errors=True)
        D.barrier()


def write_outputs(root: Path, stage: str, metrics: dict, curve_name: str, curve: list[dict],
                  columns: tuple[str, ...]) -> None:
    if D.is_main():
        write_json_atomic(root / paths.METRICS / f"{stage}.json", metrics)
        write_curve(root / paths.PLOTS / curve_name, curve, columns)


def stage_meta(stage: str, params: Params, inputs: dict[str, str], **extra) -> dict:
    return build_meta(stage, params.section_hash("project", "data", "model", "compute", stage), inputs, **extra)


def build_engine(params: Params, section: EpochConfig, key: str, n_rows: int, build_model: Callable, init_source: str,
                 tokenizer, max_length: int) -> tuple[StepPlan, TrainEngine]:
    """The step plan over ``n_rows`` and a DeepSpeed engine around ``build_model()`` (built under ZeRO-3's init
    context when used), after checking that the tokenizer fits the model's vocab and ``max_length`` (the
    ``key`` named in the error) fits its positions."""
    compute = params.compute
    plan = StepPlan(n_rows, section.micro_batch_size, section.grad_accum, D.world_size(), section.epochs,
                    section.max_steps)
    with model_init_context(compute, section):
        model = build_model()
    check_vocab_fits(tokenizer, model, init_source)
    check_max_length(model, max_length, key)
    model = prepare_for_training(model, compute, params.project.seed)
    return plan, TrainEngine(model, compute, section, plan.total_steps)


def checkpoints_for(root: Path, params: Params, stage: str, section: OptimConfig,
                    inputs: dict[str, str]) -> CheckpointManager:
    """``checkpoints/<stage>/``, keyed by what the run trains (``fingerprint``)."""
    return CheckpointManager(root / paths.CHECKPOINTS / stage, fingerprint(params, stage, section, inputs),
                             section.keep_checkpoints)


def resume_or_start(ckpt: CheckpointManager, engine: TrainEngine, resume: bool, evaluate_initial: Callable[[], dict],
                    seed: int) -> tuple[TrainState, int]:
    """Continue from the newest matching checkpoint, or start fresh: evaluate the initial model (kept in
    ``state.extra["before"]`` so a resumed run still reports it) and seed this rank's RNG.
    Returns the state and the step it resumed from (0 when fresh)."""
    tag = ckpt.prepare(resume)
    if tag is not None:
        state = TrainState.from_json(ckpt.load(engine, tag))
        return state, state.step
    state = TrainState()
    state.extra["before"] = evaluate_initial()
    torch.manual_seed(seed + 17 * D.rank())
    return state, 0


def run_metrics(state: TrainState, resumed_from: int, engine: TrainEngine, params: Params, max_length: int) -> dict:
    """The bookkeeping metrics every training stage reports."""
    curve = state.curve
    return {
        "train_loss_first": curve[0]["loss"] if curve else None,
        "train_loss_last": curve[-1]["loss"] if curve else None,
        "steps": state.step, "resumed_from_step": resumed_from, "tokens": state.tokens,
        "train_time_s": round(state.train_time_s, 3),
        "tokens_per_s": state.tokens / state.train_time_s if state.train_time_s else 0.0,
        "world_size": D.world_size(), "zero_stage": params.compute.zero_stage, "precision": engine.precision,
        "max_length": max_length,
    }


def finish_stage(root: Path, stage: str, engine: TrainEngine, model_dir: Path, save_fn: Callable, tokenizer,
                 meta: dict, metrics: dict, curve: tuple[str, tuple[str, ...]], state: TrainState, t_start: float,
                 log: LogFn | None, params: Params) -> dict:
    """Save the final model atomically with its model card, then write ``metrics/<stage>.json`` and the curve
    CSV, and log the numeric metrics; ``metrics`` gains ``wall_time_s``."""
    save_final(engine, model_dir, save_fn, tokenizer, meta,
               card=render_model_card(meta, params, metrics))
    metrics["wall_time_s"] = round(time.perf_counter() - t_start, 2)
    write_outputs(root, stage, metrics, curve[0], state.curve, curve[1])
    if log is not None and D.is_main():
        log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, state.step)
    return metrics
