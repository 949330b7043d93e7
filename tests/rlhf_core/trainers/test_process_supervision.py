"""Process supervision's math (rlhf_core/algos/process.py) against hand-computed numbers."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.algos.process import (
    normalised_step_rewards,
    process_advantages,
    rewards_to_go,
    step_bce_loss,
    step_ends,
    step_token_rewards,
)

D = 9  # the delimiter token


def test_step_ends_are_the_delimiters_and_the_last_token():
    ids = torch.tensor([[5, D, 6, 7, 2, 0],    # two steps: "5 D" and "6 7 EOS"; 0 is padding
                        [5, 6, 2, 0, 0, 0],    # no delimiter: one step
                        [5, D, 6, D, 0, 0],    # ends on a delimiter: it is also the last token (one end)
                        [0, 0, 0, 0, 0, 0]])   # no valid token: no step
    mask = torch.tensor([[1, 1, 1, 1, 1, 0], [1, 1, 1, 0, 0, 0], [1, 1, 1, 1, 0, 0], [0] * 6])
    ends, empty = step_ends(ids, mask, D)
    assert ends.int().tolist() == [[0, 1, 0, 0, 1, 0], [0, 0, 1, 0, 0, 0], [0, 1, 0, 1, 0, 0], [0] * 6]
    assert empty.tolist() == [False, False, False, False]


def test_an_empty_step_is_flagged():
    ids = torch.tensor([[D, 5, 6, 2],   # opens with a delimiter
                        [5, D, D, 2],   # two delimiters in a row
                        [5, D, 6, D]])  # fine
    ends, empty = step_ends(ids, torch.ones(3, 4), D)
    assert empty.tolist() == [True, True, False]
    assert ends.int().tolist() == [[1, 0, 0, 1], [0, 1, 1, 1], [0, 1, 0, 1]]


def test_step_bce_loss_by_hand():
    logits = torch.tensor([[0.0, 5.0, 2.0]])
    labels = torch.tensor([[1.0, 1.0, 0.0]])
    ends = torch.tensor([[1, 0, 1]])  # the middle position is not a step end: ignored
    expected = (math.log(2.0) + math.log1p(math.exp(2.0))) / 2  # -log sigmoid(0), -log(1 - sigmoid(2))
    assert step_bce_loss(logits, labels, ends).item() == pytest.approx(expected, abs=1e-6)
    assert step_bce_loss(logits, labels, torch.zeros(1, 3)).item() == 0.0


def test_process_advantages_by_hand():
    """One group of two outputs. Step rewards R = {1, 0 | 1, 1}: mean 0.75, unbiased std 0.5, so
    r~ = {0.5, -1.5 | 0.5, 0.5}; each token sums the r~ of the step ends at or after it."""
    rewards = torch.tensor([[7.0, 1.0, 7.0, 0.0],    # ends at t=1 (r 1) and t=3 (r 0); 7s are not step ends
                            [7.0, 7.0, 1.0, 1.0]])   # ends at t=2 (r 1) and t=3 (r 1)
    ends = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 1]])
    adv = process_advantages(rewards, ends, torch.ones(2, 4), group_size=2, eps=0.0)
    torch.testing.assert_close(adv, torch.tensor([[-1.0, -1.0, -1.5, -1.5], [1.0, 1.0, 1.0, 0.5]]))


def test_rewards_to_go_by_hand():
    """Each token sums the step rewards at or after it; 0 outside the mask (here the padded last token)."""
    per_step = torch.tensor([[0.0, 1.0, 0.0, 2.0], [0.0, -1.0, 0.0, 5.0]])
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    torch.testing.assert_close(rewards_to_go(per_step, mask), torch.tensor([[3.0, 3.0, 2.0, 2.0],
                                                                             [4.0, 4.0, 5.0, 0.0]]))


def test_ppo_step_token_rewards_by_hand():
    """The same group: r~ = {0.5, -1.5 | 0.5, 0.5} at the step ends. With k1 = logp - ref = 0.5 on row 0 and -1 on
    row 1 and c = 0.1, every valid token gets -c k1 (-0.05 / +0.1) and each step end adds its r~ (clipped to 1)."""
    rewards = torch.tensor([[7.0, 1.0, 7.0, 0.0], [7.0, 7.0, 1.0, 1.0]])
    ends = torch.tensor([[0, 1, 0, 1], [0, 0, 1, 1]])
    normalised = normalised_step_rewards(rewards, ends, torch.ones(2, 4), group_size=2, eps=0.0)
    torch.testing.assert_close(normalised, torch.tensor([[0.0, 0.5, 0.0, -1.5], [0.0, 0.0, 0.5, 0.5]],
                                                        dtype=torch.float64))
    logp = torch.tensor([[-1.0] * 4, [-2.0] * 4])
    ref = torch.tensor([[-1.5] * 4, [-1.0] * 4])
    r = step_token_rewards(normalised.float(), logp, ref, torch.ones(2, 4), kl_coef=0.1)
    torch.testing.assert_close(r, torch.tensor([[-0.05, 0.45, -0.05, -1.55], [0.1, 0.1, 0.6, 0.6]]))
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]])
    clipped = step_token_rewards(normalised.float(), logp, ref, mask, kl_coef=0.1, clip=1.0)
    torch.testing.assert_close(clipped, torch.tensor([[-0.05, 0.45, -0.05, -1.05], [0.1, 0.1, 0.6, 0.0]]))


def test_process_advantages_groups_masks_and_a_lone_step():
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0], [3.0, 0.0], [5.0, 0.0]])
    ends = torch.tensor([[1, 0], [1, 0], [1, 0], [0, 1]])
    mask = torch.tensor([[1, 0], [1, 0], [1, 0], [1, 1]])
    adv = process_advantages(rewards, ends, mask, group_size=2, eps=0.0)
    # group 1: R = {1, 0}: mean 0.5, std sqrt(0.5); group 2: R = {3, 0} (row 3's end is at t=1, reward 0)
    s = math.sqrt(0.5)
    torch.testing.assert_close(adv, torch.tensor([[0.5 / s, 0.0], [-0.5 / s, 0.0],
                                                  [1.5 / 4.5 ** 0.5, 0.0], [-1.5 / 4.5 ** 0.5] * 2]))
    lone = process_advantages(torch.tensor([[2.0, 0.0]]), torch.tensor([[1, 0]]), torch.ones(1, 2), 1)
    assert lone.tolist() == [[0.0, 0.0]]  # a single step: std 0, the reward minus its own mean
    with pytest.raises(ValueError, match="does not divide"):
        process_advantages(rewards, ends, mask, group_size=3)


# --------------------------------------------------------------------------- the multi-step task
from rlhf_core.rewards.multistep import (  # noqa: E402
    Problem,
    check_steps,
    generate,
    parse_expression,
    problem_from_prompt,
    slipped,
    step_labels,
)

P = Problem(12, (("+", 7), ("-", 5), ("+", 30)))


def test_step_accuracy_is_the_share_of_solution_steps_right():
    from rlhf_core.rewards.multistep import step_accuracy

    prompt = f"Solve {P.expression} one step per line."
    assert problem_from_prompt(prompt) == P
    assert step_accuracy("12 + 7 = 19\n19 - 5 = 14\n14 + 30 = 44", prompt) == 1.0
    assert step_accuracy("12 + 7 = 19\n19 - 5 = 15\n15 + 30 = 45", prompt) == pytest.approx(1 / 3)  # then wrong
    assert step_accuracy("12 + 7 = 19", prompt) == pytest.approx(1 / 3)  # two steps missing
    assert step_accuracy("12 + 7 = 19\n19 - 5 = 14\n14 + 30 = 44\n44 + 0 = 44", prompt) == 1.0  # extra: not a step
    assert step_accuracy("", prompt) == 0.0


def test_the_solution_and_its_labels():
    assert P.solution() == ["12 + 7 = 19", "19 - 5 = 14", "14 + 30 = 44"] and P.answer == 44
    right = "12 + 7 = 19\n19 - 5 = 14\n14 + 30 = 44\n"
    assert step_labels(right, P) == [True, True, True] and check_steps(right, P)
    # a slip at step 2 and the next step carried on from it (its own arithmetic right): wrong from the slip on
    assert step_labels("12 + 7 = 19\n19 - 5 = 15\n15 + 30 = 45", P) == [True, False, False]
    assert step_labels("12 + 7 = 19", P) == [True, False, False]  # missing steps are wrong
    assert step_labels("12 + 7 = 19\n19 - 5 = 14\n14 + 30 = 44\n44 + 0 = 44", P) == [True] * 3 + [False]
    assert step_labels("12 + 7 = 19\n\n19 - 5 = 14", P) == [True, False, False]  # an empty line is a wrong step
    assert step_labels("The answer is 44.", P) == [False, False, False]  # unreadable
    assert step_labels("", P) == [False, False, False]
    assert not check_steps("12 + 7 = 19\n19 - 5 = 14\n14 + 30 = 44\n44 + 0 = 44", P)


def test_generate_holds_out_and_slips_one_step():
    import random

    first = lambda m: m[0]["content"]  # noqa: E731
    train, held = generate(60, 20, (2, 4), 30, seed=3, share=0.2, held_out_phrasings=1, render=first)
    assert len(train) == 60 and len(held) == 20
    assert not {r["expression"] for r in train} & {r["expression"] for r in held}
    for row in train + held:
        problem = parse_expression(row["expression"])
        assert check_steps(row["chosen"], problem) and row["answer"] == str(problem.answer)
        labels = step_labels(row["rejected"], problem)
        assert not all(labels) and labels == sorted(labels, reverse=True)  # right, then wrong from the slip on
        assert all(int(line.rsplit("=", 1)[1]) >= 0 for line in row["response"].split("\n"))
    assert generate(60, 20, (2, 4), 30, 3, 0.2, 1, first) == (train, held)
    assert slipped(P, random.Random(0)) != "\n".join(P.solution())


@pytest.mark.parametrize("bad", ["12 +", "12 * 3", "a + 3", "12 + 3 4", ""])
def test_a_bad_expression_or_prompt_is_named(bad):
    with pytest.raises(ValueError, match="not an expression"):
        parse_expression(bad)
    assert problem_from_prompt("Human: Solve 3 + 4 - 1 step by step.").expression == "3 + 4 - 1"
    with pytest.raises(ValueError, match="no expression of the multi-step task in the prompt 'Human: hi'"):
        problem_from_prompt("Human: hi")


def test_prepare_builds_the_multistep_task_for_the_tiny_model(tmp_path):
    """`data.source: multistep` on the tiny model: held-out questions apart, each line a step ending in one newline
    token of the tokenizer trained on the rows, and every demonstration right at every step."""
    import pandas as pd
    from transformers import AutoTokenizer

    from rlhf_core.rewards.multistep import STEP_DELIMITER
    from rlhf_core.stages.prepare import prepare
    from tests.conftest import make_params

    prepare(make_params("data.source=multistep", "data.multistep.n_train=300", "data.multistep.n_held_out=60",
                        "data.multistep.max_ops=3", "data.max_prompt_len=40", "data.max_response_len=40"), tmp_path)
    prepared = tmp_path / "data/prepared"
    sft, eval_sft = pd.read_parquet(prepared / "sft.parquet"), pd.read_parquet(prepared / "eval_sft.parquet")
    train_exprs = {problem_from_prompt(p).expression for p in sft.prompt}
    held_exprs = {problem_from_prompt(p).expression for p in eval_sft.prompt}
    assert len(sft) > 0 and len(eval_sft) > 0 and not train_exprs & held_exprs
    assert all(check_steps(r.response, problem_from_prompt(r.prompt)) for r in sft.itertuples())
    tok = AutoTokenizer.from_pretrained(tmp_path / "models/base")
    newline = tok.encode(STEP_DELIMITER, add_special_tokens=False)
    assert len(newline) == 1
    ids = tok.encode(sft.response.iloc[0], add_special_tokens=False)
    assert ids.count(newline[0]) == sft.response.iloc[0].count(STEP_DELIMITER)


# --------------------------------------------------------------------------- the process reward model
def _step_pairs(labels_c, labels_r):
    """One pair by hand: prompt [5, 6], chosen response [7, D, 8, EOS], rejected [7, D, 9, EOS] (D = 3, EOS = 2)."""
    from rlhf_core.data.collate import PairData, Ragged, TokenizedSequences
    from rlhf_core.trainers.rm_process import StepPairData

    def seqs(row):
        tokens = Ragged.from_lists([row])
        return TokenizedSequences(tokens, torch.tensor([False, False, True, True, True, True]), torch.tensor([2]), 0)

    data = PairData(seqs([5, 6, 7, 3, 8, 2]), seqs([5, 6, 7, 3, 9, 2]))
    return StepPairData(data.chosen, data.rejected, Ragged.from_lists([labels_c], dtype=torch.float32),
                        Ragged.from_lists([labels_r], dtype=torch.float32), delimiter_id=3)


def test_step_batches_put_each_label_at_its_step_end():
    """Steps end at the delimiter (position 3) and the EOS (5): chosen [1, 1], rejected [1, 0] land there; an
    unlabelled row (no labels: its steps did not match its text) has no step end."""
    from rlhf_core.trainers.rm_process import collate_steps

    batch = collate_steps(_step_pairs([1.0, 1.0], [1.0, 0.0]), torch.tensor([0]), pad_id=0)
    assert batch["step_ends"].tolist() == [[False, False, False, True, False, True]] * 2
    assert batch["step_labels"].tolist() == [[0, 0, 0, 1, 0, 1], [0, 0, 0, 1, 0, 0]]
    unlabelled = collate_steps(_step_pairs([1.0, 1.0], []), torch.tensor([0]), pad_id=0)
    assert not unlabelled["step_ends"][1].any() and unlabelled["step_ends"][0].sum() == 2


@pytest.fixture(scope="module")
def multistep_ws(tmp_path_factory):
    """The multi-step task on the tiny model (operands 0-9, 2-3 steps) and its SFT model, made once."""
    from rlhf_core.stages.prepare import prepare
    from rlhf_core.trainers.sft import train_sft

    root = tmp_path_factory.mktemp("prm")
    prepare(_prm_params(), root)
    train_sft(_prm_params(), root)
    return root


def _prm_params(*overrides: str):
    from tests.tiny import TINY_DEMO, tiny_params

    return tiny_params([*TINY_DEMO, "data.source=multistep", "data.multistep.n_train=1500",
                        "data.multistep.n_held_out=150", "data.multistep.max_ops=3", "data.multistep.max_operand=9",
                        "data.max_prompt_len=40", "data.max_response_len=40", "model.tiny.max_position_embeddings=96",
                        "sft.epochs=10", "rm.objective=process", "rm.micro_batch_size=32", "rm.lr=0.003",
                        "rm.warmup_steps=5", "rm.log_every=20", "rm.epochs=6", "eval.max_prompts=16"], *overrides)


def test_prm_learns_held_out_step_labels_and_its_outcome_score_is_the_last_steps(multistep_ws, tmp_path):
    """``rm.objective: process`` on the checker's step labels of the pairs: on held-out questions the step loss
    falls and the steps labelled wrong, all missed at the start, start being found; the saved PRM is an ordinary
    reward model whose score (RL's ``rm`` source) is the value at the last step's end."""
    import shutil

    import pyarrow.parquet as pq

    from rlhf_core.rewards.sources import RewardSources
    from rlhf_core.trainers.rm import train_rm

    for sub in ("data", "models"):
        shutil.copytree(multistep_ws / sub, tmp_path / sub)
    m = train_rm(_prm_params(), tmp_path)
    assert m["objective"] == "process" and m["step_ends"] > 200 and m["unlabelled_rows"] <= 5, m
    assert m["step_loss"] < m["step_loss_before"] - 0.03, m
    assert m["step_accuracy_wrong_before"] < 0.05 and m["step_accuracy_wrong"] > 0.15, m
    pairs = pq.read_table(tmp_path / "data/prepared/eval_pairs.parquet").to_pylist()
    chosen = RewardSources({"rm": 1.0}, tmp_path / "models/rm")([x["prompt"] for x in pairs],
                                                                  [x["chosen"] for x in pairs])
    assert float(chosen.mean()) == pytest.approx(m["chosen_mean"], rel=1e-4, abs=1e-5)
    card = (tmp_path / "models/rm/README.md").read_text()
    assert "Process reward model" in card and "| `rm.objective` | `process` |" in card
    assert "defined only up to a per-prompt constant" in card  # a proxy's limits


def test_prm_refuses_a_task_without_step_labels_and_a_split_delimiter(multistep_ws, tmp_path):
    import shutil

    from rlhf_core.engine.errors import TrainingInputError
    from rlhf_core.trainers.rm import train_rm

    for sub in ("data", "models"):
        shutil.copytree(multistep_ws / sub, tmp_path / sub)
    with pytest.raises(TrainingInputError, match="data.source must be multistep"):
        train_rm(_prm_params("data.source=demo"), tmp_path)
    with pytest.raises(TrainingInputError, match=r"rm.step_delimiter 'Compute step' is \d+ tokens"):
        train_rm(_prm_params("rm.step_delimiter=Compute step"), tmp_path)


# --------------------------------------------------------------------------- RL with process supervision
@pytest.fixture(scope="module")
def with_prm(multistep_ws, tmp_path_factory):
    """The multi-step workspace with a trained process reward model in models/rm."""
    import shutil

    from rlhf_core.trainers.rm import train_rm

    root = tmp_path_factory.mktemp("prm-rl")
    for sub in ("data", "models"):
        shutil.copytree(multistep_ws / sub, root / sub)
    train_rm(_prm_params(), root)
    return root


RL_PROCESS = ("rlhf.algorithm=grpo", "rlhf.grpo.supervision=process", "rlhf.reward_fns={rm: 1.0}",
              "rlhf.prompts_per_step=4", "rlhf.grpo.group_size=4", "rlhf.max_new_tokens=24", "rlhf.micro_batch_size=16",
              "rlhf.num_steps=2", "rlhf.log_every=1", "rlhf.save_every=0", "rlhf.lr=1e-3", "rlhf.temperature=1.5")


def test_grpo_with_process_supervision_credits_each_token_with_its_steps_rewards(with_prm):
    """One iteration under ``grpo.supervision: process``: every kept row's advantages are
    ``process_advantages`` of the PRM's values at its step ends, normalised over its whole group of G, before any
    row was dropped; the training step runs and stays finite."""
    from rlhf_core.trainers.rlhf.trainer import RLHFTrainer

    tr = RLHFTrainer(_prm_params(*RL_PROCESS), with_prm, evaluate=False, checkpoints=False).setup()
    assert tr.bundle.algorithm.name == "grpo/process" and tr.maker.cfg.process is not None
    captured = _spy_on_the_prm(tr)
    torch.manual_seed(0)
    exp = tr.collect(0)
    roll, (adv, _, step_rewards, empty) = captured["roll"], captured["out"]
    values = tr.maker.cfg.process.values(roll.sequences, roll.attention_mask, roll.responses.shape[1])
    ends, empty_again = step_ends(roll.responses, roll.action_mask, tr.maker.cfg.process.delimiter_id)
    assert torch.equal(empty, empty_again) and ends.sum() > len(roll.responses)  # several steps per row
    expected = process_advantages(values, ends & ~empty[:, None], roll.action_mask, 4)
    torch.testing.assert_close(adv, expected)
    torch.testing.assert_close(step_rewards, torch.where(ends, values, torch.zeros(())))  # the logged rewards
    from rlhf_core.trainers.rlhf.experience import empty_response

    kept = ~(empty | empty_response(roll.responses, roll.action_mask, tr.bundle.tokenizer.eos_token_id))
    assert kept.any()  # the buffer: the sampled rows less the dropped ones, in order, trimmed to the longest
    torch.testing.assert_close(exp.step_advantages, adv[kept][:, :exp.response_len])
    metrics = tr.step()
    assert all(v == v for v in metrics.values() if isinstance(v, float)), metrics
    assert "empty_step_dropped" in metrics


def _spy_on_the_prm(tr) -> dict:
    """Record the rollout the experience maker reads the PRM on and what it read."""
    captured, read = {}, tr.maker.cfg.process.read

    def spy(roll, group_size):
        captured["roll"], captured["out"] = roll, read(roll, group_size)
        return captured["out"]

    object.__setattr__(tr.maker.cfg.process, "read", spy)
    return captured


def test_ppo_with_process_supervision_puts_each_steps_reward_on_its_last_token(with_prm):
    """One iteration of ``ppo.supervision: process``: the critic starts from the PRM; the buffer's step rewards
    are the PRM's values at the step ends normalised over each whole group; the token rewards GAE reads are
    ``step_token_rewards`` of them and the KL penalty; the update runs and stays finite."""
    from rlhf_core.trainers.rlhf.algorithms import compute_advantages
    from rlhf_core.trainers.rlhf.experience import empty_response
    from rlhf_core.trainers.rlhf.trainer import RLHFTrainer

    ppo = [o for o in RL_PROCESS if not o.startswith(("rlhf.algorithm", "rlhf.grpo"))]
    params = _prm_params(*ppo, "rlhf.algorithm=ppo", "rlhf.ppo.supervision=process", "rlhf.ppo.samples_per_prompt=4",
                         "rlhf.kl_coef=0.1")
    tr = RLHFTrainer(params, with_prm, evaluate=False, checkpoints=False).setup()
    assert tr.bundle.algorithm.name == "ppo/gae/process" and tr.bundle.algorithm.critic
    captured = _spy_on_the_prm(tr)
    torch.manual_seed(0)
    exp = tr.collect(0)
    roll, (_, normalised, _, empty) = captured["roll"], captured["out"]
    values = tr.maker.cfg.process.values(roll.sequences, roll.attention_mask, roll.responses.shape[1])
    ends, _ = step_ends(roll.responses, roll.action_mask, tr.maker.cfg.process.delimiter_id)
    torch.testing.assert_close(normalised, normalised_step_rewards(values, ends & ~empty[:, None], roll.action_mask,
                                                                   4).float())
    kept = ~(empty | empty_response(roll.responses, roll.action_mask, tr.bundle.tokenizer.eos_token_id))
    torch.testing.assert_close(exp.step_rewards, normalised[kept][:, :exp.response_len])
    exp = compute_advantages(exp, tr.bundle.algorithm, tr.bundle.kl_ctl.value)
    expected = step_token_rewards(exp.step_rewards, exp.old_logp, exp.ref_logp, exp.action_mask, 0.1,
                                  params.rlhf.reward_clip, params.rlhf.kl_estimator)
    torch.testing.assert_close(exp.rewards, expected)
    assert exp.advantages.abs().sum() > 0
    metrics = tr.step()
    assert all(v == v for v in metrics.values() if isinstance(v, float)), metrics


def test_evaluate_reports_step_accuracy_and_the_gate_reads_it(with_prm, tmp_path):
    """On the multi-step task the evaluate stage's judge also reads every step: per model the mean
    ``step_accuracy`` of its greedy held-out answers, and the candidate's gain over the reference, which the gate
    checks. The SFT model as the candidate: the same answers, gain 0, the step gate passes."""
    import json
    import shutil

    from rlhf_core.rewards.multistep import step_accuracy
    from rlhf_core.stages.evaluate import evaluate
    from tasks.gates import decide

    for sub in ("data", "models"):
        shutil.copytree(with_prm / sub, tmp_path / sub)
    shutil.copytree(tmp_path / "models/sft", tmp_path / "models/actor")
    params = _prm_params("rlhf.reward_fns={rm: 1.0}")
    report = evaluate(params, tmp_path)
    table = json.loads((tmp_path / "reports/eval_answers.json").read_text())
    expected = sum(map(step_accuracy, table["reference_response"], table["prompt"])) / len(table["prompt"])
    assert report["reference"]["step_accuracy"] == pytest.approx(expected)
    assert expected < 1.0 and report["candidate"]["step_accuracy"] == report["reference"]["step_accuracy"]
    assert report["step_accuracy_gain_vs_reference"] == 0.0
    check = {c.name: c for c in decide(report, params.gates).checks}["step_accuracy_gain_vs_reference"]
    assert check.passed and check.value == 0.0


def test_the_rl_stages_held_out_eval_reports_step_accuracy_on_the_multistep_task(with_prm):
    """The RL stage's held-out evaluation (and TRL's in the benchmark, the same function) judges every step on
    the multi-step task (``step_judge``: ``rewards.multistep.step_accuracy``; none on another task):
    ``step_accuracy`` is the weighted mean of the judge over the greedy answers, each with its own prompt. A
    judge that scores the prompt's position (1 on odd ones) makes a misrouted prompt or a double count show."""
    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.evaluation import heldout_eval, step_judge
    from rlhf_core.models.loading import load_causal_lm
    from rlhf_core.rewards.multistep import step_accuracy
    from rlhf_core.trainers.rlhf.inputs import load_prompts
    from tests.tiny import TINY_DEMO, tiny_params

    params = _prm_params("rlhf.reward_fns={rm: 1.0}", "eval.batch_size=5")
    assert step_judge(params) is step_accuracy and step_judge(tiny_params(TINY_DEMO)) is None
    tok = load_tokenizer(with_prm / "models/sft")
    model = load_causal_lm(with_prm / "models/sft")
    held = load_prompts(params, with_prm, tok).heldout
    seen = []

    def judge(answer: str, prompt: str) -> float:
        seen.append(prompt)
        return float(held.prompts.index(prompt) % 2)

    out = heldout_eval(model, tok, held, params.eval, "cpu", step_judge=judge)
    n = len(held.prompts)
    assert sorted(seen) == sorted(held.prompts) and n >= 3
    assert out["step_accuracy"] == pytest.approx((n // 2) / n)
    assert "step_accuracy" not in heldout_eval(model, tok, held, params.eval, "cpu")


def test_ppo_process_supervision_needs_gae(tmp_path):
    from rlhf_core.config import ConfigError, load_params

    with pytest.raises(ConfigError, match="ppo.supervision: process .* needs ppo.advantage_estimator: gae"):
        load_params(tmp_path / "params.yaml", ["rlhf.algorithm=ppo", "rlhf.ppo.supervision=process",
                                                "rlhf.ppo.advantage_estimator=rloo"])


def test_process_supervision_refuses_other_rewards_and_an_outcome_rm(with_prm, tmp_path):
    import json
    import shutil

    from rlhf_core.engine.errors import TrainingInputError
    from rlhf_core.trainers.rlhf.trainer import RLHFTrainer

    with pytest.raises(TrainingInputError, match=r"process reward model alone: set rlhf.reward_fns to \{rm: 1.0\}"):
        RLHFTrainer(_prm_params(*RL_PROCESS, "rlhf.reward_fns={rm: 1.0, format: 0.5}"), with_prm).setup()
    for sub in ("data", "models"):
        shutil.copytree(with_prm / sub, tmp_path / sub)
    meta = tmp_path / "models/rm/rlhf_meta.json"
    meta.write_text(json.dumps({**json.loads(meta.read_text()), "objective": "score_head"}))
    with pytest.raises(TrainingInputError, match="trained with rm.objective: score_head"):
        RLHFTrainer(_prm_params(*RL_PROCESS), tmp_path).setup()
