"""``rlhf stage evaluate``: candidate actor vs SFT reference vs current champion, on the same prompts.

Every model answers the same held-out prompts (``eval_prompts``) with the same decoding settings
(``eval.*``) and is scored twice:

* the **proxy**: the reward the actor was trained against (``rlhf.reward_fns``, e.g. the RM): what RL
  optimised, so it can rise while the answers get worse;
* the **judge**: a measure the training reward does not control (``eval.judge``): the task's checker where
  the prompts carry answers (the score is the exact-answer accuracy), else a judge reward model
  (``eval.judge_model``) trained on pairs the proxy never saw (the gold-vs-proxy setup of reward
  over-optimisation studies), else none.

Per model: ``reward_mean`` (proxy), ``judge_mean``, ``accuracy`` when prompts carry answers (and
``step_accuracy`` on the multi-step task: ``rewards.multistep.step_accuracy``), KL to the
reference, response length and the share of responses that ended with EOS. Win rates compare per-prompt
judge scores (proxy rewards without a judge; a tie counts one half). Writes ``reports/eval.json`` (read by
the gate), ``reports/eval_answers.json`` (every prompt's answers and scores per model; logged as an MLflow
table) and ``metrics/evaluate.json``.

KL to the reference is exact per token given each prefix and summed over the
response: ``mean_i sum_t mask_it KL(pi(.|x_i, y_i<t) || pi_ref(.|x_i, y_i<t))``
(non-negative whatever the decoding, unlike a sampled log-ratio).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from rlhf_core.config import Params
from rlhf_core.data.collate import encode_prompts
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.evaluation import HeldOut, answer_batches, sequence_kl
from rlhf_core.models import load_causal_lm
from rlhf_core.ops import paths, tracking
from rlhf_core.ops.atomic import write_json_atomic
from rlhf_core.ops.meta import dir_sha256
from rlhf_core.rewards import get_checker
from rlhf_core.rewards.multistep import step_accuracy
from rlhf_core.rewards.sources import RM_SOURCE, RewardSources, load_reward_model
from rlhf_core.trainers.common import read_prepared_table


def load_policy(path: str | Path, params: Params):
    """A saved policy and its tokenizer, in eval mode (LoRA adapters merged as in training)."""
    trc = params.model.trust_remote_code
    model = load_causal_lm(path, trust_remote_code=trc, attn_implementation=params.compute.attn_implementation)
    return model.eval(), load_tokenizer(path, trc)


def load_champion(uri: str):
    """The registered champion actor (``models:/<prefix>-actor/<version>``) as (model, tokenizer)."""
    import mlflow

    components = mlflow.transformers.load_model(uri, return_type="components")
    tok = components["tokenizer"]
    tok.padding_side = "left"
    return components["model"].eval(), tok


def answer_model(model, tok, prompts: list[str], params: Params) -> list:
    """Every prompt answered once with ``eval.*`` decoding, tokenised with the model's own tokenizer."""
    ev = params.eval
    data = HeldOut(prompts, None, encode_prompts(tok, prompts, params.data.max_prompt_len))
    return [roll for _, _, roll in answer_batches(model, tok, data, ev.batch_size, ev.max_new_tokens, ev.temperature)]


def summarise(rollouts, rewards: torch.Tensor, kl: torch.Tensor, answers: list | None,
              judge: torch.Tensor | None = None, checker: str = "exact") -> dict:
    texts = [t for r in rollouts for t in r.texts]
    lengths = torch.cat([r.action_mask.sum(dim=1).float() for r in rollouts])
    ended = torch.cat([r.ended.float() for r in rollouts])
    out = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
           "judge_mean": float(judge.mean()) if judge is not None else None,
           "kl_to_reference": float(kl.mean()), "response_length": float(lengths.mean()),
           "eos_share": float(ended.mean()), "accuracy": None}
    if answers is not None:
        check_answer = get_checker(checker)
        out["accuracy"] = sum(check_answer(t, a) for t, a in zip(texts, answers, strict=True)) / len(texts)
    return out


