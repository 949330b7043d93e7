"""What a reward model learns from the preference pairs: one declaration per objective (``rm.objective``).

    score_head   r(x, y) = w . h_T(x, y)                            a fresh head at the last token
    dpo          r(x, y) = beta * [log pi(y|x) - log pi_ref(y|x)]   DPO's implicit reward (Rafailov et al. 2023)
                 + rm.rpo_alpha x the chosen answers' NLL per token in the loss (RPO, ``algos.rpo_loss``)
    process      r(x, y_<=k) = w . h_end(k)(x, y)                    the head at every step's end (Math-Shepherd)

``score_head`` and ``dpo`` train on ``-log sigmoid(r_chosen - r_rejected - margin)`` (``algos.pairwise_rm_loss``;
DPO's loss is that on its implicit rewards, margin 0); ``process`` on the checker's step labels of the same
pairs' responses (``rm_process``). An objective says how its model is built from the init (``rm.init_from``),
how a batch of ``[2B]`` chosen-then-rejected rows is scored, how the model is saved, what the saved model's
score is (its ``rlhf_meta.json``), which settings it refuses, and, where it trains on more than the pairs'
order, what it adds to the pairs, batches them with, minimises and measures.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_core.algos import rpo_loss
from rlhf_core.config import Params, RMConfig
from rlhf_core.data.collate import PairData, collate_pairs
from rlhf_core.engine import distributed as D
from rlhf_core.engine.errors import TrainingInputError
from rlhf_core.evaluation import shard_for_eval
from rlhf_core.models.implicit_reward import (
    PolicyScores,
    implicit_scores,
    implicit_scores_on_prompts,
    save_implicit_rm,
)
from rlhf_core.models.loading import build_causal_lm, build_value_model, load_causal_lm, save_value_model
from rlhf_core.ops import paths
from rlhf_core.passes.values import shared_prefix_scores, worth_sharing
from rlhf_core.trainers import rm_process

ScoreFn = Callable[[torch.nn.Module, dict, torch.device], torch.Tensor]  # (model or engine, batch, device) -> [2B]


def pair_layout(model, batch: dict, device, saving: bool) -> tuple[torch.Tensor, ...] | None:
    """``(prefix_ids, prefix_mask, owner, suffix_ids, suffix_mask)`` on ``device`` from the batch's
    ``collate.shared_prompt_layout``, ``owner`` each response's pair; None where the batch has none or, with
    ``saving``, sharing would skip less than a quarter of the positions (``worth_sharing``: responses longer
    than their prompts). Under ZeRO-3 over several ranks every rank gets a layout or none, so that all make the
    same forward passes."""
    use = "prefix_ids" in batch and (not saving or worth_sharing(*batch["prefix_ids"].shape,
                                                                  *batch["suffix_ids"].shape))
    if D.forwards_in_lockstep(model):
        (use,) = D.all_agree(use)
    if not use:
        return None
    owner = torch.arange(len(batch["prefix_ids"]), device=device).repeat(2)
    return (batch["prefix_ids"].to(device), batch["prefix_mask"].to(device), owner, batch["suffix_ids"].to(device),
            batch["suffix_mask"].to(device))


def head_scores(model, batch: dict, device) -> torch.Tensor:
    """The value at each row's last token ``[2B]``. Each pair's prompt goes through once, its two responses on
    its KV cache (``passes.values.shared_prefix_scores`` on ``pair_layout``), where that skips a quarter of the
    positions and the model can share its cache: the same scores and gradients up to float rounding."""
    layout = pair_layout(model, batch, device, saving=True)
    scores = shared_prefix_scores(model, *layout) if layout is not None else None
    if scores is not None:
        return scores
    return model(batch["input_ids"].to(device), batch["attention_mask"].to(device)).scores


def dpo_policy_scores(model, batch: dict, device, beta: float, reference: bool = True) -> PolicyScores:
    """Each row's implicit reward, policy log-prob and token count ``[2B]``; ``model`` is the engine (training) or
    the peft model (evaluation). From the batch's ``pair_layout``: each pair's prompt once, logits at the
    responses only. Without ``reference``, the policy pass alone (no reward)."""
    peft = getattr(model, "module", model)
    layout = pair_layout(model, batch, device, saving=False)
    if layout is not None:
        return implicit_scores_on_prompts(model, peft.disable_adapter, *layout, beta, reference)
    return implicit_scores(model, peft.disable_adapter, batch["input_ids"].to(device),
                           batch["attention_mask"].to(device), batch["response_mask"].to(device), beta, reference)


def dpo_scores(beta: float) -> ScoreFn:
    """Each row's implicit reward ``[2B]`` (:func:`dpo_policy_scores`)."""
    return lambda model, batch, device: dpo_policy_scores(model, batch, device, beta).reward


def dpo_loss(cfg: RMConfig) -> Callable[[object, dict], tuple[torch.Tensor, dict]]:
    """DPO's loss on a batch's pairs, plus ``rm.rpo_alpha`` times the chosen answers' NLL (``algos.rpo_loss``)."""
    def loss(engine, batch: dict) -> tuple[torch.Tensor, dict]:
        scores = dpo_policy_scores(engine, batch, engine.device, cfg.beta)
        (r_c, r_r), (logp_c, _), (n_c, _) = (x.float().chunk(2) for x in scores)
        value, stats = rpo_loss(r_c, r_r, logp_c, n_c, cfg.rpo_alpha, cfg.margin)
        return value, {"tokens": batch["attention_mask"].sum().float(), "accuracy": stats["accuracy"],
                       "nll": stats["nll"]}

    return loss


