"""The learning comparison (``benchmarks.learning``): seeds x variants side by side, ours and TRL's
GRPOTrainer from one base workspace, judged by one held-out evaluator; the summary's numbers by hand."""

from __future__ import annotations

import json
import subprocess
from concurrent.futures import Future

import pytest
import torch
import yaml

from benchmarks.learning import Variant, judged, judged_summary, mean_spread, provenance, render, rm_build, summarise
from tests.conftest import make_params

TINY = ["data.demo.n_rows=600", "data.demo.max_operand=4", "data.max_prompt_len=16", "data.max_response_len=4",
        "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "model.tiny.num_hidden_layers=1",
        "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=2", "compute.num_threads=1",
        "sft.epochs=2", "rm.max_steps=3", "eval.max_prompts=8", "eval.max_new_tokens=4",
        "rlhf.num_steps=2", "rlhf.prompts_per_step=4", "rlhf.max_new_tokens=4", "rlhf.micro_batch_size=8",
        "rlhf.ptx_coef=0", "rlhf.reward_fns={rm: 1.0}", "rlhf.grpo.scale=batch"]


def test_variant_parse():
    assert Variant.parse("ours") == Variant("ours", ())
    assert Variant.parse("g=rlhf.algorithm=grpo,rlhf.lr=1e-4") == Variant("g", ("rlhf.algorithm=grpo", "rlhf.lr=1e-4"))
    with pytest.raises(ValueError, match="empty name"):
        Variant.parse("=rlhf.lr=1")


def test_summary_mean_spread_by_hand():
    assert mean_spread([70.0, 80.0, 90.0]) == (80.0, 10.0, 70.0, 90.0)  # sample std: sqrt(200 / 2)
    rows = [{"variant": "a", "seed": s, "rc": 0, "accuracy": acc, "sft_accuracy": 0.5, "accuracy_gain": acc - 0.5,
             "kl_to_reference": 0.2, "train_time_s": 10.0, "sft_step_accuracy": 0.4, "step_accuracy": acc - 0.2}
            for s, acc in ((1, 0.7), (2, 0.8), (3, 0.9))]
    rows.append({"variant": "b", "seed": 1, "rc": 1})
    a, b = summarise(rows)
    assert a["runs"] == 3 and a["acc_mean"] == pytest.approx(80.0) and a["acc_std"] == pytest.approx(10.0)
    assert a["accuracy_gain"] == pytest.approx(30.0) and a["acc_by_seed"] == [70.0, 80.0, 90.0]
    assert b == {"variant": "b", "runs": 0, "failed": 1}
    table = render([a, b])
    assert "| a | 3 | 80.0 ± 10.0 (70.0-90.0) | 70.0 / 80.0 / 90.0 | 30.0 |" in table and "| b | 0 (1 failed)" in table
    assert a["step_accuracy"] == pytest.approx(60.0) and table.splitlines()[2].endswith("| 40.0 -> 60.0 |")


def test_rm_build_names_the_weights_and_the_ensemble_not_the_metadata(tmp_path):
    rm = tmp_path / "models" / "rm"
    assert rm_build(tmp_path) is None  # no RM: nothing to name
    (rm / "members" / "1").mkdir(parents=True)
    (rm / "model.safetensors").write_bytes(b"member 0")
    (rm / "members" / "1" / "model.safetensors").write_bytes(b"member 1")
    (rm / "ensemble.json").write_text('{"members": []}')
    (rm / "rlhf_meta.json").write_text('{"finished": "12:00"}')
    first = rm_build(tmp_path)
    assert len(first) == 12 and int(first, 16) >= 0
    (rm / "rlhf_meta.json").write_text('{"finished": "13:00"}')  # an identical retraining, another timestamp
    assert rm_build(tmp_path) == first
    for path, other in ((rm / "members" / "1" / "model.safetensors", b"member 1, another seed"),
                        (rm / "ensemble.json", b'{"members": [1]}')):
        before = path.read_bytes()
        path.write_bytes(other)
        assert rm_build(tmp_path) != first, path
        path.write_bytes(before)
    assert rm_build(tmp_path) == first


def test_provenance_names_the_sft_build_the_params_and_the_common_overrides(tmp_path):
    """Rows of two invocations that differ only in the SFT model, the params file or an override given to every
    variant were indistinguishable (a slip-task build could not be told from an earlier one)."""
    sft = tmp_path / "models" / "sft"
    sft.mkdir(parents=True)
    (sft / "model.safetensors").write_bytes(b"sft weights")
    (sft / "rlhf_meta.json").write_text('{"finished": "12:00"}')
    (tmp_path / "params.yaml").write_text("rlhf: {ptx_coef: 0.3}\n")
    first = provenance(tmp_path, ("rlhf.algorithm=grpo",))
    assert first["rm_build"] is None and first["common_overrides"] == ["rlhf.algorithm=grpo"]
    assert len(first["sft_build"]) == 12 and len(first["params_sha"]) == 12
    (sft / "rlhf_meta.json").write_text('{"finished": "13:00"}')
    assert provenance(tmp_path, ("rlhf.algorithm=grpo",)) == first
    (sft / "model.safetensors").write_bytes(b"sft weights, another run")
    assert provenance(tmp_path, ("rlhf.algorithm=grpo",))["sft_build"] != first["sft_build"]
    (tmp_path / "params.yaml").write_text("rlhf: {ptx_coef: 1.2}\n")
    assert provenance(tmp_path, ())["params_sha"] != first["params_sha"]


