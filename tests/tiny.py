"""The tiny demo the SFT and RM tests train on: operands 0-9, no de-duplication (so correct demonstrations are
the majority), a 2-layer 64-wide Llama; seconds per stage on one CPU thread."""

from __future__ import annotations

from rlhf_core.config import apply_overrides, validate

TINY_DEMO = [
    "data.demo.n_rows=3000", "data.demo.max_operand=9", "data.dedupe=false", "data.max_prompt_len=16",
    "data.max_response_len=4", "compute.num_threads=1",
    "model.tiny.hidden_size=64", "model.tiny.intermediate_size=128", "model.tiny.num_hidden_layers=2",
    "model.tiny.num_attention_heads=2", "model.tiny.num_key_value_heads=2", "model.tiny.max_position_embeddings=32",
    "sft.micro_batch_size=32", "sft.lr=0.003", "sft.warmup_steps=3", "sft.log_every=5",
    "eval.batch_size=48", "eval.max_new_tokens=4",
]


def tiny_params(base: list[str], *overrides: str):
    """Validated Params from ``base`` then ``overrides`` (later keys win)."""
    return validate(apply_overrides({}, [*base, *overrides]), origin="<test>")


def reseal_prepared(root, *names: str) -> None:
    """Record the sha256 of prepared files a test edited on purpose in ``data/prepared/manifest.json`` (stages
    refuse a prepared file whose hash differs from the one prepare recorded)."""
    import json
    from pathlib import Path

    from rlhf_core.meta import file_sha256

    manifest = Path(root) / "data/prepared/manifest.json"
    data = json.loads(manifest.read_text())
    for name in names:
        data["hashes"][name] = file_sha256(manifest.parent / name)
    manifest.write_text(json.dumps(data))
