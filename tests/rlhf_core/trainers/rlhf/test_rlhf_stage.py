"""The RLHF stage end to end on a tiny workspace: learning, outputs, resume, bad input, LoRA, options,
two processes under torchrun.

The workspace (built once per module): demo data with small operands, a tiny Llama SFT-trained with the
project's SFT trainer, a reward model trained a few steps (the PPO critic's init), and the RL prompts cut to
4 so a few GRPO steps can visibly raise the exact-answer reward.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from rlhf_core.config import ConfigError
from rlhf_core.engine.errors import TrainingInputError
from rlhf_core.ops.integrity import MODEL_MANIFEST
from tests.conftest import REPO, make_params
from tests.stage_signals import sigterm_at_step
from tests.tiny import reseal_prepared

TINY = ["model.tiny.hidden_size=64", "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=2",
        "model.tiny.num_hidden_layers=1", "model.tiny.intermediate_size=64", "data.demo.max_operand=4",
        "data.demo.n_rows=600", "compute.num_threads=1", "eval.max_prompts=16", "eval.max_new_tokens=4"]
RL = ["rlhf.prompts_per_step=4", "rlhf.max_new_tokens=4", "rlhf.micro_batch_size=16", "rlhf.warmup_steps=0",
      "rlhf.lr_scheduler=constant", "rlhf.log_every=1", "rlhf.ppo.samples_per_prompt=1", "rlhf.save_every=0"]


def params(*overrides: str):
    return make_params(*TINY, *RL, *overrides)


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """prepare -> SFT (project trainer) -> RM (a few steps); RL prompts cut to 4."""
    from rlhf_core.stages.prepare import prepare
    from rlhf_core.trainers.rm import train_rm
    from rlhf_core.trainers.sft import train_sft

    root = tmp_path_factory.mktemp("rlhf_ws")
    cwd = Path.cwd()
    os.chdir(root)
    try:
        p = make_params(*TINY, "sft.epochs=40", "sft.lr=3e-3", "sft.micro_batch_size=16", "rm.max_steps=3")
        prepare(p)
        train_sft(p, root)
        train_rm(p, root)
    finally:
        os.chdir(cwd)
    prompts = root / "data/prepared/prompts.parquet"
    pd.read_parquet(prompts).head(4).to_parquet(prompts)
    reseal_prepared(root, "prompts.parquet")
    for d in ("checkpoints", "metrics", "plots"):
        shutil.rmtree(root / d, ignore_errors=True)
    return root


@pytest.fixture
def ws(built, tmp_path, monkeypatch):
    """A private copy of the built workspace (the stage writes outputs and checkpoints into it)."""
    root = tmp_path / "ws"
    shutil.copytree(built, root)
    monkeypatch.chdir(root)
    return root


def _trainer(root, *overrides, evaluate=False, checkpoints=False, log=None, hooks=None):
    from rlhf_core.trainers.rlhf.trainer import RLHFTrainer

    return RLHFTrainer(params(*overrides), root, log, hooks, evaluate=evaluate, checkpoints=checkpoints).setup()


# --------------------------------------------------------------------------- learning
def test_grpo_raises_the_reward_under_a_fixed_seed(ws):
    tr = _trainer(ws, "rlhf.algorithm=grpo", "rlhf.grpo.group_size=8", "rlhf.lr=1e-3", "rlhf.num_steps=30",
                  "rlhf.micro_batch_size=32")
    assert not tr.maker.cfg.need_old_logp  # one optimizer step per buffer: no separate old-logp pass
    metrics = [tr.step() for _ in range(30)]
    scores = [m["score_mean"] for m in metrics]
    first, last = sum(scores[:6]) / 6, sum(scores[-6:]) / 6
    assert last >= first + 0.1, scores
    assert metrics[-1]["kl"] > 0 and metrics[-1]["group_reward_std"] >= 0  # KL from the training pass' log-probs


def test_grpo_with_lora_adapters_raises_the_reward_too(ws):
    """The real-model profile trains LoRA adapters on the merged SFT model: the same GRPO run with an r-8 adapter
    (the reference: the adapter off) learns as the full model does, if more slowly (0.17 -> 0.33 over 80 steps
    here; the full model above 0.15 -> 0.34 over 30). SmolLM2's RL stage moving little is not this."""
    tr = _trainer(ws, "rlhf.algorithm=grpo", "rlhf.grpo.group_size=8", "rlhf.lr=1e-2", "rlhf.num_steps=80",
                  "rlhf.micro_batch_size=32", "compute.lora.enabled=true", "compute.lora.r=8")
    scores = [tr.step()["score_mean"] for _ in range(80)]
    assert sum(scores[-10:]) / 10 >= sum(scores[:10]) / 10 + 0.1, scores


def test_ppo_step_metrics_and_kl_control(ws):
    logged = []
    tr = _trainer(ws, "rlhf.num_steps=2", "rlhf.kl_controller=adaptive", "rlhf.kl_target=0.001",
                  "rlhf.kl_horizon=10", log=lambda m, s: logged.append((s, m)))
    before = tr.kl_ctl.value
    m = tr.step()
    for key in ("score_mean", "score_std", "reward_mean", "reward_std", "kl", "kl_coef", "entropy", "clipfrac",
                "approx_kl", "policy_loss", "value_loss", "explained_variance", "response_length", "eos_share",
                "no_eos_share", "empty_dropped", "uniform_dropped", "t_generate", "t_score", "t_train", "samples_per_s",
                "train_accuracy"):
        assert key in m and m[key] == m[key] or key == "explained_variance", key
    assert m["rows"] == 4 and logged and logged[-1][0] == 1
    assert 0 <= m["eos_share"] <= 1 and m["response_length"] > 0
    tr.step()
    assert tr.kl_ctl.value != before  # adaptive: moved towards the target


