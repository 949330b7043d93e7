"""``rlhf stage rlhf``: PPO (actor + critic) or GRPO (actor only) on the DeepSpeed training engine.

Reads ``models/sft`` (actor init and frozen reference), ``models/rm`` (PPO critic init; the reward model when
``rlhf.reward_fns`` names ``rm``) and ``data/prepared/{prompts,eval_prompts}.parquet`` (``sft.parquet`` for the
ptx loss). Writes ``models/actor/``, ``models/critic/`` (PPO with GAE), ``models/actor_ema/`` (``rlhf.ema_decay``),
``metrics/rlhf.json`` and ``plots/rlhf_{reward,kl,response_length}.csv``; resumable checkpoints in
``checkpoints/rlhf/``. Runs in one process, or N under ``torchrun --nproc_per_node N -m rlhf_core.cli stage rlhf``.

``build.build`` makes the parts (models, engines, data, tokenizer, config: an ``RLHFBundle``); ``setup`` resumes
from a checkpoint or starts fresh; ``outputs.py`` writes what the stage leaves. One iteration
(``RLHFTrainer.step``), in the order of CleanRL's loop::

    collect      prompts of this rank --ExperienceMaker (per generation batch)--> experience buffer
    advantages   Algorithm.advantages(buffer)            (GRPO / GAE / RLOO / REINFORCE++, ``algorithms.py``)
    update       for epoch in ppo_epochs: shuffled mini-batches x grad_accum micro-batches:
                     actor: clipped surrogate (+KL in loss, -entropy, +ptx) -> backward -> step (EMA update)
                            (the first ``ppo.critic_warmup_iterations``: the loss only, for the metrics)
                     critic (PPO/GAE): clipped value loss                    -> backward -> step
    log          KL controller update, metrics all-reduced by name, rank 0 logs, checkpoint

The same code runs 1 process or N under ``torchrun``: each rank generates its share of the prompts,
gradients are all-reduced by DeepSpeed, every rank runs the same number of passes.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_core.config import Params, for_round
from rlhf_core.data.collate import collate_sft, left_pad_prompts
from rlhf_core.engine import distributed as D
from rlhf_core.engine.errors import NonFiniteLossError
from rlhf_core.engine.loop import LogFn, TrainState
from rlhf_core.engine.stop import StopRequested, stop_requested
from rlhf_core.evaluation import heldout_eval, step_judge
from rlhf_core.ops import paths, tracking
from rlhf_core.trainers.common import fingerprint, input_hashes, resume_or_start
from rlhf_core.trainers.rlhf.algorithms import compute_advantages
from rlhf_core.trainers.rlhf.build import RLHFBundle, build
from rlhf_core.trainers.rlhf.checkpoint import MultiEngineCheckpoint, checkpoint_dir
from rlhf_core.trainers.rlhf.experience import Experience, minibatch_plan, zero_row
from rlhf_core.trainers.rlhf.metrics import (
    all_reduce_named,
    buffer_sums,
    curve_summary,
    heldout_summary,
    iteration_metrics,
)
from rlhf_core.trainers.rlhf.outputs import STAGE, save_models, write_metrics
from rlhf_core.trainers.rlhf.ppo import actor_loss, critic_loss, ptx_loss

CURVE_KEYS = {"reward": "score_mean", "kl": "kl", "response_length": "response_length",
              "samples_per_s": "samples_per_s", "t_generate": "t_generate", "t_score": "t_score", "t_train": "t_train"}


@dataclass
class RLHFHooks:
    """Test/instrumentation hooks."""

    after_step: Callable[[int, dict], None] | None = None  # (step, metrics) after the checkpoint
    log_table: Callable[[dict, str], None] | None = None  # (columns, artifact file): sampled responses


class RLHFTrainer:
    """Set up with ``setup()``, then ``step()`` per iteration (or ``train()`` for the whole run), ``finish()``.
    The bundle's parts read as the trainer's own (``trainer.actor``, ``trainer.maker``, ...)."""

    def __init__(self, params: Params, root: str | Path = ".", log: LogFn | None = None,
                 hooks: RLHFHooks | None = None, evaluate: bool = True, checkpoints: bool = True):
        self.params, self.root, self.log = params, Path(root), log
        self.hooks = hooks or RLHFHooks()
        self.cfg = params.rlhf
        self.do_eval, self.use_ckpt = evaluate, checkpoints
        self.bundle: RLHFBundle | None = None

    def __getattr__(self, name: str):
        bundle = self.__dict__.get("bundle")
        if bundle is None:
            raise AttributeError(f"RLHFTrainer has no {name!r} (before setup())")
        return getattr(bundle, name)

    # ------------------------------------------------------------------ setup
    def setup(self) -> RLHFTrainer:
        self.t_start = time.perf_counter()
        self.bundle = b = build(self.params, self.root)
        self._resume_or_start()
        if self.log is not None and D.is_main():
            cfg = self.cfg
            self.log({"n_prompts": len(b.prompts.texts), "n_eval_prompts": len(b.prompts.heldout.prompts),
                      "rows_per_step": b.per_rank_prompts * cfg.samples_per_prompt * b.world,
                      "minibatches_per_step": b.n_mini, "optimizer_steps_total": b.total_opt,
                      "shared_prefix": float(b.shared_prefix), **b.ptx_counts,
                      "resumed_from_step": self.resumed_from, "threads": b.threads}, self.state.step)
        return self

    def _resume_or_start(self) -> None:
        """Continue from the newest matching checkpoint (engines, RNG, KL controller, EMA) or start fresh
        (the SFT model's held-out evaluation kept as ``state.extra["before"]``)."""
        b, params, cfg = self.bundle, self.params, self.cfg
        files = [paths.prepared_file("prompts"), paths.prepared_file("prompts", True)]
        if cfg.ptx_coef > 0:
            files.append(paths.prepared_file("sft"))
        round_start = {"actor_init": b.inputs.actor_init} if b.inputs.actor_init != b.inputs.sft else {}
        self.hashes = input_hashes(self.root, files, {"sft": paths.SFT_MODEL, **round_start,
                                                      **({"rm": paths.RM_MODEL} if b.inputs.uses_rm else {})})
        initial = (lambda: self.heldout_eval(b.actor.module, with_kl=False)) if self.do_eval else dict
        self.ckpt = None
        if not self.use_ckpt:
            self.state, self.resumed_from = TrainState(), 0
            self.state.extra["before"] = initial()
            torch.manual_seed(params.project.seed + 17 * b.rank)
        else:
            fp = fingerprint(params, STAGE, cfg, self.hashes, ignore=("max_steps",),
                             eval=params.eval.model_dump(mode="json"))
            self.ckpt = MultiEngineCheckpoint(checkpoint_dir(self.root), fp, cfg.keep_checkpoints)
            self.state, self.resumed_from = resume_or_start(self.ckpt, b.engines, cfg.resume, initial,
                                                            params.project.seed)
            if self.resumed_from:
                b.kl_ctl.load_state_dict(self.state.extra["kl_ctl"])
                ema = self.ckpt.load_ema(self.ckpt.latest_tag())
                if ema is not None and b.ema is not None:
                    b.ema.load_state_dict(ema)
        self.state.extra.setdefault("totals", {})

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        while self.state.step < self.bundle.stop_at:
            self.step()
            if stop_requested():  # SIGTERM: checkpoint this iteration and leave (a re-run resumes here)
                self._stop()

    def step(self) -> dict:
        """One iteration: collect -> advantages -> update -> log (and checkpoint)."""
        b, step = self.bundle, self.state.step
        t0 = time.perf_counter()
        exp = self.collect(step)
        exp = compute_advantages(exp, b.algorithm, b.kl_ctl.value)
        t1 = time.perf_counter()
        train, grad_norm = self.update(exp, step)
        t_train = time.perf_counter() - t1
        metrics = self._log_step(exp, train, t_train, time.perf_counter() - t0, grad_norm)
        if self.hooks.after_step is not None:
            self.hooks.after_step(self.state.step, metrics)
        return metrics

    # ------------------------------------------------------------------ collect
    def prompt_indices(self, step: int) -> torch.Tensor:
        """This rank's prompts for iteration ``step``: always ``prompts_per_step / world`` of them, read from the
        endless stream of per-epoch permutations (sharded ``rank::world``), so a batch that reaches the end of
        an epoch continues into the next one. Depends only on (seed, step, rank): resumable."""
        b = self.bundle
        n, per = b.per_rank_prompts, b.sampler.plan.per_rank
        pos = torch.arange(step * n, (step + 1) * n)
        epochs = pos // per
        out = torch.empty(n, dtype=torch.long)
        for e in epochs.unique().tolist():
            sel = epochs == e
            out[sel] = b.sampler.shard(e)[pos[sel] % per]
        return out

    def collect(self, step: int) -> Experience:
        """This rank's experience buffer for iteration ``step`` (generation batches concatenated)."""
        b = self.bundle
        idx = self.prompt_indices(step)
        gb = self.cfg.generation_batch_size or len(idx)
        p = b.prompts
        parts = []
        for start in range(0, len(idx), gb):
            rows = idx[start:start + gb]
            batch = left_pad_prompts(p.tokens, rows, b.tokenizer.pad_token_id)
            columns = {"answer": [p.answers[i] for i in rows.tolist()]} if p.has_answers else {}
            parts.append(b.maker.make(batch["input_ids"], batch["attention_mask"],
                                      [p.texts[i] for i in rows.tolist()], columns, group_offset=start))
        exp = Experience.cat(parts, b.tokenizer.pad_token_id)
        exp.info = {k: sum(part.info[k] for part in parts) for k in parts[0].info}
        return exp

    # ------------------------------------------------------------------ update
    def update(self, exp: Experience, step: int) -> tuple[dict[str, float], float | None]:
        """``ppo_epochs`` passes over the buffer in a fixed number of shuffled mini-batches; returns the
        token-weighted sums of the loss statistics (``{stat: sum stat * tokens, "tokens": ...}``) and the
        last gradient norm."""
        b, cfg = self.bundle, self.cfg
        actor, critic = b.actor, b.critic
        gen = torch.Generator().manual_seed(self.params.project.seed * 1_000_003 + step * 1009 + b.rank)
        sums: dict[str, float] = {"tokens": 0.0}
        grad_norm = None
        actor.train()
        if critic is not None:
            critic.train()
        # Without stored rollout log-probs (one optimizer step per buffer) the first pass computes them with
        # the unchanged policy: keep them for the KL metrics.
        fill_logp = exp.old_logp is None
        if fill_logp:
            exp.old_logp = torch.zeros(exp.action_mask.shape)
        frozen = self.actor_frozen(step)
        for _ in range(cfg.ppo_epochs):
            for minibatch in minibatch_plan(exp.group, b.n_mini, cfg.grad_accum, gen):
                for rows in minibatch:
                    mb = (exp.select(rows) if len(rows) else zero_row(exp)).to(b.device)
                    if fill_logp:
                        mb.old_logp = None
                    with torch.set_grad_enabled(not frozen):
                        loss, stats = actor_loss(actor, mb, b.algorithm.loss, b.kl_ctl.value, b.shared_prefix,
                                                 cfg.pack_groups)
                    logp = stats.pop("_logp")
                    if fill_logp and len(rows):
                        exp.old_logp[rows, :logp.shape[1]] = logp.float().cpu()
                    if not frozen:
                        if b.ptx is not None:
                            ptx = self._ptx_loss()
                            loss = loss + cfg.ptx_coef * ptx
                            stats["ptx_loss"] = ptx.detach()
                        self._check_finite(loss.detach(), "actor loss")
                        actor.backward(loss)
                        if actor.step():
                            grad_norm = self._checked_grad_norm()
                            if b.ema is not None:
                                b.ema.update(actor.module)
                    if critic is not None:
                        closs, cstats = critic_loss(critic, mb, cfg.ppo.value_clip_eps, cfg.ppo.vf_coef,
                                                    b.shared_prefix)
                        self._check_finite(closs.detach(), "critic loss")
                        critic.backward(closs)
                        critic.step()
                        stats.update(cstats)
                    n_tok = float(mb.action_mask.sum())
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + float(v) * n_tok
                    sums["tokens"] += n_tok
        return sums, grad_norm

    def actor_frozen(self, step: int) -> bool:
        """Whether iteration ``step`` (0-based) trains only the critic (``rlhf.ppo.critic_warmup_iterations``)."""
        return self.bundle.critic is not None and step < self.cfg.ppo.critic_warmup_iterations

    def _ptx_loss(self) -> torch.Tensor:
        b = self.bundle
        data, sampler = b.ptx
        micro = int(self.state.extra.get("ptx_micro", 0))
        self.state.extra["ptx_micro"] = micro + 1
        batch = collate_sft(data, sampler.batch(micro), b.tokenizer.pad_token_id)
        return ptx_loss(b.actor, {k: v.to(b.device) for k, v in batch.items()})

    def _check_finite(self, value: torch.Tensor, what: str) -> None:
        bad = D.all_reduce_sum(torch.tensor([0.0 if math.isfinite(float(value)) else 1.0]))
        if float(bad[0]) > 0:
            raise NonFiniteLossError(self.state.step + 1, what, float(value),
                                     self.ckpt.latest_path() if self.ckpt else None)

    def _checked_grad_norm(self) -> float | None:
        grad_norm = self.bundle.actor.grad_norm
        if grad_norm is not None and not math.isfinite(grad_norm):
            raise NonFiniteLossError(self.state.step + 1, "actor gradient norm", grad_norm,
                                     self.ckpt.latest_path() if self.ckpt else None)
        return grad_norm

    # ------------------------------------------------------------------ log (and checkpoint)
    def _log_step(self, exp: Experience, train: dict[str, float], t_train: float, t_step: float,
                  grad_norm: float | None) -> dict:
        """Reduce the iteration's metrics, advance the state (KL controller, curve, totals), log, checkpoint,
        and every ``eval.table_every`` iterations log a table of sampled responses."""
        b, cfg, state = self.bundle, self.cfg, self.state
        sums = buffer_sums(exp, b.algorithm.kl_metric) | {"t_train": t_train, "t_step": t_step}
        reduced = all_reduce_named(sums | {f"train.{k}": v for k, v in train.items()})
        train_sums = {k.removeprefix("train."): v for k, v in reduced.items() if k.startswith("train.")}
        m = iteration_metrics({k: v for k, v in reduced.items() if not k.startswith("train.")}, train_sums,
                              b.world, b.prompts.has_answers, cfg.samples_per_prompt > 1)
        m |= {"kl_coef": b.kl_ctl.value, "lr": b.actor.lr, "actor_frozen": float(self.actor_frozen(state.step)),
              "grad_norm": grad_norm if grad_norm is not None else float("nan"),
              **({"critic_lr": b.critic.lr} if b.critic is not None else {})}
        b.kl_ctl.update(m["kl"], int(m["rows"]))
        state.step += 1
        state.train_time_s += m["t_step"]
        totals = state.extra["totals"]
        for k in ("rows", "empty_dropped", "uniform_dropped", "unselected_dropped", "no_eos"):
            totals[k] = totals.get(k, 0.0) + m[k]
        state.curve.append({"step": state.step} | {k: round(m[src], 6) for k, src in CURVE_KEYS.items()})
        state.extra["kl_ctl"] = b.kl_ctl.state_dict()
        edge = state.step in (1, b.stop_at)
        if self.log is not None and D.is_main() and (state.step % cfg.log_every == 0 or edge):
            self.log(m, state.step)
        if self.ckpt is not None and ((cfg.save_every and state.step % cfg.save_every == 0)
                                      or state.step == b.stop_at):
            self.ckpt.save(b.engines, state.step, state.to_json(), b.ema.state_dict() if b.ema is not None else None)
        every = self.params.eval.table_every
        if self.hooks.log_table is not None and D.is_main() and every and (state.step % every == 0 or edge):
            self.hooks.log_table(self.sample_table(), f"rlhf_samples/step_{state.step:05d}.json")
        return m

    def sample_table(self, rows: int = 32) -> dict[str, list]:
        """The first ``rows`` sampled responses of this iteration's last generation batch: prompt, response,
        proxy reward (the training score) and the judge's score (the checker) where one exists."""
        return {k: v[:rows] for k, v in self.bundle.maker.samples.items()}

    def _stop(self) -> None:
        b, ckpt, state = self.bundle, self.ckpt, self.state
        if ckpt is not None and ckpt.latest_tag() != f"step_{state.step:08d}":
            ema = b.ema.state_dict() if b.ema is not None else None
            ckpt.save(b.engines, state.step, state.to_json(), ema)
        raise StopRequested(state.step, str(ckpt.latest_path()) if ckpt is not None else None)

    # ------------------------------------------------------------------ evaluation and outputs
    def heldout_eval(self, model, with_kl: bool = True, with_extras: bool = True) -> dict[str, float]:
        """Greedy ``heldout_eval`` of ``model`` on this run's held-out prompts, with its reward (the proxy) and,
        ``with_kl``, the exact KL to its reference; with ``with_extras``, its accuracy on the ``eval.seen_prompts``
        training prompts (``seen_accuracy``) and of ``eval.sampled_answers`` sampled answers per held-out prompt
        (``sampled_accuracy``, drawn from a fork of the RNG seeded with ``project.seed``: the same draws for the
        SFT start and the actor, and training's random stream untouched)."""
        b = self.bundle
        out = heldout_eval(model, b.tokenizer, b.prompts.heldout, self.params.eval, b.device,
                           ref=b.ref if with_kl else None, reward=b.reward, synced_gpus=b.gen.synced_gpus,
                           step_judge=step_judge(self.params))
        if with_extras and b.prompts.seen is not None:
            seen = heldout_eval(model, b.tokenizer, b.prompts.seen, self.params.eval, b.device,
                                synced_gpus=b.gen.synced_gpus)
            out["seen_accuracy"] = seen["accuracy"]
        if with_extras and b.prompts.sampled is not None:
            with torch.random.fork_rng(devices=[b.device] if b.device.type == "cuda" else []):
                torch.manual_seed(self.params.project.seed)
                sampled = heldout_eval(model, b.tokenizer, b.prompts.sampled, self.params.eval, b.device,
                                       temperature=self.cfg.temperature, synced_gpus=b.gen.synced_gpus)
            out["sampled_accuracy"] = sampled["accuracy"]
        return out

    def finish(self) -> dict:
        """Final evaluation, models (actor, critic, EMA) in HF format, metrics and plots (rank 0 writes)."""
        b = self.bundle
        final = self.heldout_eval(b.actor.module) if self.do_eval else {}
        ema_model = b.ema.model(b.actor.module) if b.ema is not None else None
        ema_eval = None
        if self.do_eval and ema_model is not None and b.world == 1:
            ema_eval = self.heldout_eval(ema_model, with_kl=True, with_extras=False)  # only its accuracy is kept
        before = self.state.extra.get("before", {})
        metrics = {"algorithm": self.cfg.algorithm, "resumed_from_step": self.resumed_from,
                   **heldout_summary(before, final, ema_eval, self.params.gates.max_kl, b.prompts.has_answers),
                   **curve_summary(self.state), "world_size": b.world,
                   "zero_stage": self.params.compute.zero_stage, "precision": b.actor.precision,
                   "n_prompts": len(b.prompts.texts), "n_eval_prompts": len(b.prompts.heldout.prompts),
                   **b.ptx_counts, "wall_time_s": round(time.perf_counter() - self.t_start, 2)}
        save_models(b, self.root, self.state, self.hashes, ema_model, metrics)
        if D.is_main():
            write_metrics(self.root, metrics, self.state.curve)
            if self.log is not None:
                self.log({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, self.state.step)
        D.barrier()
        return metrics


def train_rlhf(params: Params, root: str | Path = ".", log: LogFn | None = None,
               hooks: RLHFHooks | None = None) -> dict:
    """Run the RLHF stage under ``root``; returns the stage metrics (also ``metrics/rlhf.json``). Without
    ``hooks``, sampled responses are logged as MLflow tables (``tracking.log_table``: nothing when off)."""
    trainer = RLHFTrainer(for_round(params), root, log, hooks or RLHFHooks(log_table=tracking.log_table)).setup()
    trainer.train()
    return trainer.finish()
