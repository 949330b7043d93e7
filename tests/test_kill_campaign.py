"""The kill campaign at a small size: SFT on the tiny demo SIGKILLed at random moments, re-run: every re-run
finishes with the uninterrupted run's weights, loses at most the steps since the last checkpoint, and no kill
leaves a half-written model directory."""

from __future__ import annotations

import pytest

from tests.test_sft import TINY, prepared  # noqa: F401  (the tiny demo's prepared workspace)

pytestmark = pytest.mark.slow


def test_sft_killed_at_random_moments_resumes_to_identical_weights(prepared, tmp_path):  # noqa: F811
    import yaml

    from rlhf_core.bench.kill_campaign import main, summarise
    from rlhf_core.config import apply_overrides

    (prepared / "params.yaml").write_text(yaml.safe_dump(apply_overrides({}, TINY)))
    rows = main(["--workspace", str(prepared), "--stage", "sft", "--kills", "3", "--seed", "3",
                 "--out", str(tmp_path / "kills.jsonl"), "-S", "sft.max_steps=12", "-S", "sft.save_every=4",
                 "-S", "eval.max_prompts=8"])
    assert len(rows) == 3 and any(r["killed"] for r in rows)
    for r in rows:
        assert r["rerun_rc"] == 0 and r["identical_weights"] and r["steps"] == 12, r
        assert r["model_after_kill"] in ("absent", "whole") and r["model_after_rerun"] == "whole", r
        assert 0 <= r["steps_lost"] <= 4, r  # at most the steps since the last checkpoint (save_every)
    assert "| sft | " in summarise(rows)
