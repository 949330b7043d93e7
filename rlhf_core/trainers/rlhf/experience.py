"""Experience: rollouts (OpenRLHF's *Samples*) turned into training rows (*Experience*), and the buffer.

One generation batch goes through these steps (``ExperienceMaker.make``)::

    prompts (token ids, left-padded) --generate (KV cache, sampling)--> Rollout
      -> score every row with the reward sources (no-EOS rows optionally get ``no_eos_penalty``)
      -> the algorithm's baseline on whole groups (``baselined``: GRPO, RLOO, group mean) on *all* rows
      -> drop rows whose response is empty (only EOS), counted; with ``drop_uniform_groups`` (GRPO) also the
         groups whose scores are all equal (zero advantage on every row), with ``drop_unselected`` (RAFT) the
         rows that are not their group's pick, each counted
      -> one pass per model under ``torch.inference_mode()``, logits only over response positions:
         actor old log-probs (unless recorded while sampling), reference log-probs, critic values

Masks (see ``rlhf_core.passes.generation``): prompts are left-padded; a response ends at its first EOS, which is an
action; everything after it is masked; ``pad == eos`` tokenizers work because the mask comes from EOS
positions only; the logits at position ``t`` score token ``t + 1``, so a response of ``R`` tokens is scored
by the logits at positions ``-R-1 .. -2`` and the critic's value of action ``t`` is read at the same place
(the state *before* the token).

The buffer (DeepSpeed-Chat's ``MiniDataset``): the generation batches of one iteration are concatenated
(re-padded), advantages are computed over the whole buffer (``Algorithm.advantages``), and the rows are
shuffled (whole groups together) into a fixed number of mini-batches of micro-batches, reused for
``ppo_epochs``.  The count is fixed by the configuration, not by how many rows survived, so every process
runs the same number of forward/backward passes (a requirement of data-parallel gradient all-reduce);
an empty micro-batch is a single row with an all-zero action mask (zero loss, zero gradient).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields, replace

import torch
import torch.nn.functional as F

from rlhf_core.algos import kl_estimate
from rlhf_core.algos.process import normalised_step_rewards, rewards_to_go, step_ends
from rlhf_core.engine import distributed as D
from rlhf_core.passes.generation import (
    GenerationConfig,
    PromptResponseBatch,
    ended_with_eos,
    response_logprobs,
    rollout,
)
from rlhf_core.passes.values import sequence_values
from rlhf_core.rewards import get_checker


# --------------------------------------------------------------------------- responses
def empty_response(responses: torch.Tensor, action_mask: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """Rows whose response has no token before its EOS (the only action is the EOS itself)."""
    return (action_mask.sum(dim=1) <= 1) & (responses[:, 0] == eos_token_id)


# --------------------------------------------------------------------------- experience rows
_OPTIONAL = ("old_logp", "ref_logp", "values", "rewards", "advantages", "returns", "baselined", "step_advantages",
             "step_rewards")


@dataclass
class Experience(PromptResponseBatch):
    """Training rows: ``sequences = cat(prompt_ids, responses)``; ``[B, R]`` tensors are over response tokens.

    ``scores``: sequence score ``s`` (reward sources, no-EOS penalty applied); ``baselined``: the score after
    the algorithm's baseline ``b`` (``rlhf_core.trainers.rlhf.algorithms``: GRPO's group advantage, RLOO's
    leave-one-out score, a group-centred or the plain score), computed on whole groups before empty rows were
    dropped; ``group``: row's prompt id within the iteration.
    """

    scores: torch.Tensor  # [B]
    group: torch.Tensor  # [B] long
    old_logp: torch.Tensor | None = None
    ref_logp: torch.Tensor | None = None
    values: torch.Tensor | None = None
    baselined: torch.Tensor | None = None  # [B]
    step_advantages: torch.Tensor | None = None  # [B, R] process supervision: advantages from the step rewards
    step_rewards: torch.Tensor | None = None  # [B, R] process supervision: r~ at the step ends, 0 elsewhere
    rewards: torch.Tensor | None = None  # [B, R] token rewards (set by compute_advantages)
    advantages: torch.Tensor | None = None  # [B, R]
    returns: torch.Tensor | None = None  # [B, R]
    info: dict[str, float] = field(default_factory=dict)

    def __len__(self) -> int:
        return self.responses.shape[0]

    @property
    def response_len(self) -> int:
        return self.responses.shape[1]

    def _row_tensors(self) -> dict[str, torch.Tensor | None]:
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name != "info"}

    def select(self, idx: torch.Tensor, trim: bool = True) -> Experience:
        """Rows ``idx``; with ``trim`` the all-pad prompt columns (left) and all-masked response columns
        (right) of the selection are cut, so a micro-batch costs only its longest row."""
        out = {k: (v[idx] if v is not None else None) for k, v in self._row_tensors().items()}
        sel = Experience(**out)
        return sel.trimmed() if trim else sel

    def trimmed(self) -> Experience:
        pm, am = self.prompt_mask.bool(), self.action_mask.bool()
        p_cols = pm.any(dim=0).nonzero()
        start = int(p_cols[0]) if len(p_cols) else max(0, pm.shape[1] - 1)
        r_cols = am.any(dim=0).nonzero()
        end = int(r_cols[-1]) + 1 if len(r_cols) else 1
        changes = {"prompt_ids": self.prompt_ids[:, start:], "prompt_mask": self.prompt_mask[:, start:]}
        for k in ("responses", "action_mask", *_OPTIONAL):
            v = getattr(self, k)
            if v is not None and v.dim() == 2:
                changes[k] = v[:, :end]
        return replace(self, **changes)

    def to(self, device: torch.device | str) -> Experience:
        return replace(self, **{k: (v.to(device) if v is not None else None) for k, v in self._row_tensors().items()})

    @staticmethod
    def cat(parts: Sequence[Experience], pad_token_id: int) -> Experience:
        """Concatenate rows of several generation batches: prompts left-padded and responses right-padded to
        the longest; masks and per-token tensors padded with 0."""
        if len(parts) == 1:
            return parts[0]
        P = max(p.prompt_ids.shape[1] for p in parts)
        R = max(p.response_len for p in parts)
        cols: dict[str, list] = {}
        for p in parts:
            dp, dr = P - p.prompt_ids.shape[1], R - p.response_len
            cols.setdefault("prompt_ids", []).append(F.pad(p.prompt_ids, (dp, 0), value=pad_token_id))
            cols.setdefault("prompt_mask", []).append(F.pad(p.prompt_mask, (dp, 0), value=0))
            cols.setdefault("responses", []).append(F.pad(p.responses, (0, dr), value=pad_token_id))
            for k in ("action_mask", *_OPTIONAL, "scores", "group"):
                v = getattr(p, k)
                cols.setdefault(k, []).append(None if v is None else (F.pad(v, (0, dr)) if v.dim() == 2 else v))
        merged = {}
        for k, vs in cols.items():
            if any(v is None for v in vs):
                if not all(v is None for v in vs):
                    raise ValueError(f"cannot concatenate experiences: {k} is missing in some parts")
                merged[k] = None
            else:
                merged[k] = torch.cat(vs)
        return Experience(**merged)


# --------------------------------------------------------------------------- the buffer's mini-batches
def minibatch_plan(groups: torch.Tensor, n_minibatches: int, grad_accum: int,
                   generator: torch.Generator) -> list[list[torch.Tensor]]:
    """Shuffle rows by whole groups and split them into ``n_minibatches`` x ``grad_accum`` micro-batches.

    Returns row indices per micro-batch; some may be empty when few rows survived (the caller substitutes
    a zero-mask row). The count is fixed so every process runs the same number of passes.
    """
    uniq, inverse = torch.unique(groups, return_inverse=True)
    order = torch.randperm(len(uniq), generator=generator)
    rank_of_group = torch.empty_like(order)
    rank_of_group[order] = torch.arange(len(order))
    key = rank_of_group[inverse] * (len(groups) + 1) + torch.arange(len(groups))
    rows = torch.argsort(key)
    return [list(torch.tensor_split(mb, grad_accum)) for mb in torch.tensor_split(rows, n_minibatches)]


def zero_row(exp: Experience) -> Experience:
    """One row of ``exp`` with an all-zero action mask: a micro-batch that contributes nothing."""
    row = exp.select(torch.tensor([0]), trim=False)
    return replace(row, action_mask=torch.zeros_like(row.action_mask)).trimmed()


# --------------------------------------------------------------------------- the maker
ScoreFn = Callable[..., torch.Tensor]


@dataclass
class MakerConfig:
    samples_per_prompt: int
    gen: GenerationConfig
    forward_batch_size: int
    need_old_logp: bool
    need_ref: bool
    need_values: bool
    baseline: Callable[[torch.Tensor], torch.Tensor]  # Algorithm.baseline: scores -> baselined scores
    no_eos_penalty: float | None = None
    shared_prefix: bool = False  # log-prob passes compute each group's prompt once
    pack_groups: bool = False  # ... with the group's responses packed after it (``group_packing``)
    drop_uniform_groups: bool = False  # drop groups whose scores are all equal (zero advantage on every row)
    drop_unselected: bool = False  # drop rows that are not their group's pick (RAFT: baselined score 0)
    checker: str = "exact"  # eval.checker: judges the samples (logged, never the reward)
    process: ProcessRewards | None = None  # grpo.supervision / ppo.supervision: process


@dataclass(frozen=True)
class ProcessRewards:
    """A process reward model read at every step end: ``values(sequences, attention_mask, R)`` gives ``[B, R]``
    (its value after each response token), ``delimiter_id`` ends a step (``algos.process.step_ends``)."""

    values: Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
    delimiter_id: int

    def read(self, roll, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """On whole groups: ``(GRPO's advantages [B, R], the normalised step rewards r~ at the ends [B, R], the raw
        step rewards at the ends [B, R], rows with an empty step [B])`` (``algos.process``)."""
        mask = roll.action_mask
        ends, empty = step_ends(roll.responses, mask, self.delimiter_id)
        rewards = self.values(roll.sequences, roll.attention_mask, roll.responses.shape[1]).float().cpu()
        normalised = normalised_step_rewards(rewards, ends & ~empty[:, None], mask, group_size)
        return (rewards_to_go(normalised, mask).to(rewards.dtype), normalised.float(),
                torch.where(ends, rewards, torch.zeros(())), empty)


def batched(fn, n: int, batch: int, lockstep: bool = False):
    """``fn(slice)`` over rows ``0..n`` in slices of ``batch``, concatenated; None without rows. ``lockstep``
    (ZeRO-3 over several ranks, ``distributed.forwards_in_lockstep``): as many slices as the rank with the
    most rows makes (rows dropped as empty or uniform differ per rank), the slices past this rank's rows run
    its last row again and drop the output, so every rank makes the same forward passes."""
    slices = -(-n // batch)
    if lockstep:
        slices = D.all_max(slices)
    if not n:
        return None
    parts = [fn(slice(i * batch, (i + 1) * batch)) if i * batch < n else fn(slice(n - 1, n))[:0]
             for i in range(slices)]
    return torch.cat(parts)


class ExperienceMaker:
    """Generate + score + one inference pass per model for a batch of prompts.

    ``actor``/``ref``/``critic`` are callables with the HF forward signature (the critic returns ``.values``);
    ``score_fn(prompts, completions, **columns) -> FloatTensor[B]`` is ``RewardSources``.
    """

    def __init__(self, actor, ref, critic, score_fn: ScoreFn, tokenizer, cfg: MakerConfig, device=None):
        self.actor, self.ref, self.critic = actor, ref, critic
        self.score_fn, self.tok, self.cfg = score_fn, tokenizer, cfg
        self.device = device if device is not None else torch.device("cpu")
        self.samples: dict[str, list] = {}  # the last batch's prompts, responses, proxy scores (and judge)

    def make(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, prompts: list[str],
             columns: dict[str, list], group_offset: int = 0) -> Experience:
        """Experience for ``prompts`` (already tokenised as ``prompt_ids``), ``samples_per_prompt`` each.

        ``info`` carries sums for the iteration's metrics: rows, empty (dropped), no_eos, response tokens,
        correct answers (when an ``answer`` column is given) and the phase times.
        """
        cfg, n = self.cfg, self.cfg.samples_per_prompt
        t0 = time.perf_counter()
        ids = prompt_ids.repeat_interleave(n, dim=0)
        pmask = prompt_mask.repeat_interleave(n, dim=0)
        group = torch.arange(len(prompts)).repeat_interleave(n) + group_offset
        was_training = self.actor.training
        self.actor.eval()
        roll = rollout(self.actor, ids, pmask, self.tok, cfg.gen, group_size=n if cfg.shared_prefix else 1)
        t_gen = time.perf_counter() - t0

        t1 = time.perf_counter()
        rep_prompts = [p for p in prompts for _ in range(n)]
        rep_cols = {k: [v for v in vals for _ in range(n)] for k, vals in columns.items()}
        with torch.inference_mode():
            scores = self.score_fn(rep_prompts, roll.texts, **rep_cols).float().cpu()
        scores = scores.clone()
        ended = ended_with_eos(roll.responses, self.tok.eos_token_id)
        if cfg.no_eos_penalty is not None:
            scores = torch.where(ended, scores, torch.tensor(float(cfg.no_eos_penalty)))
        baselined = cfg.baseline(scores)
        judged = None
        if "answer" in rep_cols:
            check = get_checker(self.cfg.checker)
            judged = [float(check(t, a)) for t, a in zip(roll.texts, rep_cols["answer"], strict=True)]
        correct = sum(judged) if judged is not None else 0.0
        self.samples = {"prompt": rep_prompts, "response": list(roll.texts), "proxy": scores.tolist(),
                        **({"judge": judged} if judged is not None else {})}
        empty = empty_response(roll.responses, roll.action_mask, self.tok.eos_token_id)
        lengths = roll.action_mask.sum(dim=1).float()
        info = {"rows": float(len(roll.texts)), "empty": float(empty.sum()), "no_eos": float((~ended).sum()),
                "length_sum": float(lengths.sum()), "correct": correct,
                "group_std_sum": float(scores.view(-1, n).std(dim=1).sum()) if n > 1 else 0.0,
                "groups": float(len(prompts))}
        all_equal = uniform_groups(scores, n)
        uniform = (all_equal if cfg.drop_uniform_groups else torch.zeros_like(empty)) & ~empty
        unselected = (baselined == 0) & ~empty & ~uniform if cfg.drop_unselected else torch.zeros_like(empty)
        idle = uniform | unselected  # scored, never trained on
        info |= {"uniform_groups": float(all_equal.sum()) / n, "uniform": float(uniform.sum()),
                 "unselected": float(unselected.sum()), "idle": float(idle.sum()),
                 "idle_score": float(scores[idle].sum()), "idle_score_sq": float((scores[idle] ** 2).sum())}
        step_adv = step_norm = step_rewards = None
        if cfg.process is not None:
            step_adv, step_norm, step_rewards, empty_step = cfg.process.read(roll, n)
            empty_step &= ~empty
            info["empty_step"] = float(empty_step.sum())
            empty |= empty_step
        keep = ~empty & ~idle
        # the rows trained on, and every non-empty row of their groups: the candidates a pick was made among
        candidates = keep.view(-1, n).any(dim=1).repeat_interleave(n) & ~empty
        verdicts = torch.tensor(judged) if judged is not None else torch.zeros(len(keep))
        info |= {"correct_trained": float(verdicts[keep].sum()), "candidates": float(candidates.sum()),
                 "correct_candidates": float(verdicts[candidates].sum())}
        if not keep.any():  # keep one row with a zero action mask so the training passes still run
            keep = torch.zeros_like(keep)
            keep[0] = True
            roll.action_mask[0] = 0
        exp = Experience(roll.prompt_ids, roll.prompt_mask, roll.responses, roll.action_mask, scores, group,
                         old_logp=roll.logp, baselined=baselined, rewards=step_rewards,
                         step_advantages=step_adv, step_rewards=step_norm
                         ).select(keep.nonzero(as_tuple=True)[0], trim=True)
        exp.info = info
        self._forward_passes(exp)
        self.actor.train(was_training)
        info["t_generate"] = t_gen
        info["t_score"] = time.perf_counter() - t1
        return exp

    @torch.inference_mode()
    def _passes(self, exp: Experience) -> dict[str, torch.Tensor | None]:
        cfg, R, dev = self.cfg, exp.response_len, self.device
        seq, att = exp.sequences.to(dev), exp.attention_mask.to(dev)
        bs = cfg.forward_batch_size or len(exp)
        out: dict[str, torch.Tensor | None] = {"old_logp": exp.old_logp, "ref_logp": None, "values": None}
        t = cfg.gen.temperature
        group = exp.group.to(dev) if cfg.shared_prefix else None

        def logprobs(model, s: slice) -> torch.Tensor:
            return response_logprobs(model, seq[s], att[s], R, t, group=group[s] if group is not None else None,
                                     pack=cfg.pack_groups)

        if cfg.need_old_logp and exp.old_logp is None:  # not recorded while sampling
            out["old_logp"] = batched(lambda s: logprobs(self.actor, s).float(), len(exp), bs,
                                      D.forwards_in_lockstep(self.actor))
        if cfg.need_ref:
            out["ref_logp"] = batched(lambda s: logprobs(self.ref, s).float(), len(exp), bs,
                                      D.forwards_in_lockstep(self.ref))
        if cfg.need_values:
            out["values"] = batched(lambda s: sequence_values(self.critic, seq[s], att[s], R,
                                                              group[s] if group is not None else None).float(),
                                    len(exp), bs, D.forwards_in_lockstep(self.critic))
        return out

    def _forward_passes(self, exp: Experience) -> None:
        critic_training = self.critic.training if self.critic is not None else False
        if self.critic is not None:
            self.critic.eval()
        for k, v in self._passes(exp).items():
            # clone outside inference mode: inference tensors cannot be saved for backward later
            setattr(exp, k, v.cpu().clone() if v is not None else None)
        if self.critic is not None:
            self.critic.train(critic_training)


def uniform_groups(scores: torch.Tensor, group_size: int) -> torch.Tensor:
    """Rows (``[B]`` bool) of groups whose ``group_size`` scores are all equal: every row's group-relative
    advantage is 0, so the policy-gradient term gets nothing from them (DAPO's zero-variance groups)."""
    if group_size < 2:
        return torch.zeros(scores.shape[0], dtype=torch.bool)
    g = scores.view(-1, group_size)
    return (g == g[:, :1]).all(dim=1).repeat_interleave(group_size)


def sampled_kl(exp: Experience, kind: str = "k1") -> torch.Tensor:
    """Per row: sum over action tokens of the sampled KL estimate between the rollout policy and the reference."""
    if exp.old_logp is None or exp.ref_logp is None:
        return torch.zeros(len(exp))
    mask = exp.action_mask.bool()
    kl = kl_estimate(exp.old_logp, exp.ref_logp, kind)
    return torch.where(mask, kl, torch.zeros(())).sum(dim=1)


def n_minibatches(rows_per_process: int, micro_batch_size: int, grad_accum: int) -> int:
    return max(1, math.ceil(rows_per_process / (micro_batch_size * grad_accum)))
