"""The gate refuses reward hacking, through the whole flow against a real `mlflow server`.

A tiny demo project: SFT (~58 % held-out accuracy) and an RM. The first run promotes a checker-trained actor
(v1). The second run over-optimises a *weak* learned RM on purpose — an RM trained one epoch (~68 % on held-out
pairs), the only reward, no ptx, no KL, a high learning rate — so the proxy (RM score) rises while the judge (the
checker's accuracy) falls. The gate must fail on the judge with "reward hacking suspected", and the champion must
stay v1.

Why the weak RM: the 10-epoch RM of the first run (97 % on held-out pairs) is not hackable in 40 steps on
this task. Measured on this project with the stage alone (`rlhf stage rlhf` with the overrides below): with it,
the sampled reward rises 0.97 -> 1.74 but the greedy proxy falls (2.39 -> 1.75, and 2.13 after 80 steps, 1.63 at
lr 1e-3), a loss on both measures rather than hacking. With the one-epoch RM, over three seeds: proxy
0.33 -> 0.48 / 0.56 / 0.42 while the judge falls 58 % -> 12.5 / 19 / 19 %, KL 1.1-2.1 nats.
"""

from __future__ import annotations

import json

import pytest

from tests.flows.test_pipeline_e2e import rlhf_run
from tests.servers import mlflow_server, project_copy

pytestmark = pytest.mark.slow

TINY = {
    "data": {"demo": {"n_rows": 3000, "max_operand": 9}, "max_prompt_len": 16, "max_response_len": 4},
    "model": {"tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                       "num_attention_heads": 2, "num_key_value_heads": 2, "max_position_embeddings": 32}},
    "compute": {"num_threads": 1},
    "sft": {"epochs": 20, "micro_batch_size": 32, "lr": 0.003, "warmup_steps": 3},
    "rm": {"epochs": 10},
    "rlhf": {"algorithm": "ppo", "num_steps": 2, "prompts_per_step": 16, "max_new_tokens": 4, "micro_batch_size": 64,
             "reward_fns": {"exact_answer": 1.0}, "ppo": {"score_baseline": "none"}},
    "eval": {"max_prompts": 64, "max_new_tokens": 4, "batch_size": 48},
    "gates": {"min_reward_gain": -1000.0, "min_win_rate_vs_champion": 0.0, "max_kl": 1.0e9, "min_judge_gain": -1.0},
    "tracking": {"system_metrics": False},
}
HACK = ["rm.epochs=1", "rlhf.reward_fns={rm: 1.0}", "rlhf.ptx_coef=0", "rlhf.kl_coef=0", "rlhf.lr=3e-4",
        "rlhf.num_steps=40", "gates.min_judge_gain=0.01"]


def test_over_optimised_actor_is_refused_and_the_champion_stays(tmp_path):
    from mlflow import MlflowClient

    project = project_copy(tmp_path / "project", TINY)
    with mlflow_server(tmp_path) as uri:
        first = rlhf_run(project, uri)
        assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-6000:]
        client = MlflowClient(uri)
        assert client.get_model_version_by_alias("rlhf-demo-actor", "champion").version == "1"

        hacked = rlhf_run(project, uri, *[a for o in HACK for a in ("-S", o)])
        assert hacked.returncode == 0, hacked.stdout[-3000:] + hacked.stderr[-6000:]
        report = json.loads((project / "reports/eval.json").read_text())
        assert report["reward_source"] == "rm:1" and report["judge_source"] == "checker"
        assert report["proxy_gain_vs_reference"] > 0 > report["judge_gain_vs_reference"], report
        out = hacked.stdout + hacked.stderr
        assert "gate: FAILED (judge_gain_vs_reference=" in out and "promoted: False" in out
        assert "reward hacking suspected: proxy +" in out
        assert client.get_model_version_by_alias("rlhf-demo-actor", "champion").version == "1"
        v2 = client.get_model_version("rlhf-demo-actor", "2")
        assert v2.tags["rlhf.gate"] == "failed" and "reward hacking suspected" in v2.tags["rlhf.gate.failing"]
        assert client.get_model_version_by_alias("rlhf-demo-actor", "challenger").version == "2"
