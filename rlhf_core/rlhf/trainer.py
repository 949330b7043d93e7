"""The RLHF trainer: PPO (actor + critic) or GRPO (actor only) on the DeepSpeed training engine.

One iteration (``RLHFTrainer.step``)::

    prompts of this rank  --ExperienceMaker (per generation batch)-->  experience buffer
    compute_advantages(buffer)                       (GAE / RLOO / REINFORCE++ / group advantages)
    for epoch in ppo_epochs:  shuffled mini-batches x grad_accum micro-batches:
        actor: clipped surrogate (+KL in loss, -entropy, +ptx)  -> backward -> step
        critic (PPO/GAE): clipped value loss                    -> backward -> step
        EMA update at every optimizer step
    KL controller update (global mean KL), metrics all-reduced, rank 0 logs, checkpoint

The same code runs 1 process or N under ``torchrun``: each rank generates its share of the prompts,
gradients are all-reduced by DeepSpeed, every rank runs the same number of passes.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from rlhf_core import paths
from rlhf_core.algos import AdaptiveKLController, FixedKLController
from rlhf_core.config import Params
from rlhf_core.data.collate import Ragged, encode_prompts, left_pad_prompts
from rlhf_core.engine import distributed as D
from rlhf_core.engine.errors import NonFiniteLossError, TrainingInputError
from rlhf_core.engine.loop import LogFn, TrainState
from rlhf_core.engine.sampler import ResumableSampler, StepPlan
from rlhf_core.generation import GenerationConfig, rollout
from rlhf_core.rlhf.checkpoint import MultiEngineCheckpoint, checkpoint_dir
from rlhf_core.rlhf.experience import (
    AdvantageConfig,
    Experience,
    ExperienceMaker,
    MakerConfig,
    compute_advantages,
    minibatch_plan,
    n_minibatches,
    sampled_kl,
    zero_row,
)
from rlhf_core.rlhf.grpo import grpo_loss_config
from rlhf_core.rlhf.ppo import actor_loss, critic_loss, ppo_loss_config, ptx_loss

STAGE = "rlhf"
ACTOR_EMA_MODEL = Path("models/actor_ema")
PLOT_FILES = {"reward": "rlhf_reward.csv", "kl": "rlhf_kl.csv", "response_length": "rlhf_response_length.csv"}
# Section keys that do not change what is trained (resume fingerprint ignores them).
_NON_TRAINING_KEYS = ("save_every", "log_every", "resume", "keep_checkpoints", "max_steps")


@dataclass
class RLHFHooks:
    """Test/instrumentation hooks."""

    after_step: Callable[[int, dict], None] | None = None  # (step, metrics) after the checkpoint
    log_table: Callable[[dict, str], None] | None = None  # (columns, artifact file): sampled responses


class AdapterDisabled:
    """The reference policy under LoRA: the actor itself with its adapters switched off (no second copy)."""

    def __init__(self, peft_model):
        self.model = peft_model

    def __call__(self, *args, **kwargs):
        with self.model.disable_adapter():
            return self.model(*args, **kwargs)

    def parameters(self):
        return self.model.parameters()

    @property
    def training(self) -> bool:
        return self.model.training

    def eval(self):
        return self

    def train(self, mode: bool = True):
        return self


# --------------------------------------------------------------------------- checks
def check_inputs(params: Params, root: Path) -> dict:
    """Fail early, naming the key or path, on inputs the stage cannot use."""
    cfg = params.rlhf
    sft_dir, rm_dir = root / paths.SFT_MODEL, root / paths.RM_MODEL
    if not (sft_dir / "config.json").exists():
        raise TrainingInputError(f"{paths.SFT_MODEL}: no SFT model (actor and reference start from it); "
                                 "run `rlhf stage sft` first")
    needs_critic = cfg.algorithm == "ppo" and cfg.ppo.advantage_estimator == "gae"
    if needs_critic and not (rm_dir / "config.json").exists():
        raise TrainingInputError(
            f"{paths.RM_MODEL}: no reward model, but PPO with rlhf.ppo.advantage_estimator: gae needs a critic "
            "initialised from it; run `rlhf stage rm`, or use rlhf.algorithm: grpo or a critic-free "
            "rlhf.ppo.advantage_estimator (rloo, reinforce_pp)")
    if needs_critic:
        check_critic_tokenizer(sft_dir, rm_dir, params.model.trust_remote_code)
    world = D.world_size()
    if cfg.prompts_per_step % world:
        raise TrainingInputError(f"rlhf.prompts_per_step ({cfg.prompts_per_step}) must be divisible by the number "
                                 f"of processes ({world})")
    if cfg.ema_decay is not None and params.compute.zero_stage == 3:
        raise TrainingInputError("rlhf.ema_decay is not supported with compute.zero_stage: 3")
    from rlhf_core.rewards.registry import REWARD_FUNCTIONS
    from rlhf_core.rewards.sources import RM_SOURCE

    unknown = [k for k in cfg.reward_fns if k != RM_SOURCE and k not in REWARD_FUNCTIONS]
    if unknown:
        raise TrainingInputError(f"rlhf.reward_fns: unknown reward function(s) {unknown}; known: "
                                 f"{', '.join(sorted(REWARD_FUNCTIONS))}, {RM_SOURCE}")
    if RM_SOURCE in cfg.reward_fns and not (rm_dir / "config.json").exists():
        raise TrainingInputError(f"rlhf.reward_fns names `rm` but {paths.RM_MODEL} has no reward model; "
                                 "run `rlhf stage rm` or remove `rm`")
    return {"sft": sft_dir, "rm": rm_dir, "uses_rm": needs_critic or RM_SOURCE in cfg.reward_fns,
            "needs_critic": needs_critic}


def check_critic_tokenizer(sft_dir: Path, rm_dir: Path, trust_remote_code: bool) -> None:
    """The critic (initialised from the RM) reads the actor's token ids: refuse an RM with another vocabulary
    (the reward can be re-tokenised from text, the critic's per-token values cannot)."""
    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.rewards.sources import same_tokenizer

    if not same_tokenizer(load_tokenizer(sft_dir, trust_remote_code), load_tokenizer(rm_dir, trust_remote_code)):
        raise TrainingInputError(
            f"{paths.RM_MODEL}: its tokenizer differs from the actor's ({paths.SFT_MODEL}), but PPO with "
            "rlhf.ppo.advantage_estimator: gae initialises the critic from it and feeds it the actor's token ids; "
            "train the RM from the SFT model (rm.init_from: sft), or use a critic-free estimator (grpo, rloo, "
            "reinforce_pp), which score the RM on re-tokenised text")


def _sum_stats(total: dict[str, float], stats: dict[str, torch.Tensor], weight: float) -> None:
    for k, v in stats.items():
        total[k] = total.get(k, 0.0) + float(v) * weight


class RLHFTrainer:
    """Set up with ``setup()``, then ``step()`` per iteration (or ``train()`` for the whole run)."""

    def __init__(self, params: Params, root: str | Path = ".", log: LogFn | None = None,
                 hooks: RLHFHooks | None = None, evaluate: bool = True, checkpoints: bool = True):
        self.params, self.root, self.log = params, Path(root), log
        self.hooks = hooks or RLHFHooks()
        self.cfg = params.rlhf
        self.do_eval, self.use_ckpt = evaluate, checkpoints

    # ------------------------------------------------------------------ setup
    def setup(self) -> RLHFTrainer:
        from rlhf_core.data.tokenizer import load_tokenizer
        from rlhf_core.engine.engine import TrainEngine
        from rlhf_core.models.loading import check_vocab_fits
        from rlhf_core.rewards.sources import RewardSources
        from rlhf_core.trainers.common import read_split

        self.t_start = time.perf_counter()
        params, cfg, compute, root = self.params, self.cfg, self.params.compute, self.root
        D.init_distributed()
        self.threads = D.set_num_threads(compute.num_threads)
        self.inputs = check_inputs(params, root)
        self.tokenizer = tok = load_tokenizer(self.inputs["sft"], params.model.trust_remote_code)
        if tok.pad_token_id is None:
            raise TrainingInputError(f"tokenizer at {self.inputs['sft']} has no pad token")
        rm_path = self.inputs["rm"] if self.inputs["uses_rm"] else None
        self.reward = RewardSources(cfg.reward_fns, rm_path, tok, cfg.rm_tokenizer_mismatch, device=D.device())

        # ---- data: prompts tokenised once (same special tokens as SFT training)
        train = read_split(root, "prompts", columns=("id", "prompt", "answer"))
        self.prompts, self.answers = train["prompt"], train["answer"]
        self.has_answers = any(a is not None for a in self.answers)
        self.prompt_tokens = self._encode(self.prompts)
        evals = read_split(root, "prompts", eval_split=True, columns=("id", "prompt", "answer"))
        n_eval = min(len(evals["prompt"]), params.eval.max_prompts)
        self.eval_prompts, self.eval_answers = evals["prompt"][:n_eval], evals["answer"][:n_eval]
        self.eval_tokens = self._encode(self.eval_prompts)
        self.ptx = None
        if cfg.ptx_coef > 0:
            self._setup_ptx()

        # ---- models
        self.world, self.rank = D.world_size(), D.rank()
        self.per_rank_prompts = cfg.prompts_per_step // self.world
        self.rows_per_rank = self.per_rank_prompts * cfg.samples_per_prompt
        self.n_mini = n_minibatches(self.rows_per_rank, cfg.micro_batch_size, cfg.grad_accum)
        self.total_steps = cfg.num_steps
        self.stop_at = min(cfg.max_steps, cfg.num_steps) if cfg.max_steps else cfg.num_steps
        total_opt = cfg.num_steps * cfg.ppo_epochs * self.n_mini
        actor = self._load_actor()
        check_vocab_fits(tok, actor, str(paths.SFT_MODEL))
        self.actor = TrainEngine(actor, compute, cfg, total_opt)
        self.ref = self._load_ref()
        self.critic = None
        if self.inputs["needs_critic"]:
            critic_cfg = cfg.model_copy(update={"lr": cfg.ppo.critic_lr})
            self.critic = TrainEngine(self._load_critic(), compute, critic_cfg, total_opt)
        self.engines = {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}
        self.device = self.actor.device

        # ---- experience / losses
        ppo = cfg.algorithm == "ppo"
        one_step_per_buffer = cfg.ppo_epochs == 1 and self.n_mini == 1
        kl_coef = cfg.kl_coef if ppo else cfg.grpo.beta
        synced = compute.zero_stage == 3 and self.world > 1
        self.gen = GenerationConfig(cfg.max_new_tokens, cfg.temperature, cfg.top_p, True, synced)
        self.maker = ExperienceMaker(
            self.actor.module, self.ref, self.critic.module if self.critic is not None else None, self.reward, tok,
            MakerConfig(algorithm=cfg.algorithm, samples_per_prompt=cfg.samples_per_prompt, gen=self.gen,
                        forward_batch_size=cfg.micro_batch_size * cfg.grad_accum,
                        need_old_logp=ppo or not one_step_per_buffer, need_ref=kl_coef > 0,
                        need_values=self.critic is not None, no_eos_penalty=cfg.no_eos_penalty,
                        estimator=cfg.ppo.advantage_estimator, grpo_scale=cfg.grpo.scale,
                        score_baseline=cfg.ppo.score_baseline if ppo else "none"),
            device=self.device)
        self.adv_cfg = AdvantageConfig(cfg.algorithm, cfg.ppo.advantage_estimator, cfg.ppo.kl_in, cfg.kl_estimator,
                                       cfg.reward_clip, cfg.ppo.gamma, cfg.ppo.lam, cfg.whiten_advantages)
        self.loss_cfg = ppo_loss_config(cfg) if ppo else grpo_loss_config(cfg)
        if ppo and cfg.kl_controller == "adaptive":
            self.kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
        else:
            self.kl_ctl = FixedKLController(kl_coef)
        plan = StepPlan(len(self.prompts), self.per_rank_prompts, 1, self.world, epochs=1 << 20)
        self.sampler = ResumableSampler(plan, params.project.seed, self.rank)

        # ---- EMA (trainable parameters only; rank 0 keeps it)
        self.ema: dict[str, torch.Tensor] | None = None
        if cfg.ema_decay is not None and D.is_main():
            self.ema = {n: p.detach().clone() for n, p in self.actor.module.named_parameters() if p.requires_grad}

        # ---- resume or start
        self.state = TrainState()
        self.resumed_from = 0
        self.ckpt = None
        self.hashes = self._input_hashes()
        if self.use_ckpt:
            self.ckpt = MultiEngineCheckpoint(checkpoint_dir(root), self._fingerprint(), cfg.keep_checkpoints)
            tag = self.ckpt.prepare(cfg.resume)
            if tag is not None:
                state, ema = self.ckpt.load(self.engines, tag)
                self.state = TrainState.from_json(state)
                self.kl_ctl.load_state_dict(self.state.extra["kl_ctl"])
                if ema is not None and self.ema is not None:
                    self.ema = {k: v.to(self.device) for k, v in ema.items()}
                self.resumed_from = self.state.step
        if self.resumed_from == 0:
            if self.do_eval:
                self.state.extra["sft_eval"] = self.heldout_eval(self.actor.module, with_kl=False)
            torch.manual_seed(params.project.seed + 17 * self.rank)
        self.state.extra.setdefault("totals", {})
        if self.log is not None and D.is_main():
            self.log({"n_prompts": len(self.prompts), "n_eval_prompts": len(self.eval_prompts),
                      "rows_per_step": self.rows_per_rank * self.world, "minibatches_per_step": self.n_mini,
                      "optimizer_steps_total": total_opt, "resumed_from_step": self.resumed_from,
                      "threads": self.threads}, self.state.step)
        return self

    def _encode(self, prompts: list[str]) -> Ragged:
        # prepare already cut the prompts; the BOS a tokenizer adds may take them one over
        return encode_prompts(self.tokenizer, prompts, self.params.data.max_prompt_len)

    def _setup_ptx(self) -> None:
        from rlhf_core.data.collate import build_sft_data, encode_sequences
        from rlhf_core.trainers.common import default_max_length, read_split

        sft = read_split(self.root, "sft", columns=("id", "prompt", "response"))
        max_len = default_max_length(self.params, self.params.sft.max_length)
        seqs = encode_sequences(self.tokenizer, sft["prompt"], sft["response"], max_len,
                                str(paths.prepared_file("sft")), "sft.max_length", sft["id"])
        data = build_sft_data(seqs)
        plan = StepPlan(len(data), self.cfg.micro_batch_size, 1, D.world_size(), epochs=1 << 20)
        self.ptx = (data, ResumableSampler(plan, self.params.project.seed + 1, D.rank()))

    def _model_kwargs(self) -> dict:
        return {"trust_remote_code": self.params.model.trust_remote_code,
                "attn_implementation": self.params.compute.attn_implementation}

    def _load_actor(self):
        from rlhf_core.engine.engine import model_init_context
        from rlhf_core.models.loading import disable_dropout, load_causal_lm, prepare_for_training

        with model_init_context(self.params.compute, self.cfg):
            model = load_causal_lm(self.inputs["sft"], **self._model_kwargs())
        return disable_dropout(prepare_for_training(model, self.params.compute))

    def _load_ref(self):
        compute = self.params.compute
        if compute.lora.enabled:
            return AdapterDisabled(self.actor.module)
        from rlhf_core.engine.engine import model_init_context
        from rlhf_core.models.loading import load_causal_lm

        with model_init_context(compute, self.cfg):
            ref = load_causal_lm(self.inputs["sft"], **self._model_kwargs())
        ref.requires_grad_(False)
        if compute.zero_stage == 3:  # partitioned frozen copy (DeepSpeed-Chat's reference under ZeRO-3)
            import deepspeed

            conf = {"train_micro_batch_size_per_gpu": self.cfg.micro_batch_size,
                    "train_batch_size": self.cfg.micro_batch_size * D.world_size(),
                    "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e4},
                    "bf16": {"enabled": self.actor.precision == "bf16"},
                    "fp16": {"enabled": self.actor.precision == "fp16"}}
            ref = deepspeed.initialize(model=ref, config=conf, dist_init_required=False)[0].module
        else:
            dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(self.actor.precision)
            ref = ref.to(device=self.actor.device, dtype=dtype) if dtype else ref.to(self.actor.device)
        return ref.eval()

    def _load_critic(self):
        from rlhf_core.engine.engine import model_init_context
        from rlhf_core.models.loading import disable_dropout, prepare_for_training
        from rlhf_core.models.value_head import ValueHeadModel

        with model_init_context(self.params.compute, self.cfg):
            critic = ValueHeadModel.from_pretrained(self.inputs["rm"], require_head=True, **self._model_kwargs())
        return disable_dropout(prepare_for_training(critic, self.params.compute))

    def _input_hashes(self) -> dict[str, str]:
        from rlhf_core.trainers.common import input_hashes

        files = [paths.prepared_file("prompts"), paths.prepared_file("prompts", True)]
        if self.cfg.ptx_coef > 0:
            files.append(paths.prepared_file("sft"))
        models = {"sft": paths.SFT_MODEL, **({"rm": paths.RM_MODEL} if self.inputs["uses_rm"] else {})}
        return input_hashes(self.root, files, models)

    def _fingerprint(self) -> dict:
        params = self.params
        return {"stage": STAGE, "seed": params.project.seed,
                "section": self.cfg.model_dump(mode="json", exclude=set(_NON_TRAINING_KEYS)),
                "model": params.model.model_dump(mode="json"), "compute": params.compute.model_dump(mode="json"),
                "data_limits": [params.data.max_prompt_len, params.data.max_response_len],
                "eval": params.eval.model_dump(mode="json"), "inputs": self.hashes, "world_size": D.world_size()}

    # ------------------------------------------------------------------ one iteration
    def _columns(self, idx: list[int]) -> dict[str, list]:
        return {"answer": [self.answers[i] for i in idx]} if self.has_answers else {}

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
        parts = []
        for start in range(0, len(idx), gb):
            chunk = idx[start:start + gb]
            batch = left_pad_prompts(self.prompt_tokens, chunk, self.tokenizer.pad_token_id)
            rows = chunk.tolist()
            parts.append(self.maker.make(batch["input_ids"], batch["attention_mask"], [self.prompts[i] for i in rows],
                                         self._columns(rows), group_offset=start))
        exp = Experience.cat(parts, self.tokenizer.pad_token_id)
        info: dict[str, float] = {}
        for p in parts:
            for k, v in p.info.items():
                info[k] = info.get(k, 0.0) + v
        exp.info = info
        return exp

    def step(self) -> dict:
        cfg, step = self.cfg, self.state.step
        t0 = time.perf_counter()
        exp = self.collect(step)
        exp = compute_advantages(exp, self.adv_cfg, self.kl_ctl.value)
        t1 = time.perf_counter()
        train_stats, grad_norm = self.train_on(exp, step)
        t_train = time.perf_counter() - t1
        metrics = self._metrics(exp, train_stats, t_train, time.perf_counter() - t0)
        metrics["grad_norm"] = grad_norm if grad_norm is not None else float("nan")
        self.kl_ctl.update(metrics["kl"], int(metrics["rows"]))
        self.state.step += 1
        self.state.train_time_s += metrics["t_step"]
        totals = self.state.extra["totals"]
        for k in ("rows", "empty_dropped", "no_eos"):
            totals[k] = totals.get(k, 0.0) + metrics[k]
        self.state.curve.append({"step": self.state.step, "reward": round(metrics["score_mean"], 6),
                                 "kl": round(metrics["kl"], 6), "response_length": round(metrics["response_length"], 6),
                                 "samples_per_s": round(metrics["samples_per_s"], 3),
                                 "t_generate": round(metrics["t_generate"], 4), "t_score": round(metrics["t_score"], 4),
                                 "t_train": round(metrics["t_train"], 4)})
        self.state.extra["kl_ctl"] = self.kl_ctl.state_dict()
        if self.log is not None and D.is_main() and (self.state.step % cfg.log_every == 0 or
                                                     self.state.step in (1, self.stop_at)):
            self.log(metrics, self.state.step)
        if self.ckpt is not None and ((cfg.save_every and self.state.step % cfg.save_every == 0)
                                      or self.state.step == self.stop_at):
            ema = {k: v.cpu() for k, v in self.ema.items()} if self.ema is not None else None
            self.ckpt.save(self.engines, self.state.step, self.state.to_json(), ema)
        every = self.params.eval.table_every
        if (self.hooks.log_table is not None and D.is_main() and every
                and (self.state.step % every == 0 or self.state.step in (1, self.stop_at))):
            self.hooks.log_table(self.sample_table(), f"rlhf_samples/step_{self.state.step:05d}.json")
        if self.hooks.after_step is not None:
            self.hooks.after_step(self.state.step, metrics)
        return metrics

    def sample_table(self, rows: int = 32) -> dict[str, list]:
        """The first ``rows`` sampled responses of this iteration's last generation batch: prompt, response,
        proxy reward (the training score) and the judge's score (the checker) where one exists."""
        return {k: v[:rows] for k, v in self.maker.samples.items()}

    def _check_finite(self, value: torch.Tensor, what: str) -> None:
        bad = D.all_reduce_sum(torch.tensor([0.0 if math.isfinite(float(value)) else 1.0]))
        if float(bad[0]) > 0:
            raise NonFiniteLossError(self.state.step + 1, what, float(value),
                                     self.ckpt.latest_path() if self.ckpt else None)

    def train_on(self, exp: Experience, step: int) -> tuple[dict[str, float], float | None]:
        """``ppo_epochs`` passes over the buffer in a fixed number of shuffled mini-batches."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(self.params.project.seed * 1_000_003 + step * 1009 + self.rank)
        sums: dict[str, float] = {}
        weight_total, grad_norm = 0.0, None
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
                    n_tok = float(mb.action_mask.sum())
                    loss, stats = actor_loss(self.actor, mb, self.loss_cfg, self.kl_ctl.value)
                    logp = stats.pop("_logp")
                    if fill_logp and len(rows):
                        exp.old_logp[rows, :logp.shape[1]] = logp.float().cpu()
                    if self.ptx is not None:
                        ptx = self._ptx_loss()
                        loss = loss + cfg.ptx_coef * ptx
                        stats["ptx_loss"] = ptx.detach()
                    self._check_finite(loss.detach(), "actor loss")
                    self.actor.backward(loss)
                    boundary = self.actor.step()
                    if boundary:
                        grad_norm = self.actor.grad_norm
                        if grad_norm is not None and not math.isfinite(grad_norm):
                            raise NonFiniteLossError(self.state.step + 1, "actor gradient norm", grad_norm,
                                                     self.ckpt.latest_path() if self.ckpt else None)
                        self._ema_update()
                    if self.critic is not None:
                        closs, cstats = critic_loss(self.critic, mb, cfg.ppo.value_clip_eps, cfg.ppo.vf_coef)
                        self._check_finite(closs.detach(), "critic loss")
                        self.critic.backward(closs)
                        self.critic.step()
                        stats.update(cstats)
                    _sum_stats(sums, stats, n_tok)
                    weight_total += n_tok
        return {k: v / max(weight_total, 1.0) for k, v in sums.items()} | {"_tokens": weight_total}, grad_norm

    def _ptx_loss(self) -> torch.Tensor:
        from rlhf_core.data.collate import collate_sft

        data, sampler = self.ptx
        micro = int(self.state.extra.get("ptx_micro", 0))
        self.state.extra["ptx_micro"] = micro + 1
        batch = collate_sft(data, sampler.batch(micro), self.tokenizer.pad_token_id)
        return ptx_loss(self.actor, {k: v.to(self.device) for k, v in batch.items()})

    @torch.no_grad()
    def _ema_update(self) -> None:
        if self.ema is None:
            return
        decay = self.cfg.ema_decay
        for n, p in self.actor.module.named_parameters():
            if n in self.ema:
                self.ema[n].lerp_(p.detach(), 1.0 - decay)

    def _metrics(self, exp: Experience, train: dict[str, float], t_train: float, t_step: float) -> dict:
        """Iteration metrics, reduced over ranks (sums all-reduced, then divided)."""
        info = exp.info
        mask = exp.action_mask.bool()
        kept = float(mask.any(dim=1).sum())
        scores = torch.where(mask.any(dim=1), exp.scores, torch.zeros(()))
        seq_reward = torch.where(mask, exp.rewards, torch.zeros(())).sum(dim=1)
        kl = sampled_kl(exp, self.cfg.kl_estimator if self.cfg.algorithm == "ppo" else "k1")
        ev = torch.zeros(5)
        if exp.values is not None and exp.returns is not None:
            ret = torch.where(mask, exp.returns, torch.zeros(()))
            diff = torch.where(mask, exp.returns - exp.values, torch.zeros(()))
            ev = torch.stack([ret.sum(), (ret ** 2).sum(), diff.sum(), (diff ** 2).sum(), mask.sum().float()])
        keys = sorted(k for k in train if not k.startswith("_"))
        vec = torch.tensor([info["rows"], info["empty"], info["no_eos"], info["length_sum"], info["correct"],
                            info["group_std_sum"], info["groups"], kept, float(scores.sum()),
                            float((scores ** 2).sum()), float(seq_reward.sum()), float((seq_reward ** 2).sum()),
                            float(kl.sum()), *ev.tolist(), train["_tokens"]]
                           + [train[k] * train["_tokens"] for k in keys]
                           + [info["t_generate"], info["t_score"], t_train, t_step], dtype=torch.float64)
        vec = D.all_reduce_sum(vec)
        (rows, empty, no_eos, length_sum, correct, gstd, groups, kept, s_sum, s_sq, r_sum, r_sq, kl_sum,
         ret_s, ret_sq, d_s, d_sq, n_val, tokens) = vec[:19].tolist()
        train_vals = vec[19:19 + len(keys)].tolist()
        t_gen, t_score, t_tr, t_st = (vec[19 + len(keys):] / self.world).tolist()

        def std(s, sq, n):
            return math.sqrt(max(sq / n - (s / n) ** 2, 0.0) * n / (n - 1)) if n > 1 else 0.0

        kept = max(kept, 1.0)
        m = {"score_mean": s_sum / kept, "score_std": std(s_sum, s_sq, kept),
             "reward_mean": r_sum / kept, "reward_std": std(r_sum, r_sq, kept), "kl": kl_sum / kept,
             "kl_coef": self.kl_ctl.value, "response_length": length_sum / rows, "eos_share": 1 - no_eos / rows,
             "no_eos_share": no_eos / rows, "empty_dropped": empty, "no_eos": no_eos, "rows": rows,
             "lr": self.actor.lr, "t_generate": t_gen, "t_score": t_score, "t_train": t_tr, "t_step": t_st,
             "samples_per_s": rows / t_st if t_st > 0 else 0.0}
        if self.has_answers:  # the judge (checker) on the same sampled responses the proxy scored
            m["train_accuracy"] = m["judge_score"] = correct / rows
        if self.cfg.samples_per_prompt > 1:
            m["group_reward_std"] = gstd / max(groups, 1.0)
        if n_val > 1:
            var_r = ret_sq / n_val - (ret_s / n_val) ** 2
            var_d = d_sq / n_val - (d_s / n_val) ** 2
            m["explained_variance"] = 1 - var_d / var_r if var_r > 0 else float("nan")
        for k, v in zip(keys, train_vals, strict=True):
            m[k] = v / max(tokens, 1.0)
        if self.critic is not None:
            m["critic_lr"] = self.critic.lr
        return m

    def train(self) -> None:
        while self.state.step < self.stop_at:
            self.step()

    # ------------------------------------------------------------------ evaluation
    def heldout_eval(self, model, with_kl: bool = True) -> dict[str, float]:
        """``heldout_eval`` of ``model`` on this run's held-out prompts, against its reference and reward."""
        data = HeldOut(self.eval_prompts, self.eval_answers if self.has_answers else None, self.eval_tokens)
        return heldout_eval(model, self.ref if with_kl else None, self.tokenizer, data, self.reward,
                            self.params.eval, self.device, self.gen.synced_gpus)

    # ------------------------------------------------------------------ outputs
    def finish(self) -> dict:
        """Final evaluation, models (actor, critic, EMA) in HF format, metrics and plots (rank 0 writes)."""
        from rlhf_core.meta import dir_sha256, write_json_atomic
        from rlhf_core.models.loading import save_causal_lm, save_value_model
        from rlhf_core.trainers.common import save_final, stage_meta, write_curve

        cfg, compute, root = self.cfg, self.params.compute, self.root
        merge = compute.lora.merge_on_save
        final = self.heldout_eval(self.actor.module) if self.do_eval else {}
        sft_eval = self.state.extra.get("sft_eval", {})
        ema_eval = None
        ema_model = self._ema_model() if self.ema is not None else None
        if self.do_eval and self.cfg.ema_decay is not None:
            ema_eval = self.heldout_eval(ema_model, with_kl=True) if D.is_main() and self.world == 1 else None

        inputs = {"sft": dir_sha256(self.inputs["sft"])}
        if self.inputs["uses_rm"]:
            inputs["rm"] = dir_sha256(self.inputs["rm"])
        meta = stage_meta(STAGE, self.params, inputs, algorithm=cfg.algorithm, steps=self.state.step,
                          data=self.hashes, sft_model=str(paths.SFT_MODEL),
                          rm_model=str(paths.RM_MODEL) if self.inputs["uses_rm"] else None,
                          lora=compute.lora.enabled)
        save_final(self.actor, root / paths.ACTOR_MODEL, lambda m, d: save_causal_lm(m, d, merge_lora=merge),
                   self.tokenizer, {**meta, "role": "actor"})
        if self.critic is not None:
            save_final(self.critic, root / paths.CRITIC_MODEL, lambda m, d: save_value_model(m, d, merge_lora=merge),
                       self.tokenizer, {**meta, "role": "critic"})
        elif D.is_main():
            from rlhf_core.meta import write_meta_only

            write_meta_only(root / paths.CRITIC_MODEL, {**meta, "role": "critic", "critic": None,
                                                        "reason": f"{cfg.algorithm} trains no critic"})
        if ema_model is not None and D.is_main():
            self._save_plain(ema_model, root / ACTOR_EMA_MODEL, {**meta, "role": "actor_ema",
                                                                 "ema_decay": cfg.ema_decay})
        D.barrier()

        curve = self.state.curve
        head, tail = curve[:3], curve[-3:]

        def avg(rows, key):
            return sum(r[key] for r in rows) / len(rows) if rows else None

        metrics = {
            "algorithm": cfg.algorithm, "steps": self.state.step, "resumed_from_step": self.resumed_from,
            "sft_accuracy": sft_eval.get("accuracy"), "accuracy": final.get("accuracy"),
            "accuracy_gain": (final["accuracy"] - sft_eval["accuracy"]) if "accuracy" in final and sft_eval else None,
            "proxy_reward": final.get("proxy_reward"), "sft_proxy_reward": sft_eval.get("proxy_reward"),
            "reward_hacking_suspected": hacking_suspected(sft_eval, final) if self.has_answers else None,
            "kl_to_reference": final.get("kl_to_reference"), "kl_bound": self.params.gates.max_kl,
            "kl_within_bound": (final["kl_to_reference"] <= self.params.gates.max_kl) if final else None,
            "eos_share": final.get("eos_share"), "response_length": final.get("response_length"),
            "sft_eos_share": sft_eval.get("eos_share"),
            "ema_accuracy": ema_eval["accuracy"] if ema_eval else None,
            "train_reward_first": avg(head, "reward"), "train_reward_last": avg(tail, "reward"),
            "train_kl_last": avg(tail, "kl"), "samples_per_s": avg(curve, "samples_per_s"),
            "time_generate_s": sum(r["t_generate"] for r in curve), "time_score_s": sum(r["t_score"] for r in curve),
            "time_train_s": sum(r["t_train"] for r in curve), "train_time_s": round(self.state.train_time_s, 3),
            "empty_dropped_total": self.state.extra["totals"].get("empty_dropped", 0.0),
            "no_eos_total": self.state.extra["totals"].get("no_eos", 0.0),
            "rows_total": self.state.extra["totals"].get("rows", 0.0),
            "world_size": self.world, "zero_stage": compute.zero_stage, "precision": self.actor.precision,
            "n_prompts": len(self.prompts), "n_eval_prompts": len(self.eval_prompts),
            "wall_time_s": round(time.perf_counter() - self.t_start, 2),
        }
        if D.is_main():
            write_json_atomic(root / paths.METRICS / f"{STAGE}.json", metrics)
            for key, name in PLOT_FILES.items():
                write_curve(root / paths.PLOTS / name, [{"step": r["step"], "value": r[key]} for r in curve],
                            ("step", "value"))
            if self.log is not None:
                self.log({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, self.state.step)
        D.barrier()
        return metrics

    def _ema_model(self):
        """A copy of the actor with the EMA weights (rank 0)."""
        model = copy.deepcopy(self.actor.module)
        with torch.no_grad():
            for n, p in model.named_parameters():
                if n in self.ema:
                    p.copy_(self.ema[n])
        return model.eval()

    def _save_plain(self, model, target: Path, meta: dict) -> None:
        from rlhf_core.engine.checkpoint import atomic_dir
        from rlhf_core.meta import write_meta
        from rlhf_core.models.loading import save_causal_lm

        with atomic_dir(target) as tmp:
            save_causal_lm(model, tmp, merge_lora=self.params.compute.lora.merge_on_save)
            self.tokenizer.save_pretrained(tmp)
            write_meta(tmp, meta)


def hacking_suspected(before: dict, after: dict) -> bool | None:
    """The proxy (training reward) rose on the held-out answers while the judge's accuracy fell."""
    if not before or not after:
        return None
    return after["proxy_reward"] > before["proxy_reward"] and after["accuracy"] < before["accuracy"]


@dataclass
class HeldOut:
    """Held-out prompts (text, answers or None, tokens as in training)."""

    prompts: list[str]
    answers: list | None
    tokens: Ragged


@torch.no_grad()
def heldout_eval(model, ref, tokenizer, data: HeldOut, reward, ev, device, synced_gpus: bool = False
                 ) -> dict[str, float]:
    """Greedy decoding on the held-out prompts (``eval.max_new_tokens``), sharded over ranks: the judge's
    exact-answer accuracy, the proxy reward (``reward``: the training reward sources), EOS share, length and,
    with a ``ref``, the exact KL to it, ``mean_i sum_t KL(pi(.|prefix) || pi_ref(.|prefix))`` (as ``rlhf stage
    evaluate``). Used for our actor and for TRL's in the learning comparison: one evaluator."""
    from rlhf_core.rewards import check_answer
    from rlhf_core.stages.evaluate import sequence_kl
    from rlhf_core.trainers.common import shard_for_eval

    idx, weight = shard_for_eval(len(data.prompts))
    gen = GenerationConfig(ev.max_new_tokens, do_sample=False, synced_gpus=synced_gpus)
    was_training = model.training
    model.eval()
    sums = torch.zeros(6, dtype=torch.float64)  # correct, eos, length, kl, proxy reward, n
    for i in range(0, len(idx), ev.batch_size):
        rows, w = idx[i:i + ev.batch_size], weight[i:i + ev.batch_size].double()
        batch = left_pad_prompts(data.tokens, rows, tokenizer.pad_token_id)
        roll = rollout(model, batch["input_ids"], batch["attention_mask"], tokenizer, gen)
        answers = [data.answers[j] for j in rows.tolist()] if data.answers is not None else None
        ok = torch.tensor([check_answer(t, a) for t, a in zip(roll.texts, answers, strict=True)]
                          if answers is not None else [0.0] * len(rows), dtype=torch.float64)
        ended = (roll.responses == tokenizer.eos_token_id).any(dim=1).double()
        length = roll.action_mask.sum(dim=1).double()
        prompts = [data.prompts[j] for j in rows.tolist()]
        proxy = reward(prompts, roll.texts, **({"answer": answers} if answers is not None else {})).double()
        kl = torch.zeros_like(w)
        if ref is not None:
            dev_roll = type(roll)(roll.prompt_ids.to(device), roll.prompt_mask.to(device),
                                  roll.responses.to(device), roll.action_mask.to(device), roll.texts)
            kl = sequence_kl(model, ref, dev_roll, ev.batch_size).double().cpu()
        sums += torch.stack([(ok * w).sum(), (ended * w).sum(), (length * w).sum(), (kl * w).sum(),
                             (proxy * w).sum(), w.sum()])
    model.train(was_training)
    sums = D.all_reduce_sum(sums)
    n = float(sums[5].clamp(min=1))
    out = {"accuracy": float(sums[0]) / n, "eos_share": float(sums[1]) / n, "response_length": float(sums[2]) / n,
           "proxy_reward": float(sums[4]) / n}
    if ref is not None:
        out["kl_to_reference"] = float(sums[3]) / n
    return out


def train_rlhf(params: Params, root: str | Path = ".", log: LogFn | None = None,
               hooks: RLHFHooks | None = None) -> dict:
    """Run the RLHF stage under ``root``; returns the stage metrics (also ``metrics/rlhf.json``)."""
    trainer = RLHFTrainer(params, root, log, hooks).setup()
    trainer.train()
    return trainer.finish()
