"""MLflow wiring for stage entry points (the only place trainers' ``log`` meets MLflow).

Contract (docs/architecture.md): one experiment per project, one parent run per pipeline
run, one child run per stage.  A stage started by the flow finds its parent
in ``RLHF_PARENT_RUN_ID``; started by hand it makes a standalone run.  With no
``MLFLOW_TRACKING_URI`` the embedded default is used: SQLite in the workspace
folder with a local artifact root.  ``RLHF_TRACKING=off`` disables tracking.
Only rank 0 of a distributed job logs.
"""

from __future__ import annotations

import base64
import csv
import importlib.util
import json
import logging
import os
import sys
import urllib.error
import urllib.request
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

import yaml

from rlhf_core.config import ConfigError, Params
from rlhf_core.ops import paths
from rlhf_core.ops.meta import code_lineage

ENV_PARENT = "RLHF_PARENT_RUN_ID"
ENV_TRACKING = "RLHF_TRACKING"
ENV_CHAMPION = "RLHF_CHAMPION_URI"  # the registered champion actor the evaluate stage compares against
LogFn = Callable[[dict, int], None]

# which prepared files each stage consumes (logged with mlflow.log_input)
STAGE_INPUTS = {
    "sft": ("sft", "eval_sft"),
    "rm": ("pairs", "eval_pairs"),
    "rlhf": ("prompts",),
    "evaluate": ("eval_prompts",),
}
# which params sections each stage reads (logged as run params)
STAGE_SECTIONS = {
    "prepare": ("project", "data", "model"),
    "sft": ("project", "model", "compute", "sft"),
    "feedback": ("project", "feedback"),
    "rm": ("project", "model", "compute", "rm", "feedback"),
    "rlhf": ("project", "model", "compute", "rlhf", "feedback"),
    "evaluate": ("project", "eval", "gates"),
}


class TrackingUnavailable(RuntimeError):
    """MLflow cannot be reached; raised before any training starts."""


class TrackingRefused(ConfigError):
    """MLflow answered but refused the credentials (or their absence): a retry cannot help, the config must change."""


def tracking_enabled() -> bool:
    return os.environ.get(ENV_TRACKING, "on").lower() not in ("off", "0", "false") and is_rank_zero()


def is_rank_zero() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def default_tracking_uri(params: Params, root: str | Path = ".") -> str:
    db = (Path(root) / params.project.workspace / "mlflow.db").resolve()
    return f"sqlite:///{db}"


def tracking_uri(params: Params, root: str | Path = ".") -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or default_tracking_uri(params, root)


def experiment_name(params: Params) -> str:
    return params.tracking.experiment or params.project.name


def registry_prefix(params: Params) -> str:
    return params.tracking.registry_prefix or params.project.name


def check_reachable(uri: str, timeout_s: float = 30.0) -> None:
    """Fail fast with a clear message when an HTTP tracking server does not answer. A refused connection fails at
    once; ``timeout_s`` bounds only a server that accepts and stays silent, and is long enough for a busy one
    (a 5 s bound failed a healthy server's /health on a loaded 2-core CI machine)."""
    if not uri.startswith(("http://", "https://")):
        return
    url = uri.rstrip("/") + "/health"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 (scheme checked above)
            if resp.status >= 500:
                raise TrackingUnavailable(f"MLflow at {uri} answered {resp.status} on /health")
    except (urllib.error.URLError, OSError) as err:
        raise TrackingUnavailable(
            f"MLflow tracking server {uri} is unreachable ({getattr(err, 'reason', err)}); start it, fix "
            f"MLFLOW_TRACKING_URI, or unset it to use the embedded SQLite store") from None
    check_credentials(uri)


