"""MLflow model registry: register the actor / critic / reward, move aliases, record lineage.

Registered models are ``<prefix>-actor`` (``mlflow.transformers``, loadable
with ``mlflow.transformers.load_model("models:/<prefix>-actor@champion")``),
``<prefix>-critic`` and ``<prefix>-reward`` (pyfunc; ``predict`` returns
scores).  A new version gets alias ``challenger``; passing the gate moves
``champion``.  A model directory whose content hash is already registered is
not registered again (a re-run that skipped training adds no versions).

A registration killed at any point resumes on the next run, never doubles a version, never leaves one
pointing at partial files: the artifacts are uploaded first; the version is created from them in one call
that carries every tag (content hash, lineage); its description, the ``challenger`` alias and
``rlhf.registration=complete`` follow, and a re-run that finds the hash on a version without that tag
finishes those steps instead of registering again.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime
from importlib import metadata
from pathlib import Path

from prefect import get_run_logger, task

import rlhf_core
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.ops.meta import dir_sha256, read_meta
from rlhf_core.ops.model_card import CARD_FILE
from rlhf_core.ops.serving import ScorerModel
from tasks.gates import failing_reasons

DESCRIPTION_LIMIT = 5000  # MLflow's SQL store: model_versions.description is String(5000)

CHALLENGER, CHAMPION = "challenger", "champion"
HASH_TAG = "rlhf.content_hash"
COMPLETE_TAG = "rlhf.registration"  # "complete": the version's description and challenger alias are set


@dataclass
class Registered:
    name: str
    version: str
    new: bool  # False when an identical model was already registered
    model_id: str | None = None  # the MLflow 3 logged model behind a new version

    def as_dict(self) -> dict:
        return {"name": self.name, "version": self.version, "new": self.new, "model_id": self.model_id}


def _client():
    from mlflow import MlflowClient

    return MlflowClient()


def find_version_by_hash(name: str, content_hash: str):
    from mlflow.exceptions import MlflowException

    try:
        found = _client().search_model_versions(f"name='{name}' and tags.`{HASH_TAG}`='{content_hash}'")
    except MlflowException:
        return None
    return max(found, key=lambda v: int(v.version)) if found else None


def alias_version(name: str, alias: str) -> str | None:
    from mlflow.exceptions import MlflowException

    try:
        return _client().get_model_version_by_alias(name, alias).version
    except MlflowException:
        return None


def pip_requirements() -> list[str]:
    """Explicit requirements (MLflow's inference probes for torchvision, which has no CPU build here)."""
    pins = []
    for pkg in ("torch", "transformers", "tokenizers", "safetensors", "accelerate", "mlflow"):
        try:
            pins.append(f"{pkg}=={metadata.version(pkg).split('+')[0]}")
        except metadata.PackageNotFoundError:
            continue
    return pins


def scorer_signature():
    """Reward / critic pyfunc: rows of ``prompt`` + ``response`` (tokenised as in training) or of ``text``; one
    float score per row."""
    from mlflow.models import ModelSignature
    from mlflow.types.schema import ColSpec, Schema

    return ModelSignature(inputs=Schema([ColSpec("string", "prompt", required=False),
                                         ColSpec("string", "response", required=False),
                                         ColSpec("string", "text", required=False)]),
                          outputs=Schema([ColSpec("double")]))


def scorer_input_example():
    import pandas as pd

    return pd.DataFrame({"prompt": ["Human: What is 2 + 3?\n\nAssistant:"] * 2, "response": [" 5", " 7"]})


def _log_model(kind: str, model_dir: Path, name: str):
    import mlflow

    if kind == "actor":
        # Components in memory: MLflow's path-only logging does not understand transformers 5's task table.
        # load_causal_lm merges an adapter saved apart (merge_on_save: false): the policy, not its base weights.
        from transformers import AutoTokenizer

        components = {"model": load_causal_lm(model_dir),
                      "tokenizer": AutoTokenizer.from_pretrained(model_dir)}
        card = model_dir / CARD_FILE
        model_card = None
        if card.is_file():  # MLflow stores it as model_card.md / model_card_data.yaml beside the weights
            from huggingface_hub import ModelCard

            model_card = ModelCard(card.read_text())
        # a tokenizer with a chat template: MLflow's chat task (OpenAI-style messages in, a chat completion out)
        task = "llm/v1/chat" if getattr(components["tokenizer"], "chat_template", None) else "text-generation"
        return mlflow.transformers.log_model(transformers_model=components, task=task, name=kind,
                                             pip_requirements=pip_requirements(), model_card=model_card)
    return mlflow.pyfunc.log_model(name=kind, python_model=ScorerModel(), artifacts={"model": str(model_dir)},
                                   pip_requirements=pip_requirements(),
                                   code_paths=[str(Path(rlhf_core.__file__).parent)],
                                   signature=scorer_signature(), input_example=scorer_input_example())


def register_model_dir(kind: str, model_dir: str | Path, name: str, tags: dict[str, str],
                       run_id: str | None = None) -> Registered:
    """Register ``model_dir`` under ``name`` unless its content is already there.

    The model is logged in ``run_id`` (the stage run that trained it, so "which run made this version" is the
    version's run link), else in the active run, else in a run of its own.
    """
    import mlflow

    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{model_dir}: no model to register as {name}")
    content_hash = dir_sha256(model_dir)
    existing = find_version_by_hash(name, content_hash)
    if existing is not None and existing.tags.get(COMPLETE_TAG) == "complete":
        return Registered(name, existing.version, new=False)
    model_id = None
    if existing is None:  # upload, then one call creates the version with all its tags
        own_run = run_id is not None or mlflow.active_run() is None
        if run_id is not None:
            mlflow.start_run(run_id=run_id, nested=mlflow.active_run() is not None)
        elif own_run:
            mlflow.start_run(run_name=f"register-{kind}")
        try:
            info = _log_model(kind, model_dir, name)
        finally:
            if own_run:
                mlflow.end_run()
        tags = {**tags, HASH_TAG: content_hash, "rlhf.kind": kind}
        existing = mlflow.register_model(info.model_uri, name, tags={k: str(v) for k, v in tags.items()})
        model_id = info.model_id
    _finish_registration(name, existing.version, model_dir)
    return Registered(name, str(existing.version), new=True, model_id=model_id or logged_model_id(existing))


def logged_model_id(version) -> str | None:
    """The MLflow 3 logged model behind a version (``models:/m-...`` source), if any."""
    source = version.source or ""
    return version.model_id or (source.removeprefix("models:/") if source.startswith("models:/m-") else None)


def _finish_registration(name: str, version: str, model_dir: Path) -> None:
    """Description (the model card), ``challenger``, then ``rlhf.registration=complete``; idempotent."""
    client = _client()
    card = model_dir / CARD_FILE
    if card.is_file():  # the model card is the version's description in the registry UI
        client.update_model_version(name, version, description=card_description(card.read_text()))
    client.set_registered_model_alias(name, CHALLENGER, version)
    client.set_model_version_tag(name, version, COMPLETE_TAG, "complete")


def card_description(card: str, limit: int = DESCRIPTION_LIMIT) -> str:
    """The card without its YAML front matter, cut to the registry's description limit (with a note)."""
    if card.startswith("---\n") and "\n---\n" in card[4:]:
        card = card[4:].split("\n---\n", 1)[1].lstrip()
    note = "\n\n(cut: the whole card is README.md in the model's artifacts)"
    return card if len(card) <= limit else card[: limit - len(note)] + note


def model_lineage(model_dir: Path, base_tags: dict[str, str]) -> dict[str, str]:
    """Lineage tags from ``rlhf_meta.json``: inputs' hashes, params hash, git sha, upstream versions."""
    meta = read_meta(model_dir)
    tags = dict(base_tags)
    tags["rlhf.params_hash"] = meta.get("params_hash", tags.get("rlhf.params_hash", ""))
    if meta.get("git_sha"):
        tags["rlhf.git_sha"] = meta["git_sha"]
    for key, value in (meta.get("inputs") or {}).items():
        tags[f"rlhf.input.{key}"] = str(value)
    return tags


def promote(name: str, version: str, reason: str, by: str = "gate") -> str | None:
    """Move ``champion`` to ``version``; the previous champion is recorded in a tag. Returns it."""
    client = _client()
    previous = alias_version(name, CHAMPION)
    client.set_registered_model_alias(name, CHAMPION, version)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    client.set_model_version_tag(name, version, "rlhf.promoted_at", now)
    client.set_model_version_tag(name, version, "rlhf.promoted_by", by)
    client.set_model_version_tag(name, version, "rlhf.promotion_reason", reason)
    client.set_model_version_tag(name, version, "rlhf.previous_champion", previous or "none")
    return previous


def rollback(name: str, reason: str = "manual rollback") -> tuple[str, str]:
    """Move ``champion`` back to the version the current champion replaced. Returns (from, to)."""
    client = _client()
    current = alias_version(name, CHAMPION)
    if current is None:
        raise ValueError(f"{name} has no champion to roll back")
    previous = client.get_model_version(name, current).tags.get("rlhf.previous_champion", "none")
    if previous == "none":
        raise ValueError(f"{name} v{current} is the first champion; there is nothing to roll back to")
    client.set_registered_model_alias(name, CHAMPION, previous)
    now = datetime.now(UTC).isoformat(timespec="seconds")
    client.set_model_version_tag(name, current, "rlhf.rolled_back_at", now)
    client.set_model_version_tag(name, previous, "rlhf.restored_by_rollback_from", current)
    client.set_model_version_tag(name, previous, "rlhf.rollback_reason", reason)
    return current, previous


def record_gate(name: str, version: str, gate: dict) -> None:
    """Tag a version with the gate outcome, the judge that decided it (``rlhf.gate.judge``: the report's judge, or
    ``none (gates.allow_unjudged)``, or ``none``) and, when it failed, the failing gates and their values."""
    client = _client()
    client.set_model_version_tag(name, version, "rlhf.gate", "passed" if gate["passed"] else "failed")
    client.set_model_version_tag(name, version, "rlhf.gate.judge", gate.get("judge") or "none")
    failing = failing_reasons(gate)
    if failing:
        client.set_model_version_tag(name, version, "rlhf.gate.failing", "; ".join(failing))


def log_model_evaluation(model_id: str | None, metrics: dict[str, float], run_id: str | None) -> None:
    """Log held-out ``metrics`` linked to the logged model ``model_id`` (MLflow 3: they show on the model's
    page), in ``run_id`` (the evaluate stage's run) or the active run."""
    import mlflow

    numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float) and not isinstance(v, bool)}
    if model_id and numbers:
        mlflow.log_metrics(numbers, model_id=model_id, run_id=run_id)


@task(name="register-models", task_run_name="register-{kinds}", retries=2, retry_delay_seconds=[5, 30])
def register_models(kinds: list[str], dirs: dict[str, str], prefix: str, lineage: dict[str, str],
                    runs: dict[str, str] | None = None) -> dict:
    """Register each of ``kinds`` (actor / critic / reward) from ``dirs``, each logged in its training run
    ``runs[kind]`` when given; returns name, version, new per kind."""
    logger = get_run_logger()
    out = {}
    for kind in kinds:
        reg = register_model_dir(kind, dirs[kind], f"{prefix}-{kind}", model_lineage(Path(dirs[kind]), lineage),
                                 run_id=(runs or {}).get(kind))
        logger.info("%s: %s v%s (%s)", kind, reg.name, reg.version, "new" if reg.new else "already registered")
        out[kind] = reg.as_dict()
    return out


@task(name="promote", task_run_name="promote-{name}-v{version}")
def promote_task(name: str, version: str, reason: str) -> str | None:
    return promote(name, version, reason)
