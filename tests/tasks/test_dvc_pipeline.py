"""DVC: `dvc repro prepare` runs the stage, skips when nothing changed, and push/pull use the local remote."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from flows.local_pipeline import ensure_dvc
from rlhf_core.ops.dvc_repro import stage_env

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def _run(cmd, cwd):
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=stage_env())
    assert proc.returncode == 0, f"{cmd}: {proc.stdout}\n{proc.stderr}"
    return proc.stdout + proc.stderr


@pytest.fixture
def dvc_repo(tmp_path):
    """A git + DVC repo holding this project's pipeline files and a small demo params.yaml."""
    root = tmp_path / "repo"
    root.mkdir()
    shutil.copytree(REPO / "rlhf_core", root / "rlhf_core", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(REPO / "dvc.yaml", root / "dvc.yaml")
    for group in ("data", "model", "rm"):  # committed in a clone (inputs/*/.gitkeep): the stages' link deps
        (root / "inputs" / group).mkdir(parents=True)
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["data"]["demo"]["n_rows"] = 300
    params["compute"]["num_threads"] = 1  # the test workers share the cores
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    _run(["git", "init", "-q"], root)
    ensure_dvc(root, ".rlhf")
    return root


def dvc(root, *args):
    return _run([sys.executable, "-m", "dvc", *args], root)


def test_repro_skips_unchanged_and_reruns_on_param_change(dvc_repo):
    out = dvc(dvc_repo, "repro", "prepare")
    assert "Running stage 'prepare'" in out
    assert (dvc_repo / "data/prepared/sft.parquet").exists()
    out = dvc(dvc_repo, "repro", "prepare")
    assert "Stage 'prepare' didn't change, skipping" in out
    params = yaml.safe_load((dvc_repo / "params.yaml").read_text())
    params["data"]["demo"]["wrong_share"] = 0.1
    (dvc_repo / "params.yaml").write_text(yaml.safe_dump(params))
    assert "Running stage 'prepare'" in dvc(dvc_repo, "repro", "prepare")


def test_push_and_pull_against_local_remote(dvc_repo):
    dvc(dvc_repo, "repro", "prepare")
    digest = (dvc_repo / "data/prepared/sft.parquet").read_bytes()
    dvc(dvc_repo, "push", "prepare")
    remote = dvc_repo / ".rlhf" / "dvc-remote"
    assert any(p.is_file() for p in remote.rglob("*")), "nothing reached the local remote"
    shutil.rmtree(dvc_repo / "data" / "prepared")
    shutil.rmtree(dvc_repo / ".dvc" / "cache")
    dvc(dvc_repo, "pull", "prepare")
    assert (dvc_repo / "data/prepared/sft.parquet").read_bytes() == digest
    assert os.path.exists(dvc_repo / "models/base/tokenizer.json")


def _flip_a_bit_in_place(path: Path) -> None:
    """One bit of a cache file flipped while it keeps its read-only mode and its mtime: bit rot, as DVC sees it
    (it trusts a read-only entry and re-uses a hash while inode, size and mtime stay the same)."""
    st = path.stat()
    path.chmod(0o644)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))
    path.chmod(st.st_mode)


def _rlhf(root, *args):
    proc = subprocess.run([sys.executable, "-m", "rlhf_core.cli", *args], cwd=root, capture_output=True, text=True,
                          env=stage_env())
    return proc.returncode, " ".join((proc.stdout + proc.stderr).split())  # the messages as one line


def test_a_damaged_cache_entry_is_refused_by_the_stage_and_found_by_cache_verify(dvc_repo):
    """A DVC cache entry damaged in place passes ``dvc status`` and comes back through ``dvc checkout``; the next
    stage refuses the file before training, ``rlhf cache verify`` names the entry, ``--repair`` removes it and a
    pull puts the remote's good copy back."""
    import hashlib

    dvc(dvc_repo, "repro", "prepare")
    sft = dvc_repo / "data/prepared/sft.parquet"
    pristine = sft.read_bytes()
    dvc(dvc_repo, "push", "prepare")
    assert _rlhf(dvc_repo, "cache", "verify")[0] == 0
    md5 = hashlib.md5(pristine).hexdigest()
    entry = dvc_repo / ".dvc/cache/files/md5" / md5[:2] / md5[2:]
    assert entry.is_file() and entry.read_bytes() == pristine

    _flip_a_bit_in_place(entry)
    assert "Data and pipelines are up to date" in dvc(dvc_repo, "status", "prepare")  # DVC trusts it
    shutil.rmtree(dvc_repo / "data/prepared")
    dvc(dvc_repo, "checkout", "data/prepared")
    assert sft.read_bytes() != pristine  # the damaged bytes came back

    code, said = _rlhf(dvc_repo, "stage", "sft")
    assert code == 65, said
    assert ("data/prepared/sft.parquet: sha256 differs from the one data/prepared/manifest.json recorded" in said
            or "data/prepared/sft.parquet: not a readable parquet file" in said), said
    assert not (dvc_repo / "checkpoints").exists()

    code, said = _rlhf(dvc_repo, "cache", "verify")
    assert code == 65 and f"{entry}: content no longer matches its md5 (data/prepared/sft.parquet, stage " \
                          "prepare); remove it with `rlhf cache verify --repair`" in said, said
    assert entry.exists()
    code, said = _rlhf(dvc_repo, "cache", "verify", "--repair")
    assert code == 65 and "removed: restore it with `dvc pull prepare`" in said and not entry.exists(), said
    dvc(dvc_repo, "pull", "prepare")
    assert entry.read_bytes() == pristine  # the remote's good copy
    sft.unlink()  # DVC trusts the copy it checked out: it goes first, as the stage's message says
    dvc(dvc_repo, "checkout", "data/prepared")
    assert sft.read_bytes() == pristine
    code, said = _rlhf(dvc_repo, "cache", "verify")
    assert code == 0 and "0 damaged, 0 not in the local cache" in said, said