def _clone(module: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in module.named_parameters()}


def _moved(module: torch.nn.Module, before: dict[str, torch.Tensor]) -> bool:
    return any(not torch.equal(p, before[n]) for n, p in module.named_parameters())


@pytest.mark.parametrize("options", [(), ("compute.lora.enabled=true", "compute.gradient_checkpointing=true")])
def test_critic_warmup_trains_only_the_critic_for_its_iterations(ws, options):
    """``ppo.critic_warmup_iterations: 2``: iterations 1 and 2 move the critic and leave the actor, its EMA and
    the ptx stream untouched (its loss still logged); iteration 3 moves the actor as a run without warm-up does.
    Also with LoRA adapters and gradient checkpointing (the frozen actor's forward runs without gradients)."""
    tr = _trainer(ws, "rlhf.num_steps=3", "rlhf.ppo.critic_warmup_iterations=2", "rlhf.ema_decay=0.5",
                  "rlhf.ptx_coef=0.5", "rlhf.lr=1e-3", *options)
    actor, critic, ema = _clone(tr.actor.module), _clone(tr.critic.module), dict(tr.ema.state_dict())
    for _ in range(2):
        m = tr.step()
        assert m["actor_frozen"] == 1.0 and math.isnan(m["grad_norm"]) and "ptx_loss" not in m, m
        assert m["policy_loss"] == m["policy_loss"] and m["value_loss"] > 0
        assert not _moved(tr.actor.module, actor)
        assert all(torch.equal(v, ema[k]) for k, v in tr.ema.state_dict().items())
    assert _moved(tr.critic.module, critic) and tr.state.extra.get("ptx_micro", 0) == 0
    m = tr.step()
    assert m["actor_frozen"] == 0.0 and m["grad_norm"] > 0 and "ptx_loss" in m
    assert _moved(tr.actor.module, actor)


def test_critic_warmup_needs_a_critic_and_leaves_iterations_for_the_actor():
    with pytest.raises(ConfigError, match="critic_warmup_iterations trains the critic alone"):
        params("rlhf.ppo.critic_warmup_iterations=1", "rlhf.ppo.advantage_estimator=reinforce_pp")
    with pytest.raises(ConfigError, match="leaves no iteration of num_steps 3"):
        params("rlhf.ppo.critic_warmup_iterations=3", "rlhf.num_steps=3")
    assert params("rlhf.algorithm=grpo", "rlhf.ppo.critic_warmup_iterations=5", "rlhf.num_steps=3")  # PPO's key


def test_grpo_drops_uniform_groups_but_scores_every_sample(ws):
    """``grpo.drop_uniform_groups``: groups scored all alike leave training (counted), yet ``score_mean`` still
    covers every non-empty sample: with the checker as reward the score sum is the number of correct answers."""
    from rlhf_core.trainers.rlhf.algorithms import algorithm_for

    assert not algorithm_for(params("rlhf.grpo.drop_uniform_groups=true").rlhf).drop_uniform_groups  # GRPO's key
    tr = _trainer(ws, "rlhf.algorithm=grpo", "rlhf.grpo.drop_uniform_groups=true", "rlhf.num_steps=3")
    assert tr.maker.cfg.drop_uniform_groups
    ms = [tr.step() for _ in range(3)]
    assert sum(m["uniform_dropped"] for m in ms) > 0
    for m in ms:
        scored = m["rows"] - m["empty_dropped"]
        assert m["score_mean"] * scored == pytest.approx(m["train_accuracy"] * m["rows"])
        uniform_rows = m["uniform_group_share"] * m["rows"]  # groups of G rows: share of groups = share of rows
        assert uniform_rows == round(uniform_rows) and 0 <= m["uniform_group_share"] <= 1
        assert uniform_rows - m["empty_dropped"] <= m["uniform_dropped"] <= uniform_rows


def test_raft_trains_on_each_groups_pick_and_raises_the_reward(ws):
    """``grpo.advantage: best`` (RAFT): of each group of 8 only the pick is trained on; the other 7 leave before
    the reference pass, counted as ``unselected_dropped`` (7 per group, less the empty rows among them), and
    ``score_mean`` still covers every non-empty sample. The held-in reward rises as GRPO's does above."""
    tr = _trainer(ws, "rlhf.algorithm=grpo", "rlhf.grpo.advantage=best", "rlhf.grpo.group_size=8", "rlhf.lr=1e-3",
                  "rlhf.num_steps=30", "rlhf.micro_batch_size=32")
    assert tr.maker.cfg.drop_unselected and not tr.maker.cfg.drop_uniform_groups
    metrics = [tr.step() for _ in range(30)]
    for m in metrics:
        groups = m["rows"] / 8
        assert groups * 7 - m["empty_dropped"] <= m["unselected_dropped"] <= groups * 7, m
        assert m["score_mean"] * (m["rows"] - m["empty_dropped"]) == pytest.approx(m["train_accuracy"] * m["rows"])
        # the checker is the reward here: a group's pick is right whenever any of its samples is
        assert m["trained_judge_score"] >= max(m["candidate_judge_score"], m["train_accuracy"])
    scores = [m["score_mean"] for m in metrics]
    assert sum(scores[-6:]) / 6 >= sum(scores[:6]) / 6 + 0.1, scores
    assert tr.state.extra["totals"]["unselected_dropped"] == sum(m["unselected_dropped"] for m in metrics)


