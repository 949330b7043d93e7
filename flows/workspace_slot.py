"""One pipeline run per project directory across every deployment: a Prefect global concurrency limit.

A deployment's ``concurrency_limit`` (prefect.yaml) serialises the runs of that deployment only: the nightly
and the weekly deployment, or a manual run beside them, could overlap on one workspace, and two ``dvc repro``
there fail on DVC's lock. So every flow run holds the one slot of the global concurrency limit
``rlhf-workspace-<hash of the resolved project directory>`` for its whole run, and a second run waits for it
(the Prefect UI lists it under Concurrency). Runs on one directory share the limit (on Kubernetes: flow-run pods
mounting one workspace PVC at one path); other directories get their own. It is created with limit 1 on first
use; an operator may raise it or deactivate it, and it is not recreated. A run that dies without releasing its
slot holds it until the lease expires (``LEASE_S``; the holder renews it while it runs).

Under a DVC remote (``k8s.dvc_remote``) the run also holds ``rlhf-dvc-remote-<hash of the URL>``: two pipelines
in different workspaces (two clusters, a laptop and a cluster) on one remote would otherwise publish their
``dvc.lock`` over each other's (``rlhf_core/ops/dvc_remote.py`` refuses an upload over a lock that changed, this
keeps them from getting there). Both slots are taken in one request, so two runs cannot each hold one.
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency
from prefect.exceptions import ObjectAlreadyExists, ObjectNotFound

LEASE_S = 300.0
LIMIT = 1


def limit_name(root: str | Path) -> str:
    return "rlhf-workspace-" + hashlib.sha256(str(Path(root).resolve()).encode()).hexdigest()[:12]


def ensure_limit(name: str) -> None:
    """Create the limit (``LIMIT`` slots) unless it exists; an existing one is left as an operator set it."""
    with get_client(sync_client=True) as client:
        try:
            client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            with contextlib.suppress(ObjectAlreadyExists):  # another run created it meanwhile
                client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=LIMIT))


def remote_limit_name(url: str) -> str:
    return "rlhf-dvc-remote-" + hashlib.sha256(url.rstrip("/").encode()).hexdigest()[:12]


@contextlib.contextmanager
def workspace_slot(root: str | Path, remote: str | None = None) -> Iterator[list[str]]:
    """Hold the project directory's slot, and the DVC remote's when there is one, for the block (waiting for
    them); yields the limits' names."""
    names = [limit_name(root)] + ([remote_limit_name(remote)] if remote else [])
    for name in names:
        ensure_limit(name)
    with concurrency(names, occupy=1, strict=True, lease_duration=LEASE_S):
        yield names
