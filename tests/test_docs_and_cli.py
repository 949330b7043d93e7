"""The params reference cannot drift from the models; the stage CLI validates and overrides."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from rlhf_core.params_doc import render_params_reference

REPO = Path(__file__).resolve().parents[1]


def test_params_reference_is_current():
    assert (REPO / "docs" / "params.md").read_text() == render_params_reference(), (
        "docs/params.md is stale: run `rlhf params docs > docs/params.md`")


def test_params_reference_lists_every_leaf_key():
    import yaml

    doc = render_params_reference()
    defaults = yaml.safe_load((REPO / "params.yaml").read_text())

    def leaves(d, prefix=""):
        for k, v in d.items():
            if isinstance(v, dict) and v and k not in ("reward_fns",):
                yield from leaves(v, f"{prefix}{k}.")
            else:
                yield f"{prefix}{k}"

    missing = [k for k in leaves(defaults) if f"`{k}`" not in doc]
    assert not missing, f"params.md lacks {missing}"


def _rlhf(*args, cwd):
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"})


def test_stage_cli_applies_overrides(tmp_path):
    proc = _rlhf("stage", "prepare", "-S", "data.demo.n_rows=300", "-S", "data.data_split=[1,1,1]", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    metrics = json.loads((tmp_path / "metrics/prepare.json").read_text())
    assert sum(metrics["counts"].values()) + json.loads(
        (tmp_path / "data/prepared/manifest.json").read_text())["dropped_total"] == 300


def test_stage_cli_errors_name_the_key(tmp_path):
    proc = _rlhf("stage", "prepare", "-S", "data.max_prompt_len=-1", cwd=tmp_path)
    assert proc.returncode == 2
    assert "data.max_prompt_len: Input should be greater than or equal to 1" in proc.stderr
    proc = _rlhf("stage", "nope", cwd=tmp_path)
    assert proc.returncode == 2 and "unknown stage 'nope'" in proc.stderr
    (tmp_path / "bad.jsonl").write_text('{"prompt": "x"\n')
    proc = _rlhf("stage", "prepare", "-S", "data.source=mixed", "-S", "data.sources=[{path: bad.jsonl}]",
                 cwd=tmp_path)
    assert proc.returncode == 65 and "bad.jsonl:1: malformed JSON" in proc.stderr  # bad input: not retried


def test_help_has_examples(tmp_path):
    proc = _rlhf("stage", "--help", cwd=tmp_path)
    assert proc.returncode == 0 and "Example: rlhf stage prepare" in proc.stdout


def test_k8s_render_cli_prints_the_submitted_manifest(tmp_path):
    import yaml

    from tasks.k8s.options import StageJobOptions
    from tasks.k8s.render import render_stage_resources

    proc = _rlhf("k8s", "render", "sft", "--gpus", "2", "--nnodes", "2", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    docs = list(yaml.safe_load_all(proc.stdout))
    assert docs == render_stage_resources(StageJobOptions("sft", gpus=2, nnodes=2))
    assert [d["kind"] for d in docs] == ["Service", "Job"]
    proc = _rlhf("k8s", "render", "nope", cwd=tmp_path)
    assert proc.returncode == 2 and "nope" in proc.stderr
    shaped = {"queue": "team-a", "priority_class": "training-low", "dvc_remote": "s3://ml/rlhf"}
    for cli in (("k8s", "render"), ("-m", "tasks.k8s", "render")):  # `rlhf k8s render` and `python -m tasks.k8s`
        args = [*cli, "rm", "--queue", "team-a", "--priority-class", "training-low", "--dvc-remote", "s3://ml/rlhf"]
        proc = _rlhf(*args, cwd=tmp_path) if cli[0] == "k8s" else subprocess.run(
            [sys.executable, *args], cwd=REPO, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stderr
        assert list(yaml.safe_load_all(proc.stdout)) == render_stage_resources(StageJobOptions("rm", **shaped))
        assert "rlhf repro rm --remote s3://ml/rlhf" in " ".join(map(str, _flat(yaml.safe_load(proc.stdout))))


def _flat(doc):
    if isinstance(doc, dict):
        return [x for v in doc.values() for x in _flat(v)]
    if isinstance(doc, list):
        return [x for v in doc for x in _flat(v)]
    return [doc]


def test_generated_k8s_files_are_current():
    proc = _rlhf("k8s", "write-manifests", "--check", cwd=REPO)
    assert proc.returncode == 0, f"stale generated files (run `make generated`):\n{proc.stderr}"


def test_the_cli_freezes_the_heap_on_the_way_out_with_the_command_s_exit():
    """rlhf_core.cli.exit_lightly: gc.freeze() after the command however it leaves (its exit code, its error
    unchanged), so the interpreter's last collection skips what torch & co. allocated."""
    import gc

    import pytest

    from rlhf_core.cli import exit_lightly

    def fails():
        raise ValueError("bad input")

    try:
        for command, raised, check in ((lambda: sys.exit(3), SystemExit, lambda e: e.code == 3),
                                       (fails, ValueError, lambda e: str(e) == "bad input"),
                                       (lambda: None, None, None)):
            gc.unfreeze()
            keep = [[] for _ in range(10)]  # objects the collector tracks, for the freeze to move
            if raised is None:
                exit_lightly(command)
            else:
                with pytest.raises(raised) as err:
                    exit_lightly(command)
                assert check(err.value)
            assert gc.get_freeze_count() >= len(keep)
    finally:
        gc.unfreeze()


def test_no_code_lives_under_docs():
    """docs/ holds pages and raw rows; a measurement worth repeating is a benchmark with a smoke test."""
    code = sorted(str(p.relative_to(REPO)) for p in (REPO / "docs").rglob("*")
                  if p.suffix in {".py", ".sh", ".patch", ".ipynb"})
    assert not code, f"code under docs/: {code}"
