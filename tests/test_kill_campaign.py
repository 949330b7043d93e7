"""The kill campaign at a small size: SFT on the tiny demo SIGKILLed at random moments (one during start-up),
re-run: every re-run finishes with the uninterrupted run's weights, loses at most the steps since the last
checkpoint, and no kill leaves a half-written model directory. And the flow process killed under a running
stage: the stage checkpoints and stops instead of training on unobserved."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from tests.rlhf_core.trainers.test_sft import TINY, prepared  # noqa: F401  (the tiny demo's prepared workspace)

pytestmark = pytest.mark.slow


def test_sft_killed_at_random_moments_resumes_to_identical_weights(prepared, tmp_path):  # noqa: F811
    import yaml

    from benchmarks.kill_campaign import main, summarise
    from rlhf_core.config import apply_overrides

    (prepared / "params.yaml").write_text(yaml.safe_dump(apply_overrides({}, TINY)))
    rows = main(["--workspace", str(prepared), "--stage", "sft", "--kills", "3", "--seed", "2",
                 "--out", str(tmp_path / "kills.jsonl"), "-S", "sft.max_steps=12", "-S", "sft.save_every=4",
                 "-S", "eval.max_prompts=8"])
    assert len(rows) == 3 and any(r["killed"] for r in rows)
    assert [r["after_step"] for r in rows] == [0, 5, 11] and rows[0]["killed"]  # the first: during start-up
    for r in rows:
        assert r["rerun_rc"] == 0 and r["identical_weights"] and r["steps"] == 12, r
        assert r["model_after_kill"] in ("absent", "whole") and r["model_after_rerun"] == "whole", r
        assert 0 <= r["steps_lost"] <= 4, r  # at most the steps since the last checkpoint (save_every)
    assert "| sft | " in summarise(rows)


def test_a_stage_whose_flow_process_is_killed_checkpoints_and_stops(prepared, tmp_path):  # noqa: F811
    """The flow runs a stage as ``dvc repro`` in a session of its own; SIGKILL the flow's process (no hook runs):
    the stage, a grandchild, notices, moves its output to a log file, checkpoints at its next step and exits 75;
    the re-run resumes from that step."""
    import shutil

    import yaml

    from rlhf_core.config import apply_overrides
    from tests.conftest import REPO
    from tests.tasks.test_retry_policy import _dvc_workspace

    root = tmp_path / "ws"
    root.mkdir()
    for sub in ("data", "models"):
        shutil.copytree(prepared / sub, root / sub)
    (root / "params.yaml").write_text(yaml.safe_dump(apply_overrides({}, TINY)))
    sets = " ".join(f"-S {o}" for o in ("sft.save_every=1000", "sft.log_every=1", "eval.max_prompts=8"))
    cmd = f"{sys.executable} -m rlhf_core.cli stage sft {sets}"
    _dvc_workspace(root, {"sft": cmd})
    flow = ("import os, sys; from pathlib import Path; from tasks.stages import dvc_repro_stage; "
            f"dvc_repro_stage('sft', Path({str(root)!r}), dict(os.environ), False, lambda l: print(l, flush=True))")
    env = {**os.environ, "PYTHONPATH": str(REPO), "RLHF_TRACKING": "off"}
    proc = subprocess.Popen([sys.executable, "-c", flow], cwd=root, env=env, stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    for line in proc.stdout:  # the flow echoes the stage's lines; kill it once training is under way
        if '"step": 3,' in line:
            break
    proc.kill()  # the flow's process only: its stage lives in a session of its own
    proc.wait()
    log = root / ".rlhf/logs/stage-sft.log"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and "stopped on SIGTERM" not in (log.read_text() if log.exists() else ""):
        time.sleep(0.2)
    said = " ".join(log.read_text().split())
    assert f"the flow process {proc.pid} that started this stage is gone: stopping" in said, said
    assert "stopped on SIGTERM after step" in said, said
    step = int(said.split("stopped on SIGTERM after step ")[1].split(";")[0])
    assert step >= 3
    assert (root / "checkpoints/sft/latest").read_text().strip() == f"step_{step:08d}"
    again = subprocess.run(cmd.split(), cwd=root, env=env, capture_output=True, text=True)  # the flow's re-run
    assert again.returncode == 0, again.stderr
    metrics = json.loads((root / "metrics/sft.json").read_text())
    assert metrics["resumed_from_step"] == step and metrics["steps"] > step  # all 4 epochs (68 steps)