def test_raft_needs_outcome_supervision():
    with pytest.raises(ConfigError, match="grpo.advantage: best .* needs grpo.supervision: outcome"):
        params("rlhf.algorithm=grpo", "rlhf.grpo.advantage=best", "rlhf.grpo.supervision=process",
               "rlhf.reward_fns={rm: 1.0}")


def test_ptx_batch_size_sets_the_sft_rows_beside_each_micro_batch(ws):
    """``rlhf.ptx_batch_size`` rows of sft.parquet per ptx loss; 0 takes ``micro_batch_size``."""
    for overrides, rows in ((("rlhf.ptx_batch_size=3",), 3), ((), 16)):
        tr = _trainer(ws, "rlhf.ptx_coef=0.5", *overrides)
        data, sampler = tr.ptx
        assert len(sampler.batch(0)) == rows and len(sampler.batch(1)) == rows
        tr.step()
        assert tr.state.extra["ptx_micro"] == 1  # one ptx batch beside the iteration's one micro-batch


def test_ptx_min_reward_drops_the_rows_the_reward_model_scores_below_it(ws):
    """``rlhf.ptx_min_reward``: the ptx rows are exactly the SFT rows whose RM score reaches the floor (here the
    median of the real RM's scores, so about half go), counted; a floor above every score names the file."""
    from rlhf_core.rewards.sources import RewardSources
    from rlhf_core.trainers.rlhf.inputs import load_ptx, ptx_keep

    assert ptx_keep(torch.tensor([-1.0, 0.0, 0.5]), 0.0).tolist() == [False, True, True]
    sft = pd.read_parquet(ws / "data/prepared/sft.parquet")
    scores = RewardSources({"rm": 1.0}, ws / "models/rm").rm_scores(list(sft["prompt"]), list(sft["response"]))
    floor = float(scores.median())
    tr = _trainer(ws, "rlhf.ptx_coef=0.5", "rlhf.reward_fns={exact_answer: 1.0, rm: 0.0}",
                  f"rlhf.ptx_min_reward={floor}")
    kept = int((scores >= floor).sum())
    assert 0 < kept < len(sft)
    assert tr.ptx_counts == {"ptx_rows": kept, "ptx_rows_dropped": len(sft) - kept}
    assert tr.ptx[0].n_examples == kept
    tr.step()  # trains on the kept rows
    with pytest.raises(TrainingInputError, match="ptx_min_reward is set but no reward model scores"):
        load_ptx(params("rlhf.ptx_coef=0.5", "rlhf.reward_fns={rm: 1.0}", "rlhf.ptx_min_reward=0"), ws, None)
    with pytest.raises(TrainingInputError, match=r"sft\.parquet: rlhf\.ptx_min_reward .* drops all"):
        _trainer(ws, "rlhf.ptx_coef=0.5", "rlhf.reward_fns={exact_answer: 1.0, rm: 0.0}",
                 f"rlhf.ptx_min_reward={float(scores.max()) + 1}")


def test_ptx_min_reward_needs_ptx_and_the_reward_model():
    for overrides in (("rlhf.ptx_coef=0", "rlhf.reward_fns={rm: 1.0}"),
                      ("rlhf.ptx_coef=0.5", "rlhf.reward_fns={exact_answer: 1.0}")):
        with pytest.raises(ConfigError, match="ptx_min_reward filters the ptx rows"):
            params("rlhf.ptx_min_reward=0", *overrides)


def test_every_iteration_gets_full_prompt_batches_across_epochs(ws):
    tr = _trainer(ws, "rlhf.prompts_per_step=3")
    stream = torch.cat([tr.prompt_indices(k) for k in range(4)])  # 12 = 3 epochs of the 4 prompts
    assert all(sorted(chunk.tolist()) == [0, 1, 2, 3] for chunk in stream.view(3, 4))
    assert torch.equal(tr.prompt_indices(2), tr.prompt_indices(2))  # a function of the step: resumable


