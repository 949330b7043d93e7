"""The metrics of one RL iteration: named sums over this rank's buffer, all-reduced, then turned into means.

Sums, not means, are reduced so that ranks with different numbers of surviving rows and tokens weigh
correctly: ``score_mean = sum score / scored rows`` (every non-empty sample, including the uniform groups
that ``rlhf.grpo.drop_uniform_groups`` and the rows that ``rlhf.grpo.advantage: best`` keep out of training;
``reward_mean`` and ``kl`` cover the trained rows), a training statistic is ``sum (stat * tokens) / tokens``,
times are means over ranks. ``explained_variance = 1 - Var(R - V) / Var(R)`` over valid tokens.
"""

from __future__ import annotations

import math

import torch

from rlhf_core.engine import distributed as D
from rlhf_core.engine.loop import TrainState
from rlhf_core.evaluation import hacking_suspected
from rlhf_core.trainers.rlhf.experience import Experience, sampled_kl

TIMES = ("t_generate", "t_score", "t_train", "t_step")


def all_reduce_named(values: dict[str, float]) -> dict[str, float]:
    """Sum every named value over ranks in one all-reduce (all ranks must pass the same names)."""
    keys = sorted(values)
    total = D.all_reduce_sum(torch.tensor([float(values[k]) for k in keys], dtype=torch.float64))
    return dict(zip(keys, total.tolist(), strict=True))


def buffer_sums(exp: Experience, kl_metric: str) -> dict[str, float]:
    """This rank's sums over its experience buffer (rows, scores, token rewards, sampled KL, returns, values)."""
    mask = exp.action_mask.bool()
    kept = mask.any(dim=1)
    zero = torch.zeros(())
    scores = torch.where(kept, exp.scores, zero)
    seq_reward = torch.where(mask, exp.rewards, zero).sum(dim=1)
    info = exp.info
    sums = {k: float(info[k]) for k in ("rows", "empty", "no_eos", "length_sum", "correct", "group_std_sum",
                                        "groups", "t_generate", "t_score", "uniform", "uniform_groups",
                                        "unselected", "correct_trained", "candidates", "correct_candidates")}
    # score_mean / score_std cover every non-empty sample, trained on or dropped (a uniform group, not the pick)
    sums |= {"kept": float(kept.sum()),
             "score": float(scores.sum()) + info["idle_score"],
             "score_sq": float((scores ** 2).sum()) + info["idle_score_sq"],
             "scored": float(kept.sum()) + info["idle"],
             "reward": float(seq_reward.sum()), "reward_sq": float((seq_reward ** 2).sum()),
             "kl": float(sampled_kl(exp, kl_metric).sum())}
    if "empty_step" in info:  # process supervision: responses with an empty step, dropped
        sums["empty_step"] = float(info["empty_step"])
    if exp.values is not None and exp.returns is not None:
        ret = torch.where(mask, exp.returns, zero)
        diff = torch.where(mask, exp.returns - exp.values, zero)
        sums |= {"ret": float(ret.sum()), "ret_sq": float((ret ** 2).sum()), "diff": float(diff.sum()),
                 "diff_sq": float((diff ** 2).sum()), "n_val": float(mask.sum())}
    return sums


def _std(s: float, sq: float, n: float) -> float:
    return math.sqrt(max(sq / n - (s / n) ** 2, 0.0) * n / (n - 1)) if n > 1 else 0.0


