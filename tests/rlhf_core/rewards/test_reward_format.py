"""The reward model's format on disk: a transformers ``*ForSequenceClassification`` checkpoint that HF and TRL load
with our scores; a sequence classifier built elsewhere (own tokenizer) as the reward and as the critic's init; the
previous value-head layout still read; directories that are neither named. Tiny models built from configs here."""

from __future__ import annotations

import json
import os
from unittest import mock

import pytest
import torch

from tests.conftest import make_params

TEXTS = ["Human: What is 1 + 2?\n\nAssistant: 3", "Human: What is 17 + 25?\n\nAssistant: 4 2 4 2 4 2",
         "Human: What is 3 + 3?\n\nAssistant:", "x"]


DEMO = "Human: What is {a} + {b}?\n\nAssistant: {c}"
OTHER = "Human: How much are {a} and {b} together?\n\nAssistant: They make {c}."  # another corpus, another vocab


def _tokenizer(template: str = DEMO, vocab_size: int = 64):
    """The demo's BPE tokenizer (``tokenizers``, as prepare trains it), trained here on ``template``'s sums."""
    from rlhf_core.data.tokenizer import train_demo_tokenizer

    return train_demo_tokenizer([template.format(a=a, b=b, c=a + b) for a in range(30) for b in range(30)],
                                vocab_size=vocab_size)


def _config(tok, **kw):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                       num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                       pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                       **kw)


def _our_rm(tok, seed: int = 0):
    """A random ValueHeadModel over a tiny Llama, its head scaled so scores are far from 0."""
    from transformers import LlamaModel

    from rlhf_core.models import ValueHeadModel

    torch.manual_seed(seed)
    model = ValueHeadModel(LlamaModel(_config(tok))).eval()
    model.scale_head(30.0)
    return model


def _right_padded(tok, texts):
    """``text + EOS`` rows, right-padded, as TRL and HF's pooling expect them."""
    return tok([t + tok.eos_token for t in texts], padding=True, padding_side="right", return_tensors="pt")


@torch.no_grad()
def _hf_scores(path, tok, texts) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(path).eval()
    return hf(**_right_padded(tok, texts)).logits[:, 0]


def _save_legacy(model, tok, directory):
    """A reward model in the previous layout, written as the old ``ValueHeadModel.save_pretrained`` did."""
    from safetensors.torch import save_file

    model.backbone.save_pretrained(directory)
    weight = model.value_head.weight.detach().float().contiguous()
    save_file({"weight": weight}, str(directory / "value_head.safetensors"))
    (directory / "value_head.json").write_text(json.dumps({"format": "rlhf-ops/value-head", "hidden_size": 32,
                                                           "bias": False}))
    tok.save_pretrained(directory)


# --------------------------------------------------------------------------- our RM -> HF / TRL
def test_saved_rm_is_a_sequence_classifier_that_hf_loads_with_our_scores(tmp_path):
    """Our RM saves as LlamaForSequenceClassification (backbone under ``model.``, head ``score.weight``, one label,
    the tokenizer's pad id in the config); ``AutoModelForSequenceClassification`` scores right-padded rows as our
    in-memory model and our loader do (left padding included on our side), to 1e-5."""
    from safetensors import safe_open

    from rlhf_core.models import RewardScorer, ValueHeadModel

    tok = _tokenizer()
    model = _our_rm(tok)
    out = tmp_path / "rm"
    model.save_pretrained(out, tok.pad_token_id)
    tok.save_pretrained(out)
    assert not (out / "value_head.safetensors").exists() and not (out / "value_head.json").exists()
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
    assert config["pad_token_id"] == tok.pad_token_id != tok.eos_token_id
    with safe_open(str(out / "model.safetensors"), "pt") as fh:
        keys = set(fh.keys())
        torch.testing.assert_close(fh.get_tensor("score.weight"), model.value_head.weight.detach())
    assert {k.split(".")[0] for k in keys} == {"model", "score"} and "model.embed_tokens.weight" in keys

    hf = _hf_scores(out, tok, TEXTS)
    batch = _right_padded(tok, TEXTS)
    with torch.no_grad():
        ours_right = model(batch["input_ids"], batch["attention_mask"]).scores
    assert len(set(batch["attention_mask"].sum(1).tolist())) > 1  # the rows are padded
    torch.testing.assert_close(hf, ours_right, atol=1e-5, rtol=1e-5)
    scorer = RewardScorer.from_pretrained(out, device="cpu")  # our loader: right-pads itself
    torch.testing.assert_close(scorer.score(TEXTS), hf, atol=1e-5, rtol=1e-5)
    left = tok([t + tok.eos_token for t in TEXTS], padding=True, padding_side="left", return_tensors="pt")
    loaded = ValueHeadModel.from_pretrained(out, require_head=True)
    with torch.no_grad():
        torch.testing.assert_close(loaded(left["input_ids"], left["attention_mask"]).scores, hf, atol=1e-5,
                                   rtol=1e-5)


