"""``import_architecture``: what a process imports before it forks the RM's workers (``rm.parallel``)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

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
