"""``rlhf deploy`` without ``--name``: the deployments of prefect.yaml whose work pool exists on the server.

``prefect deploy --all`` stops at the first deployment whose work pool is missing ("references work pool
'rlhf-process' which does not exist"), so a cluster with only the ``rlhf-kubernetes`` pool got none of its
deployments. Here each deployment is deployed when its pool exists and named as skipped, with the command that
creates its pool, when it does not; none deployable is an error listing those commands.
"""

from __future__ import annotations

from pathlib import Path

import yaml

POOL_COMMANDS = {
    "rlhf-process": "prefect work-pool create rlhf-process --type process",
    "rlhf-kubernetes": "prefect work-pool create rlhf-kubernetes --type kubernetes "
                       "--base-job-template k8s/prefect/base-job-template.json",
}


def deployment_pools(prefect_yaml: Path) -> dict[str, str]:
    """Each deployment's name -> the work pool it names, in file order."""
    deployments = (yaml.safe_load(prefect_yaml.read_text()) or {}).get("deployments") or []
    return {d["name"]: (d.get("work_pool") or {}).get("name", "") for d in deployments}


def split_by_pool(pools_of: dict[str, str], existing: set[str]) -> tuple[list[str], dict[str, str]]:
    """(the deployments to deploy, the skipped ones -> their missing pool)."""
    ready = [name for name, pool in pools_of.items() if pool in existing]
    return ready, {name: pool for name, pool in pools_of.items() if pool not in existing}


def create_command(pool: str) -> str:
    return POOL_COMMANDS.get(pool, f"prefect work-pool create {pool} --type <type>")


def server_pools() -> set[str]:
    from prefect.client.orchestration import get_client

    with get_client(sync_client=True) as client:
        return {pool.name for pool in client.read_work_pools()}
