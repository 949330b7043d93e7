"""``rlhf export``: a registered model version as a plain Hugging Face folder, and its push to the Hub.

The version is ``name@alias`` (``champion`` by default) or ``name`` version N, in the registry the workspace
tracks to (``MLFLOW_TRACKING_URI``, else the embedded ``.rlhf/mlflow.db``). Its artifacts are downloaded and
``out`` gets what ``from_pretrained`` reads:

- an actor (logged with ``mlflow.transformers``): ``config.json``, ``generation_config.json``,
  ``model.safetensors`` (``load_causal_lm`` then ``save_causal_lm``: an adapter kept apart is merged), the
  tokenizer with its chat template;
- a reward model or critic (a pyfunc around the stage's folder): the ``*ForSequenceClassification`` folder
  (``load_value_model`` then ``save_value_model``: an adapter kept apart is merged, the tokenizer's pad id in the
  config) and its tokenizer. An ensemble or a DPO implicit reward is not one transformers model: refused;
- ``README.md``: the registered model card under Hub front matter, with the version's lineage
  (``model_card.render_export_card``);
- ``rlhf_meta.json``: the trained folder's meta (the reward model's; an actor's registry keeps none) and a
  ``registry`` entry: name, version, aliases, run id, source, the version's tags.

A name, alias or version that is not there is an :class:`ExportError` naming it, and what is there.
"""

from __future__ import annotations

import json
import os
import tempfile
from datetime import UTC, datetime
from pathlib import Path

import yaml

from rlhf_core.models.implicit_reward import is_implicit
from rlhf_core.models.loading import load_causal_lm, save_causal_lm, save_value_model
from rlhf_core.models.reward_format import load_value_model
from rlhf_core.models.scorer import ENSEMBLE_FILE
from rlhf_core.models.value_head import ValueHeadModel
from rlhf_core.ops.meta import META_FILE
from rlhf_core.ops.model_card import render_export_card

CHAMPION = "champion"
KINDS = ("actor", "critic", "reward")


class ExportError(ValueError):
    """The version cannot be exported or pushed; the message names the model, alias, version or repo."""


def _client(uri: str):
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri, registry_uri=uri)


def find_version(uri: str, name: str, alias: str | None = CHAMPION, version: str | None = None):
    """The model version ``version`` of ``name``, else the one ``alias`` names."""
    from mlflow.exceptions import MlflowException

    if uri.startswith("sqlite:///") and not Path(uri.removeprefix("sqlite:///")).is_file():
        raise ExportError(
            f"no MLflow registry at {uri}: nothing was registered from this workspace (run "
            "`rlhf run` here first, or set MLFLOW_TRACKING_URI to the registry's server)"
        )
    client = _client(uri)
    try:
        model = client.get_registered_model(name)
    except MlflowException:
        names = sorted(m.name for m in client.search_registered_models(max_results=100))
        raise ExportError(f"no registered model {name!r} in {uri} (registered: {', '.join(names) or 'none'})") from None
    if version is not None:
        try:
            return client.get_model_version(name, str(version))
        except MlflowException:
            have = sorted(int(v.version) for v in client.search_model_versions(f"name='{name}'"))
            raise ExportError(
                f"{name} has no version {version} (versions: {', '.join(map(str, have)) or 'none'})"
            ) from None
    try:
        return client.get_model_version_by_alias(name, alias)
    except MlflowException:
        named = ", ".join(f"{a} -> v{v}" for a, v in sorted(_aliases(model).items())) or "none"
        raise ExportError(
            f"{name} has no alias {alias!r} (aliases: {named}); give --version N, or move it with `rlhf promote N`"
        ) from None


def _aliases(model) -> dict[str, str]:
    aliases = model.aliases or {}
    return dict(aliases) if isinstance(aliases, dict) else {a.alias: a.version for a in aliases}


def _kind(name: str, version) -> str:
    kind = version.tags.get("rlhf.kind") or name.rsplit("-", 1)[-1]
    if kind not in KINDS:
        raise ExportError(
            f"{name} v{version.version}: not an rlhf-ops actor, critic or reward model (tag "
            f"rlhf.kind {version.tags.get('rlhf.kind')!r})"
        )
    return kind


def _write_actor(local: Path, out: Path) -> str | None:
    """Weights and tokenizer of an ``mlflow.transformers`` actor; returns the registered model card, if any."""
    from transformers import AutoTokenizer

    flavor = (yaml.safe_load((local / "MLmodel").read_text()).get("flavors") or {}).get("transformers")
    if flavor is None:
        raise ExportError(f"{local}: the registered actor is not an mlflow.transformers model")
    if "peft_adaptor" in flavor:  # MLflow's own LoRA layout: base weights named by Hub id, the adapter beside
        import mlflow

        model = mlflow.transformers.load_model(str(local), return_type="components")["model"]
    else:
        model = load_causal_lm(local / flavor.get("model_binary", "model"))
    save_causal_lm(model, out)  # a peft model is merged on save
    AutoTokenizer.from_pretrained(local / "components" / "tokenizer").save_pretrained(out)
    card = local / "model_card.md"
    return card.read_text() if card.is_file() else None


