"""The flow runner's Role covers every request the flow makes: derived from what ``submit.py`` sends.

Each path of ``tasks/k8s/submit.py`` (a Job, a multi-node Job and its Service, a JobSet, the cancel hook) runs
against ``FakeCluster`` (the real kubernetes client, its HTTP answered); every request becomes (API group,
resource, verb) as the API server authorises it, and ``k8s/base/rbac.yaml``'s ``rlhf-flow-runner`` Role must
allow each. A kind added to submit.py without its rule fails here, not hours into a flow on a cluster.
"""

from __future__ import annotations

import re
from pathlib import Path

import yaml

from tasks.k8s import submit
from tests.tasks.k8s.test_k8s_jobs import (
    COMPLETE,
    JS_COMPLETED,
    JS_RUNNING,
    NS,
    RUNNING,
    FakeCluster,
    FakeHTTPResponse,
    _listed,
    apis,
    pod,
)

REPO = Path(__file__).resolve().parents[3]
PATH = re.compile(r"^/apis?/(?:(?P<group>[^/]+)/)?(?P<version>v[^/]+)/namespaces/[^/]+/(?P<resource>[^/]+)"
                  r"(?:/(?P<name>[^/]+)(?:/(?P<sub>[^/]+))?)?$")


def authorised_as(method: str, path: str) -> tuple[str, str, str]:
    """(group, resource[/subresource], verb) of one request, as the API server's authorizer reads it."""
    m = PATH.match(path)
    assert m, path
    group = m["group"] if path.startswith("/apis/") else ""
    resource = m["resource"] + (f"/{m['sub']}" if m["sub"] else "")
    verb = {"POST": "create", "DELETE": "delete", "PUT": "update", "PATCH": "patch"}.get(method)
    return group, resource, verb or ("get" if m["name"] else "list")


def flow_runner_rules() -> set[tuple[str, str, str]]:
    docs = list(yaml.safe_load_all((REPO / "k8s" / "base" / "rbac.yaml").read_text()))
    (role,) = [d for d in docs if d and d["kind"] == "Role" and d["metadata"]["name"] == "rlhf-flow-runner"]
    return {(g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"]
            for v in rule["verbs"]}


def every_request() -> set[tuple[str, str, str]]:
    clusters = []
    one = FakeCluster(job_states=[COMPLETE], pods=[pod("rlhf-sft-x-a")], logs=["2025-01-01T00:00:02Z a\n"])
    two = FakeCluster(job_states=[COMPLETE], pods=[pod("rlhf-rm-y-0-a", index="0")], logs=["2025-01-01T00:00:02Z"])
    js = FakeCluster(job_states=[RUNNING], jobset_states=[JS_RUNNING, JS_COMPLETED],
                     pods=[pod("rlhf-rlhf-z-node-0-0-a", index="0")], logs=["2025-01-01T00:00:02Z b\n"])
    for cluster, kw in ((one, {}), (two, {"nnodes": 2}), (js, {"nnodes": 2, "multinode": "jobset"})):
        batch, core = apis(cluster)
        submit.submit_stage_job("rlhf", name="rlhf-rlhf-z", batch_api=batch, core_api=core, poll_s=0,
                                log=lambda _: None, **kw)
        clusters.append(cluster)
    cancel = FakeCluster(job_states=[RUNNING], jobset_states=[JS_RUNNING], listed_jobs=[_listed("rlhf-rm-b", RUNNING)],
                         listed_jobsets=[{"metadata": {"name": "rlhf-rlhf-d", "namespace": NS}, "status": JS_RUNNING}])
    submit.delete_flow_run_jobs("run-1", NS, batch_api=apis(cancel)[0], log=lambda _: None)
    clusters.append(cancel)
    return {authorised_as(r.method, r.path) for c in clusters for r in c.requests}


def test_the_flow_runner_role_allows_every_request_the_flow_makes():
    made = every_request()
    assert ("jobset.x-k8s.io", "jobsets", "create") in made and ("batch", "jobs", "delete") in made  # all paths ran
    missing = sorted(made - flow_runner_rules())
    assert not missing, f"rlhf-flow-runner lacks {missing}"


class ForbiddenJobSets(FakeCluster):
    """A cluster whose RBAC refuses JobSets (an older Role): 403 on every JobSet request."""

    def answer(self, req):
        if "/jobsets" in req.path:
            return FakeHTTPResponse(403, {"kind": "Status", "code": 403, "reason": "Forbidden",
                                          "message": "jobsets.jobset.x-k8s.io is forbidden"})
        return super().answer(req)


def test_cancel_deletes_the_jobs_even_when_jobsets_are_forbidden():
    cluster = ForbiddenJobSets(job_states=[RUNNING], jobset_states=[JS_RUNNING],
                               listed_jobs=[_listed("rlhf-rm-b2", RUNNING)])
    lines: list[str] = []
    assert submit.delete_flow_run_jobs("run-1", NS, batch_api=apis(cluster)[0], log=lines.append) == ["rlhf-rm-b2"]
    assert any("could not list jobsets" in ln and "403" in ln for ln in lines), lines
