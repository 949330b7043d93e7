"""``rlhf stage rlhf``: PPO (actor + critic) or GRPO (actor only) on the DeepSpeed training engine.

Reads ``models/sft`` (actor init and frozen reference), ``models/rm`` (PPO critic init; the reward model when
``rlhf.reward_fns`` names ``rm``) and ``data/prepared/{prompts,eval_prompts}.parquet`` (``sft.parquet`` for the
ptx loss). Writes ``models/actor/``, ``models/critic/`` (PPO with GAE), ``models/actor_ema/`` (``rlhf.ema_decay``),
``metrics/rlhf.json`` and ``plots/rlhf_{reward,kl,response_length}.csv``; resumable checkpoints in
``checkpoints/rlhf/``. Runs in one process, or N under ``torchrun --nproc_per_node N -m rlhf_core.cli stage rlhf``.

One iteration (``RLHFTrainer.step``), in the order of CleanRL's loop::

    collect      prompts of this rank --ExperienceMaker (per generation batch)--> experience buffer
    advantages   Algorithm.advantages(buffer)            (GRPO / GAE / RLOO / REINFORCE++, ``algorithms.py``)
    train        for epoch in ppo_epochs: shuffled mini-batches x grad_accum micro-batches:
                     actor: clipped surrogate (+KL in loss, -entropy, +ptx) -> backward -> step (EMA update)
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

from rlhf_core import paths
from rlhf_core.algos import AdaptiveKLController, FixedKLController
from rlhf_core.config import Params
from rlhf_core.data.collate import left_pad_prompts
from rlhf_core.engine import distributed as D
from rlhf_core.engine.errors import NonFiniteLossError, TrainingInputError
from rlhf_core.engine.loop import LogFn
from rlhf_core.engine.sampler import ResumableSampler, StepPlan
from rlhf_core.engine.stop import StopRequested, stop_requested
from rlhf_core.evaluation import heldout_eval
from rlhf_core.generation import GenerationConfig
from rlhf_core.trainers.rlhf.algorithms import algorithm_for, compute_advantages
from rlhf_core.trainers.rlhf.checkpoint import MultiEngineCheckpoint, checkpoint_dir
from rlhf_core.trainers.rlhf.ema import EMA
from rlhf_core.trainers.rlhf.experience import (
    Experience,
    ExperienceMaker,
    MakerConfig,
    minibatch_plan,
    n_minibatches,
    zero_row,
)
from rlhf_core.trainers.rlhf.metrics import (
    all_reduce_named,
    buffer_sums,
    curve_summary,
    heldout_summary,
    iteration_metrics,
)
from rlhf_core.trainers.rlhf.ppo import actor_loss, critic_loss, ptx_loss

STAGE = "rlhf"
ACTOR_EMA_MODEL = Path("models/actor_ema")
PLOT_FILES = {"reward": "rlhf_reward.csv", "kl": "rlhf_kl.csv", "response_length": "rlhf_response_length.csv"}
CURVE_KEYS = {"reward": "score_mean", "kl": "kl", "response_length": "response_length",
              "samples_per_s": "samples_per_s", "t_generate": "t_generate", "t_score": "t_score", "t_train": "t_train"}


@dataclass
class RLHFHooks:
    """Test/instrumentation hooks."""

    after_step: Callable[[int, dict], None] | None = None  # (step, metrics) after the checkpoint
    log_table: Callable[[dict, str], None] | None = None  # (columns, artifact file): sampled responses


class RLHFTrainer:
    """Set up with ``setup()``, then ``step()`` per iteration (or ``train()`` for the whole run), ``finish()``."""

    def __init__(self, params: Params, root: str | Path = ".", log: LogFn | None = None,
                 hooks: RLHFHooks | None = None, evaluate: bool = True, checkpoints: bool = True):
        self.params, self.root, self.log = params, Path(root), log
        self.hooks = hooks or RLHFHooks()
        self.cfg = params.rlhf
        self.algorithm = algorithm_for(self.cfg)
        self.do_eval, self.use_ckpt = evaluate, checkpoints

    # ------------------------------------------------------------------ setup
    def setup(self) -> RLHFTrainer:
        from rlhf_core.data.tokenizer import load_tokenizer
        from rlhf_core.engine.engine import TrainEngine
        from rlhf_core.models.loading import check_vocab_fits
        from rlhf_core.rewards.sources import RewardSources
        from rlhf_core.trainers.rlhf.inputs import check_inputs, load_prompts, load_ptx
        from rlhf_core.trainers.rlhf.models import load_actor, load_critic, load_reference

        self.t_start = time.perf_counter()
        params, cfg, alg, compute, root = self.params, self.cfg, self.algorithm, self.params.compute, self.root
        D.init_distributed()
        self.threads = D.set_num_threads(compute.num_threads)
        self.world, self.rank = D.world_size(), D.rank()
        self.inputs = check_inputs(params, root, alg.critic)
        self.tokenizer = tok = load_tokenizer(self.inputs.sft, params.model.trust_remote_code)
        if tok.pad_token_id is None:
            raise TrainingInputError(f"tokenizer at {self.inputs.sft} has no pad token")
        self.reward = RewardSources(cfg.reward_fns, self.inputs.rm if self.inputs.uses_rm else None, tok,
                                    cfg.rm_tokenizer_mismatch, device=D.device(),
                                    batch_size=cfg.micro_batch_size * cfg.grad_accum)
        self.prompts = load_prompts(params, root, tok)
        self.ptx, self.ptx_counts = None, {}
        if cfg.ptx_coef > 0:
            rows = load_ptx(params, root, tok, self.reward.rm_scores if self.reward.rm is not None else None)
            self.ptx_counts = {"ptx_rows": rows.data.n_examples, "ptx_rows_dropped": rows.dropped}
            plan = StepPlan(len(rows.data), cfg.ptx_batch_size or cfg.micro_batch_size, 1, self.world,
                            epochs=1 << 20)
            self.ptx = (rows.data, ResumableSampler(plan, params.project.seed + 1, self.rank))

        # ---- models: actor (trained), reference (frozen), critic (PPO/GAE)
        self.per_rank_prompts = cfg.prompts_per_step // self.world
        self.n_mini = n_minibatches(self.per_rank_prompts * cfg.samples_per_prompt, cfg.micro_batch_size,
                                    cfg.grad_accum)
        self.stop_at = min(cfg.max_steps, cfg.num_steps) if cfg.max_steps else cfg.num_steps
        total_opt = cfg.num_steps * cfg.ppo_epochs * self.n_mini
        actor = load_actor(params, self.inputs.actor_init)
        check_vocab_fits(tok, actor, str(self.inputs.actor_init))
        self.actor = TrainEngine(actor, compute, cfg, total_opt)
        self.ref = load_reference(params, self.inputs.reference, self.actor, self.inputs.actor_init)
        self.critic = None
        if alg.critic:
            critic_cfg = cfg.model_copy(update={"lr": cfg.ppo.critic_lr})
            self.critic = TrainEngine(load_critic(params, self.inputs.rm), compute, critic_cfg, total_opt)
        self.engines = {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}
        self.device = self.actor.device

        # ---- experience: the rollout log-probs are needed before training only when the policy moves before
        # they are used (several optimizer steps per buffer) or the KL goes into the reward; they are recorded
        # while sampling (`rollout_logprobs: generation`) or recomputed in a separate pass
        one_step_per_buffer = cfg.ppo_epochs == 1 and self.n_mini == 1
        # a checkpointed layer re-runs its forward in backward and would append to the shared KV cache twice
        self.shared_prefix = cfg.shared_prefix and cfg.samples_per_prompt > 1 and not compute.gradient_checkpointing
        self.gen = GenerationConfig(cfg.max_new_tokens, cfg.temperature, cfg.top_p, True,
                                    synced_gpus=compute.zero_stage == 3 and self.world > 1,
                                    record_logprobs=cfg.rollout_logprobs == "generation")
        self.maker = ExperienceMaker(
            self.actor.module, self.ref, self.critic.module if self.critic is not None else None, self.reward, tok,
            MakerConfig(samples_per_prompt=cfg.samples_per_prompt, gen=self.gen,
                        forward_batch_size=cfg.micro_batch_size * cfg.grad_accum,
                        need_old_logp=alg.kl_in_reward or not one_step_per_buffer,
                        need_ref=alg.needs_reference, need_values=alg.critic, baseline=alg.baseline,
                        no_eos_penalty=cfg.no_eos_penalty, shared_prefix=self.shared_prefix,
                        pack_groups=cfg.pack_groups,
                        drop_uniform_groups=alg.drop_uniform_groups, checker=params.eval.checker),
            device=self.device)
        if alg.adaptive_kl:
            self.kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
        else:
            self.kl_ctl = FixedKLController(alg.kl_coef)
        plan = StepPlan(len(self.prompts.texts), self.per_rank_prompts, 1, self.world, epochs=1 << 20)
        self.sampler = ResumableSampler(plan, params.project.seed, self.rank)

        self.ema = EMA(self.actor.module, cfg.ema_decay) if cfg.ema_decay is not None and D.is_main() else None

        self._resume_or_start()
        if self.log is not None and D.is_main():
            self.log({"n_prompts": len(self.prompts.texts), "n_eval_prompts": len(self.prompts.heldout.prompts),
                      "rows_per_step": self.per_rank_prompts * cfg.samples_per_prompt * self.world,
                      "minibatches_per_step": self.n_mini, "optimizer_steps_total": total_opt,
                      "shared_prefix": float(self.shared_prefix), **self.ptx_counts,
                      "resumed_from_step": self.resumed_from, "threads": self.threads}, self.state.step)
        return self

    def _resume_or_start(self) -> None:
        """Continue from the newest matching checkpoint (engines, RNG, KL controller, EMA) or start fresh
        (the SFT model's held-out evaluation kept as ``state.extra["before"]``)."""
        from rlhf_core.engine.loop import TrainState
        from rlhf_core.trainers.common import fingerprint, input_hashes, resume_or_start

        params, cfg = self.params, self.cfg
        files = [paths.prepared_file("prompts"), paths.prepared_file("prompts", True)]
        if cfg.ptx_coef > 0:
            files.append(paths.prepared_file("sft"))
        round_start = {"actor_init": self.inputs.actor_init} if self.inputs.actor_init != self.inputs.sft else {}
        self.hashes = input_hashes(self.root, files, {"sft": paths.SFT_MODEL, **round_start,
                                                      **({"rm": paths.RM_MODEL} if self.inputs.uses_rm else {})})
        initial = (lambda: self.heldout_eval(self.actor.module, with_kl=False)) if self.do_eval else dict
        self.ckpt = None
        if not self.use_ckpt:
            self.state, self.resumed_from = TrainState(), 0
            self.state.extra["before"] = initial()
            torch.manual_seed(params.project.seed + 17 * self.rank)
        else:
            fp = fingerprint(params, STAGE, cfg, self.hashes, ignore=("max_steps",),
                             eval=params.eval.model_dump(mode="json"))
            self.ckpt = MultiEngineCheckpoint(checkpoint_dir(self.root), fp, cfg.keep_checkpoints)
            self.state, self.resumed_from = resume_or_start(self.ckpt, self.engines, cfg.resume, initial,
                                                            params.project.seed)
            if self.resumed_from:
                self.kl_ctl.load_state_dict(self.state.extra["kl_ctl"])
                ema = self.ckpt.load_ema(self.ckpt.latest_tag())
                if ema is not None and self.ema is not None:
                    self.ema.load_state_dict(ema)
        self.state.extra.setdefault("totals", {})

    # ------------------------------------------------------------------ one iteration
    def prompt_indices(self, step: int) -> torch.Tensor:
        """This rank's prompts for iteration ``step``: always ``prompts_per_step / world`` of them, read from the
        endless stream of per-epoch permutations (sharded ``rank::world``), so a batch that reaches the end of
        an epoch continues into the next one. Depends only on (seed, step, rank): resumable."""
        n, per = self.per_rank_prompts, self.sampler.plan.per_rank
        pos = torch.arange(step * n, (step + 1) * n)
        epochs = pos // per
        out = torch.empty(n, dtype=torch.long)
        for e in epochs.unique().tolist():
            sel = epochs == e
            out[sel] = self.sampler.shard(e)[pos[sel] % per]
        return out

    def collect(self, step: int) -> Experience:
        """This rank's experience buffer for iteration ``step`` (generation batches concatenated)."""
        idx = self.prompt_indices(step)
        gb = self.cfg.generation_batch_size or len(idx)
        p = self.prompts
        parts = []
        for start in range(0, len(idx), gb):
            rows = idx[start:start + gb]
            batch = left_pad_prompts(p.tokens, rows, self.tokenizer.pad_token_id)
            columns = {"answer": [p.answers[i] for i in rows.tolist()]} if p.has_answers else {}
            parts.append(self.maker.make(batch["input_ids"], batch["attention_mask"],
                                         [p.texts[i] for i in rows.tolist()], columns, group_offset=start))
        exp = Experience.cat(parts, self.tokenizer.pad_token_id)
        exp.info = {k: sum(part.info[k] for part in parts) for k in parts[0].info}
        return exp

    def step(self) -> dict:
        t0 = time.perf_counter()
        exp = self.collect(self.state.step)
        exp = compute_advantages(exp, self.algorithm, self.kl_ctl.value)
        t1 = time.perf_counter()
        train, grad_norm = self.train_on(exp, self.state.step)
        t_train = time.perf_counter() - t1
        metrics = self._log_step(exp, train, t_train, time.perf_counter() - t0, grad_norm)
        if self.hooks.after_step is not None:
            self.hooks.after_step(self.state.step, metrics)
        return metrics

    def train_on(self, exp: Experience, step: int) -> tuple[dict[str, float], float | None]:
        """``ppo_epochs`` passes over the buffer in a fixed number of shuffled mini-batches; returns the
        token-weighted sums of the loss statistics (``{stat: sum stat * tokens, "tokens": ...}``) and the
        last gradient norm."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(self.params.project.seed * 1_000_003 + step * 1009 + self.rank)
        sums: dict[str, float] = {"tokens": 0.0}
        grad_norm = None
        self.actor.train()
        if self.critic is not None:
            self.critic.train()
        # Without stored rollout log-probs (one optimizer step per buffer) the first pass computes them with
        # the unchanged policy: keep them for the KL metrics.
        fill_logp = exp.old_logp is None
        if fill_logp:
            exp.old_logp = torch.zeros(exp.action_mask.shape)
        for _ in range(cfg.ppo_epochs):
            for minibatch in minibatch_plan(exp.group, self.n_mini, cfg.grad_accum, gen):
                for rows in minibatch:
                    mb = (exp.select(rows) if len(rows) else zero_row(exp)).to(self.device)
                    if fill_logp:
                        mb.old_logp = None
                    loss, stats = actor_loss(self.actor, mb, self.algorithm.loss, self.kl_ctl.value,
                                             self.shared_prefix, cfg.pack_groups)
                    logp = stats.pop("_logp")
                    if fill_logp and len(rows):
                        exp.old_logp[rows, :logp.shape[1]] = logp.float().cpu()
                    if self.ptx is not None:
                        ptx = self._ptx_loss()
                        loss = loss + cfg.ptx_coef * ptx
                        stats["ptx_loss"] = ptx.detach()
                    self._check_finite(loss.detach(), "actor loss")
                    self.actor.backward(loss)
                    if self.actor.step():
                        grad_norm = self._checked_grad_norm()
                        if self.ema is not None:
                            self.ema.update(self.actor.module)
                    if self.critic is not None:
                        closs, cstats = critic_loss(self.critic, mb, cfg.ppo.value_clip_eps, cfg.ppo.vf_coef,
                                                     self.shared_prefix)
                        self._check_finite(closs.detach(), "critic loss")
                        self.critic.backward(closs)
                        self.critic.step()
                        stats.update(cstats)
                    n_tok = float(mb.action_mask.sum())
                    for k, v in stats.items():
                        sums[k] = sums.get(k, 0.0) + float(v) * n_tok
                    sums["tokens"] += n_tok
        return sums, grad_norm

    def _log_step(self, exp: Experience, train: dict[str, float], t_train: float, t_step: float,
                  grad_norm: float | None) -> dict:
        """Reduce the iteration's metrics, advance the state (KL controller, curve, totals), log, checkpoint,
        and every ``eval.table_every`` iterations log a table of sampled responses."""
        cfg, state = self.cfg, self.state
        sums = buffer_sums(exp, self.algorithm.kl_metric) | {"t_train": t_train, "t_step": t_step}
        reduced = all_reduce_named(sums | {f"train.{k}": v for k, v in train.items()})
        train_sums = {k.removeprefix("train."): v for k, v in reduced.items() if k.startswith("train.")}
        m = iteration_metrics({k: v for k, v in reduced.items() if not k.startswith("train.")}, train_sums,
                              self.world, self.prompts.has_answers, cfg.samples_per_prompt > 1)
        m |= {"kl_coef": self.kl_ctl.value, "lr": self.actor.lr,
              "grad_norm": grad_norm if grad_norm is not None else float("nan"),
              **({"critic_lr": self.critic.lr} if self.critic is not None else {})}
        self.kl_ctl.update(m["kl"], int(m["rows"]))
        state.step += 1
        state.train_time_s += m["t_step"]
        totals = state.extra["totals"]
        for k in ("rows", "empty_dropped", "uniform_dropped", "no_eos"):
            totals[k] = totals.get(k, 0.0) + m[k]
        state.curve.append({"step": state.step} | {k: round(m[src], 6) for k, src in CURVE_KEYS.items()})
        state.extra["kl_ctl"] = self.kl_ctl.state_dict()
        edge = state.step in (1, self.stop_at)
        if self.log is not None and D.is_main() and (state.step % cfg.log_every == 0 or edge):
            self.log(m, state.step)
        if self.ckpt is not None and ((cfg.save_every and state.step % cfg.save_every == 0)
                                      or state.step == self.stop_at):
            self.ckpt.save(self.engines, state.step, state.to_json(),
                           self.ema.state_dict() if self.ema is not None else None)
        every = self.params.eval.table_every
        if self.hooks.log_table is not None and D.is_main() and every and (state.step % every == 0 or edge):
            self.hooks.log_table(self.sample_table(), f"rlhf_samples/step_{state.step:05d}.json")
        return m

    def train(self) -> None:
        while self.state.step < self.stop_at:
            self.step()
            if stop_requested():  # SIGTERM: checkpoint this iteration and leave (a re-run resumes here)
                self._stop()

    def _stop(self) -> None:
        ckpt, state = self.ckpt, self.state
        if ckpt is not None and ckpt.latest_tag() != f"step_{state.step:08d}":
            ema = self.ema.state_dict() if self.ema is not None else None
            ckpt.save(self.engines, state.step, state.to_json(), ema)
        raise StopRequested(state.step, str(ckpt.latest_path()) if ckpt is not None else None)

    def sample_table(self, rows: int = 32) -> dict[str, list]:
        """The first ``rows`` sampled responses of this iteration's last generation batch: prompt, response,
        proxy reward (the training score) and the judge's score (the checker) where one exists."""
        return {k: v[:rows] for k, v in self.maker.samples.items()}

    def _check_finite(self, value: torch.Tensor, what: str) -> None:
        bad = D.all_reduce_sum(torch.tensor([0.0 if math.isfinite(float(value)) else 1.0]))
        if float(bad[0]) > 0:
            raise NonFiniteLossError(self.state.step + 1, what, float(value),
                                     self.ckpt.latest_path() if self.ckpt else None)

    def _checked_grad_norm(self) -> float | None:
        grad_norm = self.actor.grad_norm
        if grad_norm is not None and not math.isfinite(grad_norm):
            raise NonFiniteLossError(self.state.step + 1, "actor gradient norm", grad_norm,
                                     self.ckpt.latest_path() if self.ckpt else None)
        return grad_norm

    def _ptx_loss(self) -> torch.Tensor:
        from rlhf_core.data.collate import collate_sft

        data, sampler = self.ptx
        micro = int(self.state.extra.get("ptx_micro", 0))
        self.state.extra["ptx_micro"] = micro + 1
        batch = collate_sft(data, sampler.batch(micro), self.tokenizer.pad_token_id)
        return ptx_loss(self.actor, {k: v.to(self.device) for k, v in batch.items()})

    # ------------------------------------------------------------------ evaluation
    def heldout_eval(self, model, with_kl: bool = True) -> dict[str, float]:
        """Greedy ``heldout_eval`` of ``model`` on this run's held-out prompts, with its reward (the proxy) and,
        ``with_kl``, the exact KL to its reference."""
        return heldout_eval(model, self.tokenizer, self.prompts.heldout, self.params.eval, self.device,
                            ref=self.ref if with_kl else None, reward=self.reward, synced_gpus=self.gen.synced_gpus)

    # ------------------------------------------------------------------ outputs
    def finish(self) -> dict:
        """Final evaluation, models (actor, critic, EMA) in HF format, metrics and plots (rank 0 writes)."""
        from rlhf_core.atomic import write_json_atomic
        from rlhf_core.trainers.common import write_curve

        final = self.heldout_eval(self.actor.module) if self.do_eval else {}
        ema_model = self.ema.model(self.actor.module) if self.ema is not None else None
        ema_eval = None
        if self.do_eval and ema_model is not None and self.world == 1:
            ema_eval = self.heldout_eval(ema_model, with_kl=True)
        before = self.state.extra.get("before", {})
        metrics = {"algorithm": self.cfg.algorithm, "resumed_from_step": self.resumed_from,
                   **heldout_summary(before, final, ema_eval, self.params.gates.max_kl, self.prompts.has_answers),
                   **curve_summary(self.state), "world_size": self.world,
                   "zero_stage": self.params.compute.zero_stage, "precision": self.actor.precision,
                   "n_prompts": len(self.prompts.texts), "n_eval_prompts": len(self.prompts.heldout.prompts),
                   **self.ptx_counts, "wall_time_s": round(time.perf_counter() - self.t_start, 2)}
        self._save_models(ema_model, metrics)
        if D.is_main():
            write_json_atomic(self.root / paths.METRICS / f"{STAGE}.json", metrics)
            for key, name in PLOT_FILES.items():
                write_curve(self.root / paths.PLOTS / name,
                            [{"step": r["step"], "value": r[key]} for r in self.state.curve], ("step", "value"))
            if self.log is not None:
                self.log({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, self.state.step)
        D.barrier()
        return metrics

    def _save_models(self, ema_model, metrics: dict) -> None:
        """``models/actor``, ``models/critic`` (meta only without a critic), ``models/actor_ema``; atomic, each
        with its model card (the held-out ``metrics`` in the actor's)."""
        from rlhf_core.meta import dir_sha256, write_meta_only
        from rlhf_core.model_card import render_model_card
        from rlhf_core.models.loading import save_causal_lm, save_value_model
        from rlhf_core.trainers.common import save_final, stage_meta

        cfg, root, merge = self.cfg, self.root, self.params.compute.lora.merge_on_save
        inputs = {"sft": dir_sha256(self.inputs.sft), **({"rm": dir_sha256(self.inputs.rm)}
                                                          if self.inputs.uses_rm else {}),
                  **({"actor_init": dir_sha256(self.inputs.actor_init)} if self.inputs.actor_init != self.inputs.sft
                     else {})}
        meta = stage_meta(STAGE, self.params, inputs, algorithm=cfg.algorithm, steps=self.state.step,
                          data=self.hashes, sft_model=str(paths.SFT_MODEL),
                          rm_model=str(paths.RM_MODEL) if self.inputs.uses_rm else None,
                          lora=self.params.compute.lora.enabled, feedback_round=self.params.feedback.round,
                          actor_init=str(self.inputs.actor_init.relative_to(self.root)))

        def card(role: str, with_metrics: bool = True) -> str:
            return render_model_card({**meta, "role": role}, self.params, metrics if with_metrics else None)

        save_final(self.actor, root / paths.ACTOR_MODEL, lambda m, d: save_causal_lm(m, d, merge_lora=merge),
                   self.tokenizer, {**meta, "role": "actor"}, card=card("actor"))
        if self.critic is not None:
            pad_id = self.tokenizer.pad_token_id
            save_final(self.critic, root / paths.CRITIC_MODEL, lambda m, d: save_value_model(m, d, merge, pad_id),
                       self.tokenizer, {**meta, "role": "critic"}, card=card("critic", with_metrics=False))
        elif D.is_main():
            write_meta_only(root / paths.CRITIC_MODEL, {**meta, "role": "critic", "critic": None,
                                                        "reason": f"{cfg.algorithm} trains no critic"})
        if ema_model is not None and D.is_main():
            self._save_plain(ema_model, root / ACTOR_EMA_MODEL, {**meta, "role": "actor_ema",
                                                                 "ema_decay": cfg.ema_decay}, card("actor_ema", False))
        D.barrier()

    def _save_plain(self, model, target: Path, meta: dict, card: str) -> None:
        from rlhf_core.atomic import atomic_dir, write_text_atomic
        from rlhf_core.integrity import seal_model_dir
        from rlhf_core.meta import write_meta
        from rlhf_core.model_card import CARD_FILE
        from rlhf_core.models.loading import save_causal_lm

        with atomic_dir(target) as tmp:
            save_causal_lm(model, tmp, merge_lora=self.params.compute.lora.merge_on_save)
            self.tokenizer.save_pretrained(tmp)
            write_meta(tmp, meta)
            write_text_atomic(Path(tmp) / CARD_FILE, card)
            seal_model_dir(Path(tmp))


def train_rlhf(params: Params, root: str | Path = ".", log: LogFn | None = None,
               hooks: RLHFHooks | None = None) -> dict:
    """Run the RLHF stage under ``root``; returns the stage metrics (also ``metrics/rlhf.json``). Without
    ``hooks``, sampled responses are logged as MLflow tables (``tracking.log_table``: nothing when off)."""
    from rlhf_core import tracking
    from rlhf_core.config import for_round

    trainer = RLHFTrainer(for_round(params), root, log, hooks or RLHFHooks(log_table=tracking.log_table)).setup()
    trainer.train()
    return trainer.finish()
