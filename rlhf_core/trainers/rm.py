"""Reward-model training on DeepSpeed: a reward model trained on preference pairs.

What it learns is the objective's (``rm.objective``, declared in ``rm_objectives.py``): a ``ValueHeadModel``'s
score at the last token, or DPO's implicit reward. Chosen and rejected rows (``prompt + response + EOS``) go
through the model in one ``[2B, T]`` batch. ``rm.loss: sequence`` (default): ``-log sigmoid(r_c - r_r - margin)``
on the scores; ``rm.loss: divergence``: DeepSpeed-Chat's per-token variant after the first differing token.
Evaluation on ``eval_pairs`` before and after: pairwise accuracy, mean chosen / rejected score, margin.
``rlhf stage rm`` reads ``data/prepared/{pairs,eval_pairs}.parquet``, ``models/base`` and (``rm.init_from: sft``)
``models/sft``; writes ``models/rm/``, ``metrics/rm.json``, ``plots/rm_accuracy.csv``; resumable checkpoints in
``checkpoints/rm/``. Runs in one process, or N under ``torchrun``; an ensemble's members and the judge can
train side by side in worker processes (``rm.parallel``, ``rm_parallel.py``).

With ``rm.judge`` the same trainer then fits a **judge** RM with the roles of the splits swapped: trained on
``eval_pairs`` (which the proxy RM never sees), evaluated on ``pairs`` (which the judge never sees), into
``models/judge/`` (``metrics/rm_judge.json``, ``plots/rm_judge_accuracy.csv``, ``checkpoints/rm_judge/``; its
logged metrics are prefixed ``judge.``). Off, ``models/judge`` holds only its meta file (a DVC output).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_core.algos import divergence_rm_loss, pairwise_rm_loss
from rlhf_core.config import Params, for_round
from rlhf_core.data.collate import PairData, collate_pairs, encode_sequences
from rlhf_core.engine import distributed as D
from rlhf_core.engine.loop import Hooks, LogFn, fit
from rlhf_core.engine.sampler import ResumableSampler
from rlhf_core.evaluation import shard_for_eval
from rlhf_core.models.loading import (
    base_model_source,
    import_architecture,
    load_training_tokenizer,
)
from rlhf_core.models.scorer import ENSEMBLE_FILE, MEMBERS_DIR, EnsembleScorer
from rlhf_core.models.value_head import ValueHeadModel
from rlhf_core.ops import paths
from rlhf_core.ops.atomic import write_json_atomic
from rlhf_core.ops.input_links import sync_input_links
from rlhf_core.ops.meta import write_meta_only
from rlhf_core.trainers.common import (
    build_engine,
    checkpoints_for,
    default_max_length,
    finish_stage,
    input_hashes,
    read_split,
    resume_or_start,
    run_metrics,
    stage_meta,
)
from rlhf_core.trainers.rm_external import adopt_external_rm
from rlhf_core.trainers.rm_objectives import OBJECTIVES, ScoreFn, head_scores
from rlhf_core.trainers.rm_parallel import fit_all
from rlhf_core.trainers.rm_rounds import round_training_pairs
from rlhf_core.trainers.rm_selection import best_of_n_check

STAGE = "rm"
PAIR_COLUMNS = ("id", "prompt", "chosen", "rejected")


def encode_pairs(tokenizer, rows: dict, max_length: int, source: str) -> PairData:
    chosen = encode_sequences(tokenizer, rows["prompt"], rows["chosen"], max_length, source, "rm.max_length",
                              rows["id"], keep_eos=True)
    rejected = encode_sequences(tokenizer, rows["prompt"], rows["rejected"], max_length, source, "rm.max_length",
                                rows["id"], keep_eos=True)
    return PairData(chosen, rejected)


def pooled_at(model, pad_token_id: int | None):
    """A value-head RM that scores at the token its saved checkpoint will be read at: transformers pools the
    rightmost id that is not the config's ``pad_token_id``, and ``save_value_model`` writes the tokenizer's."""
    if isinstance(model, ValueHeadModel) and pad_token_id is not None:
        model.pad_token_id = pad_token_id
    return model


def make_rm_loss(loss_kind: str, margin: float, score_fn: ScoreFn = head_scores):
    def rm_loss(engine, batch: dict) -> tuple[torch.Tensor, dict]:
        ids, mask = batch["input_ids"].to(engine.device), batch["attention_mask"].to(engine.device)
        if loss_kind == "divergence":
            out = engine(ids, mask)
            scores = out.scores
        else:
            scores = score_fn(engine, batch, engine.device)
        chosen, rejected = scores.chunk(2)
        loss, stats = pairwise_rm_loss(chosen.float(), rejected.float(), margin)
        if loss_kind == "divergence":
            vc, vr = out.values.chunk(2)
            ic, ir = ids.chunk(2)
            mc, mr = mask.chunk(2)
            loss = divergence_rm_loss(vc, vr, ic, ir, mc, mr, margin)
        return loss, {"tokens": mask.sum().float(), "accuracy": stats["accuracy"]}

    return rm_loss


@torch.no_grad()
def eval_pairs(model, data: PairData, batch_size: int, pad_id: int, device, margin: float = 0.0,
               score_fn: ScoreFn = head_scores) -> dict[str, float]:
    """Pairwise accuracy, mean chosen / rejected scores, mean margin and loss over ``data`` (all ranks), and
    ``score_std``: the std of the scores over every chosen and rejected response (an ensemble's scale);
    ``score_fn(model, batch, device) -> [2B]`` reads the scores (the objective's, ``rm_objectives``)."""
    was_training = model.training
    model.eval()
    idx, weight = shard_for_eval(len(data))
    sums = torch.zeros(7, dtype=torch.float64)  # correct, chosen, rejected, diff, loss, n, squared scores
    for i in range(0, len(idx), batch_size):
        batch = collate_pairs(data, idx[i:i + batch_size], pad_id)
        scores = score_fn(model, batch, device).double().cpu()
        c, r = scores.chunk(2)
        w = weight[i:i + batch_size].double()
        per_pair_loss = -torch.nn.functional.logsigmoid(c - r - margin)
        sums += torch.stack([((c > r).double() * w).sum(), (c * w).sum(), (r * w).sum(), ((c - r) * w).sum(),
                             (per_pair_loss * w).sum(), w.sum(), ((c ** 2 + r ** 2) * w).sum()])
    model.train(was_training)
    sums = D.all_reduce_sum(sums)
    n = float(sums[5].clamp(min=1))
    mean = float(sums[1] + sums[2]) / (2 * n)
    return {"accuracy": float(sums[0]) / n, "chosen_mean": float(sums[1]) / n, "rejected_mean": float(sums[2]) / n,
            "margin_mean": float(sums[3]) / n, "eval_loss": float(sums[4]) / n,
            "score_std": max(float(sums[6]) / (2 * n) - mean ** 2, 0.0) ** 0.5}


@dataclass(frozen=True)
class RMRole:
    """Which split trains and which judges a reward model, and where it goes."""

    stage: str  # names the checkpoints, metrics and plot files
    model_dir: Path
    trains_on_eval_split: bool
    member: int = 0  # rm.ensemble: the member's index (its seed is project.seed + member)


PROXY = RMRole(STAGE, paths.RM_MODEL, False)
JUDGE = RMRole(f"{STAGE}_judge", paths.JUDGE_MODEL, True)


def member_role(k: int) -> RMRole:
    """Ensemble member ``k >= 1``: the proxy's pairs and settings, into ``models/rm/members/<k>``."""
    return RMRole(f"{STAGE}_member{k}", paths.RM_MODEL / MEMBERS_DIR / str(k), False, member=k)


def train_rm(params: Params, root: str | Path = ".", log: LogFn | None = None, hooks: Hooks | None = None) -> dict:
    """Run reward-model training under ``root``: the proxy RM, the other ensemble members and (``rm.judge``)
    the judge, one after another or side by side (``rm.parallel``; ``hooks``, being in-process callbacks, keep
    them in this process). Returns the proxy RM's metrics (also ``metrics/rm.json``; the judge's are in
    ``metrics/rm_judge.json``)."""
    root, proxy = Path(root), for_round(params)
    if D.is_main():
        sync_input_links(params, root)  # inputs/rm: DVC's view of rm.external (ops.input_links)
    external = adopt_external_rm(proxy, root, log) if params.rm.external else None  # rm.external: no training
    jobs = [(proxy, PROXY, "")] if external is None else []
    jobs += [(member_params(proxy, k), member_role(k), f"member{k}.") for k in range(1, params.rm.ensemble)]
    jobs += [(params, JUDGE, "judge.")] if params.rm.judge else []

    results = fit_all(fit_reward_model, jobs, root, log, params.rm.parallel, params.compute.num_threads,
                      params.compute.stop_grace_s, hooks,
                      before_start=lambda: import_architecture(root / paths.BASE_MODEL)) if jobs else []
    metrics = external if external is not None else results[0]
    if params.rm.ensemble > 1:
        metrics = summarise_ensemble(proxy, root, results[:params.rm.ensemble], log)
    if params.rm.best_of_n:
        metrics = add_best_of_n(proxy, root, metrics, log)
    if not params.rm.judge and D.is_main():
        write_meta_only(root / paths.JUDGE_MODEL, {"stage": STAGE, "role": "judge", "judge": None,
                                                   "reason": "rm.judge is off"})
    return metrics


def add_best_of_n(params: Params, root: Path, metrics: dict, log: LogFn | None = None) -> dict:
    """``metrics`` with ``rm_selection.best_of_n_check``'s figures for the saved RM, rewritten to
    ``metrics/rm.json`` and logged. Every rank runs the check whole (no collective); the main one writes."""
    metrics = metrics | best_of_n_check(params, root)
    if D.is_main():
        write_json_atomic(root / paths.METRICS / f"{STAGE}.json", metrics)
        if log is not None:
            log({k: v for k, v in metrics.items() if k.startswith("best_of_n_")}, metrics.get("steps", 0))
    D.barrier()
    return metrics


def member_params(params: Params, k: int) -> Params:
    """Ensemble member ``k``'s params: seed ``project.seed + k`` (its head initialisation and batch order)."""
    return params.model_copy(update={"project": params.project.model_copy(update={"seed": params.project.seed + k})})


def summarise_ensemble(params: Params, root: Path, members: list[dict], log: LogFn | None = None) -> dict:
    """``models/rm/ensemble.json`` (every member's path, and its mean and std score over the held-out pairs,
    which standardise it in ``EnsembleScorer``) and the ensemble's held-out pairwise accuracy beside the
    members' in ``metrics/rm.json``. Returns the updated proxy metrics (member 0's).

    ``ensemble_accuracy`` is not quite held out: the same pairs set each member's scale, which weighs the
    members in the mean (the centres cancel in a pairwise comparison). The members' own accuracies are."""
    metrics = dict(members[0])
    if D.is_main():
        spec = [{"path": str(Path(member_role(k).model_dir).relative_to(paths.RM_MODEL)) if k else ".",
                 "seed": params.project.seed + k, "accuracy": m["accuracy"],
                 "center": (m["chosen_mean"] + m["rejected_mean"]) / 2, "scale": m["score_std"]}
                for k, m in enumerate(members)]
        rm_dir = root / paths.RM_MODEL
        write_json_atomic(rm_dir / ENSEMBLE_FILE, {"members": spec})
        evals = read_split(root, "pairs", eval_split=True, columns=PAIR_COLUMNS)
        scorer = EnsembleScorer.from_pretrained(rm_dir, batch_size=params.eval.batch_size)
        chosen = scorer.score_responses(evals["prompt"], evals["chosen"])
        rejected = scorer.score_responses(evals["prompt"], evals["rejected"])
        metrics |= {"ensemble_size": len(members), "ensemble_accuracy": float((chosen > rejected).float().mean()),
                    "member_accuracy": [m["accuracy"] for m in members]}
        write_json_atomic(root / paths.METRICS / f"{STAGE}.json", metrics)
        if log is not None:
            log({k: metrics[k] for k in ("ensemble_size", "ensemble_accuracy")}, 0)
    D.barrier()
    return metrics


def fit_reward_model(params: Params, root: Path, role: RMRole, log: LogFn | None = None,
                     hooks: Hooks | None = None, before_save: Callable[[int, str | None], None] | None = None) -> dict:
    """Train one reward model on ``role``'s split and evaluate it on the other; ``before_save(step,
    checkpoint)`` runs between the last checkpoint and the final save (``rm_parallel``: a member's save waits for
    the proxy's, which replaces ``models/rm`` whole)."""
    t_start = time.perf_counter()
    cfg, compute = params.rm, params.compute
    D.init_distributed()
    threads = D.set_num_threads(compute.num_threads)
    tokenizer = load_training_tokenizer(root, params)
    max_length = default_max_length(params, cfg.max_length)

    train_file, eval_file = (paths.prepared_file("pairs", role.trains_on_eval_split),
                             paths.prepared_file("pairs", not role.trains_on_eval_split))
    train = read_split(root, "pairs", eval_split=role.trains_on_eval_split, columns=PAIR_COLUMNS)
    evals = read_split(root, "pairs", eval_split=not role.trains_on_eval_split, columns=PAIR_COLUMNS)
    files = [paths.prepared_file("pairs"), paths.prepared_file("pairs", True)]
    n_round = params.feedback.round if not role.trains_on_eval_split else 0  # the judge never sees a round's pairs
    fresh = None
    if n_round:  # a feedback round: its new pairs plus a replay of all earlier ones
        train, fresh, round_files, replay_pool = round_training_pairs(root, params, train)
        files += round_files
        train_file = paths.round_dir(n_round) / "pairs.parquet"
    data = encode_pairs(tokenizer, train, max_length, str(train_file))
    eval_data = encode_pairs(tokenizer, evals, max_length, str(eval_file))

    init_kind, init_ref = cfg.init_from, paths.SFT_MODEL if cfg.init_from == "sft" else paths.BASE_MODEL
    if n_round and params.feedback.rm_init == "previous":
        init_kind, init_ref = "previous", paths.start_dir(Path("."), n_round, "rm")
        if role.member and (root / init_ref / MEMBERS_DIR / str(role.member)).is_dir():  # the same member's
            init_ref = init_ref / MEMBERS_DIR / str(role.member)
    init_source = str(init_ref) if init_kind != "base" else base_model_source(params, root)
    objective = OBJECTIVES[cfg.objective]
    objective.check(params, init_kind)
    if objective.targets is not None:
        data = objective.targets(data, train, tokenizer, cfg)
        eval_data = objective.targets(eval_data, evals, tokenizer, cfg)
    collate = objective.collate or collate_pairs
    plan, engine = build_engine(params, cfg, "rm.max_length", len(data),
                                lambda: pooled_at(objective.build(params, root, init_kind, init_ref),
                                                  tokenizer.pad_token_id), init_source, tokenizer,
                                max_length)
    score_fn = objective.scores(cfg)

    inputs = input_hashes(root, files, {"init_model": init_ref})
    ckpt = checkpoints_for(root, params, role.stage, cfg, inputs)
    pad_id = tokenizer.pad_token_id
    bs = params.eval.batch_size
    fresh_data = encode_pairs(tokenizer, fresh, max_length, str(train_file)) if fresh is not None else None

    def evaluate(d) -> dict:
        out = eval_pairs(engine.module, d, bs, pad_id, engine.device, cfg.margin, score_fn)
        if objective.evaluate is not None:
            out |= objective.evaluate(engine.module, d, bs, pad_id, engine.device)
        return out

    def initial() -> dict:
        """The starting model on the eval pairs and, in a round, on the round's new pairs (before training on
        them: how well the previous RM judges what the current policy writes)."""
        out = evaluate(eval_data)
        if fresh_data is not None:
            out["fresh_accuracy"] = eval_pairs(engine.module, fresh_data, bs, pad_id, engine.device, cfg.margin,
                                               score_fn)["accuracy"]
        return out

    state, resumed_from = resume_or_start(ckpt, engine, cfg.resume, initial, params.project.seed)
    if log is not None and D.is_main():
        log({"n_train_pairs": len(data), "total_steps": plan.total_steps, "resumed_from_step": resumed_from,
             "truncated": data.truncated, "threads": threads}, state.step)

    state = fit(engine, plan, ResumableSampler(plan, params.project.seed, D.rank()),
                lambda idx: collate(data, idx, pad_id),
                objective.loss(cfg) if objective.loss else make_rm_loss(cfg.loss, cfg.margin, score_fn),
                state, ckpt,
                log,
                save_every=cfg.save_every, log_every=cfg.log_every, hooks=hooks)

    after = evaluate(eval_data)
    before = state.extra["before"]
    metrics = {
        **{f"{k}_before": v for k, v in before.items()}, **after,
        "train_accuracy_last": state.curve[-1].get("accuracy") if state.curve else None,
        "n_train": len(data), "n_eval": len(eval_data),
        "truncated_train": data.truncated, "truncated_eval": eval_data.truncated,
        "loss_kind": cfg.loss, "objective": cfg.objective, "init_from": str(init_ref) if n_round else cfg.init_from,
        **({"round": n_round, "n_train_new": len(fresh["id"]), "n_train_replay": len(data) - len(fresh["id"]),
            "n_train_replay_pool": replay_pool,
            "fresh_pairs_accuracy_before": before["fresh_accuracy"]} if fresh is not None else {}),
        **run_metrics(state, resumed_from, engine, params, max_length),
    }
    meta = stage_meta(STAGE, params, inputs, init_from=str(init_ref), lora=compute.lora.enabled,
                      score=objective.describe(cfg), role="judge" if role == JUDGE else "proxy",
                      objective=cfg.objective,
                      trained_on=str(train_file), **({"ensemble_member": role.member} if role.member else {}))
    if before_save is not None:
        before_save(state.step, str(ckpt.latest_path()) if ckpt is not None else None)
    return finish_stage(root, role.stage, engine, root / role.model_dir,
                        objective.save(params, pad_id), tokenizer, meta,
                        metrics, (f"{role.stage}_accuracy.csv", ("step", "accuracy", "loss")), state, t_start, log,
                        params)
