"""Prefect artifacts that lead from a flow run to MLflow: the parent run, each stage's run, the registered versions.

``mlflow_links`` is pure: ``(key, title, url)`` per target, with the MLflow UI's URLs: under ``RLHF_MLFLOW_UI_URL``
when it is set (the URL a browser opens: an ingress, a port-forward; the tracking URI a pod uses, e.g.
``http://rlhf-mlflow:5000``, resolves only inside the cluster), else the tracking URI when it is an HTTP server
(the UI is served there). With the embedded SQLite store there is no server to link to; the
flow then publishes one markdown artifact with the run ids and the ``mlflow ui`` command that shows them.
"""

from __future__ import annotations

import logging
import os

UI_URL_ENV = "RLHF_MLFLOW_UI_URL"


def ui_base(tracking_uri: str, ui_url: str | None = None) -> str | None:
    """The MLflow UI root: ``ui_url`` when given, else an HTTP(S) tracking server's, else None."""
    if ui_url:
        return ui_url.rstrip("/")
    return tracking_uri.rstrip("/") if tracking_uri.startswith(("http://", "https://")) else None


def mlflow_links(tracking_uri: str, experiment_id: str, parent_run_id: str, stage_runs: dict[str, str],
                 registered: dict[str, dict], ui_url: str | None = None) -> list[tuple[str, str, str]]:
    """``[(artifact key, title, url)]``: the parent run, ``stage_runs`` (stage -> run id), ``registered`` (kind ->
    {"name", "version"}). Empty without a UI URL or an HTTP server."""
    base = ui_base(tracking_uri, ui_url)
    if base is None:
        return []
    run = f"{base}/#/experiments/{experiment_id}/runs/"
    links = [("mlflow-pipeline-run", "MLflow: the pipeline's parent run", run + parent_run_id)]
    links += [(f"mlflow-run-{stage}", f"MLflow: the {stage} stage's run", run + run_id)
              for stage, run_id in stage_runs.items()]
    links += [(f"mlflow-model-{kind}", f"MLflow registry: {reg['name']} v{reg['version']}",
               f"{base}/#/models/{reg['name']}/versions/{reg['version']}") for kind, reg in registered.items()]
    return links


def local_runs_markdown(tracking_uri: str, parent_run_id: str, stage_runs: dict[str, str],
                        registered: dict[str, dict]) -> str:
    """Where to look when MLflow is the embedded store: the ids, and the command that serves its UI."""
    lines = ["# MLflow (embedded store)", "", f"`mlflow ui --backend-store-uri {tracking_uri}` then open",
             "http://127.0.0.1:5000.", "", "| what | id |", "|---|---|", f"| pipeline run | `{parent_run_id}` |"]
    lines += [f"| {stage} run | `{run_id}` |" for stage, run_id in stage_runs.items()]
    lines += [f"| {reg['name']} | v{reg['version']} |" for reg in registered.values()]
    return "\n".join(lines) + "\n"


def stage_run_ids(experiment_id: str, parent_run_id: str) -> dict[str, str]:
    """The newest child run per stage (tag ``rlhf.stage``) under the pipeline's parent run."""
    import mlflow

    runs = mlflow.search_runs(experiment_ids=[experiment_id], output_format="list",
                              filter_string=f"tags.mlflow.parentRunId = '{parent_run_id}'",
                              order_by=["attributes.start_time ASC"])
    return {r.data.tags["rlhf.stage"]: r.info.run_id for r in runs if "rlhf.stage" in r.data.tags}


def publish_links(tracking_uri: str, experiment_id: str, parent_run_id: str, registered: dict[str, dict]) -> None:
    """Prefect link artifacts (HTTP server) or one markdown artifact (embedded store), from inside a flow run.
    A convenience: a failure here (MLflow gone at the very end) is logged, not raised."""
    from prefect.artifacts import create_link_artifact, create_markdown_artifact

    try:
        stages = stage_run_ids(experiment_id, parent_run_id)
    except Exception as err:  # the flow's outcome does not depend on its links
        logging.getLogger("rlhf.flow").warning("no MLflow links for this flow run: %s", err)
        return
    links = mlflow_links(tracking_uri, experiment_id, parent_run_id, stages, registered,
                         os.environ.get(UI_URL_ENV) or None)
    for key, title, url in links:
        create_link_artifact(link=url, link_text=title, key=key, description=title)
    if not links:
        create_markdown_artifact(local_runs_markdown(tracking_uri, parent_run_id, stages, registered),
                                 key="mlflow-runs", description="MLflow runs and versions of this flow run")