@pytest.fixture
def restored_environ():
    """accelerate's state (built by TRL's trainer in this process) writes RANK, WORLD_SIZE, LOCAL_RANK and
    MASTER_PORT into os.environ; left there they reach every later subprocess of the test worker, whose
    DeepSpeed then takes them for a launcher's and looks for MPI."""
    with mock.patch.dict(os.environ):
        yield


def test_trl_grpo_trainer_takes_our_saved_rm_as_its_reward_function(tmp_path, restored_environ):
    """TRL's GRPOTrainer, given our RM directory as ``reward_funcs``, loads it (AutoModelForSequenceClassification,
    num_labels=1, its tokenizer from the directory) and its reward pass gives our scorer's scores."""
    pytest.importorskip("trl")
    from datasets import Dataset
    from transformers import LlamaForCausalLM, LlamaForSequenceClassification
    from trl import GRPOConfig, GRPOTrainer

    from rlhf_core.models import RewardScorer

    tok = _tokenizer()
    out = tmp_path / "rm"
    _our_rm(tok).save_pretrained(out, tok.pad_token_id)
    tok.save_pretrained(out)
    prompts = ["Human: What is 1 + 2?\n\nAssistant:", "Human: What is 17 + 25?\n\nAssistant:"] * 2
    completions = [" 3", " 4 2", " 4", " 1 7 2 5"]
    args = GRPOConfig(output_dir=str(tmp_path / "trl"), use_cpu=True, bf16=False, fp16=False, report_to=[],
                      save_strategy="no", per_device_train_batch_size=2, num_generations=2,
                      max_completion_length=4, dataloader_num_workers=0)
    torch.manual_seed(0)
    trainer = GRPOTrainer(model=LlamaForCausalLM(_config(tok)), reward_funcs=str(out), args=args,
                          train_dataset=Dataset.from_dict({"prompt": prompts}), processing_class=tok)
    assert isinstance(trainer.reward_funcs[0], LlamaForSequenceClassification)
    # TRL scores prompt + completion as written: the completions end with the EOS our scorer appends
    rewards = trainer._calculate_rewards([{"prompt": p} for p in prompts], prompts,
                                         [c + tok.eos_token for c in completions], [[0]] * len(prompts))
    ours = RewardScorer.from_pretrained(out, device="cpu").score_responses(prompts, completions)
    torch.testing.assert_close(rewards[:, 0].float(), ours, atol=1e-5, rtol=1e-5)


