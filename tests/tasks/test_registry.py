"""The model registry against a real `mlflow server`: versions, aliases, lineage, dedupe, promote, rollback."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rlhf_core.data.tokenizer import train_demo_tokenizer
from rlhf_core.ops.meta import build_meta, write_meta
from tests.servers import mlflow_server, project_copy

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[2]


def tiny_actor(path: Path, seed: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = train_demo_tokenizer([f"Human: What is {i} + {i}?\n\nAssistant: {2 * i}" for i in range(50)], 64)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    torch.manual_seed(seed)
    LlamaForCausalLM(cfg).save_pretrained(path)
    tok.save_pretrained(path)
    write_meta(path, build_meta("rlhf", "hash123", inputs={"sft": "sft-digest", "rm": "rm-digest"}))
    return path


@pytest.fixture(scope="module")
def mlflow_uri(tmp_path_factory):
    with mlflow_server(tmp_path_factory.mktemp("mlflow")) as uri:
        old = os.environ.get("MLFLOW_TRACKING_URI")
        os.environ["MLFLOW_TRACKING_URI"] = uri
        import mlflow

        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment("Default")  # not an experiment id cached from another module's server
        yield uri
        if old is None:
            os.environ.pop("MLFLOW_TRACKING_URI", None)


def test_register_dedupe_promote_rollback_and_load(mlflow_uri, tmp_path):
    import mlflow
    from mlflow import MlflowClient

    from tasks.registry import (
        CHALLENGER,
        CHAMPION,
        alias_version,
        model_lineage,
        promote,
        record_gate,
        register_model_dir,
        rollback,
    )

    mlflow.set_experiment("registry-test")
    name = "regtest-actor"
    a1 = tiny_actor(tmp_path / "a1", seed=1)
    tags = model_lineage(a1, {"rlhf.git_sha": "abc", "rlhf.dvc.data_prepared": "d41d8.dir"})
    first = register_model_dir("actor", a1, name, tags)
    assert (first.version, first.new) == ("1", True)
    again = register_model_dir("actor", a1, name, tags)
    assert (again.version, again.new) == ("1", False), "identical model registered twice"
    a2 = tiny_actor(tmp_path / "a2", seed=2)
    from rlhf_core.ops.meta import read_meta
    from rlhf_core.ops.model_card import render_model_card
    from tests.conftest import make_params

    card = render_model_card({**read_meta(a2), "role": "actor"}, make_params(),
                             {"sft_accuracy": 0.5, "accuracy": 0.75, "kl_to_reference": 0.3})
    (a2 / "README.md").write_text(card)
    second = register_model_dir("actor", a2, name, model_lineage(a2, tags))
    assert (second.version, second.new) == ("2", True)
    assert alias_version(name, CHALLENGER) == "2"

    client = MlflowClient()
    v2 = client.get_model_version(name, "2")
    assert v2.tags["rlhf.git_sha"] and v2.tags["rlhf.dvc.data_prepared"] == "d41d8.dir"
    assert v2.tags["rlhf.input.sft"] == "sft-digest" and v2.tags["rlhf.params_hash"] == "hash123"
    run = client.get_run(v2.run_id)  # walk back from the version to the run that logged it
    assert run.info.run_id == v2.run_id
    # the model card: the version's description (front matter dropped) and beside the logged weights
    assert v2.description.startswith("# rlhf-demo actor") and "| accuracy | 0.5 | 0.75 |" in v2.description
    download_uri = client.get_model_version_download_uri(name, "2")
    logged_card = mlflow.artifacts.download_artifacts(artifact_uri=f"{download_uri}/model_card.md")
    assert "| accuracy | 0.5 | 0.75 |" in Path(logged_card).read_text()

    assert promote(name, "1", "first") is None
    assert promote(name, "2", "better") == "1"
    assert client.get_model_version(name, "2").tags["rlhf.previous_champion"] == "1"
    assert rollback(name, "regression") == ("2", "1")
    assert alias_version(name, CHAMPION) == "1"
    with pytest.raises(ValueError, match="first champion; there is nothing to roll back to"):
        rollback(name)

    record_gate(name, "2", {"passed": False, "checks": [
        {"name": "kl_to_reference", "value": 7.5, "op": "<=", "threshold": 5.0, "passed": False}]})
    assert client.get_model_version(name, "2").tags["rlhf.gate.failing"] == "kl_to_reference=7.5 (needs <= 5.0)"

    components = mlflow.transformers.load_model(f"models:/{name}@{CHAMPION}", return_type="components")
    tok, model = components["tokenizer"], components["model"]
    ids = tok("Human: What is 3 + 3?\n\nAssistant:", return_tensors="pt")
    out = model.generate(**ids, max_new_tokens=3, do_sample=False, pad_token_id=tok.pad_token_id)
    assert out.shape[1] == ids["input_ids"].shape[1] + 3


def test_unreachable_mlflow_fails_fast_before_training(tmp_path):
    shutil.copy(REPO / "dvc.yaml", tmp_path / "dvc.yaml")  # a workspace (else `rlhf run` refuses it first)
    proc = subprocess.run([sys.executable, "-m", "flows.cli", "run"], cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "MLFLOW_TRACKING_URI": "http://127.0.0.1:9", "PYTHONPATH": str(REPO),
                               "RLHF_TRACKING": "on"}, timeout=120)
    assert proc.returncode == 3, proc.stderr
    assert "MLflow tracking server http://127.0.0.1:9 is unreachable" in proc.stderr
    assert not (tmp_path / "data").exists()


def _cli(project: Path, uri: str, *args: str, **kw):
    env = {**os.environ, "MLFLOW_TRACKING_URI": uri, "RLHF_TRACKING": "on", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": str(REPO), "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0", "MLFLOW_HTTP_REQUEST_TIMEOUT": "5"}
    return [sys.executable, "-m", "flows.cli", *args], {"cwd": project, "env": env, "text": True, **kw}


def test_mlflow_outage_mid_stage_keeps_the_model_and_register_retries_later(tmp_path):
    """The server dies while the RM trains: the stage still finishes and saves models/rm; `rlhf register`
    fails clearly while MLflow is down and registers the model once it is back (same store, new port)."""
    from mlflow import MlflowClient

    project = project_copy(tmp_path / "project", {
        "data": {"demo": {"n_rows": 400}},
        "model": {"tiny": {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                           "num_attention_heads": 2, "num_key_value_heads": 2}},
        "rm": {"init_from": "base", "epochs": 100, "max_steps": 600, "micro_batch_size": 4, "log_every": 1,
               "save_every": 1000},
        "tracking": {"system_metrics": False, "registry_prefix": "outage"},
    })
    store = tmp_path / "mlflow"
    store.mkdir()
    with mlflow_server(store) as uri:
        cmd, kw = _cli(project, uri, "stage", "prepare", capture_output=True)
        assert subprocess.run(cmd, **kw, timeout=300).returncode == 0
        cmd, kw = _cli(project, uri, "stage", "rm", stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        proc = subprocess.Popen(cmd, **kw)
        seen = []
        for line in proc.stdout:  # wait until training logs its first steps, then take the server down
            seen.append(line)
            if '"step": 5' in line:
                break
        else:
            pytest.fail("rm never logged a step:\n" + "".join(seen[-20:]))
    rest = proc.stdout.read()  # the server is gone (the context manager killed it); training goes on
    assert proc.wait(timeout=600) == 0, rest[-3000:]
    assert "MLflow failed during stage 'rm'" in rest and "run `rlhf register`" in rest
    metrics = json.loads((project / "metrics" / "rm.json").read_text())
    assert metrics["steps"] == 600, "training stopped early"
    assert (project / "models" / "rm" / "config.json").is_file() and (project / "models" / "rm" /
                                                                     "model.safetensors").is_file()

    cmd, kw = _cli(project, uri, "register", "--kind", "reward", capture_output=True)
    down = subprocess.run(cmd, **kw, timeout=300)
    assert down.returncode == 3 and "unreachable" in down.stderr, down.stderr

    with mlflow_server(store) as uri2:
        cmd, kw = _cli(project, uri2, "register", "--kind", "reward", capture_output=True)
        up = subprocess.run(cmd, **kw, timeout=600)
        assert up.returncode == 0, up.stderr
        assert "reward: outage-reward v1 (new)" in up.stderr
        again = subprocess.run(cmd, **kw, timeout=600)
        assert "reward: outage-reward v1 (already registered)" in again.stderr, again.stderr
        client = MlflowClient(uri2)
        version = client.get_model_version("outage-reward", "1")
        assert version.tags["rlhf.content_hash"] and version.aliases == ["challenger"]
        runs = client.search_runs([client.get_experiment_by_name("rlhf-demo").experiment_id])
        names = {r.info.run_name for r in runs}
        assert {"rm", "register-reward"} <= names, names  # the run from before the outage and the retry's run


def test_experiment_opens_as_a_model_training_experiment(mlflow_uri, tmp_path):
    """The MLflow 3 UI picks its view from ``mlflow.experimentKind``: ours is set to model development once,
    and a kind the user changed in the UI is left alone."""
    from mlflow import MlflowClient

    from rlhf_core.ops import tracking
    from tests.conftest import make_params

    params = make_params("tracking.experiment=kind-test")  # the server: MLFLOW_TRACKING_URI (fixture)
    exp_id = tracking.setup(params, tmp_path)
    client = MlflowClient()
    assert client.get_experiment(exp_id).tags[tracking.EXPERIMENT_KIND_TAG] == "custom_model_development"
    client.set_experiment_tag(exp_id, tracking.EXPERIMENT_KIND_TAG, "finetuning")
    assert tracking.setup(params, tmp_path) == exp_id
    assert client.get_experiment(exp_id).tags[tracking.EXPERIMENT_KIND_TAG] == "finetuning"


@pytest.mark.slow
def test_mlflow_models_serve_answers_with_the_champion(mlflow_uri, tmp_path):
    """`mlflow models serve -m models:/<name>@champion` (a real server process, the project's env) answers a
    real HTTP request with generated text."""
    import json as _json
    import urllib.error
    import urllib.request

    from tasks.registry import promote, register_model_dir
    from tests.servers import background, free_port, wait_http

    name = "serve-actor"
    reg = register_model_dir("actor", tiny_actor(tmp_path / "actor", seed=3), name, {})
    promote(name, reg.version, "serve test")
    port = free_port()
    env = {"MLFLOW_TRACKING_URI": mlflow_uri, "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"}
    cmd = [sys.executable, "-m", "mlflow", "models", "serve", "-m", f"models:/{name}@champion", "--env-manager",
           "local", "--host", "127.0.0.1", "--port", str(port)]
    with background(cmd, tmp_path / "serve.log", env=env) as proc:
        wait_http(f"http://127.0.0.1:{port}/ping", 240, proc, tmp_path / "serve.log")
        # the demo tokenizer has a chat template, so the actor is served as a chat model (llm/v1/chat)
        body = _json.dumps({"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 3}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{port}/invocations", data=body,
                                     headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=120) as resp:
                answer = _json.loads(resp.read())
        except urllib.error.HTTPError as err:
            raise AssertionError(f"{err.code}: {err.read().decode()[:2000]}") from None
    assert resp.status == 200
    (choice,) = answer["choices"] if isinstance(answer, dict) else answer[0]["choices"]
    assert choice["message"]["role"] == "assistant" and isinstance(choice["message"]["content"], str), answer


@pytest.mark.slow
def test_actor_with_a_chat_template_is_logged_for_chat(mlflow_uri, tmp_path):
    """A tokenizer with a chat template makes the registered actor an MLflow chat model: messages in, a chat
    completion out (``llm/v1/chat``); without one it stays plain text generation (the demo)."""
    import mlflow
    from transformers import AutoTokenizer

    from tasks.registry import register_model_dir

    path = tiny_actor(tmp_path / "chat", seed=4)
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = ("{% for m in messages %}{{ 'Human: ' if m['role'] == 'user' else 'Assistant: ' }}"
                         "{{ m['content'] }}\n\n{% endfor %}{% if add_generation_prompt %}Assistant:{% endif %}")
    tok.save_pretrained(path)
    reg = register_model_dir("actor", path, "chat-actor", {})
    model = mlflow.pyfunc.load_model(f"models:/chat-actor/{reg.version}")
    assert model.metadata.flavors["transformers"]["inference_task"] == "llm/v1/chat"
    out = model.predict({"messages": [{"role": "user", "content": "What is 2 + 3?"}], "max_tokens": 3})
    (answer,) = out if isinstance(out, list) else [out]
    assert answer["choices"][0]["message"]["role"] == "assistant"

    plain = tiny_actor(tmp_path / "plain", seed=5)
    tok = AutoTokenizer.from_pretrained(plain)
    tok.chat_template = None
    tok.save_pretrained(plain)
    (plain / "chat_template.jinja").unlink(missing_ok=True)
    reg = register_model_dir("actor", plain, "plain-actor", {})
    flavor = mlflow.pyfunc.load_model(f"models:/plain-actor/{reg.version}").metadata.flavors["transformers"]
    assert flavor["task"] == "text-generation" and "inference_task" not in flavor


def test_a_registration_cut_off_after_its_version_exists_is_finished_not_doubled(mlflow_uri, tmp_path, monkeypatch):
    """The window a kill can hit between creating a version and finishing it (description, challenger, the
    completion tag): the re-run finds the version by its content hash and finishes it; no second version."""
    import mlflow
    from mlflow import MlflowClient

    import tasks.registry as registry

    mlflow.set_experiment("registry-cut-off")
    name = "cutoff-actor"
    actor = tiny_actor(tmp_path / "a", seed=3)
    finish = registry._finish_registration

    def killed(*args):
        raise KeyboardInterrupt("killed after the version was created")

    monkeypatch.setattr(registry, "_finish_registration", killed)
    with pytest.raises(KeyboardInterrupt):
        registry.register_model_dir("actor", actor, name, {"rlhf.stage": "rlhf"})
    client = MlflowClient()
    (left,) = client.search_model_versions(f"name='{name}'")
    assert left.tags[registry.HASH_TAG] and left.tags["rlhf.stage"] == "rlhf"  # created with every tag at once
    assert registry.COMPLETE_TAG not in left.tags and registry.alias_version(name, registry.CHALLENGER) is None

    monkeypatch.setattr(registry, "_finish_registration", finish)
    again = registry.register_model_dir("actor", actor, name, {"rlhf.stage": "rlhf"})
    assert (again.version, again.new) == (left.version, True) and again.model_id == left.source.removeprefix("models:/")
    (only,) = client.search_model_versions(f"name='{name}'")
    assert only.tags[registry.COMPLETE_TAG] == "complete"
    assert registry.alias_version(name, registry.CHALLENGER) == left.version
    third = registry.register_model_dir("actor", actor, name, {"rlhf.stage": "rlhf"})
    assert (third.version, third.new) == (left.version, False)


def test_rlhf_register_killed_at_random_moments_leaves_no_partial_or_doubled_version(mlflow_uri, tmp_path):
    """The registration kill campaign at a small size: ``rlhf register`` SIGKILLed at a random moment,
    re-run to the end: every version's downloaded files are whole, each kind ends with one complete
    version under ``challenger``."""
    import shutil

    from benchmarks.kill_register import main

    ws = tmp_path / "ws"
    tiny_actor(ws / "models/actor", seed=4)
    shutil.copy(REPO / "params.yaml", ws / "params.yaml")
    rows = main(["--workspace", str(ws), "--tracking-uri", mlflow_uri, "--kills", "1", "--seed", "1",
                 "--out", str(tmp_path / "kills.jsonl")])
    assert len(rows) == 1 and rows[0]["killed"]  # at 13 % of the uninterrupted run (seed 1)
    for r in rows:
        assert r["rerun_rc"] == 0 and r["incomplete_files_after_kill"] == 0, r
        assert r["one_version_each"] and r["all_complete_and_whole"] and r["challenger_on_it"], r


def test_an_actor_saved_with_its_adapter_apart_is_registered_merged(mlflow_uri, tmp_path):
    """``compute.lora.merge_on_save: false`` leaves the actor's LoRA in ``adapter/``: the registered model is the
    policy with it merged, not the base weights under it."""
    import mlflow
    import torch
    from transformers import AutoModelForCausalLM

    from tasks.registry import register_model_dir
    from tests.tiny import save_with_random_adapter

    path = tiny_actor(tmp_path / "apart", seed=6)
    want = save_with_random_adapter(path, path, r=2, alpha=16).state_dict()
    base = AutoModelForCausalLM.from_pretrained(path).state_dict()
    reg = register_model_dir("actor", path, "apart-actor", {})
    got = mlflow.transformers.load_model(f"models:/apart-actor/{reg.version}", return_type="components")["model"]
    got = got.state_dict()
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(want[name], base[name])  # the adapter moves this weight
    assert all(torch.allclose(got[k], v) for k, v in want.items() if k in got) and name in got