# --------------------------------------------------------------------------- outputs
def test_ppo_stage_writes_models_metrics_and_plots(ws):
    from transformers import AutoModelForCausalLM

    from rlhf_core.ops.meta import dir_sha256, read_meta
    from rlhf_core.trainers.rlhf.trainer import train_rlhf as run

    metrics = run(params("rlhf.num_steps=2", "rlhf.ema_decay=0.5"), ws)
    for key in ("sft_accuracy", "accuracy", "kl_to_reference", "kl_bound", "steps", "wall_time_s"):
        assert metrics[key] is not None, key
    assert metrics["steps"] == 2 and metrics["kl_to_reference"] >= 0
    assert json.loads((ws / "metrics/rlhf.json").read_text())["steps"] == 2
    actor, critic = ws / "models/actor", ws / "models/critic"
    assert (actor / "model.safetensors").exists() and (actor / "tokenizer.json").exists()
    assert (critic / "model.safetensors").exists() and not (critic / "value_head.safetensors").exists()
    assert json.loads((critic / "config.json").read_text())["architectures"] == ["LlamaForSequenceClassification"]
    assert (ws / "models/actor_ema/model.safetensors").exists()
    meta = read_meta(actor)
    assert meta["stage"] == "rlhf" and meta["inputs"] == {"sft": dir_sha256(ws / "models/sft"),
                                                          "rm": dir_sha256(ws / "models/rm")}
    AutoModelForCausalLM.from_pretrained(str(actor), use_safetensors=True)
    card = (actor / "README.md").read_text()  # the model card, with the held-out figures of this run
    assert card.startswith("---\nlibrary_name: transformers\npipeline_tag: text-generation")
    assert f"| accuracy | {metrics['sft_accuracy']:.4g} | {metrics['accuracy']:.4g} |" in card
    assert "`rlhf.algorithm` | `ppo`" in card
    assert "pipeline_tag: text-classification" in (critic / "README.md").read_text()
    for name in ("rlhf_reward", "rlhf_kl", "rlhf_response_length"):
        lines = (ws / f"plots/{name}.csv").read_text().splitlines()
        assert lines[0] == "step,value" and len(lines) == 3


def test_grpo_has_no_critic_and_needs_no_rm(ws):
    from rlhf_core.ops.meta import read_meta
    from rlhf_core.trainers.rlhf.trainer import train_rlhf as run

    shutil.rmtree(ws / "models/rm")
    run(params("rlhf.algorithm=grpo", "rlhf.num_steps=1"), ws)
    assert (ws / "models/actor").is_dir()
    # models/critic (a DVC output) holds only its meta file: no weights, nothing to register
    assert [p.name for p in (ws / "models/critic").iterdir()] == ["rlhf_meta.json"]
    assert read_meta(ws / "models/critic")["critic"] is None
    assert set(read_meta(ws / "models/actor")["inputs"]) == {"sft"}