@torch.no_grad()
def eval_chosen_nll(model, data: PairData, batch_size: int, pad_id: int, device) -> dict[str, float]:
    """``chosen_nll``: the policy's negative log-likelihood per token of the chosen answers of ``data`` (all ranks),
    which plain DPO lets rise with the rejected answers' and RPO's term holds down."""
    was_training = model.training
    model.eval()
    idx, weight = shard_for_eval(len(data))
    sums = torch.zeros(2, dtype=torch.float64)  # -log pi summed, tokens
    for i in range(0, len(idx), batch_size):
        scores = dpo_policy_scores(model, collate_pairs(data, idx[i:i + batch_size], pad_id), device, 1.0,
                                   reference=False)
        logp, tokens = scores.logp.chunk(2)[0].double().cpu(), scores.tokens.chunk(2)[0].double().cpu()
        w = weight[i:i + batch_size].double()
        sums += torch.stack([(-logp * w).sum(), (tokens * w).sum()])
    model.train(was_training)
    sums = D.all_reduce_sum(sums)
    return {"chosen_nll": float(sums[0] / sums[1].clamp(min=1))}


def build_policy(params: Params, root: Path, init_kind: str, init_ref: Path):
    """The implicit reward's reference: ``models/sft`` (adapters merged) or the base model."""
    if init_kind == "sft":
        path = root / paths.SFT_MODEL
        if not (path / "config.json").exists():
            raise TrainingInputError(f"{path}: no SFT model; run `rlhf stage sft` first or set rm.init_from: base")
        return load_causal_lm(path, trust_remote_code=params.model.trust_remote_code,
                              attn_implementation=params.compute.attn_implementation)
    return build_causal_lm(params, root)


def check_dpo(params: Params, init_kind: str) -> None:
    """The reference is the adapter switched off, on a plain causal LM."""
    problems = [msg for bad, msg in (
        (not params.compute.lora.enabled, "compute.lora.enabled must be true (the reference is the adapter off)"),
        (params.rm.loss != "sequence", f"rm.loss must be sequence, not {params.rm.loss}"),
        (init_kind == "previous", "feedback rounds (feedback.rm_init: previous) are not supported; use sft"),
    ) if bad]
    if problems:
        raise TrainingInputError("rm.objective: dpo: " + "; ".join(problems))


@dataclass(frozen=True)
class Objective:
    build: Callable[[Params, Path, str, Path], torch.nn.Module]  # (params, root, init kind, init dir)
    scores: Callable[[RMConfig], ScoreFn]
    save: Callable[[Params, int], Callable]  # (params, pad id) -> save(model, directory)
    describe: Callable[[RMConfig], str]
    check: Callable[[Params, str], None] = lambda params, init_kind: None
    # None: the pairs alone, collate_pairs, the pairwise loss (rm.loss), pairwise accuracy only
    targets: Callable[[PairData, dict, object, RMConfig], PairData] | None = None  # (data, rows, tokenizer, cfg)
    collate: Callable[[PairData, torch.Tensor, int], dict] | None = None
    # (rm config) -> loss(engine, batch) -> (loss, stats)
    loss: Callable[[RMConfig], Callable[[object, dict], tuple[torch.Tensor, dict]]] | None = None
    evaluate: Callable[..., dict] | None = None  # (model, data, batch size, pad id, device) -> extra metrics


OBJECTIVES: dict[str, Objective] = {
    "score_head": Objective(
        build=lambda params, root, kind, ref: build_value_model(params, root, kind, ref),
        scores=lambda cfg: head_scores,
        save=lambda params, pad_id: lambda m, d: save_value_model(m, d, params.compute.lora.merge_on_save, pad_id),
        describe=lambda cfg: "value at the last non-pad token"),
    "dpo": Objective(
        build=build_policy,
        scores=lambda cfg: dpo_scores(cfg.beta),
        save=lambda params, pad_id: lambda m, d: save_implicit_rm(m, d, params.rm.beta),
        describe=lambda cfg: f"implicit reward {cfg.beta} * [log pi(y|x) - log pi_ref(y|x)]" + (
            f", trained with the chosen answers' NLL x {cfg.rpo_alpha} (RPO)" if cfg.rpo_alpha else ""),
        check=check_dpo, loss=dpo_loss, evaluate=eval_chosen_nll),
    "process": Objective(
        build=lambda params, root, kind, ref: build_value_model(params, root, kind, ref),
        scores=lambda cfg: head_scores,
        save=lambda params, pad_id: lambda m, d: save_value_model(m, d, params.compute.lora.merge_on_save, pad_id),
        describe=lambda cfg: f"process reward: the value at each step's end ({cfg.step_delimiter!r}), "
                             "sigmoid = P(the chain is still right); the outcome score is the last step's",
        check=rm_process.check_process,
        targets=lambda data, rows, tok, cfg: rm_process.with_step_labels(data, rows, tok, cfg.step_delimiter),
        collate=rm_process.collate_steps, loss=lambda cfg: rm_process.step_loss, evaluate=rm_process.eval_steps),
}
