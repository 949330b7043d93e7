"""Where each stage reads and writes, relative to the repository (DVC) root.

These paths are the contract between stages, ``dvc.yaml``, the Kubernetes Jobs
and the flows; change them here and in ``dvc.yaml`` together.
"""

from __future__ import annotations

from pathlib import Path

PREPARED = Path("data/prepared")
MANIFEST = PREPARED / "manifest.json"
BASE_MODEL = Path("models/base")  # tokenizer (+ tiny config for the demo) written by prepare
SFT_MODEL = Path("models/sft")
RM_MODEL = Path("models/rm")
JUDGE_MODEL = Path("models/judge")  # a reward model trained on the held-out pairs (rm.judge): the gate's judge
ACTOR_MODEL = Path("models/actor")
CRITIC_MODEL = Path("models/critic")
CHECKPOINTS = Path("checkpoints")  # resumable training state per stage
METRICS = Path("metrics")  # per-stage metrics JSON (DVC metrics, not cached)
PLOTS = Path("plots")  # per-stage training curves (DVC plots)
REPORTS = Path("reports")
ADAPTER_DIR = "adapter"  # inside a saved model's folder: its unmerged LoRA adapter (compute.lora.merge_on_save: false)
FEEDBACK = Path("data/feedback")  # feedback rounds: round_<n>/ (pairs, manifest, the round's starting models)


def round_dir(n: int) -> Path:
    """``data/feedback/round_<n>``: what round ``n`` collected and started from."""
    return FEEDBACK / f"round_{n}"


def start_dir(root: Path, round_: int, role: str) -> Path:
    """``data/feedback/round_<n>/start/<role>``: the actor or RM round ``n`` starts from (the feedback stage
    keeps them there; the rm and rlhf stages of the round start from them)."""
    return root / round_dir(round_) / "start" / role

PHASES = ("sft", "pairs", "prompts")


def prepared_file(phase: str, eval_split: bool = False) -> Path:
    """``data/prepared/sft.parquet`` or ``data/prepared/eval_sft.parquet``."""
    if phase not in PHASES:
        raise ValueError(f"unknown phase {phase!r}; expected one of {PHASES}")
    return PREPARED / f"{'eval_' if eval_split else ''}{phase}.parquet"
