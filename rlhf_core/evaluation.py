"""Held-out evaluation of a policy, shared by SFT, RL (ours and TRL's in the learning comparison) and
``rlhf stage evaluate``: one way to answer the held-out prompts, one exact KL, one accuracy.

* ``answer_batches``: every held-out prompt answered once (greedy, or sampled at ``temperature``), in
  batches of ``eval.batch_size``, sharded over ranks (padding rows weigh 0 so every rank runs as many
  batches: ZeRO-3 needs that).
* ``heldout_eval``: the judge's exact-answer accuracy, EOS share, length, the proxy reward (the training
  reward sources) and the exact KL to a reference, reduced over ranks.
* ``sequence_kl``: ``sum_t mask_t KL(pi(.|x, y_<t) || pi_ref(.|x, y_<t))`` per row (non-negative whatever
  the decoding, unlike a sampled log-ratio).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlhf_core.data.collate import Ragged, left_pad_prompts
from rlhf_core.engine import distributed as D
from rlhf_core.passes.generation import GenerationConfig, Rollout, response_logits, rollout
from rlhf_core.rewards import get_checker
from rlhf_core.rewards.multistep import step_accuracy


@dataclass
class HeldOut:
    """Held-out prompts: text, answers (None without a checker) and tokens as in training."""

    prompts: list[str]
    answers: list | None
    tokens: Ragged

    def repeat_each(self, k: int) -> HeldOut:
        """Every prompt ``k`` times in a row (``p0 x k, p1 x k, ...``), for ``k`` sampled answers per prompt."""
        repeat = torch.arange(len(self.prompts)).repeat_interleave(k)
        return HeldOut([self.prompts[i] for i in repeat.tolist()],
                       [self.answers[i] for i in repeat.tolist()] if self.answers is not None else None,
                       self.tokens.select(repeat))


def shard_for_eval(n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's eval rows, padded so every rank runs the same number of batches (ZeRO-3 needs that);
    returns (indices, weights) where padding rows weigh 0."""
    world = D.world_size()
    per_rank = math.ceil(n / world)
    idx = torch.arange(per_rank * world)
    mine = idx[D.rank()::world]
    return mine % max(n, 1), (mine < n).float()


@torch.no_grad()
def answer_batches(model, tokenizer, data: HeldOut, batch_size: int, max_new_tokens: int, temperature: float = 0.0,
                   synced_gpus: bool = False) -> Iterator[tuple[torch.Tensor, torch.Tensor, Rollout]]:
    """``(rows, weights, rollout)`` per batch of this rank's held-out prompts (``shard_for_eval``); greedy at
    ``temperature`` 0. The model is in eval mode while answering and back in its mode after."""
    idx, weight = shard_for_eval(len(data.prompts))
    gen = GenerationConfig(max_new_tokens, temperature or 1.0, do_sample=temperature > 0, synced_gpus=synced_gpus)
    was_training = model.training
    model.eval()
    try:
        for i in range(0, len(idx), batch_size):
            rows = idx[i:i + batch_size]
            batch = left_pad_prompts(data.tokens, rows, tokenizer.pad_token_id)
            yield rows, weight[i:i + batch_size].double(), rollout(model, batch["input_ids"], batch["attention_mask"],
                                                                   tokenizer, gen)
    finally:
        model.train(was_training)


@torch.inference_mode()
def sequence_kl(model, ref_model, batch, batch_size: int) -> torch.Tensor:
    """Per row: sum over action tokens of KL(pi(.|prefix) || pi_ref(.|prefix)) on ``batch``'s responses
    (a ``PromptResponseBatch`` on the models' device)."""
    out = []
    R = batch.responses.shape[1]
    seq, att, mask = batch.sequences, batch.attention_mask, batch.action_mask
    for i in range(0, seq.shape[0], batch_size):
        s, a, m = seq[i:i + batch_size], att[i:i + batch_size], mask[i:i + batch_size]
        lp = torch.log_softmax(response_logits(model, s, a, R).float(), dim=-1)
        lq = torch.log_softmax(response_logits(ref_model, s, a, R).float(), dim=-1)
        out.append(((lp.exp() * (lp - lq)).sum(dim=-1) * m).sum(dim=1))
    return torch.cat(out)


@torch.no_grad()
def step_judge(params):
    """The step judge of ``params``' task, ``(completion, prompt) -> share of the solution's steps right``: the
    multi-step task's (``rewards.multistep.step_accuracy``), or None where the task labels no steps."""
    return step_accuracy if params.data.source == "multistep" else None


def heldout_eval(model, tokenizer, data: HeldOut, ev, device, ref=None, reward=None, temperature: float = 0.0,
                 synced_gpus: bool = False, step_judge=None) -> dict[str, float]:
    """``accuracy`` (the checker on ``data.answers``; absent without answers), ``eos_share``, ``response_length``,
    with a ``reward`` the mean ``proxy_reward``, with a ``ref`` the exact ``kl_to_reference``, with a
    ``step_judge(completion, prompt) -> [0, 1]`` its mean ``step_accuracy``; ``ev`` gives ``max_new_tokens`` and
    ``batch_size``. Reduced over ranks."""
    check_answer = get_checker(ev.checker)
    sums = torch.zeros(7, dtype=torch.float64)  # correct, eos, length, kl, proxy reward, n, right steps
    for rows, w, roll in answer_batches(model, tokenizer, data, ev.batch_size, ev.max_new_tokens, temperature,
                                        synced_gpus):
        answers = [data.answers[j] for j in rows.tolist()] if data.answers is not None else None
        ok = torch.tensor([check_answer(t, a) for t, a in zip(roll.texts, answers, strict=True)]
                          if answers is not None else [0.0] * len(rows), dtype=torch.float64)
        length = roll.action_mask.sum(dim=1).double()
        proxy = torch.zeros_like(w)
        if reward is not None:
            prompts = [data.prompts[j] for j in rows.tolist()]
            proxy = reward(prompts, roll.texts, **({"answer": answers} if answers is not None else {})).double()
        kl = torch.zeros_like(w)
        if ref is not None:
            on_device = Rollout(roll.prompt_ids.to(device), roll.prompt_mask.to(device), roll.responses.to(device),
                                roll.action_mask.to(device), roll.texts)
            kl = sequence_kl(model, ref, on_device, ev.batch_size).double().cpu()
        steps = torch.tensor([step_judge(t, data.prompts[j]) for t, j in zip(roll.texts, rows.tolist(), strict=True)]
                             if step_judge is not None else [0.0] * len(rows), dtype=torch.float64)
        sums += torch.stack([(ok * w).sum(), (roll.ended.double() * w).sum(), (length * w).sum(), (kl * w).sum(),
                             (proxy * w).sum(), w.sum(), (steps * w).sum()])
    sums = D.all_reduce_sum(sums)
    n = float(sums[5].clamp(min=1))
    out = {"eos_share": float(sums[1]) / n, "response_length": float(sums[2]) / n}
    if data.answers is not None:  # no checker answers: no accuracy (a 0 would read as a measured one)
        out["accuracy"] = float(sums[0]) / n
    if reward is not None:
        out["proxy_reward"] = float(sums[4]) / n
    if ref is not None:
        out["kl_to_reference"] = float(sums[3]) / n
    if step_judge is not None:
        out["step_accuracy"] = float(sums[6]) / n
    return out


def hacking_suspected(before: dict, after: dict) -> bool | None:
    """The proxy (training reward) rose on the held-out answers while the judge's accuracy fell."""
    if not before or not after or "accuracy" not in after:
        return None
    return after["proxy_reward"] > before["proxy_reward"] and after["accuracy"] < before["accuracy"]
