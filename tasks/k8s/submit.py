"""Submission: create a stage's Job (and its headless Service), follow rank 0's logs, wait for the end and
explain a failure (the Job's reason, the pod's termination reason such as ``OOMKilled``, the last log lines).
The ``kubernetes`` client is imported only here, when a Job is submitted."""

from __future__ import annotations

import copy
import logging
import os
import secrets
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from rlhf_core.stages import STAGE_TIMEOUT_S
from tasks.k8s.names import COMPLETION_INDEX_ANNOTATION, FLOW_RUN_LABEL, NAMESPACE, default_job_name
from tasks.k8s.options import StageJobOptions
from tasks.k8s.render import render_stage_resources
from tasks.k8s.render_operators import render_jobset

JOBSET_API = ("jobset.x-k8s.io", "v1alpha2", "jobsets")  # group, version, plural

_log = logging.getLogger(__name__)


class StageJobFailed(RuntimeError):
    """A stage Job failed; carries the Job's and the pod's reasons (e.g. ``OOMKilled``) and the log tail."""

    def __init__(self, message: str, *, stage: str = "", job_name: str = "", reason: str | None = None,
                 pod_name: str | None = None, pod_reason: str | None = None, exit_code: int | None = None,
                 log_tail: list[str] | None = None):
        super().__init__(message)
        self.stage, self.job_name, self.reason = stage, job_name, reason
        self.pod_name, self.pod_reason, self.exit_code = pod_name, pod_reason, exit_code
        self.log_tail = log_tail or []

    def __reduce__(self):  # picklable with its attributes (Prefect persists task exceptions)
        return self.__class__, self.args, self.__dict__


class StageJobTimeout(StageJobFailed):
    """The Job did not finish within ``timeout_s``."""


def _ts_key(ts: str) -> tuple[str, int]:
    """Order RFC 3339 timestamps with variable-length fractions (kubelet: ``2024-05-01T10:00:00.12345Z``)."""
    base, _, frac = ts.rstrip("Z").partition(".")
    return base, int((frac + "000000000")[:9]) if frac else 0


class LogFollower:
    """Incremental pod logs by polling with ``timestamps=True``; lines already emitted are skipped."""

    def __init__(self, core_api, namespace: str, container: str, emit: Callable[[str], None]):
        self.core, self.namespace, self.container, self.emit = core_api, namespace, container, emit
        self.last: dict[str, tuple[tuple[str, int], int]] = {}  # pod -> (last timestamp, lines seen at it)
        self.fetched_at: dict[str, float] = {}
        self.tail: deque[str] = deque(maxlen=30)

    def poll(self, pod: str) -> None:
        from kubernetes.client.exceptions import ApiException

        kw: dict[str, Any] = {"container": self.container, "timestamps": True}
        if pod in self.fetched_at:
            kw["since_seconds"] = int(time.monotonic() - self.fetched_at[pod]) + 10
        try:
            text = self.core.read_namespaced_pod_log(pod, self.namespace, **kw)
        except ApiException as err:  # container not started yet (400) or pod gone (404)
            if err.status in (400, 404):
                return
            raise
        self.fetched_at[pod] = time.monotonic()
        last_key, seen_at_last = self.last.get(pod, (("", -1), 0))
        count_at: dict[tuple[str, int], int] = {}
        for raw in (text or "").splitlines():
            ts, _, line = raw.partition(" ")
            key = _ts_key(ts)
            count_at[key] = count_at.get(key, 0) + 1
            if key < last_key or (key == last_key and count_at[key] <= seen_at_last):
                continue
            last_key, seen_at_last = key, count_at[key]
            self.tail.append(line)
            self.emit(line)
        self.last[pod] = (last_key, seen_at_last)


def _job_condition(job) -> tuple[str | None, str | None, str | None]:
    """('Complete'|'Failed'|None, reason, message) from a V1Job's terminal conditions."""
    for cond in (job.status.conditions if job.status and job.status.conditions else []):
        if cond.type in ("Complete", "Failed") and cond.status == "True":
            return cond.type, cond.reason, cond.message
    return None, None, None