def iteration_metrics(sums: dict[str, float], train: dict[str, float], world: int, judged: bool,
                      grouped: bool) -> dict[str, float]:
    """Means from the reduced ``sums`` (``buffer_sums`` + ``t_train``, ``t_step``) and ``train``
    (``{stat: sum of stat * tokens}`` + ``tokens``), as logged each iteration. ``judged``: the checker
    scored the samples (``judge_score``); ``grouped``: several samples per prompt (``group_reward_std``)."""
    s = sums
    kept, scored, rows = max(s["kept"], 1.0), max(s["scored"], 1.0), s["rows"]
    t = {k: s[k] / world for k in TIMES}
    m = {"score_mean": s["score"] / scored, "score_std": _std(s["score"], s["score_sq"], scored),
         "reward_mean": s["reward"] / kept, "reward_std": _std(s["reward"], s["reward_sq"], kept),
         "kl": s["kl"] / kept, "response_length": s["length_sum"] / rows, "eos_share": 1 - s["no_eos"] / rows,
         "no_eos_share": s["no_eos"] / rows, "empty_dropped": s["empty"], "uniform_dropped": s["uniform"],
         "unselected_dropped": s["unselected"],
         "no_eos": s["no_eos"], "rows": rows,
         **t, "samples_per_s": rows / t["t_step"] if t["t_step"] > 0 else 0.0}
    if "empty_step" in s:
        m["empty_step_dropped"] = s["empty_step"]
    if judged:  # the judge (checker) on the same sampled responses the proxy scored
        m["train_accuracy"] = m["judge_score"] = s["correct"] / rows
        # of the rows trained on: under grpo.advantage: best, how often the reward picks a right answer; and of
        # every row of their groups (a random pick's score), so their difference is what the reward's pick adds
        m["trained_judge_score"] = s["correct_trained"] / kept
        m["candidate_judge_score"] = s["correct_candidates"] / max(s["candidates"], 1.0)
    if grouped:
        m["group_reward_std"] = s["group_std_sum"] / max(s["groups"], 1.0)
        m["uniform_group_share"] = s["uniform_groups"] / max(s["groups"], 1.0)
    if s.get("n_val", 0.0) > 1:
        n = s["n_val"]
        var_r = s["ret_sq"] / n - (s["ret"] / n) ** 2
        var_d = s["diff_sq"] / n - (s["diff"] / n) ** 2
        m["explained_variance"] = 1 - var_d / var_r if var_r > 0 else float("nan")
    tokens = max(train["tokens"], 1.0)
    m |= {k: v / tokens for k, v in train.items() if k != "tokens"}
    return m


def heldout_summary(before: dict, final: dict, ema_eval: dict | None, kl_bound: float, judged: bool) -> dict:
    """The held-out results of ``metrics/rlhf.json``: SFT start (``before``) vs the trained actor, the KL bound."""
    return {
        "sft_accuracy": before.get("accuracy"), "accuracy": final.get("accuracy"),
        "accuracy_gain": (final["accuracy"] - before["accuracy"]) if "accuracy" in final and "accuracy" in before
        else None,
        "proxy_reward": final.get("proxy_reward"), "sft_proxy_reward": before.get("proxy_reward"),
        "reward_hacking_suspected": hacking_suspected(before, final) if judged else None,
        "kl_to_reference": final.get("kl_to_reference"), "kl_bound": kl_bound,
        "kl_within_bound": (final["kl_to_reference"] <= kl_bound) if final else None,
        "eos_share": final.get("eos_share"), "response_length": final.get("response_length"),
        "sft_eos_share": before.get("eos_share"), "ema_accuracy": ema_eval.get("accuracy") if ema_eval else None,
        # the judgements a run makes only where configured: the SFT start's (sft_*) beside the actor's
        **{key: value for k in ("step_accuracy", "seen_accuracy", "sampled_accuracy") if k in final
           for key, value in ((f"sft_{k}", before.get(k)), (k, final[k]))},
    }


def curve_summary(state: TrainState) -> dict:
    """The training curve of ``metrics/rlhf.json``: reward first/last (3-iteration means), time per phase, totals."""
    curve, totals = state.curve, state.extra["totals"]
    head, tail = curve[:3], curve[-3:]

    def avg(rows, key):
        return sum(r[key] for r in rows) / len(rows) if rows else None

    return {
        "steps": state.step, "train_reward_first": avg(head, "reward"), "train_reward_last": avg(tail, "reward"),
        "train_kl_last": avg(tail, "kl"), "samples_per_s": avg(curve, "samples_per_s"),
        **{f"time_{k}_s": sum(r[f"t_{k}"] for r in curve) for k in ("generate", "score", "train")},
        "train_time_s": round(state.train_time_s, 3), "empty_dropped_total": totals.get("empty_dropped", 0.0),
        "uniform_dropped_total": totals.get("uniform_dropped", 0.0),
        "unselected_dropped_total": totals.get("unselected_dropped", 0.0),
        "no_eos_total": totals.get("no_eos", 0.0), "rows_total": totals.get("rows", 0.0),
    }