# --------------------------------------------------------------------------- resume
def _weights(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def test_stopped_run_resumes_from_its_step_and_matches_an_uninterrupted_run(ws, tmp_path):
    from rlhf_core.trainers.rlhf.trainer import RLHFHooks, train_rlhf

    common = ("rlhf.num_steps=4", "rlhf.save_every=1", "eval.max_prompts=2")
    full = tmp_path / "full"
    shutil.copytree(ws, full)
    train_rlhf(params(*common), full)

    class Stop(RuntimeError):
        pass

    def crash(step, metrics):
        if step == 2:
            raise Stop

    with pytest.raises(Stop):
        train_rlhf(params(*common), ws, hooks=RLHFHooks(after_step=crash))
    assert (ws / "checkpoints/rlhf/latest").read_text().strip() == "step_00000002"
    seen = []
    metrics = train_rlhf(params(*common), ws, hooks=RLHFHooks(after_step=lambda s, m: seen.append(s)))
    assert metrics["resumed_from_step"] == 2 and metrics["steps"] == 4 and seen == [3, 4]
    a, b = _weights(ws / "models/actor"), _weights(full / "models/actor")
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    assert json.loads((ws / "metrics/rlhf.json").read_text())["steps"] == 4


def test_max_steps_stops_early_and_a_rerun_continues(ws):
    from rlhf_core.trainers.rlhf.trainer import train_rlhf

    first = train_rlhf(params("rlhf.num_steps=3", "rlhf.max_steps=1", "rlhf.algorithm=grpo"), ws)
    assert first["steps"] == 1
    second = train_rlhf(params("rlhf.num_steps=3", "rlhf.algorithm=grpo"), ws)
    assert second["resumed_from_step"] == 1 and second["steps"] == 3
    fresh = train_rlhf(params("rlhf.num_steps=3", "rlhf.algorithm=grpo", "rlhf.lr=1e-3"), ws)
    assert fresh["resumed_from_step"] == 0  # changed params: the old checkpoint does not apply


# --------------------------------------------------------------------------- bad input
def _drop_prompt_answers(root: Path) -> None:
    """The RL prompts without their answers (resealed, so only the missing answers are wrong with them)."""
    path = root / "data/prepared/prompts.parquet"
    pd.read_parquet(path).assign(answer=None).to_parquet(path)
    reseal_prepared(root, "prompts.parquet")


def test_heldout_summary_pairs_each_configured_judgement_with_the_sft_starts():
    """``sft_<key>`` beside ``<key>`` for the step, seen and sampled accuracies the actor was judged on, and only
    those."""
    from rlhf_core.trainers.rlhf.metrics import heldout_summary

    before = {"accuracy": 0.5, "proxy_reward": 0.1, "seen_accuracy": 0.4, "sampled_accuracy": 0.3, "step_accuracy": 0.2}
    final = {"accuracy": 0.6, "proxy_reward": 0.2, "kl_to_reference": 0.1, "seen_accuracy": 0.7,
             "sampled_accuracy": 0.8}
    out = heldout_summary(before, final, None, 5.0, True)
    assert (out["sft_seen_accuracy"], out["seen_accuracy"]) == (0.4, 0.7)
    assert (out["sft_sampled_accuracy"], out["sampled_accuracy"]) == (0.3, 0.8)
    assert "step_accuracy" not in out and "sft_step_accuracy" not in out
    out = heldout_summary(before, {**final, "step_accuracy": 0.9}, None, 5.0, True)
    assert (out["sft_step_accuracy"], out["step_accuracy"]) == (0.2, 0.9)


def test_seen_prompts_judge_the_first_training_prompts_before_and_after_rl(ws):
    """``eval.seen_prompts``: the SFT start's and the actor's greedy accuracy on the first N RL prompts, as an
    independent evaluation of the saved models on exactly those prompts measures it; off, no keys."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.evaluation import heldout_eval
    from rlhf_core.trainers.rlhf.inputs import load_prompts
    from rlhf_core.trainers.rlhf.trainer import train_rlhf as run

    p = params("rlhf.algorithm=grpo", "rlhf.grpo.group_size=8", "rlhf.lr=1e-3", "rlhf.num_steps=3",
               "rlhf.micro_batch_size=32", "eval.seen_prompts=3")
    tok = load_tokenizer(ws / "models/sft")
    seen = load_prompts(p, ws, tok).seen
    assert seen.prompts == list(pd.read_parquet(ws / "data/prepared/prompts.parquet").prompt[:3])
    metrics = run(p, ws)
    for model, key in (("sft", "sft_seen_accuracy"), ("actor", "seen_accuracy")):
        m = AutoModelForCausalLM.from_pretrained(ws / "models" / model).eval()
        assert metrics[key] == pytest.approx(heldout_eval(m, tok, seen, p.eval, torch.device("cpu"))["accuracy"])
    assert json.loads((ws / "metrics/rlhf.json").read_text())["seen_accuracy"] == metrics["seen_accuracy"]
    assert "seen_accuracy" not in run(params("rlhf.algorithm=grpo", "rlhf.grpo.group_size=8", "rlhf.num_steps=1",
                                             "rlhf.micro_batch_size=32", "rlhf.resume=false"), ws)
    _drop_prompt_answers(ws)
    with pytest.raises(TrainingInputError, match=r"eval.seen_prompts: 3 .* data/prepared/prompts.parquet has no "
                                                 r"answers"):
        load_prompts(p, ws, tok)


def test_sampled_answers_judge_k_samples_per_held_out_prompt_before_and_after_rl(ws):
    """``eval.sampled_answers`` K: each held-out prompt K times, answered by sampling at ``rlhf.temperature`` with
    the seed ``project.seed``: the figure an independent evaluation of the saved model with that seed gives; at a
    temperature near 0 it is the greedy accuracy; training's random stream is untouched (the actor's weights are
    those of a run without it); no answers: an error naming the key and the file."""
    from transformers import AutoModelForCausalLM

    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.evaluation import heldout_eval
    from rlhf_core.trainers.rlhf.inputs import load_prompts
    from rlhf_core.trainers.rlhf.trainer import train_rlhf as run

    common = ("rlhf.algorithm=grpo", "rlhf.grpo.group_size=8", "rlhf.lr=1e-3", "rlhf.num_steps=2",
              "rlhf.micro_batch_size=32", "rlhf.resume=false", "project.seed=7")
    p = params(*common, "eval.sampled_answers=3")
    tok = load_tokenizer(ws / "models/sft")
    prompts = load_prompts(p, ws, tok)
    n = len(prompts.heldout.prompts)
    assert prompts.sampled.prompts == [t for t in prompts.heldout.prompts for _ in range(3)]
    assert prompts.sampled.tokens.lengths.tolist() == prompts.heldout.tokens.lengths.repeat_interleave(3).tolist()
    metrics = run(p, ws)
    actor = _weights(ws / "models/actor")
    for model, key in (("sft", "sft_sampled_accuracy"), ("actor", "sampled_accuracy")):
        m = AutoModelForCausalLM.from_pretrained(ws / "models" / model).eval()
        torch.manual_seed(7)
        want = heldout_eval(m, tok, prompts.sampled, p.eval, torch.device("cpu"), temperature=p.rlhf.temperature)
        assert metrics[key] == pytest.approx(want["accuracy"]) and 0 < metrics[key] < 1  # samples, not all alike
    assert json.loads((ws / "metrics/rlhf.json").read_text())["sampled_accuracy"] == metrics["sampled_accuracy"]
    without = run(params(*common), ws)
    assert "sampled_accuracy" not in without
    assert all(torch.equal(actor[k], v) for k, v in _weights(ws / "models/actor").items())
    cold = run(params(*common, "eval.sampled_answers=2", "rlhf.temperature=0.001"), ws)
    assert cold["sampled_accuracy"] == pytest.approx(cold["accuracy"]) and n * 2 == len(
        load_prompts(params(*common, "eval.sampled_answers=2"), ws, tok).sampled.prompts)
    _drop_prompt_answers(ws)
    with pytest.raises(TrainingInputError, match=r"eval.sampled_answers: 3 .* data/prepared/prompts.parquet has no "
                                                 r"answers"):
        load_prompts(p, ws, tok)


def test_bad_input_errors_name_the_key_or_path(ws):
    with pytest.raises(TrainingInputError, match=r"rlhf.reward_fns: unknown reward function\(s\) \['nope'\]"):
        _trainer(ws, "rlhf.reward_fns={nope: 1.0}")
    with pytest.raises(ConfigError, match=r"grpo.group_size 3 does not divide the training batch"):
        params("rlhf.algorithm=grpo", "rlhf.grpo.group_size=3")
    with pytest.raises(ConfigError, match=r"rloo needs ppo.samples_per_prompt >= 2"):
        params("rlhf.ppo.advantage_estimator=rloo", "rlhf.ppo.samples_per_prompt=1")
    with pytest.raises(ConfigError, match=r"grpo.kl_estimator: k1 .* zero expected gradient"):
        params("rlhf.algorithm=grpo", "rlhf.grpo.kl_estimator=k1")
    with pytest.raises(ConfigError, match=r"kl_estimator: k1 with ppo.kl_in: loss"):
        params("rlhf.ppo.kl_in=loss")
    params("rlhf.algorithm=grpo", "rlhf.grpo.kl_estimator=k1", "rlhf.grpo.beta=0")  # no KL term: nothing to refuse
    shutil.move(ws / "models/rm", ws / "rm_aside")
    with pytest.raises(TrainingInputError, match=r"models/rm: no reward model, but PPO .* needs a critic"):
        _trainer(ws)
    with pytest.raises(TrainingInputError, match=r"rlhf.reward_fns names `rm` but models/rm"):
        _trainer(ws, "rlhf.algorithm=grpo", "rlhf.reward_fns={rm: 1.0}")
    shutil.move(ws / "rm_aside", ws / "models/rm")
    shutil.rmtree(ws / "models/sft")
    with pytest.raises(TrainingInputError, match=r"models/sft: no SFT model"):
        _trainer(ws)


def test_rm_with_another_tokenizer_is_retokenised_or_refused(ws):
    from rlhf_core.data.tokenizer import train_demo_tokenizer

    other = train_demo_tokenizer(["Human: What is 1 + 2?\n\nAssistant: 3"] * 20, vocab_size=40)
    for f in ("tokenizer.json", "tokenizer_config.json", MODEL_MANIFEST):  # edited on purpose: loaded unchecked
        (ws / "models/rm" / f).unlink(missing_ok=True)
    other.save_pretrained(ws / "models/rm")
    with pytest.raises(ValueError, match=r"different tokenizer than the actor"):
        _trainer(ws, "rlhf.reward_fns={rm: 1.0}", "rlhf.rm_tokenizer_mismatch=error", "rlhf.algorithm=grpo")
    with pytest.raises(TrainingInputError, match=r"models/rm: its tokenizer differs from the actor's .* critic"):
        _trainer(ws, "rlhf.reward_fns={rm: 1.0}")  # PPO/GAE: the critic would read the actor's token ids
    tr = _trainer(ws, "rlhf.reward_fns={rm: 1.0, exact_answer: 1.0}", "rlhf.num_steps=1",
                  "rlhf.ppo.advantage_estimator=reinforce_pp")
    assert tr.step()["score_std"] > 0  # RM scores on re-tokenised text vary by response


# --------------------------------------------------------------------------- LoRA and options
def test_lora_reference_is_the_actor_with_adapters_disabled(ws):
    from transformers import AutoModelForCausalLM

    from rlhf_core.passes.generation import response_logprobs as sequence_logprobs
    from rlhf_core.trainers.rlhf.models import AdapterDisabled

    tr = _trainer(ws, "compute.lora.enabled=true", "compute.lora.r=4", "rlhf.lr=1e-2", "rlhf.num_steps=2")
    assert isinstance(tr.ref, AdapterDisabled)
    for _ in range(2):
        tr.step()
    sft = AutoModelForCausalLM.from_pretrained(str(ws / "models/sft")).eval()
    seq = torch.tensor([[5, 6, 7, 8, 9]])
    att = torch.ones_like(seq)
    with torch.no_grad():
        ref = sequence_logprobs(tr.ref, seq, att, 3)
        actor = sequence_logprobs(tr.actor.module, seq, att, 3)
        expected = sequence_logprobs(sft, seq, att, 3)
    assert torch.allclose(ref, expected, atol=1e-5) and not torch.allclose(actor, expected, atol=1e-5)
    tr.finish()
    saved = ws / "models/actor"
    assert (saved / "model.safetensors").exists() and not (saved / "adapter").exists()  # merged on save


def test_dropout_is_off_so_the_first_ratio_is_one(ws):
    """LoRA dropout 0.5 and attention dropout 0.3 in the checkpoint: the policy's training-mode log-probs equal
    its rollout (eval-mode) log-probs, so the first PPO ratio is exactly 1 (was 0.74-1.17)."""
    from transformers import AutoConfig

    from rlhf_core.passes.generation import response_logprobs as sequence_logprobs

    cfg = AutoConfig.from_pretrained(ws / "models/sft")
    cfg.attention_dropout = 0.3
    cfg.save_pretrained(ws / "models/sft")
    (ws / "models/sft" / MODEL_MANIFEST).unlink(missing_ok=True)  # edited on purpose: loaded unchecked
    tr = _trainer(ws, "compute.lora.enabled=true", "compute.lora.r=4", "compute.lora.dropout=0.5",
                  "rlhf.algorithm=grpo")
    model = tr.actor.module
    seq, att = torch.tensor([[5, 6, 7, 8, 9]] * 4), torch.ones(4, 5, dtype=torch.long)
    with torch.no_grad():
        model.train()
        trained = sequence_logprobs(model, seq, att, 3)
        model.eval()
        rolled = sequence_logprobs(model, seq, att, 3)
    assert torch.equal(trained, rolled)
    assert all(m.p == 0 for m in model.modules() if isinstance(m, torch.nn.Dropout))


def test_a_critic_from_an_ensemble_starts_on_its_standardised_scale(ws):
    """The ensemble's reward is standardised, member 0's head is raw: the critic's values are member 0's divided
    by its scale; from a single RM they are the RM's own."""
    from rlhf_core.models import ValueHeadModel
    from rlhf_core.trainers.rlhf.models import load_critic

    rm_dir = ws / "models/rm"
    seq = torch.tensor([[5, 6, 7, 8, 9], [9, 8, 7, 6, 5]])
    with torch.no_grad():
        raw = ValueHeadModel.from_pretrained(rm_dir, require_head=True)(seq).values
        assert torch.equal(load_critic(params(), rm_dir)(seq).values, raw)
        (rm_dir / "ensemble.json").write_text(json.dumps({"members": [
            {"path": ".", "center": 1.5, "scale": 4.0}, {"path": "members/1", "center": -1.0, "scale": 2.0}]}))
        torch.testing.assert_close(load_critic(params(), rm_dir)(seq).values, raw / 4.0)


