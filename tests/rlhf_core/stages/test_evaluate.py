"""The evaluate stage on tiny local models: report schema, hand-checkable numbers, bad input."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from rlhf_core.stages.evaluate import evaluate, win_rate
from rlhf_core.stages.prepare import prepare
from tests.conftest import make_params


def test_win_rate_counts_ties_half():
    a, b = torch.tensor([1.0, 0.0, 0.5, 2.0]), torch.tensor([0.0, 1.0, 0.5, 1.0])
    assert win_rate(a, b) == pytest.approx((1 + 0 + 0.5 + 1) / 4)


def _tiny_lm(base, out, seed):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base))
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(base).save_pretrained(out)


@pytest.fixture
def prepared(workspace):
    params = make_params("model.tiny.hidden_size=32", "model.tiny.num_attention_heads=2",
                         "model.tiny.num_key_value_heads=2", "model.tiny.num_hidden_layers=1",
                         "model.tiny.intermediate_size=64", "eval.max_prompts=12", "eval.max_new_tokens=4",
                         "rlhf.reward_fns={exact_answer: 1.0}")
    prepare(params)
    _tiny_lm(workspace / "models/base", workspace / "models/sft", seed=0)
    return params


def test_identical_candidate_and_reference(prepared, workspace):
    shutil.copytree(workspace / "models/sft", workspace / "models/actor")
    report = evaluate(prepared, workspace)
    cand, ref = report["candidate"], report["reference"]
    assert report["n_prompts"] == 12 and report["champion"] is None and report["win_rate_vs_champion"] is None
    assert cand["kl_to_reference"] == pytest.approx(0.0, abs=1e-5)
    assert report["win_rate_vs_reference"] == 0.5  # identical greedy answers tie everywhere
    assert cand["reward_mean"] == ref["reward_mean"] == cand["accuracy"]  # exact_answer reward == accuracy
    assert 0 < cand["response_length"] <= 4 and 0 <= cand["eos_share"] <= 1
    assert json.loads((workspace / "reports/eval.json").read_text()) == report
    metrics = json.loads((workspace / "metrics/evaluate.json").read_text())
    assert metrics["win_rate_vs_reference"] == 0.5


def test_different_candidate_has_positive_kl(prepared, workspace):
    _tiny_lm(workspace / "models/base", workspace / "models/actor", seed=1)
    report = evaluate(prepared, workspace)
    assert report["candidate"]["kl_to_reference"] > 0  # KL of pi to pi_ref on pi's own greedy samples


def test_missing_models_are_named(prepared, workspace):
    with pytest.raises(ValueError, match=r"models/actor is missing"):
        evaluate(prepared, workspace)


class _Table(torch.nn.Module):
    """logits[t] = table[token[t]]."""

    def __init__(self, table):
        super().__init__()
        self.table = table

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
        return type("Out", (), {"logits": self.table[input_ids][:, -logits_to_keep:]})()


def test_sequence_kl_by_hand():
    from rlhf_core.evaluation import sequence_kl
    from rlhf_core.passes.generation import Rollout

    p = torch.tensor([[0.5, 0.5], [0.9, 0.1]])  # rows: next-token distributions after token 0 / token 1
    q = torch.tensor([[0.5, 0.5], [0.5, 0.5]])
    rollout = Rollout(torch.tensor([[0]]), torch.tensor([[1]]), torch.tensor([[1, 0]]), torch.tensor([[1, 1]]), ["x"])
    kl = sequence_kl(_Table(p.log()), _Table(q.log()), rollout, batch_size=4)
    # positions scoring the response: after token 0 (KL 0) and after token 1:
    # 0.9 ln(0.9/0.5) + 0.1 ln(0.1/0.5) = 0.5290 - 0.1609 = 0.3681
    assert kl.tolist() == pytest.approx([0.36806], abs=1e-4)
    rollout.action_mask = torch.tensor([[1, 0]])  # the second response token is masked out
    assert sequence_kl(_Table(p.log()), _Table(q.log()), rollout, batch_size=4).tolist() == pytest.approx([0.0])


def test_proxy_and_judge_are_reported_with_the_answers_table(prepared, workspace):
    _tiny_lm(workspace / "models/base", workspace / "models/actor", seed=1)
    report = evaluate(prepared, workspace)
    cand, ref = report["candidate"], report["reference"]
    assert report["judge_source"] == "checker" and report["reward_source"] == "exact_answer:1"
    assert cand["judge_mean"] == cand["accuracy"] and ref["judge_mean"] == ref["accuracy"]
    assert report["judge_gain_vs_reference"] == pytest.approx(cand["accuracy"] - ref["accuracy"])
    assert report["proxy_gain_vs_reference"] == pytest.approx(cand["reward_mean"] - ref["reward_mean"])
    assert report["win_rate_basis"] == "judge"
    table = json.loads((workspace / "reports/eval_answers.json").read_text())
    assert len(table["prompt"]) == 12 and set(table) >= {"answer", "candidate_response", "candidate_proxy",
                                                          "candidate_judge", "reference_response"}
    assert sum(table["candidate_judge"]) / 12 == pytest.approx(cand["accuracy"])


def test_judge_model_scores_when_prompts_have_no_checker(prepared, workspace):
    """eval.judge: model with a judge RM directory: judge_mean is that RM's mean score; bad paths are named."""
    from transformers import AutoConfig, AutoModel, AutoTokenizer

    from rlhf_core.models.value_head import ValueHeadModel
    from rlhf_core.rewards.sources import load_reward_model

    _tiny_lm(workspace / "models/base", workspace / "models/actor", seed=1)
    torch.manual_seed(5)
    judge_dir = workspace / "judges/gold"
    ValueHeadModel(AutoModel.from_config(AutoConfig.from_pretrained(workspace / "models/base"))).save_pretrained(
        judge_dir)
    AutoTokenizer.from_pretrained(workspace / "models/base").save_pretrained(judge_dir)
    params = prepared.model_copy(update={"eval": prepared.eval.model_copy(
        update={"judge": "model", "judge_model": "judges/gold"})})
    report = evaluate(params, workspace)
    table = json.loads((workspace / "reports/eval_answers.json").read_text())
    expected = load_reward_model(judge_dir).score_responses(table["prompt"], table["candidate_response"])
    assert report["judge_source"] == "model:judges/gold"
    assert report["candidate"]["judge_mean"] == pytest.approx(float(expected.mean()), abs=1e-4)
    bad = params.model_copy(update={"eval": params.eval.model_copy(update={"judge_model": "models/nope"})})
    with pytest.raises(ValueError, match=r"eval.judge_model: .*models/nope holds no reward model"):
        evaluate(bad, workspace)
    none = params.model_copy(update={"eval": params.eval.model_copy(update={"judge_model": None})})
    with pytest.raises(ValueError, match=r"eval.judge: model needs eval.judge_model .* or a judge trained"):
        evaluate(none, workspace)
    shutil.copytree(judge_dir, workspace / "models/judge")  # trained by the rm stage (rm.judge): found by default
    assert evaluate(none, workspace)["judge_source"] == "model:models/judge"


def test_held_out_repeat_each_keeps_prompts_answers_and_tokens_together():
    from rlhf_core.data.collate import Ragged
    from rlhf_core.evaluation import HeldOut

    held = HeldOut(["a", "b"], [1, 2], Ragged.from_lists([[5, 6], [7]]))
    twice = held.repeat_each(2)
    assert twice.prompts == ["a", "a", "b", "b"] and twice.answers == [1, 1, 2, 2]
    assert twice.tokens.flat.tolist() == [5, 6, 5, 6, 7, 7] and twice.tokens.lengths.tolist() == [2, 2, 1, 1]
    assert HeldOut(["a"], None, Ragged.from_lists([[5]])).repeat_each(3).answers is None
