"""``rlhf stage evaluate``: candidate actor vs SFT reference vs current champion, on the same prompts.

Every model answers the same held-out prompts (``eval_prompts``) with the same
decoding settings (``eval.*``).  Per model: mean reward (the RM when
``models/rm`` exists, else the configured rule rewards), ground-truth accuracy
when prompts carry answers, KL to the reference, response length and the
share of responses that ended with EOS.  Win rates compare per-prompt rewards
(a tie counts one half).  Writes ``reports/eval.json`` (read by the gate) and
``metrics/evaluate.json``.

KL to the reference is exact per token given each prefix and summed over the
response: ``mean_i sum_t mask_it KL(pi(.|x_i, y_i<t) || pi_ref(.|x_i, y_i<t))``
(non-negative whatever the decoding, unlike a sampled log-ratio).
"""

from __future__ import annotations

import os
from pathlib import Path

import pandas as pd
import torch

from rlhf_core import paths, tracking
from rlhf_core.config import Params
from rlhf_core.generation import generate, position_ids
from rlhf_core.meta import dir_sha256, write_json_atomic
from rlhf_core.rewards import check_answer
from rlhf_core.rewards.sources import RM_SOURCE, RewardSources


def load_policy(path: str | Path, params: Params):
    """A saved policy and its tokenizer, in eval mode (LoRA adapters merged as in training)."""
    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.models import load_causal_lm

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


def _response_log_softmax(model, seq: torch.Tensor, att: torch.Tensor, R: int) -> torch.Tensor:
    out = model(input_ids=seq, attention_mask=att, position_ids=position_ids(att), logits_to_keep=R + 1,
                use_cache=False)
    return torch.log_softmax(out.logits[:, :-1, :].float(), dim=-1)


@torch.inference_mode()
def sequence_kl(model, ref_model, rollout, batch_size: int) -> torch.Tensor:
    """Per row: sum over action tokens of KL(pi(.|prefix) || pi_ref(.|prefix)) on ``rollout``'s responses."""
    out = []
    R = rollout.responses.shape[1]
    seq, att, mask = rollout.sequences, rollout.attention_mask, rollout.action_mask
    for i in range(0, seq.shape[0], batch_size):
        s, a, m = seq[i:i + batch_size], att[i:i + batch_size], mask[i:i + batch_size]
        lp, lq = _response_log_softmax(model, s, a, R), _response_log_softmax(ref_model, s, a, R)
        out.append(((lp.exp() * (lp - lq)).sum(dim=-1) * m).sum(dim=1))
    return torch.cat(out)


def answer_model(model, tok, prompts: list[str], params: Params):
    ev = params.eval
    rollouts = []
    for i in range(0, len(prompts), ev.batch_size):
        rollouts.append(generate(model, tok, prompts[i:i + ev.batch_size], ev.max_new_tokens,
                                 temperature=ev.temperature, do_sample=ev.temperature > 0,
                                 max_prompt_len=params.data.max_prompt_len))
    return rollouts


def summarise(rollouts, rewards: torch.Tensor, kl: torch.Tensor, answers: list | None) -> dict:
    texts = [t for r in rollouts for t in r.texts]
    lengths = torch.cat([r.action_mask.sum(dim=1).float() for r in rollouts])
    ended = torch.cat([r.ended.float() for r in rollouts])
    out = {"reward_mean": float(rewards.mean()), "reward_std": float(rewards.std()) if len(rewards) > 1 else 0.0,
           "kl_to_reference": float(kl.mean()), "response_length": float(lengths.mean()),
           "eos_share": float(ended.mean()), "accuracy": None}
    if answers is not None:
        out["accuracy"] = sum(check_answer(t, a) for t, a in zip(texts, answers, strict=True)) / len(texts)
    return out


def win_rate(a: torch.Tensor, b: torch.Tensor) -> float:
    """Share of prompts where ``a`` beats ``b``; ties count one half."""
    return float(((a > b).float() + 0.5 * (a == b).float()).mean())


def evaluate(params: Params, root: str | Path = ".", log=None) -> dict:
    root = Path(root)
    torch.manual_seed(params.project.seed)
    df = pd.read_parquet(root / paths.prepared_file("prompts", eval_split=True))
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
    weights = {RM_SOURCE: 1.0} if rm_dir.is_dir() else {k: v for k, v in params.rlhf.reward_fns.items()
                                                           if k != RM_SOURCE}
    reward_fn = RewardSources(weights, rm_dir, tok, params.rlhf.rm_tokenizer_mismatch)
    columns = {"answer": answers} if answers is not None else {}

    models = {"candidate": (candidate, tok), "reference": (reference, tok)}
    champion_uri = os.environ.get(tracking.ENV_CHAMPION)
    if champion_uri:
        models["champion"] = load_champion(champion_uri)
    results, rewards = {}, {}
    for name, (model, mtok) in models.items():
        rollouts = answer_model(model, mtok, prompts, params)
        texts = [t for r in rollouts for t in r.texts]
        rewards[name] = reward_fn(prompts, texts, **columns)
        if name == "reference":
            kl = torch.zeros(len(prompts))
        elif mtok.get_vocab() == tok.get_vocab():
            kl = torch.cat([sequence_kl(model, reference, r, params.eval.batch_size) for r in rollouts])
        else:
            kl = torch.full((len(prompts),), float("nan"))
        results[name] = summarise(rollouts, rewards[name], kl, answers)
        if log is not None:
            log({f"{name}.{k}": v for k, v in results[name].items() if v is not None}, 0)

    report = {
        "candidate": results["candidate"], "reference": results["reference"],
        "champion": results.get("champion"),
        "win_rate_vs_reference": win_rate(rewards["candidate"], rewards["reference"]),
        "win_rate_vs_champion": win_rate(rewards["candidate"], rewards["champion"]) if "champion" in rewards
        else None,
        "n_prompts": len(prompts), "reward_source": "rm" if RM_SOURCE in weights else ",".join(weights),
        "candidate_hash": dir_sha256(actor_dir), "candidate_label": str(actor_dir),
        "champion_label": champion_uri, "decoding": params.eval.model_dump(),
    }
    write_json_atomic(root / paths.REPORTS / "eval.json", report)
    flat = {"candidate_" + k: v for k, v in results["candidate"].items() if v is not None}
    flat |= {"reference_" + k: v for k, v in results["reference"].items() if v is not None}
    flat["win_rate_vs_reference"] = report["win_rate_vs_reference"]
    if report["win_rate_vs_champion"] is not None:
        flat["win_rate_vs_champion"] = report["win_rate_vs_champion"]
    write_json_atomic(root / paths.METRICS / "evaluate.json", flat)
    return report


def run(params: Params, root: str | Path = ".", log=None) -> dict:
    return evaluate(params, root, log)