def test_cache_verify_without_a_lock_or_with_a_broken_one_says_so(tmp_path):
    assert _rlhf(tmp_path, "cache", "verify") == (
        65, f"error: {tmp_path / 'dvc.lock'}: not found; nothing DVC produced to verify (run the pipeline first)")
    (tmp_path / "dvc.lock").write_text("stages: [unclosed\n")
    code, said = _rlhf(tmp_path, "cache", "verify")
    assert code == 65 and said.startswith(f"error: {tmp_path / 'dvc.lock'}: not valid YAML"), said


def test_every_stage_declares_the_sections_it_logs_and_the_stage_command():
    """dvc.yaml must name each params section a stage reads (else a changed key would not re-run it)."""
    from rlhf_core.ops.tracking import STAGE_SECTIONS
    from rlhf_core.stages import STAGE_NAMES

    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    produced = {o if isinstance(o, str) else next(iter(o)) for s in stages.values() for o in s["outs"]}
    assert list(stages) == list(STAGE_NAMES) == ["prepare", "sft", "feedback", "rm", "rlhf", "evaluate"]
    for name, stage in stages.items():
        assert stage["cmd"] == f"rlhf stage {name}"
        declared = {p.split(".")[0] for p in stage["params"] if "." not in p}
        missing = set(STAGE_SECTIONS[name]) - declared
        assert not missing, f"dvc.yaml stage {name} lacks params sections {sorted(missing)}"
        for dep in set(stage["deps"]) - produced:
            assert (REPO / dep).exists(), f"dvc.yaml stage {name}: dep {dep} does not exist"


def _stage_closure(module: str, graph: dict[str, set[str]]) -> set[str]:
    """The rlhf_core modules a stage's code runs: its module, the packages above it, and all they import."""
    parts = module.split(".")
    seen, todo = set(), [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    while todo:
        name = todo.pop()
        if name not in seen and name.startswith("rlhf_core"):
            seen.add(name)
            todo += graph.get(name, ())
    return seen


def _source(module: str) -> str:
    path = Path(*module.split("."))
    return f"{path}.py" if (REPO / f"{path}.py").exists() else f"{path}/__init__.py"


def uncovered_sources(deps: list[str], modules: set[str]) -> list[str]:
    """The modules' source files under none of ``deps`` (files or directories), but those of ``rlhf_core.ops``
    (operations: no number a stage computes depends on them) and ``rlhf_core/__init__.py`` (the version)."""
    sources = {_source(m) for m in modules if not (m == "rlhf_core" or m.startswith("rlhf_core.ops"))}
    return sorted(f for f in sources if not any(f == d or f.startswith(d.rstrip("/") + "/") for d in deps))


def test_every_stage_depends_on_the_code_it_runs():
    """A stage's code deps cover every rlhf_core module it imports, however indirectly: a dep missing from
    dvc.yaml means an edit there (the RL forward passes were one) leaves a stale model \"up to date\"."""
    from rlhf_core.stages import STAGES
    from tests.test_import_graph import import_graph

    graph = import_graph()
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for name, entry in STAGES.items():
        missing = uncovered_sources(stages[name]["deps"], _stage_closure(entry.split(":")[0], graph))
        assert not missing, f"dvc.yaml stage {name} runs code it does not depend on: {missing}"


def test_uncovered_sources_finds_a_module_outside_every_dep():
    modules = {"rlhf_core", "rlhf_core.passes.generation", "rlhf_core.ops.paths", "rlhf_core.algos.losses"}
    assert uncovered_sources(["rlhf_core/algos"], modules) == ["rlhf_core/passes/generation.py"]
    assert uncovered_sources(["rlhf_core/algos", "rlhf_core/passes/generation.py"], modules) == []


@pytest.mark.parametrize("path, ignored", [("rlhf_core/engine/__pycache__/loop.cpython-311.pyc", True),
                                           ("rlhf_core/models/.loading.py.swp", True),
                                           ("rlhf_core/engine/loop.py", False)])
def test_dvcignore_keeps_bytecode_and_editor_files_out_of_stage_inputs(path, ignored):
    """DVC itself says which files under a directory dep count: bytecode and editor files must not (an import
    that wrote one re-ran sft, rm and rlhf)."""
    out = subprocess.run([sys.executable, "-m", "dvc", "check-ignore", path], cwd=REPO, capture_output=True,
                         text=True)
    assert (out.returncode == 0) == ignored, out.stdout + out.stderr