class Judge:
    """``judge(prompts, texts) -> FloatTensor[B]``: the checker (1 for an exact answer) or a judge RM's score.

    ``eval.judge``: ``auto`` = the checker when every prompt has an answer, else the judge RM when
    ``eval.judge_model`` is set, else none; ``checker`` / ``model`` insist on one (an error names what is
    missing); ``none`` turns judging off.
    """

    def __init__(self, kind: str, answers: list | None, judge_model: str | None, root: Path, checker: str = "exact"):
        self.answers, self.rm, self.source = answers, None, None
        self.check = get_checker(checker)
        if judge_model is None and (root / paths.JUDGE_MODEL / "config.json").exists():
            judge_model = str(paths.JUDGE_MODEL)  # trained by the rm stage (rm.judge)
        model_dir = (root / judge_model) if judge_model else None
        if kind == "checker" and answers is None:
            raise ValueError("eval.judge: checker needs an `answer` for every held-out prompt "
                             f"({paths.prepared_file('prompts', eval_split=True)})")
        if kind == "model" and model_dir is None:
            raise ValueError("eval.judge: model needs eval.judge_model (a reward model directory) or a judge "
                             "trained by the rm stage (rm.judge: true)")
        if kind in ("checker", "auto") and answers is not None:
            self.source = "checker"
        elif kind in ("model", "auto") and model_dir is not None:
            if not (model_dir / "config.json").exists():
                raise ValueError(f"eval.judge_model: {model_dir} holds no reward model (config.json missing)")
            self.rm, self.source = load_reward_model(model_dir), f"model:{judge_model}"

    def __call__(self, prompts: list[str], texts: list[str]) -> torch.Tensor | None:
        if self.source == "checker":
            return torch.tensor([float(self.check(t, a)) for t, a in zip(texts, self.answers, strict=True)])
        if self.rm is not None:
            return self.rm.score_responses(prompts, texts).float().cpu()
        return None