@pytest.mark.parametrize("source", ["generation", "recompute"])
def test_rollout_log_probs_recorded_while_sampling_equal_the_recomputed_ones(ws, monkeypatch, source):
    """Several optimizer steps per buffer need the rollout policy's log-probs before training. Recorded while
    sampling (the default) they equal a full forward pass over the rows, and the maker runs no actor pass for
    them: its only log-prob pass is the reference's. ``recompute`` runs the actor pass (two in all)."""
    from rlhf_core.passes.generation import response_logprobs
    from rlhf_core.trainers.rlhf import experience

    tr = _trainer(ws, "rlhf.algorithm=grpo", "rlhf.micro_batch_size=4", "rlhf.max_new_tokens=6",
                  f"rlhf.rollout_logprobs={source}")
    assert tr.maker.cfg.need_old_logp  # 4 prompts x G=4 in mini-batches of 4: the policy moves in between
    assert tr.maker.cfg.forward_batch_size == 4  # rlhf.forward_batch_size 0: the training micro-batch
    passes: list[int] = []

    def counted(model, *args, **kwargs):
        passes.append(id(model))
        return response_logprobs(model, *args, **kwargs)

    monkeypatch.setattr(experience, "response_logprobs", counted)
    exp = tr.collect(0)
    expected = {id(tr.ref)} | ({id(tr.actor.module)} if source == "recompute" else set())
    assert set(passes) == expected and len(passes) == 4 * len(expected)  # 16 rows in forward batches of 4
    with torch.no_grad():
        recomputed = response_logprobs(tr.actor.module, exp.sequences, exp.attention_mask, exp.response_len)
    m = exp.action_mask.bool()
    assert m.sum() > 10 and torch.allclose(exp.old_logp[m], recomputed[m], atol=1e-5)


