from pathlib import Path

import pytest
import yaml

from rlhf_core.config import ConfigError, Params, apply_overrides, load_params, parse_override

REPO = Path(__file__).resolve().parents[3]


def test_repo_params_yaml_is_valid_and_demo():
    params = load_params(REPO / "params.yaml")
    assert params.data.source == "demo"
    assert params.model.name_or_path is None


def test_gpu_profile_is_valid():
    params = load_params(REPO / "configs" / "gpu.yaml")
    assert params.model.name_or_path and params.compute.zero_stage == 2 and params.compute.precision == "bf16"


def test_unknown_key_names_the_path(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"sft": {"learning_rate": 1e-3}}))
    with pytest.raises(ConfigError) as err:
        load_params(f)
    assert "sft.learning_rate: unknown key" in str(err.value)
    assert str(f) in str(err.value)


def test_wrong_type_and_range_name_the_path(tmp_path):
    f = tmp_path / "p.yaml"
    f.write_text(yaml.safe_dump({"data": {"max_prompt_len": "long", "eval_fraction": 1.5}}))
    with pytest.raises(ConfigError) as err:
        load_params(f)
    msg = str(err.value)
    assert "data.max_prompt_len:" in msg and "integer" in msg
    assert "data.eval_fraction: Input should be less than 1" in msg


def test_cross_field_validation():
    with pytest.raises(ConfigError, match="model.tiny: Value error, hidden_size must be divisible"):
        load_params("no-such-dir/params.yaml", ["model.tiny.hidden_size=100", "model.tiny.num_attention_heads=3"])
    with pytest.raises(ConfigError, match="give exactly one of `path` or `hf_id`"):
        load_params("no-such-dir/params.yaml", ["data.sources=[{format: auto}]"])


def test_override_parses_yaml_values():
    assert parse_override("data.max_prompt_len=128") == (["data", "max_prompt_len"], 128)
    assert parse_override("rlhf.ppo.dual_clip=null") == (["rlhf", "ppo", "dual_clip"], None)
    assert parse_override("data.data_split=[1,1,1]") == (["data", "data_split"], [1, 1, 1])
    assert apply_overrides({"a": {"b": 1}}, ["a.c=x", "d.e=2.5"]) == {"a": {"b": 1, "c": "x"}, "d": {"e": 2.5}}


def test_override_errors():
    with pytest.raises(ConfigError, match="expected KEY.PATH=VALUE"):
        parse_override("data.max_prompt_len")
    with pytest.raises(ConfigError, match="'b' is not a section"):
        apply_overrides({"a": {"b": 1}}, ["a.b.c=2"])
    with pytest.raises(ConfigError, match="data.max_prompt_len: Input should be greater than or equal to 1"):
        load_params("no-such-dir/params.yaml", ["data.max_prompt_len=0"])


def test_missing_params_yaml_means_defaults_and_bad_yaml_is_named(tmp_path):
    assert load_params(tmp_path / "params.yaml") == Params()  # any other missing name: test_cli_missing_inputs
    bad = tmp_path / "bad.yaml"
    bad.write_text("data: [unclosed")
    with pytest.raises(ConfigError, match=f"{bad}: not valid YAML"):
        load_params(bad)


def test_section_hash_tracks_only_named_sections():
    a, b = Params(), load_params("no-such-dir/params.yaml", ["sft.lr=0.5"])
    assert a.section_hash("data") == b.section_hash("data")
    assert a.section_hash("sft") != b.section_hash("sft")
    assert a.section_hash() != b.section_hash()