def _write_scorer(local: Path, out: Path, label: str) -> tuple[str | None, dict]:
    """The reward model / critic folder a pyfunc version holds, as a ``*ForSequenceClassification`` folder;
    returns its model card and ``rlhf_meta.json``."""
    from transformers import AutoTokenizer


    flavor = yaml.safe_load((local / "MLmodel").read_text())["flavors"]["python_function"]
    folder = local / flavor["artifacts"]["model"]["path"]
    if (folder / ENSEMBLE_FILE).is_file() or is_implicit(folder):
        what = "an ensemble of reward models" if (folder / ENSEMBLE_FILE).is_file() else "DPO's implicit reward"
        raise ExportError(
            f"{label} is {what}, not one transformers model; its files: `mlflow artifacts "
            f"download -u models:/{label.replace(' v', '/')}`"
        )
    tok = AutoTokenizer.from_pretrained(folder)
    save_value_model(load_value_model(ValueHeadModel, folder, require_head=True), out, pad_token_id=tok.pad_token_id)
    tok.save_pretrained(out)
    card = folder / "README.md"
    meta = folder / META_FILE
    return (card.read_text() if card.is_file() else None), (json.loads(meta.read_text()) if meta.is_file() else {})


def _run_params(uri: str, run_id: str | None) -> dict[str, str]:
    from mlflow.exceptions import MlflowException

    if not run_id:
        return {}
    try:
        return _client(uri).get_run(run_id).data.params
    except MlflowException:  # a deleted run: the card says less
        return {}


def export_version(
    uri: str, name: str, out: Path, alias: str | None = CHAMPION, version: str | None = None, params=None
) -> dict:
    """Write the version (see the module doc) to ``out``; returns its ``registry`` entry (name, version, kind,
    aliases, run_id, source, tags)."""
    import mlflow


    found = find_version(uri, name, alias, version)
    kind = _kind(name, found)
    label = f"{name} v{found.version}"
    mlflow.set_tracking_uri(uri)
    mlflow.set_registry_uri(uri)
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="rlhf-export-") as tmp:
        local = Path(mlflow.artifacts.download_artifacts(artifact_uri=f"models:/{name}/{found.version}", dst_path=tmp))
        if kind == "actor":
            card, meta = _write_actor(local, out), {}
        else:
            card, meta = _write_scorer(local, out, label)
    run = _run_params(uri, found.run_id)
    aliases = sorted(a for a, v in _aliases(_client(uri).get_registered_model(name)).items() if v == found.version)
    registry = {
        "name": name,
        "version": str(found.version),
        "kind": kind,
        "aliases": aliases,
        "run_id": found.run_id,
        "source": found.source,
        "tracking_uri": uri,
        "tags": dict(found.tags),
        "exported_at": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    base = run.get("model.name_or_path") or (params.model.name_or_path if params is not None else None)
    (out / "README.md").write_text(
        render_export_card(
            card,
            {
                **registry,
                "algorithm": run.get("rlhf.algorithm") if kind != "reward" else None,
                "base_model": None if base in (None, "None") else base,
            },
        )
    )
    (out / META_FILE).write_text(json.dumps({**meta, "registry": registry}, indent=2) + "\n")
    return registry


def check_hub_access(repo_id: str) -> str:
    """The token a push to ``repo_id`` would use; ``ExportError`` when offline or none is set (no network used)."""
    from huggingface_hub import constants, get_token

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ExportError(f"--push-to-hub {repo_id!r}: expected a Hub repo id, owner/name")
    if constants.HF_HUB_OFFLINE:
        raise ExportError(f"cannot push to {repo_id}: HF_HUB_OFFLINE is set (unset it on a machine with network)")
    token = get_token()
    if not token:
        raise ExportError(
            f"cannot push to {repo_id}: no Hugging Face token (run `hf auth login` or set HF_TOKEN "
            "to a token with write access)"
        )
    return token


def push_folder(folder: Path, repo_id: str, private: bool = False) -> str:
    """``HfApi.create_repo`` (if new) and ``upload_folder``: the exported folder as one commit; returns its URL."""
    from huggingface_hub import HfApi

    api = HfApi(token=check_hub_access(repo_id))
    try:
        api.create_repo(repo_id, repo_type="model", private=private, exist_ok=True)
        info = api.upload_folder(
            folder_path=str(folder), repo_id=repo_id, repo_type="model", commit_message="rlhf export"
        )
    except Exception as err:  # any transport or Hub error (httpx, HfHubHTTPError): one line, not a traceback
        first = (str(err).strip().splitlines() or [type(err).__name__])[0]
        raise ExportError(f"push to {repo_id} failed ({type(err).__name__}): {first}") from None
    return getattr(info, "commit_url", None) or f"https://huggingface.co/{repo_id}"