def win_rate(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of prompts where ``a`` beats ``b``; ties count one half."""
    return float(((a > b).float() + 0.5 * (a == b).float()).mean())


def evaluate(params: Params, root: str | Path = ".", log=None) -> dict:
    root = Path(root)
    torch.manual_seed(params.project.seed)
    df = read_prepared_table(root, paths.prepared_file("prompts", eval_split=True)).to_pandas()
    if df.empty:
        raise ValueError(f"{paths.prepared_file('prompts', eval_split=True)} is empty: nothing to evaluate")
    df = df.head(params.eval.max_prompts)
    prompts = df.prompt.tolist()
    answers = df.answer.tolist() if df.answer.notna().all() else None
    actor_dir, sft_dir, rm_dir = root / paths.ACTOR_MODEL, root / paths.SFT_MODEL, root / paths.RM_MODEL
    for d in (actor_dir, sft_dir):
        if not d.is_dir():
            raise ValueError(f"{d} is missing: run the earlier stages first")
    candidate, tok = load_policy(actor_dir, params)
    reference, _ = load_policy(sft_dir, params)
    weights = params.rlhf.reward_fns
    if RM_SOURCE in weights and not rm_dir.is_dir():
        raise ValueError(f"{rm_dir} is missing, but rlhf.reward_fns (the proxy) names `rm`")
    reward_fn = RewardSources(weights, rm_dir, tok, params.rlhf.rm_tokenizer_mismatch)
    judge = Judge(params.eval.judge, answers, params.eval.judge_model, root, params.eval.checker)
    columns = {"answer": answers} if answers is not None else {}

    models = {"candidate": (candidate, tok), "reference": (reference, tok)}
    champion_uri = os.environ.get(tracking.ENV_CHAMPION)
    if champion_uri:
        models["champion"] = load_champion(champion_uri)
    results, rewards, judged, answers_by_model = {}, {}, {}, {}
    for name, (model, mtok) in models.items():
        rollouts = answer_model(model, mtok, prompts, params)
        texts = [t for r in rollouts for t in r.texts]
        rewards[name] = reward_fn(prompts, texts, **columns)
        judged[name] = judge(prompts, texts)
        answers_by_model[name] = texts
        if name == "reference":
            kl = torch.zeros(len(prompts))
        elif mtok.get_vocab() == tok.get_vocab():
            kl = torch.cat([sequence_kl(model, reference, r, params.eval.batch_size) for r in rollouts])
        else:
            kl = torch.full((len(prompts),), float("nan"))
        results[name] = summarise(rollouts, rewards[name], kl, answers, judged[name], params.eval.checker)
        if params.data.source == "multistep":  # the judge also reads every step (process supervision)
            results[name]["step_accuracy"] = sum(map(step_accuracy, texts, prompts)) / len(texts)
        if log is not None:
            log({f"{name}.{k}": v for k, v in results[name].items() if v is not None}, 0)

    basis = judged if judge.source is not None else rewards
    cand, ref = results["candidate"], results["reference"]
    report = {
        "candidate": cand, "reference": ref, "champion": results.get("champion"),
        "win_rate_vs_reference": win_rate(basis["candidate"], basis["reference"]),
        "win_rate_vs_champion": win_rate(basis["candidate"], basis["champion"]) if "champion" in basis
        else None,
        "win_rate_basis": "judge" if judge.source is not None else "proxy",
        "proxy_gain_vs_reference": cand["reward_mean"] - ref["reward_mean"],
        "judge_gain_vs_reference": (cand["judge_mean"] - ref["judge_mean"]) if judge.source is not None else None,
        "step_accuracy_gain_vs_reference": cand["step_accuracy"] - ref["step_accuracy"]
        if "step_accuracy" in cand else None,
        "n_prompts": len(prompts), "reward_source": ",".join(f"{k}:{v:g}" for k, v in weights.items()),
        "judge_source": judge.source,
        "candidate_hash": dir_sha256(actor_dir), "candidate_label": str(actor_dir),
        "champion_label": champion_uri, "decoding": params.eval.model_dump(),
    }
    write_json_atomic(root / paths.REPORTS / "eval.json", report)
    table = answer_table(prompts, answers, answers_by_model, rewards, judged)
    write_json_atomic(root / paths.REPORTS / "eval_answers.json", table)
    tracking.log_table(table, "eval_answers.json")
    flat = {"candidate_" + k: v for k, v in results["candidate"].items() if v is not None}
    flat |= {"reference_" + k: v for k, v in results["reference"].items() if v is not None}
    flat["win_rate_vs_reference"] = report["win_rate_vs_reference"]
    flat["proxy_gain_vs_reference"] = report["proxy_gain_vs_reference"]
    for key in ("judge_gain_vs_reference", "step_accuracy_gain_vs_reference"):
        if report[key] is not None:
            flat[key] = report[key]
    if report["win_rate_vs_champion"] is not None:
        flat["win_rate_vs_champion"] = report["win_rate_vs_champion"]
    write_json_atomic(root / paths.METRICS / "evaluate.json", flat)
    return report


def answer_table(prompts: list[str], answers: list | None, texts: dict[str, list[str]],
                 proxy: dict[str, torch.Tensor], judged: dict[str, torch.Tensor | None]) -> dict[str, list]:
    """Column-oriented per-prompt table (``mlflow.log_table`` form): the prompt, the reference answer, and
    per model its answer, proxy reward and judge score."""
    table: dict[str, list] = {"prompt": list(prompts)}
    if answers is not None:
        table["answer"] = [str(a) for a in answers]
    for name, col in texts.items():
        table[f"{name}_response"] = col
        table[f"{name}_proxy"] = [round(float(x), 4) for x in proxy[name]]
        if judged[name] is not None:
            table[f"{name}_judge"] = [round(float(x), 4) for x in judged[name]]
    return table


def run(params: Params, root: str | Path = ".", log=None) -> dict:
    return evaluate(params, root, log)