@pytest.mark.parametrize("options", [
    ("rlhf.ppo.kl_in=loss", "rlhf.kl_estimator=k2", "rlhf.ppo.dual_clip=3.0", "rlhf.entropy_coef=0.01",
     "rlhf.ptx_coef=0.5", "rlhf.ppo_epochs=2", "rlhf.micro_batch_size=2", "rlhf.generation_batch_size=2",
     "rlhf.no_eos_penalty=-1.0", "rlhf.ppo.value_clip_eps=null"),
    ("rlhf.ppo.advantage_estimator=rloo", "rlhf.ppo.samples_per_prompt=2", "rlhf.kl_estimator=k3"),
    ("rlhf.ppo.advantage_estimator=reinforce_pp", "rlhf.whiten_advantages=false", "rlhf.ema_decay=0.9"),
    ("rlhf.algorithm=grpo", "rlhf.grpo.scale=none", "rlhf.grpo.beta=0", "rlhf.ppo_epochs=2"),
])
def test_options_run_and_stay_finite(ws, options):
    tr = _trainer(ws, "rlhf.num_steps=2", *options)
    for _ in range(2):
        m = tr.step()
        assert all(v == v for k, v in m.items() if k != "explained_variance"), m  # no NaN
    assert (tr.critic is not None) == ("rlhf.algorithm=grpo" not in options
                                       and not any("advantage_estimator" in o for o in options))


# --------------------------------------------------------------------------- torchrun
@pytest.mark.slow
def test_ppo_step_with_two_processes_under_torchrun(ws):
    torchrun = Path(sys.executable).parent / "torchrun"
    overrides = [*TINY, *RL, "rlhf.num_steps=1", "eval.max_prompts=4"]
    cmd = [str(torchrun), "--standalone", "--nproc_per_node", "2", "-m", "rlhf_core.cli", "stage", "rlhf"]
    for o in overrides:
        cmd += ["-S", o]
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLHF_TRACKING": "off", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    metrics = json.loads((ws / "metrics/rlhf.json").read_text())
    assert metrics["world_size"] == 2 and metrics["steps"] == 1 and metrics["rows_total"] == 4
    assert (ws / "models/actor/model.safetensors").exists() and (ws / "models/critic/model.safetensors").exists()


def test_hacking_flag_is_proxy_up_and_judge_down():
    from rlhf_core.evaluation import hacking_suspected

    sft = {"proxy_reward": 1.96, "accuracy": 0.57}
    assert hacking_suspected(sft, {"proxy_reward": 7.88, "accuracy": 0.03}) is True  # measured: GRPO, RM, no ptx
    assert hacking_suspected(sft, {"proxy_reward": 3.45, "accuracy": 0.83}) is False  # both up: learning
    assert hacking_suspected(sft, {"proxy_reward": 1.5, "accuracy": 0.5}) is False  # both down: just worse
    assert hacking_suspected({}, {"proxy_reward": 1.0, "accuracy": 0.5}) is None


