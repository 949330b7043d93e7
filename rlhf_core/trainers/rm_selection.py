"""The RM stage's check before RL (``rm.best_of_n``): can the trained reward lift the policy by choosing among its
own samples? (The table and why: ``rlhf_core.algos.selection``.)

The policy RL will start from (``models/sft``, or a feedback round's starting actor) answers each held-out RL
prompt (the first ``eval.max_prompts`` of ``eval_prompts.parquet``) n times, sampled as RL samples
(``rlhf.max_new_tokens``, ``temperature``, ``top_p``; seeded by ``project.seed``), and once greedily as the RL
stage measures its start (``eval.max_new_tokens``). The RM the stage saved (``models/rm``: a score head, an
implicit reward or the ensemble) scores every answer; ``eval.checker`` judges. ``metrics/rm.json`` gains:

* ``best_of_n``: the table, ``by_n`` per n = 1, 2, 4, ..., n;
* flat (logged): ``best_of_n_rm`` (the RM's pick of n samples), ``best_of_n_oracle`` (pass@n),
  ``best_of_n_majority``, ``best_of_n_sampled``, ``best_of_n_greedy``, ``best_of_n_rm_over_greedy`` (the RM's
  pick among the greedy answer and the n samples, ties keeping the greedy one), ``best_of_n_rm_kl`` (the same pick
  by the KL-regularised optimum's ranking, ``algos.selection``: the reward over the scale the RL stage divides it by,
  plus its KL coefficient times the policy's log-probability), ``best_of_n_rm_gain`` (rm_kl - greedy: at or below
  0, RL at these settings has no better mode to move to among these answers) and ``best_of_n_pairwise``.

An implicit reward (``rm.objective: dpo``, ``r = beta_rm * log(pi_rm / pi_ref)``) also holds a policy, and
KL-regularised RL on ``w * r`` (``w``: its weight in ``rlhf.reward_fns``) aims at

    pi* ∝ pi_ref * (pi_rm / pi_ref)^k,      k = w * beta_rm / (sigma * beta)

(``docs/training.md``, "Which policy RL from it aims at"). So the check also reads that policy, ``pi_rm`` (the RM
folder, adapter merged), greedily on the same prompts: ``best_of_n_rm_policy`` (its accuracy),
``best_of_n_rm_policy_gain`` (minus greedy: what RL at ``k = 1`` aims to add) and ``best_of_n_rm_tilt`` (``k`` at
the RL stage's settings; 0 where ``rm`` is not a reward, left out without a KL term).

Prompts without answers have nothing to judge: the check is skipped, with a warning and ``best_of_n: null``.
"""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

import torch

from rlhf_core.algos.selection import best_of_n, keep_default
from rlhf_core.config import Params
from rlhf_core.data.collate import left_pad_prompts
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.models import load_causal_lm
from rlhf_core.models.implicit_reward import is_implicit, read_beta
from rlhf_core.models.scorer import load_scorer
from rlhf_core.ops import paths
from rlhf_core.passes.generation import GenerationConfig, rollout
from rlhf_core.rewards.checkers import ANSWER_OF, get_checker
from rlhf_core.trainers.rlhf.inputs import load_prompts, start_policies

log = logging.getLogger(__name__)


def answer_ids(keys: list[list]) -> torch.Tensor:
    """``[P, N]`` ids of each row's distinct answers (the first sample with that answer); a sample with no answer
    (None) is its own."""
    return torch.tensor([[next((j for j, o in enumerate(row) if o == k), i) if k is not None else i
                          for i, k in enumerate(row)] for row in keys])


@torch.no_grad()
def sample_answers(model, tokenizer, held, n: int, gen: GenerationConfig,
                   batch_prompts: int) -> tuple[list[list[str]], torch.Tensor]:
    """``n`` answers per held-out prompt as ``gen`` decodes them (each prompt's ``n`` rows share its KV prefix),
    and ``[P, n]`` their log-probability under ``model`` at ``gen.temperature``, EOS included."""
    texts: list[list[str]] = []
    logps = []
    gen = replace(gen, record_logprobs=True)
    for i in range(0, len(held.prompts), batch_prompts):
        rows = torch.arange(i, min(i + batch_prompts, len(held.prompts))).repeat_interleave(n)
        batch = left_pad_prompts(held.tokens, rows, tokenizer.pad_token_id)
        out = rollout(model, batch["input_ids"], batch["attention_mask"], tokenizer, gen, group_size=n)
        texts += [out.texts[k:k + n] for k in range(0, len(out.texts), n)]
        logps.append((out.logp.float() * out.action_mask).sum(dim=1).cpu().view(-1, n))
    return texts, torch.cat(logps)


def kl_terms(params: Params, scores: torch.Tensor) -> tuple[float, float]:
    """``(beta, sigma)`` of the RL stage: its KL coefficient (``grpo.beta``, PPO's ``kl_coef``) and the scale it
    divides rewards by (GRPO, ``grpo.scale`` group or batch: the scores' std, taken over all samples here)."""
    cfg = params.rlhf
    if cfg.algorithm == "grpo":
        return cfg.grpo.beta, float(scores.std()) if cfg.grpo.scale != "none" and scores.numel() > 1 else 1.0
    return cfg.kl_coef, 1.0


