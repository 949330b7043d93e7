"""Everything the RL loop reads, built once (:func:`build`) into one plain :class:`RLHFBundle`.

In order: the process group and threads; the inputs, checked (``inputs.check_inputs``); the tokenizer, the
reward sources, the prompts and the ptx rows; the actor (a ``TrainEngine``), the frozen reference and, for PPO
with GAE, the critic engine; the generation settings and the ``ExperienceMaker``; the KL controller, the prompt
sampler and the EMA. Resuming from a checkpoint, the loop and the outputs are ``trainer.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from rlhf_core.algos import AdaptiveKLController, FixedKLController
from rlhf_core.config import Params, RLHFConfig
from rlhf_core.data.collate import SFTData
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.engine import distributed as D
from rlhf_core.engine.engine import TrainEngine
from rlhf_core.engine.errors import TrainingInputError
from rlhf_core.engine.sampler import ResumableSampler, StepPlan
from rlhf_core.models.loading import check_vocab_fits
from rlhf_core.passes.generation import GenerationConfig
from rlhf_core.rewards.sources import RewardSources
from rlhf_core.trainers.rlhf.algorithms import Algorithm, algorithm_for
from rlhf_core.trainers.rlhf.ema import EMA
from rlhf_core.trainers.rlhf.experience import ExperienceMaker, MakerConfig, n_minibatches
from rlhf_core.trainers.rlhf.inputs import Inputs, Prompts, check_inputs, load_prompts, load_ptx
from rlhf_core.trainers.rlhf.models import load_actor, load_critic, load_process_rewards, load_reference


@dataclass
class RLHFBundle:
    """The RL stage's config, data, models and engines, and the schedule of one iteration."""

    # config and processes
    params: Params
    cfg: RLHFConfig  # params.rlhf
    algorithm: Algorithm
    world: int
    rank: int
    threads: int
    # data
    inputs: Inputs
    tokenizer: Any
    prompts: Prompts
    reward: RewardSources
    ptx: tuple[SFTData, ResumableSampler] | None  # the ptx loss's rows and their endless sampler (rlhf.ptx_coef)
    ptx_counts: dict[str, int]  # rows kept and dropped by rlhf.ptx_min_reward ({} without ptx)
    # models
    actor: TrainEngine
    ref: Any  # the frozen reference (under LoRA possibly the actor with its adapters off)
    critic: TrainEngine | None  # PPO with GAE
    ema: EMA | None  # rlhf.ema_decay, on rank 0
    # one iteration
    per_rank_prompts: int
    n_mini: int  # mini-batches (optimizer steps) per pass over the buffer
    stop_at: int  # the iteration this run stops after (rlhf.max_steps, else rlhf.num_steps)
    total_opt: int  # optimizer steps of the whole schedule
    shared_prefix: bool
    gen: GenerationConfig
    maker: ExperienceMaker
    kl_ctl: AdaptiveKLController | FixedKLController
    sampler: ResumableSampler  # the prompts' order, per rank

    @property
    def engines(self) -> dict[str, TrainEngine]:
        """The engines a checkpoint holds: ``actor`` and (PPO with GAE) ``critic``."""
        return {"actor": self.actor, **({"critic": self.critic} if self.critic is not None else {})}

    @property
    def device(self) -> torch.device:
        return self.actor.device