# --------------------------------------------------------------------------- preemption
SIGTERM_RUNS = {
    "sft": ["sft.epochs=40", "sft.lr=3e-3", "sft.micro_batch_size=16", "sft.max_steps=40", "sft.log_every=1",
            "sft.save_every=0", "eval.max_prompts=2"],
    "rlhf": [*RL, "rlhf.num_steps=40", "eval.max_prompts=2"],
}


def _stage_cli(stage: str, root: Path, overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLHF_TRACKING": "off"}
    args = [a for o in [*TINY, *overrides] for a in ("-S", o)]
    return subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", "stage", stage, *args], cwd=root, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.slow
@pytest.mark.parametrize("stage", sorted(SIGTERM_RUNS))
def test_sigterm_checkpoints_exits_75_and_the_rerun_matches_an_uninterrupted_run(ws, tmp_path, stage):
    """A real SIGTERM to a running ``rlhf stage`` process (what Kubernetes sends on preemption): the stage
    finishes its step, checkpoints it and exits 75; the re-run resumes there and ends with the weights of a run
    that was never interrupted."""

    from rlhf_core.stages import exit_codes

    overrides = SIGTERM_RUNS[stage]
    full = tmp_path / "full"
    shutil.copytree(ws, full)
    proc = _stage_cli(stage, ws, overrides)
    err = sigterm_at_step(proc, 3)
    assert proc.wait(timeout=300) == exit_codes.STOPPED, err[-3000:]
    latest = (ws / f"checkpoints/{stage}/latest").read_text().strip()
    stopped_at = int(latest.removeprefix("step_"))
    assert 3 <= stopped_at < 40 and f"stopped on SIGTERM after step {stopped_at}" in err, err[-3000:]
    if stage == "rlhf":
        assert not (ws / "models/actor/model.safetensors").exists()  # stopped before the end: no final model

    again = _stage_cli(stage, ws, overrides)
    out, err2 = again.communicate(timeout=600)
    assert again.returncode == 0, err2[-3000:]
    metrics = json.loads((ws / f"metrics/{stage}.json").read_text())
    assert metrics["resumed_from_step"] == stopped_at and metrics["steps"] == 40

    uninterrupted = _stage_cli(stage, full, overrides)
    _, err3 = uninterrupted.communicate(timeout=600)
    assert uninterrupted.returncode == 0, err3[-3000:]
    out_dir = "actor" if stage == "rlhf" else "sft"
    a, b = _weights(ws / "models" / out_dir), _weights(full / "models" / out_dir)
    assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


def test_static_rollout_engine_collects_what_generate_collects(ws):
    """``rlhf.rollout_engine: static`` in the stage: from the same seed, the maker collects the rows ``generate``
    collects (tokens, rewards), with the recorded log-probs of a full forward over them."""
    from dataclasses import replace

    from rlhf_core.passes.generation import response_logprobs

    tr = _trainer(ws, "rlhf.algorithm=grpo", "rlhf.micro_batch_size=4", "rlhf.max_new_tokens=6",
                  "rlhf.rollout_engine=static", "rlhf.rollout_compile=true", "rlhf.rollout_attention=product")
    assert tr.maker.cfg.gen.engine == "static" and tr.maker.cfg.gen.decode_attention == "product"
    assert tr.maker.cfg.gen.compile_step is False  # rlhf.rollout_compile compiles on a GPU only
    torch.manual_seed(3)
    ours = tr.collect(0)
    tr.maker.cfg.gen = replace(tr.maker.cfg.gen, engine="generate")
    torch.manual_seed(3)
    theirs = tr.collect(0)
    assert torch.equal(ours.sequences, theirs.sequences) and torch.equal(ours.scores, theirs.scores)
    with torch.no_grad():
        recomputed = response_logprobs(tr.actor.module, ours.sequences, ours.attention_mask, ours.response_len)
    m = ours.action_mask.bool()
    assert m.sum() > 10 and torch.allclose(ours.old_logp[m], recomputed[m], atol=1e-5)


def test_gradient_checkpointing_keeps_the_shared_prompt_and_the_same_update(ws):
    """``compute.gradient_checkpointing``: GRPO's groups still share their prompt (the log-prob passes through the
    cache, the training forward packed), and one iteration from the same seed moves the actor as without it."""
    actors, metrics = [], []
    for options in ((), ("compute.gradient_checkpointing=true",)):
        tr = _trainer(ws, "rlhf.algorithm=grpo", "rlhf.grpo.group_size=4", "rlhf.lr=1e-3", *options)
        torch.manual_seed(5)
        assert tr.bundle.shared_prefix and tr.maker.cfg.shared_prefix
        metrics.append(tr.step())
        actors.append([p.detach().clone() for p in tr.actor.module.parameters()])
    assert metrics[0]["policy_loss"] == pytest.approx(metrics[1]["policy_loss"], abs=1e-5)
    moved = sum(float((a - b).abs().sum()) for a, b in zip(actors[0], actors[1], strict=True))
    assert moved < 1e-3 * sum(float(a.abs().sum()) for a in actors[0])
