"""The evaluation gate on hand-made reports: every gate passes and fails where it should."""

import math

from rlhf_core.config import GatesConfig
from tasks.gates import decide, render_report


def report(**over):
    base = {
        "candidate": {"reward_mean": 0.8, "accuracy": 0.7, "kl_to_reference": 1.2, "response_length": 3.0,
                      "eos_share": 1.0},
        "reference": {"reward_mean": 0.5, "accuracy": 0.6, "kl_to_reference": 0.0, "response_length": 3.1,
                      "eos_share": 0.9},
        "champion": None, "win_rate_vs_reference": 0.62, "win_rate_vs_champion": None, "n_prompts": 50,
        "judge_gain_vs_reference": 0.1, "judge_source": "checker",
    }
    for key, value in over.items():
        if isinstance(value, dict):
            base[key] = {**(base[key] or {}), **value}
        else:
            base[key] = value
    return base


GATES = GatesConfig(min_reward_gain=0.1, min_win_rate_vs_champion=0.55, max_kl=2.0, min_accuracy=0.65)


def by_name(result):
    return {c.name: c for c in result.checks}


def test_all_pass_without_champion():
    result = decide(report(), GATES)
    checks = by_name(result)
    assert result.passed
    assert math.isclose(checks["reward_gain_vs_reference"].value, 0.3)
    assert checks["win_rate_vs_champion"].passed and checks["win_rate_vs_champion"].note == "no champion yet"


def test_each_gate_fails_on_its_own():
    cases = {
        "reward_gain_vs_reference": report(candidate={"reward_mean": 0.55}),  # gain 0.05 < 0.1
        "win_rate_vs_champion": report(champion={"reward_mean": 0.9}, win_rate_vs_champion=0.5),
        "kl_to_reference": report(candidate={"kl_to_reference": 2.5}),
        "accuracy": report(candidate={"accuracy": 0.6}),
        "no_nan": report(candidate={"reward_mean": float("nan")}),
    }
    for gate, rep in cases.items():
        result = decide(rep, GATES)
        assert not result.passed, gate
        assert gate in [c.name for c in result.failing], (gate, result.failing)


def test_boundaries_are_inclusive():
    rep = report(candidate={"reward_mean": 0.75, "kl_to_reference": 2.0, "accuracy": 0.65},
                 reference={"reward_mean": 0.5}, champion={"reward_mean": 0.7}, win_rate_vs_champion=0.55)
    assert decide(rep, GatesConfig(min_reward_gain=0.25, min_win_rate_vs_champion=0.55, max_kl=2.0,
                                   min_accuracy=0.65)).passed


def test_nan_names_the_field_and_accuracy_optional():
    rep = report(candidate={"accuracy": None, "kl_to_reference": float("inf")})
    result = decide(rep, GATES)
    checks = by_name(result)
    assert checks["no_nan"].note == "candidate.kl_to_reference"
    assert checks["accuracy"].passed and checks["accuracy"].note == "task has no checker"


def test_markdown_report_lists_models_and_gates():
    rep = report(champion={"reward_mean": 0.7, "accuracy": 0.66}, win_rate_vs_champion=0.4,
                 champion_label="rlhf-demo-actor v1", candidate_label="rlhf-demo-actor v2")
    md = render_report(rep, decide(rep, GATES), plots={"reward curve": "runs:/abc/plots/rlhf_reward.png"})
    assert md.startswith("# Gate report: FAILED")
    assert "| reward_mean | 0.8 | 0.5 | 0.7 |" in md
    assert "| win_rate_vs_champion | 0.4 | >= 0.55 | **FAIL** |" in md
    assert "| kl_to_reference | 1.2 | <= 2 | pass |" in md
    assert "[reward curve](runs:/abc/plots/rlhf_reward.png)" in md


def test_reward_hacking_is_refused_whatever_the_proxy_says():
    """Proxy up (+2.5), judge down (-0.3): the judge gate fails and the report says it in words."""
    hacked = report(candidate={"reward_mean": 3.0, "judge_mean": 0.3}, reference={"judge_mean": 0.6},
                    judge_gain_vs_reference=-0.3, judge_source="checker")
    result = decide(hacked, GATES)
    checks = by_name(result)
    assert not result.passed and [c.name for c in result.failing] == ["judge_gain_vs_reference"]
    assert checks["reward_gain_vs_reference"].passed  # the proxy alone would have promoted it
    assert checks["judge_gain_vs_reference"].note == "reward hacking suspected: proxy +2.5, judge -0.3"
    assert "**reward hacking suspected: proxy +2.5, judge -0.3.**" in render_report(hacked, result)


def test_judge_margin_is_configurable_and_inclusive():
    rep = report(judge_gain_vs_reference=0.05, judge_source="checker")
    assert decide(rep, GATES.model_copy(update={"min_judge_gain": 0.05})).passed
    failed = decide(rep, GATES.model_copy(update={"min_judge_gain": 0.06}))
    assert [c.name for c in failed.failing] == ["judge_gain_vs_reference"]
    assert failed.failing[0].note.startswith("reward hacking suspected")  # the proxy rose by 0.3


def test_no_judge_refuses_unless_the_params_allow_it():
    """Nothing judged the candidate (no checker answers, no judge RM): the gate refuses it, whatever the proxy and
    the other gates say; ``gates.allow_unjudged`` passes it, and the result says it was decided unjudged."""
    unjudged = report(judge_gain_vs_reference=None, judge_source=None)
    refused = decide(unjudged, GATES)
    assert not refused.passed and [c.name for c in refused.failing] == ["judge_gain_vs_reference"]
    assert "gates.allow_unjudged" in refused.failing[0].note and refused.judge is None
    assert refused.to_dict()["judge"] is None
    allowed = decide(unjudged, GATES.model_copy(update={"allow_unjudged": True}))
    assert allowed.passed and allowed.judge == "none (gates.allow_unjudged)"
    assert "reward hacking cannot be detected" in by_name(allowed)["judge_gain_vs_reference"].note
    assert decide(report(), GATES).judge == "checker"  # a judged decision names its judge


def test_the_step_judge_refuses_steps_that_got_worse_and_is_silent_without_steps():
    """Process supervision's judge: the candidate's held-out step accuracy against the reference's (the
    multi-step task); a task without step labels passes with a note."""
    worse = report(step_accuracy_gain_vs_reference=-0.1, candidate={"step_accuracy": 0.4},
                   reference={"step_accuracy": 0.5})
    failed = decide(worse, GATES)
    assert [c.name for c in failed.failing] == ["step_accuracy_gain_vs_reference"]
    assert failed.failing[0].value == -0.1 and failed.failing[0].threshold == 0.0
    assert decide(report(step_accuracy_gain_vs_reference=0.0), GATES).passed  # inclusive
    assert not decide(report(step_accuracy_gain_vs_reference=0.02),
                      GATES.model_copy(update={"min_step_accuracy_gain": 0.05})).passed
    silent = by_name(decide(report(), GATES))["step_accuracy_gain_vs_reference"]
    assert silent.passed and silent.note == "the task labels no steps"
    assert "| step_accuracy | 0.4 | 0.5 |" in render_report(worse, failed)
