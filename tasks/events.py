"""Prefect events the pipeline emits, so automations can notify on what a flow run decided.

=======================  ===========================================  ==========================================
event                    when                                         payload
=======================  ===========================================  ==========================================
``rlhf.gate.failed``     the candidate actor failed its evaluation    ``failing``: each failing gate with value
                         gate (the flow run still ends Completed)      and threshold; ``report``: the headline
                                                                      figures (judge / proxy gain, KL, accuracy)
``rlhf.gate.passed``     it passed                                    the same
``rlhf.model.promoted``  the ``champion`` alias moved to it           ``previous``: the former champion version
=======================  ===========================================  ==========================================

The resource is the registered model version, ``mlflow.model-version.<name>.<version>``; Prefect relates the
event to the flow run that emitted it. ``flows/automations.yaml`` has automations that notify on them.
"""

from __future__ import annotations

from tasks.gates import failing_reasons

GATE_FAILED, GATE_PASSED, PROMOTED = "rlhf.gate.failed", "rlhf.gate.passed", "rlhf.model.promoted"
HEADLINE = ("judge_gain_vs_reference", "proxy_gain_vs_reference", "judge_source", "win_rate_vs_champion")


def model_resource(name: str, version: str) -> dict[str, str]:
    return {"prefect.resource.id": f"mlflow.model-version.{name}.{version}",
            "prefect.resource.name": f"{name} v{version}", "mlflow.model.name": name,
            "mlflow.model.version": str(version)}


def gate_event(name: str, version: str, gate: dict, report: dict) -> tuple[str, dict, dict]:
    """``(event, resource, payload)`` for a gate decision (pure: what :func:`emit_gate_event` sends)."""
    payload = {"failing": failing_reasons(gate), "report": {k: report[k] for k in HEADLINE if k in report}}
    candidate = report.get("candidate") or {}
    payload["report"].update({k: candidate[k] for k in ("accuracy", "kl_to_reference") if k in candidate})
    return (GATE_PASSED if gate["passed"] else GATE_FAILED), model_resource(name, version), payload


def emit_gate_event(name: str, version: str, gate: dict, report: dict) -> None:
    from prefect.events import emit_event

    event, resource, payload = gate_event(name, version, gate, report)
    emit_event(event=event, resource=resource, payload=payload)


def emit_promoted_event(name: str, version: str, previous: str | None, reason: str) -> None:
    from prefect.events import emit_event

    emit_event(event=PROMOTED, resource=model_resource(name, version),
               payload={"previous": previous, "reason": reason})