@pytest.mark.slow
def test_ours_and_trl_side_by_side_from_one_workspace(tmp_path, monkeypatch):
    pytest.importorskip("trl")
    from benchmarks.learning import main
    from rlhf_core.stages.prepare import prepare
    from rlhf_core.trainers.rm import train_rm
    from rlhf_core.trainers.sft import train_sft

    base = tmp_path / "base"
    base.mkdir()
    monkeypatch.chdir(base)
    params = make_params(*TINY)
    prepare(params)
    train_sft(params, base)
    train_rm(params, base)
    (base / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    out = tmp_path / "runs"
    main(["--workspace", str(base), "--out", str(out), "--seeds", "1", "--jobs", "2", "-S", "rlhf.grpo.beta=0.04",
          "ours=rlhf.algorithm=grpo", "trl"])
    rows = {r["variant"]: r for r in map(json.loads, (out / "results.jsonl").read_text().splitlines())}
    for name in ("ours", "trl"):
        assert rows[name]["rc"] == 0, (out / f"{name}-s1" / "run.log").read_text()[-3000:]
        assert 0.0 <= rows[name]["accuracy"] <= 1.0 and rows[name]["kl_to_reference"] >= 0.0
        assert rows[name]["sft_accuracy"] == rows["ours"]["sft_accuracy"]  # one evaluator, one SFT start
        assert rows[name]["sft_proxy_reward"] == pytest.approx(rows["ours"]["sft_proxy_reward"], abs=1e-4)
        assert rows[name]["rm_build"] == rm_build(base) is not None  # the one RM both scored with
        assert rows[name]["sft_build"] == provenance(base, ())["sft_build"] is not None  # the one SFT start
        assert rows[name]["common_overrides"] == ["rlhf.grpo.beta=0.04"]
    trl_metrics = json.loads((out / "trl-s1" / "metrics" / "rlhf.json").read_text())
    assert trl_metrics["framework"].startswith("trl ") and trl_metrics["optimizer_steps"] == 2 * 2  # 16 rows / 8
    from transformers import AutoModelForCausalLM  # TRL's trained policy saved as ours: a plain HF folder

    saved, sft = (AutoModelForCausalLM.from_pretrained(d).state_dict()
                  for d in (out / "trl-s1/models/actor", base / "models/sft"))
    assert (out / "trl-s1/models/actor/tokenizer_config.json").exists() and saved.keys() == sft.keys()
    assert not all(torch.equal(saved[k], sft[k]) for k in sft)  # the trained weights, not SFT's
    assert (out / "ours-s1/models/actor").is_dir() and not (out / "ours-s1/checkpoints").exists()  # finished: freed
    kept = out / "trl_ptx-s1/checkpoints/rlhf/marker"
    kept.parent.mkdir(parents=True)
    kept.write_text("a failed run's state to resume from")
    main(["--workspace", str(base), "--out", str(out), "--seeds", "1", "ours=rlhf.algorithm=grpo", "trl",
          "trl_ptx=rlhf.ptx_coef=0.5,rlhf.grpo.drop_uniform_groups=true", "kept=rlhf.algorithm=grpo",
          "--keep-checkpoints"])
    lines = [json.loads(x) for x in (out / "results.jsonl").read_text().splitlines()]
    assert len(lines) == 4  # finished pairs are not re-run; the new variants run
    assert lines[2]["variant"] == "trl_ptx" and lines[2]["rc"] != 0  # not like for like: refused
    assert kept.exists()  # a failed run keeps its checkpoints
    assert lines[3]["variant"] == "kept" and lines[3]["rc"] == 0 and (out / "kept-s1/checkpoints/rlhf").is_dir()
    refusal = "no equivalent of: rlhf.ptx_coef, rlhf.grpo.drop_uniform_groups"
    assert refusal in (out / "trl_ptx-s1" / "run.log").read_text()


@pytest.mark.slow
def test_judge_adds_the_paired_gains_over_sft_on_every_held_out_question(tmp_path, monkeypatch, capsys):
    """``--judge K``: the SFT start judged once, every run's actor after its run, and the row's paired gain the
    difference of the two files' accuracies (the mean of the differences is the difference of the means)."""
    from benchmarks.heldout import compare, read_verdicts
    from benchmarks.learning import main
    from rlhf_core.stages.prepare import prepare
    from rlhf_core.trainers.sft import train_sft

    base = tmp_path / "base"
    base.mkdir()
    monkeypatch.chdir(base)
    params = make_params(*TINY, "rlhf.algorithm=grpo", "rlhf.reward_fns={final_number: 1.0}", "rlhf.lr=1e-2")
    prepare(params)
    train_sft(params, base)
    (base / "params.yaml").write_text(yaml.safe_dump(params.model_dump(mode="json")))
    out = tmp_path / "runs"
    main(["--workspace", str(base), "--out", str(out), "--seeds", "1,2", "--judge", "2", "ours"])
    rows = [json.loads(line) for line in (out / "results.jsonl").read_text().splitlines()]
    sft = next(iter(read_verdicts(out / "heldout-sft.jsonl").values()))
    for row in rows:
        assert row["rc"] == 0, (out / f"ours-s{row['seed']}" / "run.log").read_text()[-3000:]
        actor = next(iter(read_verdicts(out / f"ours-s{row['seed']}" / "heldout.jsonl").values()))
        assert row["heldout_questions"] == sft.greedy.numel() > params.eval.max_prompts  # every question
        assert row["heldout_greedy_gain"] == pytest.approx(row["heldout_greedy"] - row["heldout_sft_greedy"],
                                                           abs=2e-4)
        assert {f"heldout_{k}": v for k, v in compare(sft, actor).items()}.items() <= row.items()
        assert row["heldout_samples"] == 2 and actor.sampled.shape == sft.sampled.shape == (sft.greedy.numel(), 2)
        right_to_wrong = int((sft.greedy.bool() & ~actor.greedy.bool()).sum())  # both files list one order here
        assert row["heldout_right_to_wrong"] == right_to_wrong
    table = capsys.readouterr().out
    assert "| ours | 2 x " in table and "sampled gain ± SE over seeds" in table
    with pytest.raises(ValueError, match=r"heldout-sft.jsonl: the SFT start was judged with 2 sampled answers per "
                                         r"question, not --judge 3"):
        main(["--workspace", str(base), "--out", str(out), "--seeds", "3", "--judge", "3", "ours"])
    assert not (out / "ours-s3").exists()  # refused before any run
    (out / "heldout-sft.jsonl").write_text("")  # a re-run skips finished pairs and judges nothing again
    main(["--workspace", str(base), "--out", str(out), "--seeds", "1,2", "--judge", "2", "ours"])
    assert (out / "heldout-sft.jsonl").read_text() == ""


def test_judged_summary_by_hand_and_a_failed_sft_judge_keeps_the_row(tmp_path):
    rows = [{"variant": "a", "seed": s, "rc": 0, "accuracy": 0.7, "heldout_questions": 300, "heldout_greedy": g,
             "heldout_sft_greedy": 0.75, "heldout_greedy_gain": g - 0.75, "heldout_sampled_gain": sg,
             "heldout_right_to_wrong": rw, "heldout_wrong_to_right": wr}
            for s, g, sg, rw, wr in ((1, 0.72, 0.02, 10, 1), (2, 0.78, 0.04, 2, 11))]
    two = judged_summary(rows)  # greedy gains -3 and +3 points: mean 0, std sqrt(18), SE 3
    assert two["heldout_greedy_gain"] == pytest.approx(0.0) and two["heldout_greedy_gain_se"] == pytest.approx(3.0)
    assert two["heldout_sampled_gain"] == pytest.approx(3.0) and two["heldout_flips"] == (6.0, 6.0)
    one = judged_summary(rows[:1])
    assert one["heldout_greedy_gain"] == pytest.approx(-3.0) and one["heldout_greedy_gain_se"] is None
    table = render(summarise(rows[:1]))
    assert "| a | 1 x 300 | 72.0 (75.0) | -3.0 ± — (1 seed) | +2.0 ± — (1 seed) | 10.0 / 1.0 |" in table
    failed = Future()
    failed.set_exception(subprocess.CalledProcessError(3, "judge"))
    run_dir = tmp_path / "ours-s1"
    assert judged(run_dir, 4, 1, failed) == {
        "heldout_error": f"the SFT start's judge failed (rc 3): see {tmp_path / 'heldout-sft.log'}"}
    no_actor = Future()
    no_actor.set_result(tmp_path / "heldout-sft.jsonl")
    run_dir.mkdir()  # a run directory without an actor (or a workspace): the actor's judge fails, the row stays
    assert judged(run_dir, 4, 1, no_actor) == {
        "heldout_error": f"the actor's judge failed (rc 1): see {run_dir / 'heldout.log'}"}
    assert "Traceback" in (run_dir / "heldout.log").read_text()