def _jobset_condition(obj: dict) -> tuple[str | None, str | None, str | None]:
    """('Complete'|'Failed'|None, reason, message) from a JobSet's terminal conditions (``Completed``, ``Failed``)."""
    for cond in (obj.get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Completed", "Failed") and cond.get("status") == "True":
            return ("Complete" if cond["type"] == "Completed" else "Failed"), cond.get("reason"), cond.get("message")
    return None, None, None


def _pod_failure(pod, container: str) -> tuple[str | None, int | None, str | None]:
    """(reason, exit code, message) of the pod's failure: the container's termination, else the pod's reason."""
    status = pod.status
    for cs in (status.container_statuses or []) if status else []:
        if cs.name != container:
            continue
        for state in (cs.state, cs.last_state):
            term = state.terminated if state else None
            if term and (term.exit_code or 0) != 0:
                return term.reason or "Error", term.exit_code, term.message
    if status and status.reason:
        return status.reason, None, status.message
    return None, None, None


def flow_job_owner(namespace: str, environ: dict | None = None) -> dict | None:
    """An ``ownerReference`` to the flow-run pod's own Job (``RLHF_FLOW_JOB_*``, set by the work pool's template
    through the downward API) when the stage runs in the same namespace (owners cannot cross namespaces):
    deleting the flow-run Job then deletes the stage Job or JobSet with it. None outside such a pod."""
    env = os.environ if environ is None else environ
    name, uid = env.get("RLHF_FLOW_JOB_NAME"), env.get("RLHF_FLOW_JOB_UID")
    if not (name and uid) or env.get("RLHF_FLOW_JOB_NAMESPACE") != namespace:
        return None
    return {"apiVersion": "batch/v1", "kind": "Job", "name": name, "uid": uid, "blockOwnerDeletion": False}


def _load_apis(batch_api, core_api):
    from kubernetes import client, config

    if batch_api is None or core_api is None:
        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
    return batch_api or client.BatchV1Api(), core_api or client.CoreV1Api()


def submit_stage_job(
    stage: str,
    *,
    namespace: str = NAMESPACE,
    name: str | None = None,
    env: dict[str, str] | None = None,
    seed_params: bool = False,
    batch_api=None,
    core_api=None,
    custom_api=None,
    timeout_s: float = STAGE_TIMEOUT_S["kubernetes"],
    poll_s: float = 10.0,
    delete_on_timeout: bool = True,
    log: Callable[[str], None] | None = None,
    **render_kw,
) -> dict:
    """Create the stage's Job (and headless Service when multi-node; a JobSet with ``multinode="jobset"``),
    stream rank 0's logs, wait for the end.

    ``render_kw`` are further ``StageJobOptions`` (image, gpus, nnodes, ...); an unknown one is an error.
    Runs against the workspace's ``params.yaml`` as the calling flow left it (``seed_params=False``).
    Returns ``{"stage", "job_name", "namespace", "status": "succeeded", "pods", "seconds"}``; raises
    :class:`StageJobFailed` naming the Job's reason and the pod's termination reason (e.g. ``OOMKilled``)
    or :class:`StageJobTimeout` (after deleting the Job, so a retry does not race it). Interrupted while
    waiting (task timeout, flow cancellation, Ctrl-C, a lost API connection) it deletes the Job and re-raises.
    """
    from kubernetes import client

    emit = log or _log.info
    name = name or f"{default_job_name(stage)}-{secrets.token_hex(3)}"
    opts = StageJobOptions.from_dict(stage, {"namespace": namespace, "name": name, "env": env,
                                             "seed_params": seed_params, **render_kw})
    batch_api, core_api = _load_apis(batch_api, core_api)
    start = time.monotonic()
    owner = flow_job_owner(namespace)
    if opts.as_jobset:  # the JobSet controller creates the Jobs, the pods and their headless Service
        custom_api = custom_api or client.CustomObjectsApi(batch_api.api_client)
        group, version, plural = JOBSET_API
        manifest = render_jobset(opts)
        if owner:
            manifest["metadata"]["ownerReferences"] = [owner]
        custom_api.create_namespaced_custom_object(group, version, namespace, plural, manifest)
        emit(f"created jobset {namespace}/{name} for stage {stage!r}")
        pod_template = manifest["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]
        watched = _Watched("jobset", lambda: _jobset_condition(
            custom_api.get_namespaced_custom_object(group, version, namespace, plural, name)),
            lambda: custom_api.delete_namespaced_custom_object(group, version, namespace, plural, name,
                                                               propagation_policy="Background"))
    else:
        resources = render_stage_resources(opts)
        manifest = resources[-1]
        if owner:
            manifest["metadata"]["ownerReferences"] = [owner]
        created = batch_api.create_namespaced_job(namespace, client.V1Job.from_dict(manifest))
        emit(f"created job {namespace}/{name} for stage {stage!r}")
        if len(resources) == 2:  # headless Service, garbage-collected with the Job
            svc = copy.deepcopy(resources[0])
            svc["metadata"]["ownerReferences"] = [{"apiVersion": "batch/v1", "kind": "Job", "name": name,
                                                   "uid": created.metadata.uid}]
            core_api.create_namespaced_service(namespace, client.V1Service.from_dict(svc))
        pod_template = manifest["spec"]["template"]
        watched = _Watched("job", lambda: _job_condition(batch_api.read_namespaced_job(name, namespace)),
                           lambda: batch_api.delete_namespaced_job(name, namespace, propagation_policy="Background"))
    container = pod_template["spec"]["containers"][0]["name"]
    try:
        return _wait_for_job(stage, name, namespace, container, watched, core_api, emit, start, timeout_s, poll_s,
                             delete_on_timeout)
    except StageJobFailed:
        raise
    except BaseException:  # task timeout, flow cancellation, Ctrl-C, a lost API connection: stop what we started
        _delete_quietly(watched, name, namespace, emit)
        raise


@dataclass(frozen=True)
class _Watched:
    """What the wait loop polls and, when interrupted, deletes: a Job or a JobSet."""

    kind: str
    condition: Callable[[], tuple[str | None, str | None, str | None]]
    delete: Callable[[], Any]


def _delete_quietly(watched: _Watched, name: str, namespace: str, emit: Callable[[str], None]) -> None:
    try:
        watched.delete()
        emit(f"deleted {watched.kind} {namespace}/{name} (the task was interrupted)")
    except Exception as err:  # the original interruption is what the caller must see
        emit(f"could not delete {watched.kind} {namespace}/{name}: {err}")


def delete_flow_run_jobs(flow_run_id: str, namespace: str = NAMESPACE, batch_api=None,
                         log: Callable[[str], None] | None = None, custom_api=None) -> list[str]:
    """Delete the stage Jobs and JobSets a flow run created (label ``rlhf-ops/flow-run=<id>``), pods included.

    For the flow's cancellation and crash hooks: a flow run that stops leaves no GPU Job behind. A JobSet's
    own Jobs go with it (deleting one of them alone would make the JobSet recreate it). A cluster without the
    JobSet API (404) has none to delete. Returns the deleted objects' names.
    """
    from kubernetes.client.exceptions import ApiException

    emit = log or _log.info
    if batch_api is None:
        batch_api, _ = _load_apis(None, None)
    selector = f"{FLOW_RUN_LABEL}={flow_run_id}"
    deleted = []
    if custom_api is None:
        from kubernetes import client

        custom_api = client.CustomObjectsApi(batch_api.api_client)
    group, version, plural = JOBSET_API
    try:
        jobsets = custom_api.list_namespaced_custom_object(group, version, namespace, plural,
                                                           label_selector=selector).get("items") or []
    except ApiException as err:  # 404: no JobSet API; 403: a Role without jobsets. The Jobs still go.
        if err.status not in (403, 404):
            raise
        if err.status == 403:
            emit(f"could not list jobsets of flow run {flow_run_id} in {namespace} (403 {err.reason}): "
                 "deleting its Jobs; the Role needs jobset.x-k8s.io/jobsets (k8s/base/rbac.yaml)")
        jobsets = []
    for js in jobsets:
        if _jobset_condition(js)[0] is None:
            js_name = js["metadata"]["name"]
            custom_api.delete_namespaced_custom_object(group, version, namespace, plural, js_name,
                                                       propagation_policy="Background")
            emit(f"deleted jobset {namespace}/{js_name} of flow run {flow_run_id}")
            deleted.append(js_name)
    jobs = batch_api.list_namespaced_job(namespace, label_selector=selector).items or []
    for job in jobs:
        if _job_condition(job)[0] in ("Complete", "Failed"):
            continue  # finished: its TTL removes it; its pods keep the logs until then
        if any(ref.kind == "JobSet" for ref in job.metadata.owner_references or []):
            continue  # goes with its JobSet
        batch_api.delete_namespaced_job(job.metadata.name, namespace, propagation_policy="Background")
        emit(f"deleted job {namespace}/{job.metadata.name} of flow run {flow_run_id}")
        deleted.append(job.metadata.name)
    return deleted


def _wait_for_job(stage: str, name: str, namespace: str, container: str, watched: _Watched, core_api,
                  emit: Callable[[str], None], start: float, timeout_s: float, poll_s: float,
                  delete_on_timeout: bool) -> dict:
    follower = LogFollower(core_api, namespace, container, emit)
    selector = f"rlhf-ops/job={name}"
    pods: list = []
    while True:
        state, reason, message = watched.condition()
        pods = sorted(core_api.list_namespaced_pod(namespace, label_selector=selector).items or [],
                      key=lambda p: (p.metadata.creation_timestamp is None, p.metadata.creation_timestamp))
        lead = [p for p in pods if (p.metadata.annotations or {}).get(COMPLETION_INDEX_ANNOTATION, "0") == "0"]
        if lead:
            follower.poll(lead[-1].metadata.name)  # rank 0 logs; the newest pod after a retry
        if state == "Complete":
            seconds = round(time.monotonic() - start, 1)
            emit(f"{watched.kind} {name} complete in {seconds}s")
            return {"stage": stage, "job_name": name, "namespace": namespace, "status": "succeeded",
                    "pods": [p.metadata.name for p in pods], "seconds": seconds}
        if state == "Failed":
            pod, pod_reason, exit_code, pod_message = None, None, None, None
            for candidate in pods:  # oldest first: the last failure wins
                found = _pod_failure(candidate, container)
                if found[0] or pod is None:
                    pod = candidate
                    if found[0]:
                        pod_reason, exit_code, pod_message = found
            text = f"stage {stage!r} failed: {watched.kind} {namespace}/{name}: {reason or 'Failed'}"
            text += f" ({message})" if message else ""
            if pod is not None:
                text += f"; pod {pod.metadata.name}: {pod_reason or 'unknown'}"
                text += f" (exit code {exit_code})" if exit_code is not None else ""
                text += f": {pod_message}" if pod_message else ""
            if follower.tail:
                text += "\nlast log lines:\n" + "\n".join(follower.tail)
            raise StageJobFailed(text, stage=stage, job_name=name, reason=reason,
                                 pod_name=pod.metadata.name if pod is not None else None, pod_reason=pod_reason,
                                 exit_code=exit_code, log_tail=list(follower.tail))
        if time.monotonic() - start > timeout_s:
            if delete_on_timeout:
                watched.delete()
            raise StageJobTimeout(f"stage {stage!r}: {watched.kind} {namespace}/{name} still running after {timeout_s}s"
                                  + (" (deleted)" if delete_on_timeout else ""), stage=stage, job_name=name,
                                  reason="Timeout", log_tail=list(follower.tail))
        time.sleep(poll_s)
