"""``import_architecture``: what a process imports before it forks the RM's workers (``rm.parallel``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import torch

LLAMA_MODULES = ("transformers.models.llama.configuration_llama", "transformers.models.llama.modeling_llama")

PROBE = """
import json, sys
from pathlib import Path
from rlhf_core.models.loading import import_architecture
before = [m in sys.modules for m in {modules!r}]
import_architecture(Path({path!r}))
print(json.dumps({{"before": before, "after": [m in sys.modules for m in {modules!r}]}}))
"""


def probe(path: Path) -> dict:
    """``import_architecture(path)`` in a fresh interpreter: which Llama modules were loaded before and after."""
    out = subprocess.run([sys.executable, "-c", PROBE.format(modules=LLAMA_MODULES, path=str(path))],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_architecture_s_modules_are_imported_and_nothing_is_loaded(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no weights, no tokenizer files
    seen = probe(tmp_path)
    assert seen == {"before": [False, False], "after": [True, True]}


def test_an_unknown_or_absent_architecture_imports_nothing(tmp_path):
    custom = tmp_path / "custom"
    custom.mkdir()
    (custom / "config.json").write_text(json.dumps({"model_type": "not-in-transformers"}))
    assert probe(custom)["after"] == [False, False]
    assert probe(tmp_path / "missing")["after"] == [False, False]


def test_lora_init_depends_on_the_seed_not_on_earlier_draws():
    """LoRA's A matrices are drawn at random: after ``prepare_for_training`` with the same seed they are equal
    whatever the global generator drew before, and differ for another seed (a stage run in-process after other
    work trained from another start: the DPO and GRPO LoRA tests flipped with the test order)."""
    from rlhf_core.config import ComputeConfig, LoraConfig
    from rlhf_core.models.loading import prepare_for_training
    from tests.tiny import tiny_lm

    compute = ComputeConfig(lora=LoraConfig(enabled=True, r=4, target_modules=["q_proj", "v_proj"]))

    def adapters(seed: int, draws_before: int) -> list[torch.Tensor]:
        model = tiny_lm("llama")
        torch.rand(draws_before)
        model = prepare_for_training(model, compute, seed)
        return [p.detach().clone() for n, p in model.named_parameters() if "lora_A" in n]

    first, after_draws, other_seed = adapters(3, 0), adapters(3, 1000), adapters(4, 0)
    assert first and all(torch.equal(a, b) for a, b in zip(first, after_draws, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other_seed, strict=True))