def build(params: Params, root: Path) -> RLHFBundle:
    """Check the inputs and build the stage's parts (every rank; the process group is set up here)."""
    cfg, compute = params.rlhf, params.compute
    alg = algorithm_for(cfg)
    D.init_distributed()
    threads = D.set_num_threads(compute.num_threads)
    world, rank = D.world_size(), D.rank()
    inputs = check_inputs(params, root, alg.critic)
    tok = load_tokenizer(inputs.sft, params.model.trust_remote_code)
    if tok.pad_token_id is None:
        raise TrainingInputError(f"tokenizer at {inputs.sft} has no pad token")
    reward = RewardSources(cfg.reward_fns, inputs.rm if inputs.uses_rm else None, tok, cfg.rm_tokenizer_mismatch,
                           device=D.device(), batch_size=cfg.micro_batch_size * cfg.grad_accum)
    prompts = load_prompts(params, root, tok)
    ptx, ptx_counts = None, {}
    if cfg.ptx_coef > 0:
        rows = load_ptx(params, root, tok, reward.rm_scores if reward.rm is not None else None)
        ptx_counts = {"ptx_rows": rows.data.n_examples, "ptx_rows_dropped": rows.dropped}
        plan = StepPlan(len(rows.data), cfg.ptx_batch_size or cfg.micro_batch_size, 1, world, epochs=1 << 20)
        ptx = (rows.data, ResumableSampler(plan, params.project.seed + 1, rank))

    # ---- models: actor (trained), reference (frozen), critic (PPO/GAE)
    per_rank_prompts = cfg.prompts_per_step // world
    n_mini = n_minibatches(per_rank_prompts * cfg.samples_per_prompt, cfg.micro_batch_size, cfg.grad_accum)
    stop_at = min(cfg.max_steps, cfg.num_steps) if cfg.max_steps else cfg.num_steps
    total_opt = cfg.num_steps * cfg.ppo_epochs * n_mini
    actor_model = load_actor(params, inputs.actor_init)
    check_vocab_fits(tok, actor_model, str(inputs.actor_init))
    actor = TrainEngine(actor_model, compute, cfg, total_opt)
    ref = load_reference(params, inputs.reference, actor, inputs.actor_init)
    critic = None
    if alg.critic:
        critic_cfg = cfg.model_copy(update={"lr": cfg.ppo.critic_lr})
        critic = TrainEngine(load_critic(params, inputs.rm), compute, critic_cfg, total_opt)

    # ---- experience: the rollout log-probs are needed before training only when the policy moves before
    # they are used (several optimizer steps per buffer) or the KL goes into the reward; they are recorded
    # while sampling (`rollout_logprobs: generation`) or recomputed in a separate pass
    one_step_per_buffer = cfg.ppo_epochs == 1 and n_mini == 1
    # under gradient checkpointing the training forwards pack or run whole rows (``prefix_cache.checkpointed``)
    shared_prefix = cfg.shared_prefix and cfg.samples_per_prompt > 1
    gen = GenerationConfig(cfg.max_new_tokens, cfg.temperature, cfg.top_p, True,
                           synced_gpus=compute.zero_stage == 3 and world > 1,
                           record_logprobs=cfg.rollout_logprobs == "generation", engine=cfg.rollout_engine,
                           compile_step=cfg.rollout_compile and actor.device.type == "cuda",
                           free_finished=cfg.rollout_free_finished, decode_attention=cfg.rollout_attention)
    maker = ExperienceMaker(
        actor.module, ref, critic.module if critic is not None else None, reward, tok,
        MakerConfig(samples_per_prompt=cfg.samples_per_prompt, gen=gen,
                    forward_batch_size=cfg.forward_batch_size or cfg.micro_batch_size,
                    need_old_logp=alg.kl_in_reward or not one_step_per_buffer,
                    need_ref=alg.needs_reference, need_values=alg.critic, baseline=alg.baseline,
                    no_eos_penalty=cfg.no_eos_penalty, shared_prefix=shared_prefix, pack_groups=cfg.pack_groups,
                    drop_uniform_groups=alg.drop_uniform_groups, drop_unselected=alg.drop_unselected,
                    checker=params.eval.checker,
                    process=load_process_rewards(params, inputs.rm, tok, actor.device,
                                                 cfg.forward_batch_size or cfg.micro_batch_size)
                    if alg.process else None),
        device=actor.device)
    if alg.adaptive_kl:
        kl_ctl = AdaptiveKLController(cfg.kl_coef, cfg.kl_target, cfg.kl_horizon)
    else:
        kl_ctl = FixedKLController(alg.kl_coef)
    plan = StepPlan(len(prompts.texts), per_rank_prompts, 1, world, epochs=1 << 20)
    sampler = ResumableSampler(plan, params.project.seed, rank)
    ema = EMA(actor.module, cfg.ema_decay) if cfg.ema_decay is not None and D.is_main() else None
    return RLHFBundle(params=params, cfg=cfg, algorithm=alg, world=world, rank=rank, threads=threads,
                      inputs=inputs, tokenizer=tok, prompts=prompts, reward=reward, ptx=ptx, ptx_counts=ptx_counts,
                      actor=actor, ref=ref, critic=critic, ema=ema, per_rank_prompts=per_rank_prompts,
                      n_mini=n_mini, stop_at=stop_at, total_opt=total_opt, shared_prefix=shared_prefix, gen=gen,
                      maker=maker, kl_ctl=kl_ctl, sampler=sampler)
