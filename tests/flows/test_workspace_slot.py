"""Runs on one workspace take turns through a Prefect global concurrency limit (flows/workspace_slot.py), on a
real Prefect server, in separate processes as separate deployments' runs would be."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from flows.workspace_slot import limit_name, remote_limit_name
from tests.servers import prefect_server

REPO = Path(__file__).resolve().parents[2]
HOLD = ("import json, sys, time; from flows.workspace_slot import workspace_slot\n"
        "with workspace_slot(sys.argv[1], sys.argv[2] or None) as names:\n"
        "    t0 = time.time(); time.sleep(4); print(json.dumps({'names': names, 'in': t0, 'out': time.time()}))\n")


def _holders(api: str, server_env: dict, roots: list[Path], remotes: list[str] | None = None) -> list[dict]:
    env = {**os.environ, **server_env, "PREFECT_API_URL": api, "PYTHONPATH": str(REPO)}
    remotes = remotes or [""] * len(roots)
    procs = [subprocess.Popen([sys.executable, "-c", HOLD, str(r), remote], env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for r, remote in zip(roots, remotes, strict=True)]
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
        assert a["names"] == b["names"] == [limit_name(one)] != c["names"]
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
        a, b, c = _holders(api, server_env, [one, other, tmp_path], ["s3://ml/rlhf", "s3://ml/rlhf/", "s3://ml/x"])
        assert a["names"] == [limit_name(one), remote_limit_name("s3://ml/rlhf")] and \
            b["names"][1] == remote_limit_name("s3://ml/rlhf")
        assert not _overlap(a, b), (a, b)  # two workspaces on one remote took turns
        assert _overlap(a, c) or _overlap(b, c), (a, b, c)  # another remote did not wait
