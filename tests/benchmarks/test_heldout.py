"""The every-question judge (``benchmarks.heldout``): paired gains and flips by hand, its rows read back, and on a
tiny workspace the same greedy verdicts as the RL stage's own evaluator, one sampling stream for every model."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from benchmarks.heldout import (
    Verdicts,
    compare,
    flips,
    held_out_questions,
    judge_models,
    main,
    paired_gain,
    read_verdicts,
)
from tests.tiny import TINY_DEMO
from tests.tiny import tiny_params as make_params


def test_paired_gain_and_flips_by_hand():
    base, other = torch.tensor([0.0, 0.0, 1.0, 1.0]), torch.tensor([1.0, 1.0, 1.0, 0.0])
    gain, se = paired_gain(base, other)  # d = [1, 1, 0, -1]: mean 0.25, sample var 2.75 / 3
    assert gain == pytest.approx(0.25) and se == pytest.approx(math.sqrt(2.75 / 3) / 2)
    assert flips(base, other) == (1, 2)
    assert paired_gain(base, base) == (0.0, 0.0) and flips(base, base) == (0, 0)
    with pytest.raises(ValueError, match=r"same questions, got \(4,\) and \(3,\)"):
        paired_gain(base, other[:3])


def test_compare_pairs_the_sampled_share_per_question():
    sft = Verdicts(torch.tensor([1.0, 0.0, 1.0]), torch.tensor([[1.0, 0.0], [0.0, 0.0], [1.0, 1.0]]))
    rl = Verdicts(torch.tensor([1.0, 1.0, 0.0]), torch.tensor([[1.0, 1.0], [1.0, 0.0], [1.0, 0.0]]))
    out = compare(sft, rl)  # sampled shares [0.5, 0, 1] -> [1, 0.5, 0.5]: d = [0.5, 0.5, -0.5]
    assert out["sampled_gain"] == pytest.approx(1 / 6, abs=1e-4)
    assert out["sampled_gain_se"] == pytest.approx(math.sqrt(1 / 3) / math.sqrt(3), abs=1e-4)
    assert out["greedy_gain"] == 0.0 and (out["right_to_wrong"], out["wrong_to_right"]) == (1, 1)
    assert sft.summary() == {"questions": 3, "greedy_accuracy": 0.6667, "greedy_se": 0.3333, "samples": 2,
                             "sampled_accuracy": 0.5, "sampled_se": 0.2887, "pass_at_2": 0.6667}


def _row(model, split, position, greedy, sampled):
    return json.dumps({"model": model, "question": position, "split": split, "position": position,
                       "id": f"{split}-{position}", "greedy_right": greedy, "sampled_right": sampled}) + "\n"


def test_read_verdicts_names_a_bad_line_and_keeps_a_rejudged_models_last_rows(tmp_path):
    rows = tmp_path / "q.jsonl"
    good = [_row("sft", "rl", 0, True, [1]), _row("sft", "sft", 0, False, [0]), _row("rl", "rl", 0, False, [0]),
            _row("rl", "sft", 0, False, [0]), _row("rl", "sft", 0, True, [1])]
    rows.write_text("".join(good))
    got = read_verdicts(rows)
    assert list(got) == ["sft", "rl"] and got["rl"].greedy.tolist() == [0.0, 1.0]
    assert got["rl"].keys == (("rl", 0, "rl-0"), ("sft", 0, "sft-0"))  # the same position in two splits: two
    for bad, message in (('{"model": "rl", "greedy_right": true}\n', r"q.jsonl:6: not a judge row \(KeyError"),
                         (_row("rl", "rl", 1, 1, [1]), r"q.jsonl:6: not a judge row .*true/false"),
                         (_row("rl", "rl", 1, True, [2]), r"q.jsonl:6: not a judge row .*list of 0/1"),
                         (_row("rl", "rl", 1, True, [1, 0]), r"q.jsonl:6: 2 sampled answers, but rl.s first row has 1"),
                         ):
        rows.write_text("".join(good) + bad)
        with pytest.raises(ValueError, match=message):
            read_verdicts(rows)


def test_compare_pairs_by_question_and_refuses_other_questions():
    keys = (("rl", 0, "a"), ("rl", 1, "b"), ("sft", 0, "c"))
    sft = Verdicts(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3, 0), keys)
    shuffled = Verdicts(torch.tensor([0.0, 1.0, 1.0]), torch.zeros(3, 0), (keys[2], keys[0], keys[1]))
    assert compare(sft, shuffled) == {"greedy_gain": round(1 / 3, 4), "greedy_gain_se": round(1 / 3, 4),
                                      "right_to_wrong": 0, "wrong_to_right": 1}  # by key: [1, 1, 0] against [1, 0, 0]
    other = Verdicts(torch.tensor([1.0, 0.0, 0.0]), torch.zeros(3, 0), (keys[0], keys[1], ("sft", 0, "d")))
    with pytest.raises(ValueError, match=r"judged on other questions \(3 and 3, 2 not in both\)"):
        compare(sft, other)
    with pytest.raises(ValueError, match=r"same questions, got \(3,\) and \(1,\)"):
        flips(sft.greedy, sft.greedy[:1])
    assert paired_gain(torch.tensor([1.0]), torch.tensor([0.0])) == (-1.0, None)  # one question: no spread


@pytest.mark.slow
def test_judge_agrees_with_the_stage_evaluator_and_samples_one_stream_for_every_model(tmp_path, monkeypatch, capsys):
    from transformers import AutoModelForCausalLM

    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.evaluation import heldout_eval
    from rlhf_core.stages.prepare import prepare
    from rlhf_core.trainers.rlhf.inputs import load_prompts
    from rlhf_core.trainers.sft import train_sft

    monkeypatch.chdir(tmp_path)
    params = make_params(TINY_DEMO, "sft.epochs=6")
    prepare(params)
    train_sft(params, tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    tok = load_tokenizer(tmp_path / "models/sft")
    questions, keys = held_out_questions(tmp_path, params, tok)
    splits = [split for split, _, _ in keys]
    heldout = load_prompts(params, tmp_path, tok).heldout
    n_rl = len(heldout.prompts)
    assert splits.count("rl_heldout") == n_rl and splits.count("sft_heldout") > 0 and len(set(keys)) == len(keys)
    assert questions.prompts[:n_rl] == heldout.prompts and len(questions.answers) == len(splits)

    sft = str(tmp_path / "models/sft")
    summaries = judge_models(tmp_path, 3, tmp_path / "q.jsonl", [sft, sft])
    assert summaries[0]["questions"] == len(splits) and summaries[0]["samples"] == 3
    verdicts = read_verdicts(tmp_path / "q.jsonl")[sft]  # the same folder twice: the second rows replace the first
    stage = heldout_eval(AutoModelForCausalLM.from_pretrained(sft).eval(), tok, heldout, params.eval,
                         torch.device("cpu"))
    assert float(verdicts.greedy[:n_rl].mean()) == pytest.approx(stage["accuracy"])
    assert summaries[0] | {"judge_s": 0} == summaries[1] | {"judge_s": 0}  # one seed: the same weights judge alike
    assert 0.0 < summaries[0]["sampled_accuracy"] < 1.0  # sampled answers, not the greedy ones again

    rows = [json.loads(line) for line in (tmp_path / "q.jsonl").read_text().splitlines()]
    other = [r | {"model": "other", "greedy_right": not r["greedy_right"]} for r in rows[:len(splits)][::-1]]
    (tmp_path / "q.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:len(splits)] + other))
    main(["compare", str(tmp_path / "q.jsonl")])
    line = json.loads(capsys.readouterr().out)
    right = int(verdicts.greedy.sum())
    assert line["model"] == "other" and line["baseline"] == sft and line["sampled_gain"] == 0.0
    assert (line["right_to_wrong"], line["wrong_to_right"]) == (right, len(splits) - right)
    assert line["greedy_gain"] == pytest.approx(1 - 2 * float(verdicts.greedy.mean()), abs=1e-4)


@pytest.mark.slow
def test_judge_applies_a_folders_unmerged_adapter(tmp_path, monkeypatch):
    """A folder with its LoRA adapter apart (an implicit-reward RM, ``merge_on_save: false``) is judged as the
    policy it holds: alike to the same adapter merged, unlike the base weights it sits on."""
    from rlhf_core.stages.prepare import prepare
    from rlhf_core.trainers.sft import train_sft
    from tests.tiny import save_with_random_adapter

    monkeypatch.chdir(tmp_path)
    params = make_params(TINY_DEMO, "sft.epochs=6")
    prepare(params)
    train_sft(params, tmp_path)
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    sft = tmp_path / "models/sft"
    apart, merged = tmp_path / "apart", tmp_path / "merged"
    save_with_random_adapter(sft, apart).save_pretrained(merged)

    judge_models(tmp_path, 2, tmp_path / "q.jsonl", [str(sft), str(apart), str(merged)])
    verdicts = read_verdicts(tmp_path / "q.jsonl")
    base, with_adapter, folded = (verdicts[str(p)] for p in (sft, apart, merged))
    assert torch.equal(with_adapter.greedy, folded.greedy) and torch.equal(with_adapter.sampled, folded.sampled)
    assert not torch.equal(with_adapter.sampled, base.sampled)