def check_credentials(uri: str, timeout_s: float = 60.0) -> None:
    """One authenticated read (``experiments/search``) with the client's credentials (``MLFLOW_TRACKING_USERNAME``
    / ``_PASSWORD``, or ``MLFLOW_TRACKING_TOKEN``): a 401/403 is :class:`TrackingRefused` before any training,
    naming the user but never the password. (The server has answered /health already; a password hash check
    on a busy server can take seconds, hence the longer timeout.)"""
    user, password = os.environ.get("MLFLOW_TRACKING_USERNAME"), os.environ.get("MLFLOW_TRACKING_PASSWORD")
    token = os.environ.get("MLFLOW_TRACKING_TOKEN")
    req = urllib.request.Request(uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1")
    if user and password:
        req.add_header("Authorization", "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode())
    elif token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        urllib.request.urlopen(req, timeout=timeout_s).close()  # noqa: S310 (http(s) only, checked by the caller)
    except urllib.error.HTTPError as err:
        if err.code in (401, 403):
            who = (f"user {user!r} (MLFLOW_TRACKING_USERNAME) was not accepted" if user and password else
                   "a token (MLFLOW_TRACKING_TOKEN) was not accepted" if token else
                   "it needs credentials: set MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD")
            raise TrackingRefused(f"MLflow at {uri} refused the request ({err.code}): {who}") from None
        if err.code >= 500:
            raise TrackingUnavailable(f"MLflow at {uri} answered {err.code}") from None
    except (urllib.error.URLError, OSError) as err:
        raise TrackingUnavailable(f"MLflow tracking server {uri} is unreachable ({getattr(err, 'reason', err)})"
                                  ) from None


def _answers(uri: str) -> bool:
    try:
        check_reachable(uri)
        return True
    except TrackingUnavailable:
        return False


# The MLflow 3 UI opens an experiment in the view its kind names; without the tag it may guess the GenAI view
# (traces, judges). Ours trains models: runs, metrics and models are what a user should land on.
EXPERIMENT_KIND_TAG = "mlflow.experimentKind"
EXPERIMENT_KIND = "custom_model_development"


def importable(module: str) -> bool:
    """Whether ``module`` is installed here (the training core lacks the orchestration extra's packages). Found,
    not imported: Prefect reads its settings once, when first imported (``flows/local_pipeline.py``)."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def setup(params: Params, root: str | Path = ".") -> str:
    """Point mlflow at the tracking URI, make sure the project's experiment exists and make it the active one
    (runs started later, e.g. by ``rlhf register``, land there); returns its id."""
    import mlflow

    root = Path(root)
    uri = tracking_uri(params, root)
    check_reachable(uri)
    if uri.startswith("sqlite:///") and not importable("sqlalchemy"):
        raise TrackingRefused(f"no MLFLOW_TRACKING_URI, and the local store {uri} needs the full mlflow, which "
                              "this install lacks (the training core has mlflow-skinny, a tracking client): set "
                              "MLFLOW_TRACKING_URI to a server, RLHF_TRACKING=off, or install "
                              "rlhf-ops[orchestration]")
    if uri.startswith("sqlite:///"):
        (root / params.project.workspace).mkdir(parents=True, exist_ok=True)
    mlflow.set_tracking_uri(uri)
    name = experiment_name(params)
    exp = mlflow.get_experiment_by_name(name)
    if exp is not None:
        experiment_id = exp.experiment_id
    else:
        artifact_location = None
        if not uri.startswith(("http://", "https://", "databricks")):
            artifact_location = (root / params.project.workspace / "mlartifacts").resolve().as_uri()
        experiment_id = mlflow.create_experiment(name, artifact_location=artifact_location)
    if exp is None or EXPERIMENT_KIND_TAG not in exp.tags:  # a kind the user chose in the UI stays
        mlflow.MlflowClient().set_experiment_tag(experiment_id, EXPERIMENT_KIND_TAG, EXPERIMENT_KIND)
    mlflow.set_experiment(experiment_id=experiment_id)
    return experiment_id


def flatten(d: dict, prefix: str = "") -> dict[str, str]:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(flatten(v, f"{key}."))
        else:
            out[key] = json.dumps(v) if isinstance(v, list | dict) else str(v)
    return out


def dvc_out_hash(out: str, root: str | Path = ".") -> str | None:
    """The md5 DVC recorded for an output in ``dvc.lock`` (e.g. ``data/prepared``), if any."""
    lock = Path(root) / "dvc.lock"
    if not lock.exists():
        return None
    stages = (yaml.safe_load(lock.read_text()) or {}).get("stages", {})
    for stage in stages.values():
        for item in stage.get("outs", []):
            if item.get("path") == out:
                return item.get("md5")
    return None


def lineage_tags(params: Params, stage: str, root: str | Path = ".") -> dict[str, str]:
    tags = {"rlhf.stage": stage, "rlhf.params_hash": params.section_hash(*STAGE_SECTIONS.get(stage, ())),
            **{f"rlhf.{k}": v for k, v in code_lineage(root).items()}}
    data_hash = dvc_out_hash(str(paths.PREPARED), root)
    if data_hash:
        tags["rlhf.dvc.data_prepared"] = data_hash
    return tags


def _log_inputs(stage: str, root: Path) -> None:
    import mlflow
    import pandas as pd

    manifest_path = root / paths.MANIFEST
    manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
    dvc_hash = dvc_out_hash(str(paths.PREPARED), root)
    for name in STAGE_INPUTS.get(stage, ()):
        path = root / paths.PREPARED / f"{name}.parquet"
        if not path.exists():
            continue
        digest = dvc_hash or manifest.get("hashes", {}).get(path.name, "")[:32] or None
        with warnings.catch_warnings():  # MLflow registers its local-file source twice and warns that the
            warnings.filterwarnings("ignore", message="The specified dataset source can be interpreted")  # path
            ds = mlflow.data.from_pandas(pd.read_parquet(path), source=str(path), name=name, digest=digest)
        mlflow.log_input(ds, context="eval" if name.startswith("eval_") else "training")


def render_plot(csv_path: Path, png_path: Path) -> Path:
    """A PNG line plot of a ``step,<metric>...`` CSV (one line per metric column)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as fh:
        rows = list(csv.DictReader(fh))
    fig, ax = plt.subplots(figsize=(6, 3.5))
    if rows:
        xkey = next(iter(rows[0]))
        for col in list(rows[0])[1:]:
            pts = [(float(r[xkey]), float(r[col])) for r in rows if r.get(col) not in (None, "")]
            ax.plot([p[0] for p in pts], [p[1] for p in pts], label=col)
        ax.set_xlabel(xkey)
        ax.legend()
    ax.set_title(csv_path.stem)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(png_path, dpi=100)
    plt.close(fig)
    return png_path


def _log_outputs(stage: str, root: Path) -> None:
    import mlflow

    metrics_file = root / paths.METRICS / f"{stage}.json"
    if metrics_file.exists():
        mlflow.log_artifact(str(metrics_file), artifact_path="metrics")
        values = flatten(json.loads(metrics_file.read_text()))
        numeric = {}
        for k, v in values.items():
            try:
                numeric[f"final.{k}"] = float(v)
            except ValueError:
                continue
        if numeric:
            mlflow.log_metrics(numeric)
    for csv_path in sorted((root / paths.PLOTS).glob(f"{stage}_*.csv")):
        png = render_plot(csv_path, csv_path.with_suffix(".png"))
        mlflow.log_artifact(str(csv_path), artifact_path="plots")
        mlflow.log_artifact(str(png), artifact_path="plots")


def log_table(table: dict[str, list], artifact_file: str) -> None:
    """``mlflow.log_table`` into the active stage run (rank 0); nothing when tracking is off or no run is active.

    Tables are evidence, not training: an MLflow failure is warned about and never raised.
    """
    if not tracking_enabled() or not is_rank_zero():
        return
    import mlflow

    if mlflow.active_run() is None:
        return
    try:
        mlflow.log_table(data=table, artifact_file=artifact_file)
    except Exception as err:  # any transport or server error
        print(f"warning: MLflow could not log table {artifact_file} ({type(err).__name__}: {err})", file=sys.stderr)


class _Guard:
    """Runs MLflow calls until the first failure, then warns once and stops: an outage never kills training."""

    def __init__(self, stage: str):
        self.stage, self.ok = stage, True

    def __call__(self, fn, *args, **kwargs):
        if not self.ok:
            return None
        try:
            return fn(*args, **kwargs)
        except Exception as err:  # any transport or server error
            self.ok = False
            print(f"warning: MLflow failed during stage {self.stage!r} ({type(err).__name__}: {err}); "
                  "tracking stops for this stage, its outputs stay in the workspace; "
                  "run `rlhf register` once MLflow is back", file=sys.stderr)
            return None


# INFO lines every stage would print and nobody acts on (system metrics start/stop, first-use DB creation,
# "validating input example")
QUIET_LOGGERS = ("mlflow.system_metrics", "mlflow.store.db.utils", "mlflow.pyfunc")


def quiet_library_logs() -> None:
    """Raise MLflow's chattiest loggers to WARNING and, when stderr is not a terminal (Prefect, Kubernetes, CI),
    turn off Hugging Face progress bars, which arrive there as raw carriage-return lines."""
    for name in QUIET_LOGGERS:
        logging.getLogger(name).setLevel(logging.WARNING)
    if not sys.stderr.isatty():
        import huggingface_hub.utils
        import transformers.utils.logging

        os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")
        transformers.utils.logging.disable_progress_bar()
        huggingface_hub.utils.disable_progress_bars()


@contextmanager
def stage_run(stage: str, params: Params, root: str | Path = ".") -> Iterator[LogFn]:
    """A child MLflow run for ``stage``; yields ``log(metrics, step)``. No-op when tracking is off.

    MLflow must answer at the start (else :class:`TrackingUnavailable`); a failure later only
    stops tracking for the stage (warned once), it never fails the training.
    """
    root = Path(root)
    if not tracking_enabled():
        yield lambda metrics, step: None
        return
    import mlflow

    quiet_library_logs()
    experiment_id = setup(params, root)
    parent = os.environ.get(ENV_PARENT)
    mlflow.start_run(experiment_id=experiment_id, run_name=stage, parent_run_id=parent, nested=bool(parent),
                     tags=lineage_tags(params, stage, root), log_system_metrics=params.tracking.system_metrics)
    guard = _Guard(stage)
    dump = params.model_dump(mode="json")
    guard(mlflow.log_params, flatten({k: dump[k] for k in STAGE_SECTIONS.get(stage, ())}))
    guard(_log_inputs, stage, root)

    def log(metrics: dict, step: int) -> None:
        clean = {k: float(v) for k, v in metrics.items() if isinstance(v, int | float)}
        if clean:
            guard(mlflow.log_metrics, clean, step=step)

    status = "FAILED"
    try:
        yield log
        guard(_log_outputs, stage, root)
        status = "FINISHED"
    finally:
        if guard.ok or _answers(mlflow.get_tracking_uri()):  # (back after an outage:) close the run properly
            guard.ok = True
            guard(mlflow.end_run, status=status)
        else:  # still down (already warned): one quick try, here and at exit, instead of minutes of retries
            os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"
            with suppress(Exception):
                mlflow.end_run(status=status)
