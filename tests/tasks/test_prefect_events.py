"""A failed gate reaches a person: the flow's ``rlhf.gate.failed`` event, through the automation that
``rlhf automations`` creates on a real Prefect server, posts a notification to a (local) webhook."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path

import pytest

from tasks.events import GATE_FAILED, GATE_PASSED, gate_event
from tests.servers import prefect_server

REPO = Path(__file__).resolve().parents[2]

GATE = {"passed": False, "checks": [
    {"name": "judge_gain_vs_reference", "value": -0.12, "threshold": 0.01, "op": ">=", "passed": False,
     "note": "reward hacking suspected: proxy +3.1, judge -0.12"},
    {"name": "kl_to_reference", "value": 0.4, "threshold": 5.0, "op": "<=", "passed": True, "note": ""}]}
REPORT = {"judge_gain_vs_reference": -0.12, "proxy_gain_vs_reference": 3.1, "judge_source": "checker",
          "candidate": {"accuracy": 0.45, "kl_to_reference": 0.4, "reward_mean": 5.0}}


def test_gate_event_names_the_version_and_the_failing_gates():
    event, resource, payload = gate_event("demo-actor", "7", GATE, REPORT)
    assert event == GATE_FAILED and resource["prefect.resource.id"] == "mlflow.model-version.demo-actor.7"
    assert payload["failing"] == ["judge_gain_vs_reference=-0.12 (needs >= 0.01; reward hacking suspected: "
                                  "proxy +3.1, judge -0.12)"]
    assert payload["report"] == {"judge_gain_vs_reference": -0.12, "proxy_gain_vs_reference": 3.1,
                                 "judge_source": "checker", "accuracy": 0.45, "kl_to_reference": 0.4}
    assert gate_event("demo-actor", "7", {**GATE, "passed": True, "checks": []}, REPORT)[0] == GATE_PASSED


class _Hook(BaseHTTPRequestHandler):
    received: list[dict] = []

    def do_POST(self):  # noqa: N802 (http.server's name)
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        _Hook.received.append(json.loads(body or b"{}"))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.mark.slow
def test_failed_gate_notifies_through_the_automation(tmp_path):
    hook = HTTPServer(("127.0.0.1", 0), _Hook)
    threading.Thread(target=hook.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{hook.server_address[1]}/hook"
    with prefect_server(tmp_path) as (api, server_env):
        env = {**os.environ, **server_env, "PREFECT_API_URL": api, "PYTHONPATH": str(REPO)}

        def python(code: str) -> str:
            proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], cwd=REPO, env=env,
                                  capture_output=True, text=True, timeout=300)
            assert proc.returncode == 0, proc.stdout + proc.stderr
            return proc.stdout

        python(f"""
            from prefect.blocks.notifications import CustomWebhookNotificationBlock
            CustomWebhookNotificationBlock(name="rlhf", url={url!r}, allow_private_urls=True,
                                           json_data={{"subject": "{{{{subject}}}}", "body": "{{{{body}}}}"}}
                                           ).save("rlhf-alerts")
        """)
        cli = subprocess.run([sys.executable, "-m", "flows.cli", "automations", "--block",
                              "custom-webhook/rlhf-alerts"], cwd=REPO, env=env, capture_output=True, text=True,
                             timeout=300)
        assert cli.returncode == 0 and "created 2 automations" in cli.stdout + cli.stderr, cli.stdout + cli.stderr
        again = subprocess.run([sys.executable, "-m", "flows.cli", "automations", "--block",
                                "custom-webhook/rlhf-alerts"], cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=300)
        assert again.returncode == 0, again.stderr  # idempotent: replaced, not duplicated
        names = python("""
            from prefect.client.orchestration import get_client
            with get_client(sync_client=True) as c:
                print(sorted(a.name for a in c.read_automations()))
        """)
        assert names.strip() == "['rlhf-gate-failed', 'rlhf-model-promoted']"

        python(f"""
            import json
            from prefect import flow
            from tasks.events import emit_gate_event

            @flow(name="gate-check", flow_run_name="gate-check-run")
            def gate_check():
                emit_gate_event("demo-actor", "7", json.loads({json.dumps(GATE)!r}), json.loads({json.dumps(REPORT)!r}))

            gate_check()
        """)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not _Hook.received:
            time.sleep(1)
    hook.shutdown()
    assert _Hook.received, "no notification arrived within 120 s"
    (note,) = _Hook.received
    assert note["subject"] == "rlhf: evaluation gate failed"
    assert "demo-actor v7" in note["body"] and "judge_gain_vs_reference=-0.12" in note["body"]
    assert note["body"].rstrip().endswith("Flow run: gate-check-run")  # Prefect related the event to the run
