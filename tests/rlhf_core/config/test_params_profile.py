"""``rlhf run -p PROFILE``: the profile is written over params.yaml with every key filled in, because DVC refuses
a stage whose declared params are missing from params.yaml (a profile lists only what it changes)."""

from __future__ import annotations

import pytest
import yaml

from flows.params_file import use_profile
from rlhf_core.config import ConfigError, load_params
from tests.conftest import REPO


def test_profile_is_written_with_every_key(tmp_path):
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs/p.yaml").write_text("project: {name: mine}\nsft: {epochs: 3}\n")
    (tmp_path / "params.yaml").write_text("project: {name: demo}\n")
    assert use_profile(tmp_path, "configs/p.yaml")
    written = yaml.safe_load((tmp_path / "params.yaml").read_text())
    assert written["project"]["name"] == "mine" and written["sft"]["epochs"] == 3
    assert written["feedback"]["round"] == 0 and written["data"]["on_malformed"] == "error"  # defaults filled in
    assert load_params(tmp_path / "params.yaml") == load_params(tmp_path / "configs/p.yaml")
    assert not use_profile(tmp_path, "configs/p.yaml")  # unchanged: not rewritten
    assert not use_profile(tmp_path, "params.yaml")  # the params file itself
    (tmp_path / "params.yaml").unlink()
    assert not use_profile(tmp_path, "params.yaml")  # missing: every default, as load_params reads it


def test_every_shipped_profile_declares_what_dvc_reads(tmp_path):
    """Each stage's params in dvc.yaml exist in params.yaml after `-p` with each shipped profile."""
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    for profile in sorted((REPO / "configs").glob("*.yaml")):
        (tmp_path / "configs").mkdir(exist_ok=True)
        (tmp_path / "configs" / profile.name).write_text(profile.read_text())
        use_profile(tmp_path, f"configs/{profile.name}")
        written = yaml.safe_load((tmp_path / "params.yaml").read_text())
        for name, stage in stages.items():
            for key in stage["params"]:
                node = written
                for part in key.split("."):
                    assert part in node, f"{profile.name}: stage {name} reads {key}, missing after -p"
                    node = node[part]


def test_bad_profiles_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml"):
        use_profile(tmp_path, "nope.yaml")
    (tmp_path / "bad.yaml").write_text("sft: {epochs: -1}\n")
    with pytest.raises(ConfigError, match="sft.epochs"):
        use_profile(tmp_path, "bad.yaml")
    assert not (tmp_path / "params.yaml").exists()
