"""Shared fixtures: small params, a scratch workspace, and helpers to write data files."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from rlhf_core.config import apply_overrides, validate

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("RLHF_TRACKING", "off")  # tests that check MLflow turn it on

REPO = Path(__file__).resolve().parents[1]


def make_params(*overrides: str, base: dict | None = None):
    """Validated Params from a base dict plus ``key.path=value`` overrides (small demo by default)."""
    raw = base if base is not None else {"data": {"demo": {"n_rows": 400}}}
    return validate(apply_overrides(json.loads(json.dumps(raw)), list(overrides)), origin="<test>")


@pytest.fixture
def params_factory():
    return make_params


@pytest.fixture
def workspace(tmp_path, monkeypatch):
    """A scratch working directory (stages write relative to the cwd)."""
    monkeypatch.chdir(tmp_path)
    return tmp_path


def write_jsonl(path: Path, rows: list, raw_lines: list[bytes] | None = None) -> Path:
    """Write rows as JSON lines; ``raw_lines`` are appended verbatim (for malformed-input tests)."""
    with open(path, "wb") as fh:
        for row in rows:
            fh.write(json.dumps(row).encode() + b"\n")
        for line in raw_lines or []:
            fh.write(line + b"\n")
    return path


@pytest.fixture(scope="session")
def tiny_chat_tokenizer_dir(tmp_path_factory) -> str:
    """A small BPE tokenizer with the demo chat template, trained on the arithmetic task's phrasings and saved to
    a folder (what ``model.tokenizer`` may name): the arithmetic task without any model weights."""
    from rlhf_core.data.tokenizer import train_demo_tokenizer
    from rlhf_core.rewards.arithmetic import PHRASINGS

    corpus = [t.format(a=a, b=b) for op in PHRASINGS for t in PHRASINGS[op] for a, b in ((12, 345), (67, 89))]
    tok = train_demo_tokenizer(corpus + ["Human: Assistant: 0123456789"] * 3, vocab_size=300)
    path = tmp_path_factory.mktemp("chat_tok")
    tok.save_pretrained(path)
    return str(path)
