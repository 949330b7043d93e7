"""Stages under DVC against a shared S3 remote with no git (``rlhf repro``, ``rlhf_core/ops/dvc_remote.py``), as
cluster pods run them: against a real S3-compatible server (moto) on loopback, real DVC with ``dvc-s3``.

Each "pod" is a fresh folder: it shares nothing with the others but the remote. A toy project (``dvc.yaml``
with shell stages, a code file) keeps the mechanics fast; one test runs the real ``prepare`` stage.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import boto3
import pytest
import yaml

from rlhf_core.ops.dvc_remote import STATE_DIR, pull_outputs
from tests.servers import REPO, s3_server

pytestmark = pytest.mark.slow
BUCKET = "rlhf-test"

TOY_PIPELINE = {"stages": {
    "a": {"cmd": "mkdir -p outa metrics && cat code/a.txt > outa/f && echo \"$(cat code/a.txt)\" >> ran-a.log "
                 "&& echo '{\"a\": 1}' > metrics/a.json",
          "deps": ["code/a.txt"], "params": ["a"], "outs": ["outa"],
          "metrics": [{"metrics/a.json": {"cache": False}}]},
    "b": {"cmd": "cat outa/f > outb && echo '{\"b\": 2}' > metrics/b.json "
                 "&& { [ -z \"$RLHF_TOY_EXIT\" ] || exit $RLHF_TOY_EXIT; }",
          "deps": ["outa"], "outs": ["outb"], "metrics": [{"metrics/b.json": {"cache": False}}]},
    "slow": {"cmd": f"{sys.executable} -c \"import signal, sys, time; "
                    "signal.signal(signal.SIGTERM, lambda *a: sys.exit(75)); open('started', 'w').close(); "
                    "time.sleep(120)\"",
             "deps": ["code/a.txt"], "outs": ["outslow"]},
}}


@pytest.fixture(scope="module")
def s3(tmp_path_factory):
    with s3_server(tmp_path_factory.mktemp("moto"), BUCKET) as env:
        yield env


@pytest.fixture
def toy(tmp_path, s3, monkeypatch):
    """The toy project (``RLHF_PROJECT_DIR``), its params file, and the S3 environment in ``os.environ``."""
    project = tmp_path / "project"
    (project / "code").mkdir(parents=True)
    (project / "dvc.yaml").write_text(yaml.safe_dump(TOY_PIPELINE, sort_keys=False))
    (project / "code" / "a.txt").write_text("v1\n")
    (tmp_path / "params.yaml").write_text("a: {x: 1}\n")
    monkeypatch.setenv("RLHF_PROJECT_DIR", str(project))
    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    return project


def repro(pod: Path, stage: str, remote: str, *args: str, expect: int = 0, env: dict | None = None) -> str:
    pod.mkdir(parents=True, exist_ok=True)
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", "repro", stage, "--remote", remote, *args],
                          cwd=pod, capture_output=True, text=True, env={**os.environ, **(env or {})}, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == expect, f"rlhf repro {stage}: exit {proc.returncode}\n{out}"
    return out


def state_keys(prefix: str) -> set[str]:
    listed = boto3.client("s3").list_objects_v2(Bucket=BUCKET, Prefix=prefix).get("Contents", [])
    return {o["Key"][len(prefix) + 1:] for o in listed}


def test_a_stage_runs_once_then_other_pods_skip_it_and_pull_its_outputs(toy, tmp_path):
    remote = f"s3://{BUCKET}/once"
    out = repro(tmp_path / "pod1", "a", remote, "--params", str(tmp_path / "params.yaml"))
    assert "Running stage 'a'" in out and "a ran" in out
    keys = state_keys("once")
    assert {f"{STATE_DIR}/params.yaml", f"{STATE_DIR}/dvc.lock", f"{STATE_DIR}/metrics/a.json"} <= keys
    assert any(k.startswith("files/md5/") for k in keys), keys  # the output itself, in DVC's layout

    out = repro(tmp_path / "pod2", "a", remote)  # a fresh pod, params from the remote: nothing changed
    assert "Running stage 'a'" not in out and "a skipped" in out
    out = repro(tmp_path / "pod3", "b", remote)  # b's input comes from the remote, not from pod1
    assert "Running stage 'b'" in out
    assert (tmp_path / "pod3" / "outb").read_text() == "v1\n"
    lock = yaml.safe_load((tmp_path / "pod3" / "dvc.lock").read_text())
    assert set(lock["stages"]) == {"a", "b"}

    reader = tmp_path / "flow"  # the registering flow: outputs from the remote only, into a checkout of its own
    reader.mkdir()
    for args in (["init", "--no-scm", "-q"], ["remote", "add", "--local", "-d", "mine", str(tmp_path / "mine")]):
        subprocess.run([sys.executable, "-m", "dvc", *args], cwd=reader, check=True, capture_output=True)
    pull_outputs(reader, remote, ["a", "b", "slow"], echo=lambda _line: None)
    default = subprocess.run([sys.executable, "-m", "dvc", "remote", "default"], cwd=reader, capture_output=True,
                             text=True, check=True).stdout.strip()
    assert default == "mine"  # the checkout's own default remote is left alone
    assert (reader / "outa" / "f").read_text() == "v1\n" and (reader / "outb").read_text() == "v1\n"
    assert json.loads((reader / "metrics" / "b.json").read_text()) == {"b": 2}
    assert not (reader / "outslow").exists()  # never ran: not in the lock, left out


def test_changed_params_or_code_rerun_the_stage(toy, tmp_path):
    remote = f"s3://{BUCKET}/changes"
    params = tmp_path / "params.yaml"
    repro(tmp_path / "pod1", "a", remote, "--params", str(params))
    params.write_text("a: {x: 2}\n")
    assert "Running stage 'a'" in repro(tmp_path / "pod2", "a", remote, "--params", str(params))
    assert "Running stage 'a'" not in repro(tmp_path / "pod3", "a", remote)  # the new params are the state's
    (toy / "code" / "a.txt").write_text("v2\n")  # a new image: the copied code differs
    assert "Running stage 'a'" in repro(tmp_path / "pod3", "a", remote)
    reader = tmp_path / "flow"
    pull_outputs(reader, remote, ["a"], echo=lambda _line: None)
    assert (reader / "outa" / "f").read_text() == "v2\n"


def test_no_params_anywhere_is_bad_config_naming_the_state(toy, tmp_path):
    out = repro(tmp_path / "pod", "a", f"s3://{BUCKET}/empty", expect=2)
    assert f"s3://{BUCKET}/empty/{STATE_DIR}/params.yaml does not exist" in out


def test_a_failed_stage_exits_with_its_code_and_leaves_the_state(toy, tmp_path):
    remote = f"s3://{BUCKET}/failing"
    repro(tmp_path / "pod1", "a", remote, "--params", str(tmp_path / "params.yaml"))
    before = boto3.client("s3").get_object(Bucket=BUCKET, Key=f"failing/{STATE_DIR}/dvc.lock")["Body"].read()
    out = repro(tmp_path / "pod2", "b", remote, expect=65, env={"RLHF_TOY_EXIT": "65"})
    assert "exit 65 (bad input)" in out
    after = boto3.client("s3").get_object(Bucket=BUCKET, Key=f"failing/{STATE_DIR}/dvc.lock")["Body"].read()
    assert after == before and f"{STATE_DIR}/metrics/b.json" not in state_keys("failing")


@pytest.mark.parametrize("shell", ["/bin/sh", "/bin/bash"])
def test_sigterm_reaches_the_stage_and_its_exit_75_is_kept(toy, tmp_path, shell, monkeypatch):
    """DVC runs the cmd as ``$SHELL -c CMD``: bash execs it, dash (Debian's /bin/sh, CI's when SHELL is unset)
    forks, and a dash killed by the SIGTERM would exit -15 in place of the stage's 75."""
    if not Path(shell).exists():
        pytest.skip(f"no {shell}")
    monkeypatch.setenv("SHELL", shell)
    pod = tmp_path / "pod"
    pod.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "rlhf_core.cli", "repro", "slow", "--remote",
                             f"s3://{BUCKET}/term-{Path(shell).name}", "--params", str(tmp_path / "params.yaml")],
                            cwd=pod, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 120
    while not (pod / "started").exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)  # what the kubelet sends the container's first process
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 75, out
    assert "stopped on SIGTERM, checkpointed" in out


