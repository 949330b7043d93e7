"""What is missing is said in one line, with exit 65, at once: a mistyped ``-p`` file (never the defaults), a
relative model folder that is not there (never tried as a Hub id), a Hub id that the cache lacks while offline
or the Hub cannot be reached (never a minute of retries and a traceback)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from rlhf_core.config import ParamsFileMissing, load_params
from rlhf_core.model_source import ModelSource, ModelSourceError, check_hub, locate

REPO = Path(__file__).resolve().parents[2]


def rlhf(*args: str, cwd: Path, **env: str) -> tuple[subprocess.CompletedProcess, float]:
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO), **env}, timeout=120)
    return out, time.perf_counter() - start


def error_lines(out: subprocess.CompletedProcess) -> list[str]:
    return [line for line in (out.stdout + out.stderr).splitlines() if line.strip()]


def test_a_missing_params_file_is_an_error_not_the_defaults(tmp_path):
    with pytest.raises(ParamsFileMissing, match="myparms.yaml not found"):
        load_params(tmp_path / "myparms.yaml")
    assert load_params(tmp_path / "params.yaml").data.source == "demo"  # no params.yaml at all: the defaults
    for args in (("stage", "prepare", "-p", "myparms.yaml"), ("params", "check", "-p", "nope.yaml")):
        out, _ = rlhf(*args, cwd=tmp_path)
        assert out.returncode == 65, out
        assert error_lines(out) == [f"error: params file {args[-1]} not found"]
    assert not (tmp_path / "data").exists()  # nothing was prepared


def test_a_relative_model_folder_that_is_not_there_is_not_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    with pytest.raises(ModelSourceError, match="models/mine: no such model folder"):
        locate("models/mine")
    assert locate("org/name").kind == "hub"  # no local folder `org`: a Hub id
    out, _ = rlhf("stage", "prepare", "-S", "model.name_or_path=models/mine", cwd=tmp_path)
    assert out.returncode == 65 and len(error_lines(out)) == 1, out
    assert "models/mine: no such model folder" in out.stderr


def test_a_hub_id_offline_fails_in_one_line_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    out, seconds = rlhf("stage", "prepare", "-S", "model.name_or_path=org/not-cached", cwd=tmp_path,
                        HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(tmp_path / "hub"))
    assert out.returncode == 65 and len(error_lines(out)) == 1, out
    assert "org/not-cached" in out.stderr and "HF_HUB_OFFLINE" in out.stderr
    assert seconds < 30  # the interpreter's imports; from_pretrained's retries took 46 s


def test_an_unreachable_hub_fails_in_one_line_at_once(tmp_path):
    """Online mode, but the Hub endpoint refuses (a closed port on loopback, as no network does)."""
    assert locate("org/not-cached").kind == "hub"
    env = {"HF_HUB_OFFLINE": "0", "HF_ENDPOINT": "http://127.0.0.1:9", "HF_HUB_CACHE": str(tmp_path / "hub")}
    code = ("import sys; from rlhf_core.model_source import check_hub, locate\n"
            "try:\n    check_hub(locate('org/not-cached'), timeout=2)\n"
            "except ValueError as err:\n    print(err); sys.exit(65)\n")
    start = time.perf_counter()
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(REPO), **env})
    assert out.returncode == 65, out
    assert "the Hub cannot be reached" in out.stdout and time.perf_counter() - start < 30
    check_hub(ModelSource("mine", str(tmp_path), None, "hf_folder"))  # a local source never asks the Hub
