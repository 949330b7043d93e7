"""The RL stage's models: the actor and the frozen reference from ``models/sft``, the critic from ``models/rm``.

The actor and critic train with dropout off (TRL does the same): the rollout pass runs in eval mode, so
with dropout the first PPO ratio would not be 1. Under LoRA the reference is the actor with its adapters
switched off (no second copy); under ZeRO-3 it is a partitioned frozen DeepSpeed module
(DeepSpeed-Chat's reference).
"""

from __future__ import annotations

from pathlib import Path

import torch

from rlhf_core.config import Params
from rlhf_core.engine import distributed as D
from rlhf_core.engine.engine import model_init_context
from rlhf_core.models.implicit_reward import is_implicit
from rlhf_core.models.loading import disable_dropout, load_causal_lm, prepare_for_training
from rlhf_core.models.scorer import ENSEMBLE_FILE, read_ensemble_spec
from rlhf_core.models.value_head import ValueHeadModel
from rlhf_core.ops.integrity import verify_model_dir
from rlhf_core.trainers.rlhf.experience import ProcessRewards
from rlhf_core.trainers.rm_process import delimiter_token


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


def _model_kwargs(params: Params) -> dict:
    return {"trust_remote_code": params.model.trust_remote_code,
            "attn_implementation": params.compute.attn_implementation}


def load_actor(params: Params, sft_dir: Path):
    """The trainable policy, initialised from the SFT model (LoRA / gradient checkpointing per ``compute``)."""
    with model_init_context(params.compute, params.rlhf):
        model = load_causal_lm(sft_dir, **_model_kwargs(params))
    return disable_dropout(prepare_for_training(model, params.compute, params.project.seed))


def load_reference(params: Params, sft_dir: Path, actor_engine, actor_init: Path | None = None):
    """The frozen reference policy at ``sft_dir``, on the actor's device and in its precision (under LoRA, when
    the actor was initialised from the same weights, the actor with its adapters off)."""
    compute, cfg = params.compute, params.rlhf
    if compute.lora.enabled and (actor_init is None or Path(actor_init) == Path(sft_dir)):
        return AdapterDisabled(actor_engine.module)
    with model_init_context(compute, cfg):
        ref = load_causal_lm(sft_dir, **_model_kwargs(params))
    ref.requires_grad_(False)
    if compute.zero_stage == 3:
        import deepspeed

        conf = {"train_micro_batch_size_per_gpu": cfg.micro_batch_size,
                "train_batch_size": cfg.micro_batch_size * D.world_size(),
                "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 1e4},
                "bf16": {"enabled": actor_engine.precision == "bf16"},
                "fp16": {"enabled": actor_engine.precision == "fp16"}}
        ref = deepspeed.initialize(model=ref, config=conf, dist_init_required=False)[0].module
    else:
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(actor_engine.precision)
        ref = ref.to(device=actor_engine.device, dtype=dtype) if dtype else ref.to(actor_engine.device)
    return ref.eval()


def load_critic(params: Params, rm_dir: Path):
    """The value model, initialised from the reward model (backbone and scalar head): ours, any decoder
    ``*ForSequenceClassification`` reward model (a Hub or TRL one; its tokenizer must be the actor's,
    ``inputs.check_critic_tokenizer``), or the previous value-head layout (``models.reward_format``).

    When ``rm_dir`` holds an ensemble (``rm.ensemble``), the reward is the members' mean *standardised* score
    while the head is member 0's raw one: the head is divided by member 0's scale ``a_0`` (``ensemble.json``)
    so the critic starts on the scale of the returns it learns, as OpenRLHF's critic divides its values by the
    RM's reward std (``normalize_reward``). An implicit reward (``rm.objective: dpo``) gives the backbone of its
    reference (the adapter off, as saved) and a fresh head, as the RM stage starts a score head from SFT.
    """
    with model_init_context(params.compute, params.rlhf):
        if is_implicit(rm_dir):  # no value head, and its adapter is a policy's: the reference's backbone, a fresh head
            from transformers import AutoModel

            verify_model_dir(Path(rm_dir))
            torch.manual_seed(params.project.seed + 1)
            critic = ValueHeadModel(AutoModel.from_pretrained(str(rm_dir), use_safetensors=True,
                                                              **_model_kwargs(params)))
        else:
            critic = ValueHeadModel.from_pretrained(rm_dir, require_head=True, **_model_kwargs(params))
    if (Path(rm_dir) / ENSEMBLE_FILE).is_file():
        paths, _, scale = read_ensemble_spec(rm_dir)
        if "." in paths:  # the head is member "."'s (the RM stage writes it first)
            critic.scale_head(1.0 / scale[paths.index(".")])
    return disable_dropout(prepare_for_training(critic, params.compute, params.project.seed + 1))


def load_process_rewards(params: Params, rm_dir: Path, tokenizer, device: torch.device, batch_size: int):
    """``grpo.supervision`` or ``ppo.supervision: process``: the PRM in ``models/rm`` (``rm.objective: process``)
    read after every response token of the actor's own ids, ``batch_size`` rows per pass, under
    ``torch.inference_mode()``."""
    prm = ValueHeadModel.from_pretrained(rm_dir, require_head=True).to(device).eval()

    @torch.inference_mode()
    def values(sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int) -> torch.Tensor:
        parts = [prm(sequences[i:i + batch_size].to(device), attention_mask[i:i + batch_size].to(device))
                 .values[:, -response_len:].float().cpu() for i in range(0, len(sequences), batch_size)]
        return torch.cat(parts).clone()

    return ProcessRewards(values, delimiter_token(tokenizer, params.rm.step_delimiter))
