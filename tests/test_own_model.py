"""A user's own model, data and reward model, end to end, the way a user takes them: `rlhf init` beside their
files, `rlhf run`, an edit to a data file, `dvc status`, `rlhf run` again.

Their model is a Hugging Face folder with SmolLM2's tokenizer (its chat template injects a system prompt; pad =
EOS), their SFT rows are chat `messages`, their pairs and RL prompts plain rows, their reward model a Hub-format
`LlamaForSequenceClassification` (`rm.external`). Their prompts carry no answers and no judge is trained, so
the gate has nothing to judge by: the actor is registered, not promoted.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml

from tests.conftest import write_jsonl

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
QUESTIONS = [f"Give the opposite of word {i}." for i in range(24)]
SMALL = ["sft.max_steps=2", "sft.micro_batch_size=4", "sft.save_every=0", "rm.micro_batch_size=4",
         "rlhf.num_steps=1", "rlhf.prompts_per_step=2", "rlhf.micro_batch_size=4", "rlhf.max_new_tokens=3",
         "rlhf.save_every=0", "rlhf.ptx_coef=0", "eval.max_prompts=4", "eval.max_new_tokens=4", "eval.batch_size=4",
         "eval.table_every=0", "eval.seen_prompts=0", "rm.best_of_n=0", "data.max_prompt_len=64",
         "tracking.system_metrics=false", "compute.num_threads=1"]


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLHF_TRACKING": "on", "OMP_NUM_THREADS": "2",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for key in ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI"):  # the embedded default
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", *args], cwd=cwd, env=env, capture_output=True, text=True,
                          timeout=2400)


def tree_sha(folder: str) -> str:
    digest = hashlib.sha256()
    for path in sorted(Path(folder).rglob("*")):
        if path.is_file():
            digest.update(path.relative_to(folder).as_posix().encode() + path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, user_model_dir, user_rm_dir):
    mine = tmp_path_factory.mktemp("mine")
    write_jsonl(mine / "sft.jsonl", [{"messages": [{"role": "user", "content": q},
                                                   {"role": "assistant", "content": f"antonym {i}"}]}
                                     for i, q in enumerate(QUESTIONS)])
    write_jsonl(mine / "pairs.jsonl", [{"prompt": q, "chosen": f"antonym {i}", "rejected": "no idea"}
                                       for i, q in enumerate(QUESTIONS)])
    write_jsonl(mine / "prompts.jsonl", [{"prompt": q} for q in QUESTIONS])
    ws = tmp_path_factory.mktemp("ws") / "my-rlhf"
    done = cli("flows.cli", "init", str(ws), "--model", user_model_dir, "--sft", str(mine / "sft.jsonl"),
               "--pairs", str(mine / "pairs.jsonl"), "--prompts", str(mine / "prompts.jsonl"), "--rm", user_rm_dir,
               cwd=mine)
    assert done.returncode == 0, done.stdout + done.stderr
    rm_sha = tree_sha(user_rm_dir)
    first = cli("flows.cli", "run", *[a for s in SMALL for a in ("-S", s)], cwd=ws)
    assert first.returncode == 0, first.stdout[-4000:] + first.stderr[-6000:]
    return {"ws": ws, "mine": mine, "rm_sha": rm_sha, "first": first}


def test_every_phase_prompt_carries_the_models_template(workspace):
    prepared = workspace["ws"] / "data" / "prepared"
    for name in ("sft", "eval_sft", "pairs", "eval_pairs", "prompts", "eval_prompts"):
        prompts = pd.read_parquet(prepared / f"{name}.parquet").prompt
        assert len(prompts) and prompts.str.startswith("<|im_start|>system\n").all(), (name, prompts.iloc[0])
        assert prompts.str.endswith("<|im_end|>\n<|im_start|>assistant\n").all(), name
    manifest = json.loads((prepared / "manifest.json").read_text())
    assert manifest["chat_template"] == "auto" and manifest["templated"] and manifest["truncation"] == "drop"


def test_the_external_rm_is_used_as_it_is_and_never_written(workspace, user_rm_dir):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    ws = workspace["ws"]
    assert tree_sha(user_rm_dir) == workspace["rm_sha"]
    metrics = json.loads((ws / "metrics" / "rm.json").read_text())
    assert metrics["external"] == str(Path(user_rm_dir).resolve()) and metrics["n_train"] == 0
    theirs = AutoModelForSequenceClassification.from_pretrained(user_rm_dir).eval()
    ours = AutoModelForSequenceClassification.from_pretrained(ws / "models" / "rm").eval()
    ids = AutoTokenizer.from_pretrained(user_rm_dir)(QUESTIONS[0] + " antonym 0", return_tensors="pt").input_ids
    with torch.no_grad():
        assert torch.allclose(theirs(ids).logits, ours(ids).logits, atol=1e-6)


def test_nothing_judged_means_nothing_promoted(workspace):
    out = " ".join((workspace["first"].stdout + workspace["first"].stderr).split())  # rich wraps long lines
    assert "registered actor: my-rlhf-actor v1" in out, out[-3000:]
    assert "gate: FAILED (" in out and "judge_gain_vs_reference=None" in out, out[-3000:]
    assert "judge: none; promoted: False; champion: vNone" in out, out[-3000:]
    assert "no judge scored the candidate" in out


def test_an_appended_sft_row_reruns_prepare_and_what_depends_on_it(workspace, user_rm_dir):
    ws, mine = workspace["ws"], workspace["mine"]
    clean = subprocess.run([sys.executable, "-m", "dvc", "status", "prepare", "sft"], cwd=ws, capture_output=True,
                           text=True)
    assert "up to date" in clean.stdout, clean.stdout + clean.stderr
    with open(mine / "sft.jsonl", "a") as fh:
        fh.write(json.dumps({"messages": [{"role": "user", "content": "Opposite of early?"},
                                          {"role": "assistant", "content": "late"}]}) + "\n")
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=ws, capture_output=True, text=True)
    assert "prepare:" in status.stdout and "inputs/data" in status.stdout, status.stdout + status.stderr
    again = cli("flows.cli", "run", *[a for s in SMALL for a in ("-S", s)], cwd=ws)
    assert again.returncode == 0, again.stdout[-4000:] + again.stderr[-6000:]
    out = again.stdout + again.stderr
    assert "Running stage 'prepare'" in out and "Running stage 'sft'" in out
    counts = json.loads((ws / "data" / "prepared" / "manifest.json").read_text())["counts"]
    assert counts["sft"] + counts["eval_sft"] == len(QUESTIONS) + 1
    assert tree_sha(user_rm_dir) == workspace["rm_sha"]  # re-run, restored: their folder untouched
    params = yaml.safe_load((ws / "params.yaml").read_text())
    assert params["rm"]["external"] == str(Path(user_rm_dir).resolve())
