"""What the RL stage leaves behind: ``models/actor``, ``models/critic`` (meta only without a critic),
``models/actor_ema`` (``rlhf.ema_decay``), each atomic with its meta and model card; ``metrics/rlhf.json`` and the
curves under ``plots/``."""

from __future__ import annotations

from pathlib import Path

from rlhf_core.engine import distributed as D
from rlhf_core.engine.loop import TrainState
from rlhf_core.models.loading import save_causal_lm, save_value_model
from rlhf_core.ops import paths
from rlhf_core.ops.atomic import atomic_dir, write_json_atomic, write_text_atomic
from rlhf_core.ops.integrity import seal_model_dir
from rlhf_core.ops.meta import dir_sha256, write_meta, write_meta_only
from rlhf_core.ops.model_card import CARD_FILE, render_model_card
from rlhf_core.trainers.common import save_final, stage_meta, write_curve
from rlhf_core.trainers.rlhf.build import RLHFBundle

STAGE = "rlhf"
ACTOR_EMA_MODEL = Path("models/actor_ema")
PLOT_FILES = {"reward": "rlhf_reward.csv", "kl": "rlhf_kl.csv", "response_length": "rlhf_response_length.csv"}


def save_models(b: RLHFBundle, root: Path, state: TrainState, hashes: dict, ema_model, metrics: dict) -> None:
    """``models/actor``, ``models/critic`` (meta only without a critic), ``models/actor_ema``; atomic, each
    with its model card (the held-out ``metrics`` in the actor's). Every rank calls it."""
    params, cfg, inputs = b.params, b.cfg, b.inputs
    merge = params.compute.lora.merge_on_save
    hashed = {"sft": dir_sha256(inputs.sft), **({"rm": dir_sha256(inputs.rm)} if inputs.uses_rm else {}),
              **({"actor_init": dir_sha256(inputs.actor_init)} if inputs.actor_init != inputs.sft else {})}
    meta = stage_meta(STAGE, params, hashed, algorithm=cfg.algorithm, steps=state.step, data=hashes,
                      sft_model=str(paths.SFT_MODEL), rm_model=str(paths.RM_MODEL) if inputs.uses_rm else None,
                      lora=params.compute.lora.enabled, feedback_round=params.feedback.round,
                      actor_init=str(inputs.actor_init.relative_to(root)))

    def card(role: str, with_metrics: bool = True) -> str:
        return render_model_card({**meta, "role": role}, params, metrics if with_metrics else None)

    save_final(b.actor, root / paths.ACTOR_MODEL, lambda m, d: save_causal_lm(m, d, merge_lora=merge),
               b.tokenizer, {**meta, "role": "actor"}, card=card("actor"))
    if b.critic is not None:
        pad_id = b.tokenizer.pad_token_id
        save_final(b.critic, root / paths.CRITIC_MODEL, lambda m, d: save_value_model(m, d, merge, pad_id),
                   b.tokenizer, {**meta, "role": "critic"}, card=card("critic", with_metrics=False))
    elif D.is_main():
        write_meta_only(root / paths.CRITIC_MODEL, {**meta, "role": "critic", "critic": None,
                                                    "reason": f"{cfg.algorithm} trains no critic"})
    if ema_model is not None and D.is_main():
        save_plain(ema_model, root / ACTOR_EMA_MODEL, b.tokenizer, merge,
                   {**meta, "role": "actor_ema", "ema_decay": cfg.ema_decay}, card("actor_ema", False))
    D.barrier()


def save_plain(model, target: Path, tokenizer, merge_lora: bool, meta: dict, card: str) -> None:
    """A model that no engine holds (the EMA weights), saved like the others: weights, tokenizer, meta, card,
    sealed, renamed into place."""
    with atomic_dir(target) as tmp:
        save_causal_lm(model, tmp, merge_lora=merge_lora)
        tokenizer.save_pretrained(tmp)
        write_meta(tmp, meta)
        write_text_atomic(Path(tmp) / CARD_FILE, card)
        seal_model_dir(Path(tmp))


def write_metrics(root: Path, metrics: dict, curve: list[dict]) -> None:
    """``metrics/rlhf.json`` and ``plots/rlhf_{reward,kl,response_length}.csv`` (rank 0)."""
    write_json_atomic(root / paths.METRICS / f"{STAGE}.json", metrics)
    for key, name in PLOT_FILES.items():
        write_curve(root / paths.PLOTS / name, [{"step": r["step"], "value": r[key]} for r in curve], ("step", "value"))
