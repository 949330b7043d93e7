"""``rlhf export``: a registered version, through a real ``mlflow server``, as a Hugging Face folder."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.conftest import rlhf_cli
from tests.tasks.test_registry import mlflow_uri, tiny_actor  # noqa: F401  (the module's server fixture)

pytestmark = pytest.mark.slow
TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def test_export_writes_the_champion_as_a_hub_folder_that_transformers_loads(mlflow_uri, tmp_path):  # noqa: F811
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from tasks.registry import promote, register_model_dir

    path = tiny_actor(tmp_path / "actor", seed=11)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = TEMPLATE
    tok.save_pretrained(path)
    reg = register_model_dir("actor", path, "export-actor", {"rlhf.gate": "passed", "rlhf.input.sft": "sft-md5"})
    promote("export-actor", reg.version, "passed evaluation gate (judge: checker)")

    out = tmp_path / "exported"
    done = rlhf_cli("export", "--name", "export-actor", "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    assert f"exported export-actor v{reg.version} (actor) to {out}" in done.stdout
    model, exported_tok = AutoModelForCausalLM.from_pretrained(out), AutoTokenizer.from_pretrained(out)
    want = AutoModelForCausalLM.from_pretrained(path).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in model.state_dict().items())
    assert exported_tok.chat_template == TEMPLATE
    assert (out / "model.safetensors").is_file() and (out / "generation_config.json").is_file()
    card = (out / "README.md").read_text()
    front = yaml.safe_load(card.split("---\n")[1])
    assert front["library_name"] == "transformers" and front["pipeline_tag"] == "text-generation"
    assert {"rlhf-ops", "rlhf", "actor"} <= set(front["tags"])
    assert f"`export-actor` version {reg.version} (aliases: challenger, champion)" in card
    assert "| promotion reason | `passed evaluation gate (judge: checker)` |" in card
    assert "| input `sft` | `sft-md5` |" in card
    meta = json.loads((out / "rlhf_meta.json").read_text())["registry"]
    assert (meta["name"], meta["version"], meta["aliases"]) == ("export-actor", reg.version, ["challenger", "champion"])

    again = rlhf_cli("export", "--name", "export-actor", "--out", str(out), cwd=tmp_path)  # the folder holds files now
    assert again.returncode == 65 and "is not empty; give a new folder or --force" in again.stdout


def test_export_of_a_reward_model_is_a_sequence_classifier_with_the_same_scores(
    mlflow_uri,  # noqa: F811
    tmp_path,
    user_rm_dir,
):
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from tasks.registry import register_model_dir

    reg = register_model_dir("reward", user_rm_dir, "export-reward", {})
    out = tmp_path / "rm"
    done = rlhf_cli("export", "--name", "export-reward", "--version", reg.version, "--out", str(out), cwd=tmp_path)
    assert done.returncode == 0, done.stdout
    tok = AutoTokenizer.from_pretrained(out)
    batch = tok(["hot and cold", "a longer text about the weather today"], return_tensors="pt", padding=True)
    with torch.no_grad():
        got = AutoModelForSequenceClassification.from_pretrained(out)(**batch).logits
        want = AutoModelForSequenceClassification.from_pretrained(user_rm_dir)(**batch).logits
    assert torch.allclose(got, want, atol=1e-5), (got, want)
    front = yaml.safe_load((out / "README.md").read_text().split("---\n")[1])
    assert front["pipeline_tag"] == "text-classification"


def test_export_names_what_is_missing(mlflow_uri, tmp_path):  # noqa: F811
    from tasks.registry import register_model_dir

    register_model_dir("actor", tiny_actor(tmp_path / "a", seed=12), "unpromoted-actor", {})
    cases = [
        (("--name", "no-such-actor"), "no registered model 'no-such-actor'"),
        (("--name", "unpromoted-actor"), "unpromoted-actor has no alias 'champion' (aliases: challenger -> v1)"),
        (("--name", "unpromoted-actor", "--version", "7"), "unpromoted-actor has no version 7 (versions: 1)"),
    ]
    for args, message in cases:
        done = rlhf_cli("export", *args, "--out", str(tmp_path / "x"), cwd=tmp_path)
        assert done.returncode == 65 and message in done.stdout, (args, done.stdout)
    offline = rlhf_cli(
        "export",
        "--name",
        "unpromoted-actor",
        "--version",
        "1",
        "--out",
        str(tmp_path / "y"),
        "--push-to-hub",
        "me/model",
        cwd=tmp_path,
        env={"HF_HUB_OFFLINE": "1"},
    )
    assert offline.returncode == 65 and "cannot push to me/model: HF_HUB_OFFLINE is set" in offline.stdout
    assert not (tmp_path / "y").exists()  # refused before anything was downloaded
