"""Runs on one workspace take turns through a Prefect global concurrency limit (flows/workspace_slot.py), on a
real Prefect server, in separate processes as separate deployments' runs would be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from flows.workspace_slot import limit_name
from tests.servers import prefect_server

REPO = Path(__file__).resolve().parents[2]
HOLD = ("import json, sys, time; from flows.workspace_slot import workspace_slot\n"
        "with workspace_slot(sys.argv[1]) as name:\n"
        "    t0 = time.time(); time.sleep(4); print(json.dumps({'name': name, 'in': t0, 'out': time.time()}))\n")


def _holders(api: str, server_env: dict, roots: list[Path]) -> list[dict]:
    env = {**os.environ, **server_env, "PREFECT_API_URL": api, "PYTHONPATH": str(REPO)}
    procs = [subprocess.Popen([sys.executable, "-c", HOLD, str(r)], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r in roots]
    out = []
    for p in procs:
        stdout, stderr = p.communicate(timeout=180)
        assert p.returncode == 0, stderr[-3000:]
        out.append(json.loads(stdout.strip().splitlines()[-1]))
    return out


def _overlap(a: dict, b: dict) -> bool:
    return a["in"] < b["out"] and b["in"] < a["out"]


def test_runs_on_one_workspace_take_turns_and_other_workspaces_do_not_wait(tmp_path):
    one, other = tmp_path / "one", tmp_path / "other"
    one.mkdir()
    other.mkdir()
    assert limit_name(one) == limit_name(one / ".." / "one") != limit_name(other)  # the resolved directory
    with prefect_server(tmp_path) as (api, server_env):
        a, b, c = _holders(api, server_env, [one, one, other])
        assert a["name"] == b["name"] == limit_name(one) != c["name"]
        assert not _overlap(a, b), (a, b)  # the second waited for the first's slot
        assert _overlap(a, c) or _overlap(b, c), (a, b, c)  # another workspace did not wait

        from prefect.client.orchestration import get_client
        from prefect.client.schemas.actions import GlobalConcurrencyLimitUpdate
        from prefect.settings import PREFECT_API_URL, temporary_settings

        with temporary_settings({PREFECT_API_URL: api}), get_client(sync_client=True) as client:
            made = client.read_global_concurrency_limit_by_name(limit_name(one))
            assert made.limit == 1 and made.active_slots == 0  # created with one slot; released
            client.update_global_concurrency_limit(limit_name(one), GlobalConcurrencyLimitUpdate(limit=2))  # by hand
        a, b = _holders(api, server_env, [one, one])
        assert _overlap(a, b), (a, b)  # left as the operator set it, not recreated
