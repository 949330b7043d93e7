"""Model cards: Hugging Face front matter, the stage's key params, input hashes, held-out figures, limits."""

from __future__ import annotations

import yaml

from rlhf_core.ops.model_card import render_model_card
from tasks.registry import card_description
from tests.conftest import make_params

META = {"stage": "rlhf", "role": "actor", "algorithm": "grpo", "params_hash": "abc123",
        "inputs": {"sft": "s" * 64, "rm": "r" * 64}, "git_sha": "0123abc", "created_at": "2026-11-24T00:00:00+00:00",
        "versions": {"torch": "2.13.0", "rlhf-ops": "0.1.0"}, "image": "registry.example.com/rlhf@sha256:" + "f" * 64}


def _front_matter(card: str) -> dict:
    assert card.startswith("---\n")
    return yaml.safe_load(card.split("---\n")[1])


def test_actor_card_front_matter_params_data_evaluation_and_limits():
    params = make_params("rlhf.algorithm=grpo", "model.name_or_path=meta-llama/Llama-3.2-1B")
    card = render_model_card(META, params, {"sft_accuracy": 0.57, "accuracy": 0.85, "sft_proxy_reward": 1.96,
                                            "proxy_reward": 3.67, "kl_to_reference": 0.36})
    assert _front_matter(card) == {"library_name": "transformers", "pipeline_tag": "text-generation",
                                   "tags": ["rlhf-ops", "rlhf", "grpo"], "base_model": "meta-llama/Llama-3.2-1B"}
    assert "| `rlhf.algorithm` | `grpo` |" in card and "| params hash | `abc123` |" in card
    assert f"| `rm` | `{'r' * 64}` |" in card
    assert "| accuracy | 0.57 | 0.85 |" in card and "| proxy reward | 1.96 | 3.67 |" in card
    assert "| KL to the reference (nats/response) | 0 | 0.36 |" in card
    assert "- git sha: `0123abc`" in card and "sha256:" + "f" * 64 in card
    assert "Optimised against a proxy reward" in card and "Demo profile" not in card  # a real base model


def test_demo_rm_card_and_local_base_model():
    meta = {**META, "stage": "rm", "role": "proxy", "algorithm": None}
    card = render_model_card(meta, make_params("model.name_or_path=/models/llama"),
                             {"accuracy_before": 0.58, "accuracy": 0.92})
    fm = _front_matter(card)
    assert fm["pipeline_tag"] == "text-classification" and "base_model" not in fm  # a local path is no Hub id
    assert "| accuracy | 0.58 | 0.92 |" in card and "per-prompt constant" in card
    assert "Demo profile" in render_model_card(meta, make_params(), {})
    assert "## Evaluation" not in render_model_card(meta, make_params(), {})  # nothing measured: no table


def test_registry_description_drops_front_matter_and_respects_the_limit():
    card = render_model_card(META, make_params(), {"sft_accuracy": 0.5, "accuracy": 0.7})
    described = card_description(card)
    assert described.startswith("# rlhf-demo actor") and "library_name" not in described
    cut = card_description(card, limit=300)
    assert len(cut) == 300 and cut.endswith("(cut: the whole card is README.md in the model's artifacts)")


def test_mlflow_links_for_a_server_and_the_embedded_store():
    from tasks.links import local_runs_markdown, mlflow_links

    reg = {"actor": {"name": "demo-actor", "version": "3"}}
    links = mlflow_links("http://mlflow:5000/", "7", "p1", {"sft": "s1"}, reg)
    assert links == [("mlflow-pipeline-run", "MLflow: the pipeline's parent run",
                      "http://mlflow:5000/#/experiments/7/runs/p1"),
                     ("mlflow-run-sft", "MLflow: the sft stage's run", "http://mlflow:5000/#/experiments/7/runs/s1"),
                     ("mlflow-model-actor", "MLflow registry: demo-actor v3",
                      "http://mlflow:5000/#/models/demo-actor/versions/3")]
    assert mlflow_links("sqlite:///x/mlflow.db", "7", "p1", {"sft": "s1"}, reg) == []
    # the URL a browser opens, not the in-cluster tracking URI the pods use
    outside = mlflow_links("http://rlhf-mlflow:5000", "7", "p1", {}, reg, ui_url="https://mlflow.example.org/")
    assert [url for _, _, url in outside] == ["https://mlflow.example.org/#/experiments/7/runs/p1",
                                              "https://mlflow.example.org/#/models/demo-actor/versions/3"]
    assert mlflow_links("sqlite:///x/mlflow.db", "7", "p1", {}, reg, ui_url="http://127.0.0.1:5000")[0][2] == \
        "http://127.0.0.1:5000/#/experiments/7/runs/p1"  # `mlflow ui` over the embedded store
    md = local_runs_markdown("sqlite:///x/mlflow.db", "p1", {"sft": "s1"}, reg)
    assert "`mlflow ui --backend-store-uri sqlite:///x/mlflow.db`" in md and "| sft run | `s1` |" in md