def test_the_real_prepare_stage_runs_once_across_pods(tmp_path, s3, monkeypatch):
    for key, value in s3.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("RLHF_PROJECT_DIR", raising=False)  # this checkout's dvc.yaml and sources
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"]["demo"]["n_rows"] = 300
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(params))
    remote = f"s3://{BUCKET}/real"
    assert "Running stage 'prepare'" in repro(tmp_path / "pod1", "prepare", remote, "--params",
                                              str(tmp_path / "params.yaml"))
    out = repro(tmp_path / "pod2", "prepare", remote)
    assert "prepare skipped" in out
    assert (tmp_path / "pod2" / "data/prepared/sft.parquet").read_bytes() == \
        (tmp_path / "pod1" / "data/prepared/sft.parquet").read_bytes()  # an up-to-date stage's outputs pulled
    assert (tmp_path / "pod2" / "rlhf_core" / "stages" / "prepare.py").read_text() == \
        (REPO / "rlhf_core" / "stages" / "prepare.py").read_text()  # the code the lock hashes is the code that ran
    assert (tmp_path / "pod2" / ".dvcignore").read_text() == (REPO / ".dvcignore").read_text()
    bytecode = tmp_path / "pod2" / "rlhf_core" / "stages" / "__pycache__"
    bytecode.mkdir()
    (bytecode / "prepare.cpython-311.pyc").write_bytes(b"\x00" * 64)  # torchrun's `-m` imports the copy
    assert "prepare skipped" in repro(tmp_path / "pod2", "prepare", remote)