def implicit_tilt(weight: float, rm_beta: float, sigma: float, beta: float) -> float | None:
    """``k = w * beta_rm / (sigma * beta)``: the power of ``pi_rm / pi_ref`` in the RL stage's KL optimum; None
    without a KL term or with scores all alike (``sigma * beta = 0``: RL maximises the reward, no finite k)."""
    return weight * rm_beta / (sigma * beta) if sigma * beta > 0 else None


def greedy_answers(model, tokenizer, held, params: Params) -> tuple[list[str], torch.Tensor, torch.Tensor]:
    """``model``'s greedy answers to the held-out prompts (as the RL stage measures its start), ``[P, 1]`` their
    log-probabilities and ``[P]`` the checker's verdicts."""
    texts, logp = sample_answers(model, tokenizer, held, 1, GenerationConfig(
        params.eval.max_new_tokens, params.rlhf.temperature, do_sample=False), params.eval.batch_size)
    check = get_checker(params.eval.checker)
    correct = torch.tensor([check(row[0], a) for row, a in zip(texts, held.answers, strict=True)])
    return [row[0] for row in texts], logp, correct


def implicit_policy(params: Params, root: Path, tokenizer, held, greedy: float, sigma: float, beta: float,
                    device: torch.device) -> dict:
    """The implicit reward's own policy read greedily (the module's last paragraph); ``{}`` for a score head."""
    rm_dir = root / paths.RM_MODEL
    if not is_implicit(rm_dir):
        return {}
    model = load_causal_lm(rm_dir).to(device).eval()
    accuracy = float(greedy_answers(model, tokenizer, held, params)[2].double().mean())
    tilt = implicit_tilt(params.rlhf.reward_fns.get("rm", 0.0), read_beta(rm_dir), sigma, beta)
    return {"best_of_n_rm_policy": accuracy, "best_of_n_rm_policy_gain": accuracy - greedy,
            **({"best_of_n_rm_tilt": tilt} if tilt is not None else {})}


def best_of_n_check(params: Params, root: Path) -> dict:
    """The module's metrics for the RM saved under ``root``. Under several ranks each runs it whole (the same seed,
    the same answers; no collective)."""
    n, cfg = params.rm.best_of_n, params.rlhf
    policy = start_policies(params, root)[0]  # the log-probs below are its: the KL reference in the base pipeline
    tokenizer = load_tokenizer(policy)
    held = load_prompts(params, root, tokenizer).heldout
    if held.answers is None:
        log.warning("rm.best_of_n: the prompts carry no answers, so the checker has nothing to judge; skipped")
        return {"best_of_n": None}
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    model = load_causal_lm(policy).to(device).eval()
    per_batch = params.eval.batch_size
    greedy, greedy_logp, greedy_correct = greedy_answers(model, tokenizer, held, params)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(params.project.seed)
        texts, logp = sample_answers(model, tokenizer, held, n, GenerationConfig(
            cfg.max_new_tokens, cfg.temperature, cfg.top_p, True), max(1, per_batch // n))
    del model
    check, answer_of = get_checker(params.eval.checker), ANSWER_OF[params.eval.checker]
    correct = torch.tensor([[check(t, a) for t in row] for row, a in zip(texts, held.answers, strict=True)])
    scorer = load_scorer(root / paths.RM_MODEL, device=device, batch_size=per_batch)
    scores = scorer.score_responses([p for p in held.prompts for _ in range(n + 1)],
                                    [t for g, row in zip(greedy, texts, strict=True) for t in (g, *row)])
    scores = scores.float().cpu().view(len(texts), n + 1)
    table = best_of_n(correct, scores[:, 1:], answer_ids([[answer_of(t) for t in row] for row in texts]))
    at_n, accuracy = table["by_n"][n], float(greedy_correct.double().mean())
    over_greedy = keep_default(greedy_correct, scores[:, 0], correct, scores[:, 1:])
    beta, sigma = kl_terms(params, scores[:, 1:])
    value = scores / sigma + beta * torch.cat([greedy_logp, logp], dim=1)
    kl_pick = keep_default(greedy_correct, value[:, 0], correct, value[:, 1:])
    del scorer
    rm_policy = implicit_policy(params, root, tokenizer, held, accuracy, sigma, beta, device)
    return {"best_of_n": {"n": n, "prompts": len(texts), "greedy": accuracy, "rm_over_greedy": over_greedy,
                          "rm_kl": kl_pick, "kl_beta": beta, "reward_scale": sigma, **table,
                          **{k.removeprefix("best_of_n_"): v for k, v in rm_policy.items()}},
            **rm_policy,
            "best_of_n_rm": at_n["reward"], "best_of_n_oracle": at_n["oracle"],
            "best_of_n_majority": at_n["majority"], "best_of_n_sampled": table["sampled"],
            "best_of_n_greedy": accuracy, "best_of_n_rm_over_greedy": over_greedy, "best_of_n_rm_kl": kl_pick,
            "best_of_n_rm_gain": kl_pick - accuracy,
            **({"best_of_n_pairwise": table["pairwise"]} if table["pairwise"] is not None else {})}