def test_lora_rm_is_merged_on_save_and_an_unmerged_adapter_is_reapplied(tmp_path):
    """LoRA merged on save (default): HF loads the plain classifier with the adapted model's scores; unmerged
    (``merge_on_save: false``): the adapter goes to ``adapter/`` and our loader applies it again."""
    from rlhf_core.config import LoraConfig
    from rlhf_core.models import ValueHeadModel
    from rlhf_core.models.loading import apply_lora, save_value_model

    tok = _tokenizer()
    batch = _right_padded(tok, TEXTS)
    for merge in (True, False):
        model = apply_lora(_our_rm(tok), LoraConfig(enabled=True, r=4, target_modules=["q_proj", "v_proj"]), seed=0)
        torch.manual_seed(1)
        with torch.no_grad():  # B starts at 0 (no change); a random B makes the adapter matter
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(0, 0.5)
            want = model.eval()(batch["input_ids"], batch["attention_mask"]).scores
        out = tmp_path / f"rm-{merge}"
        save_value_model(model, out, merge_lora=merge, pad_token_id=tok.pad_token_id)
        assert (out / "adapter").is_dir() != merge
        loaded = ValueHeadModel.from_pretrained(out, require_head=True).eval()
        with torch.no_grad():
            torch.testing.assert_close(loaded(batch["input_ids"], batch["attention_mask"]).scores, want, atol=1e-5,
                                       rtol=1e-5)
        if merge:
            torch.testing.assert_close(_hf_scores(out, tok, TEXTS), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- a classifier built elsewhere
def _hf_reward_model(tok, directory, seed: int = 3, num_labels: int = 1):
    """A LlamaForSequenceClassification made with transformers alone, saved with its own tokenizer."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    model = LlamaForSequenceClassification(_config(tok, num_labels=num_labels)).eval()
    with torch.no_grad():
        model.score.weight.mul_(30.0)
    model.save_pretrained(directory)
    tok.save_pretrained(directory)
    return model


def test_a_sequence_classifier_with_its_own_tokenizer_is_the_reward(tmp_path):
    """A transformers-made classifier with another vocabulary than the actor's: ``rm`` reward scores it with its
    own tokenizer (re-tokenised text) and gives HF's scores; ``rm_tokenizer_mismatch: error`` refuses it."""
    from rlhf_core.rewards.sources import RewardSources

    actor_tok, own_tok = _tokenizer(), _tokenizer(OTHER, vocab_size=80)
    assert actor_tok.get_vocab() != own_tok.get_vocab()
    rm_dir = tmp_path / "hub-rm"
    _hf_reward_model(own_tok, rm_dir)
    prompts = ["Human: What is 1 + 2?\n\nAssistant:", "Human: What is 51 + 7?\n\nAssistant:", "Human: hi"]
    responses = [" 3", " 5 8", ""]
    reward = RewardSources({"rm": 1.0}, rm_dir, actor_tok, "retokenize")
    assert reward.rm.tokenizer.get_vocab() == own_tok.get_vocab()
    want = _hf_scores(rm_dir, own_tok, [p + r for p, r in zip(prompts, responses, strict=True)])
    torch.testing.assert_close(reward(prompts, responses), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match=f"{rm_dir}.*different tokenizer"):
        RewardSources({"rm": 1.0}, rm_dir, actor_tok, "error")
    # weight 0 (the no-reward control): the rule alone, the RM never run, though loaded for rm_scores
    control = RewardSources({"rm": 0.0, "format": 1.0}, rm_dir, actor_tok)
    calls = []
    control.rm.score_responses = lambda *a: calls.append(a)
    assert control(prompts, [" 3", " five", ""]).tolist() == [1.0, 0.0, 0.0] and not calls


def test_a_sequence_classifier_initialises_the_critic_and_a_round_continues_from_it(tmp_path):
    """``load_critic`` and ``build_value_model(init_from='previous')`` take a transformers-made classifier: its
    backbone and ``score`` head, one value per token, the last one HF's score. Its tokenizer must be the actor's
    (``check_critic_tokenizer`` names the RM otherwise)."""
    from rlhf_core.engine.errors import TrainingInputError
    from rlhf_core.models.loading import build_value_model
    from rlhf_core.trainers.rlhf.inputs import check_critic_tokenizer
    from rlhf_core.trainers.rlhf.models import load_critic

    tok = _tokenizer()
    rm_dir, sft_dir, other_dir = tmp_path / "rm", tmp_path / "sft", tmp_path / "other"
    hf = _hf_reward_model(tok, rm_dir)
    tok.save_pretrained(sft_dir)
    check_critic_tokenizer(sft_dir, rm_dir, False)  # same vocabulary: accepted
    _hf_reward_model(_tokenizer(OTHER, vocab_size=80), other_dir)
    with pytest.raises(TrainingInputError, match="tokenizer differs from the actor"):
        check_critic_tokenizer(sft_dir, other_dir, False)

    batch = _right_padded(tok, TEXTS)
    want = _hf_scores(rm_dir, tok, TEXTS)
    critic = load_critic(make_params(), rm_dir).eval()
    with torch.no_grad():
        out = critic(batch["input_ids"], batch["attention_mask"])
    assert out.values.shape == batch["input_ids"].shape
    torch.testing.assert_close(out.scores, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(critic.value_head.weight, hf.score.weight)
    again = build_value_model(make_params(), tmp_path, "previous", "rm")
    torch.testing.assert_close(again.value_head.weight, hf.score.weight)


def test_a_hub_id_is_read_as_the_reward(tmp_path):
    """A Hub id (``org/name``) loads as the reward: here from a Hub cache laid out offline (refs/main -> a snapshot
    holding a transformers-made classifier and its tokenizer), in a process of its own pointed at that cache."""
    import subprocess
    import sys

    from tests.conftest import REPO

    tok = _tokenizer()
    snapshot = tmp_path / "hub" / "models--org--tiny-rm" / "snapshots" / "0123abcd"
    _hf_reward_model(tok, snapshot)
    (tmp_path / "hub" / "models--org--tiny-rm" / "refs").mkdir()
    (tmp_path / "hub" / "models--org--tiny-rm" / "refs" / "main").write_text("0123abcd")
    code = ("from rlhf_core.models import RewardScorer; "
            f"print(RewardScorer.from_pretrained('org/tiny-rm', device='cpu').score({TEXTS!r}).tolist())")
    env = {**os.environ, "HF_HUB_CACHE": str(tmp_path / "hub"), "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.tensor(json.loads(proc.stdout.strip().splitlines()[-1]))
    torch.testing.assert_close(got, _hf_scores(snapshot, tok, TEXTS), atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- the previous layout
def test_legacy_value_head_directory_still_loads_scores_the_same_and_resaves_for_hf(tmp_path):
    """A reward model in the value-head layout (sealed, as a stage wrote it) loads as the reward, the critic's init
    and an ensemble member beside a new-format one, with its old scores; saved again, HF reads it."""
    from rlhf_core.models import EnsembleScorer, RewardScorer, ValueHeadModel, load_scorer
    from rlhf_core.ops.integrity import seal_model_dir
    from rlhf_core.trainers.rlhf.models import load_critic

    tok = _tokenizer()
    model = _our_rm(tok)
    legacy = tmp_path / "rm"
    _save_legacy(model, tok, legacy)
    seal_model_dir(legacy)
    batch = _right_padded(tok, TEXTS)
    with torch.no_grad():
        want = model(batch["input_ids"], batch["attention_mask"]).scores
    old = RewardScorer.from_pretrained(legacy, device="cpu")
    torch.testing.assert_close(old.score(TEXTS), want, atol=1e-5, rtol=1e-5)
    critic = load_critic(make_params(), legacy).eval()
    torch.testing.assert_close(critic.value_head.weight, model.value_head.weight)

    member = legacy / "members/1"  # an ensemble: member 0 in the old layout, member 1 in the new one
    _our_rm(tok, seed=1).save_pretrained(member, tok.pad_token_id)
    tok.save_pretrained(member)
    (legacy / "ensemble.json").write_text(json.dumps({"members": [
        {"path": ".", "center": 1.0, "scale": 2.0}, {"path": "members/1", "center": -1.0, "scale": 0.5}]}))
    seal_model_dir(legacy)
    ensemble = load_scorer(legacy, device="cpu")
    assert isinstance(ensemble, EnsembleScorer)
    s1 = RewardScorer.from_pretrained(member, device="cpu").score(TEXTS)
    torch.testing.assert_close(ensemble.score(TEXTS), ((want - 1.0) / 2.0 + (s1 + 1.0) / 0.5) / 2, atol=1e-5,
                               rtol=1e-5)

    resaved = tmp_path / "resaved"
    ValueHeadModel.from_pretrained(legacy, require_head=True).save_pretrained(resaved, tok.pad_token_id)
    torch.testing.assert_close(_hf_scores(resaved, tok, TEXTS), want, atol=1e-5, rtol=1e-5)


# --------------------------------------------------------------------------- bad input
def test_directories_that_are_no_reward_model_are_named(tmp_path):
    """Neither format (a plain backbone), no config.json, no tokenizer files, several labels, an encoder
    classifier: each an error that names the directory."""
    from transformers import BertConfig, BertForSequenceClassification, LlamaModel

    from rlhf_core.models import RewardScorer, ValueHeadModel
    from rlhf_core.models.reward_format import RewardModelFormatError
    from rlhf_core.rewards.sources import RewardSources

    tok = _tokenizer()
    plain = tmp_path / "plain"
    LlamaModel(_config(tok)).save_pretrained(plain)
    tok.save_pretrained(plain)
    with pytest.raises(RewardModelFormatError, match=f"{plain}: not a reward / value model"):
        RewardScorer.from_pretrained(plain, device="cpu")
    with pytest.raises(ValueError, match=f"{plain}: not a reward / value model"):
        RewardSources({"rm": 1.0}, plain)
    assert ValueHeadModel.from_pretrained(plain) is not None  # a backbone to start a reward model from

    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(RewardModelFormatError, match=f"{empty}: no config.json"):
        ValueHeadModel.from_pretrained(empty, require_head=True)
    with pytest.raises(ValueError, match=f"{empty}: no tokenizer files"):
        RewardScorer.from_pretrained(empty, device="cpu")

    no_tok = tmp_path / "no-tokenizer"
    _hf_reward_model(tok, no_tok)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (no_tok / name).unlink(missing_ok=True)
    with pytest.raises(ValueError, match=f"{no_tok}: no tokenizer files"):
        RewardScorer.from_pretrained(no_tok, device="cpu")

    headless = tmp_path / "headless"  # a classifier's config over weights without the head: not a trained RM
    _hf_reward_model(tok, headless)
    from safetensors.torch import load_file, save_file

    weights = load_file(headless / "model.safetensors")
    del weights["score.weight"]
    save_file(weights, str(headless / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(RewardModelFormatError, match=f"{headless}: the checkpoint lacks weights of .*score.weight"):
        RewardScorer.from_pretrained(headless, device="cpu")

    two = tmp_path / "two-labels"
    _hf_reward_model(tok, two, num_labels=2)
    with pytest.raises(RewardModelFormatError, match=f"{two}: LlamaForSequenceClassification has num_labels=2"):
        RewardScorer.from_pretrained(two, device="cpu")

    bert = tmp_path / "bert"
    BertForSequenceClassification(BertConfig(vocab_size=len(tok), hidden_size=32, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=64, num_labels=1)
                                  ).save_pretrained(bert)
    with pytest.raises(RewardModelFormatError, match=f"{bert}: BertForSequenceClassification has no `score`"):
        ValueHeadModel.from_pretrained(bert, require_head=True)