def _locked(pod: Path) -> dict:
    return yaml.safe_load((pod / "dvc.lock").read_text())["stages"]


def _state_lock(prefix: str) -> dict:
    body = boto3.client("s3").get_object(Bucket=BUCKET, Key=f"{prefix}/{STATE_DIR}/dvc.lock")["Body"].read()
    return yaml.safe_load(body)["stages"]


def test_a_push_that_failed_is_published_by_the_retry(toy, tmp_path):
    """The first attempt runs the stage and its `dvc push` fails (the remote cannot take the objects); the retry
    in the same workspace finds the stage up to date (or restores it from the run-cache) and must still push and
    publish it: before, it said "skipped" and left the remote with neither the data nor the lock."""
    remote = tmp_path / "remote"
    remote.mkdir()
    (remote / "files").write_text("not a folder")  # DVC's objects go under files/md5/: the push fails
    params = str(tmp_path / "params.yaml")
    out = repro(tmp_path / "pod", "a", str(remote), "--params", params, expect=1)
    assert "Running stage 'a'" in out and "dvc push a" in out
    assert not (remote / STATE_DIR / "dvc.lock").exists()
    (remote / "files").unlink()  # the remote is back
    out = repro(tmp_path / "pod", "a", str(remote), "--params", params)  # the flow's retry
    assert "uploaded params.yaml, metrics/a.json, dvc.lock" in out, out
    assert "a" in yaml.safe_load((remote / STATE_DIR / "dvc.lock").read_text())["stages"]
    repro(tmp_path / "fresh", "b", str(remote))  # a's output now comes from the remote
    assert (tmp_path / "fresh" / "outb").read_text() == "v1\n"


def test_params_1_2_1_leaves_the_state_at_1(toy, tmp_path):
    """Params 1 -> 2 -> 1 in one workspace: the third run restores 1's outputs from DVC's run-cache ("is cached -
    skipping run"). That is a run for the remote: before, it was reported skipped, and the state kept params 1
    beside 2's lock."""
    remote, prefix, params = f"s3://{BUCKET}/oscillate", "oscillate", tmp_path / "params.yaml"
    pod = tmp_path / "pod"
    for x in (1, 2, 1):
        params.write_text(f"a: {{x: {x}}}\n")
        out = repro(pod, "a", remote, "--params", str(params))
    assert "Stage 'a' is cached - skipping run" in out and "a ran" in out, out
    assert _state_lock(prefix)["a"]["params"]["params.yaml"]["a"] == {"x": 1} == \
        _locked(pod)["a"]["params"]["params.yaml"]["a"]


def test_a_lock_published_by_another_writer_meanwhile_is_not_overwritten(toy, tmp_path):
    """Two pipelines on one remote: while this pod's stage runs, another pod publishes stage b. This pod's
    upload would drop b from the state's lock (last writer wins): it is refused, naming the lock, and the other
    writer's lock stays."""
    from rlhf_core.ops.dvc_remote import RemoteStateError
    from rlhf_core.ops.dvc_remote import repro as repro_in_process

    remote, prefix, params = f"s3://{BUCKET}/race", "race", tmp_path / "params.yaml"
    repro(tmp_path / "pod1", "a", remote, "--params", str(params))
    changed = tmp_path / "params-2.yaml"
    changed.write_text("a: {x: 2}\n")

    def meanwhile(_proc) -> None:  # this stage is running: the other pipeline publishes b
        repro(tmp_path / "other", "b", remote)

    with pytest.raises(RemoteStateError, match=rf"{STATE_DIR}/dvc.lock changed while this stage ran"):
        repro_in_process("a", tmp_path / "pod2", remote, changed, echo=lambda _line: None, started=meanwhile)
    state = _state_lock(prefix)
    assert set(state) == {"a", "b"} and state["a"]["params"]["params.yaml"]["a"] == {"x": 1}
