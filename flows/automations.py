"""Prefect automations that notify on what a pipeline run decided (``tasks.events``).

A failed gate ends the flow run ``Completed``: nothing in Prefect's run states calls for attention, so the
flow emits ``rlhf.gate.failed`` and these automations turn it (and a promotion) into a notification through
any Prefect notification block (Slack, Teams, email, ...). ``rlhf automations --block slack-webhook/alerts``
creates them on the current Prefect API; an automation with the same name is replaced, so re-running is safe.
"""

from __future__ import annotations

from datetime import timedelta
from uuid import UUID

from tasks.events import GATE_FAILED, PROMOTED

GATE_FAILED_BODY = (
    "The evaluation gate refused {{ event.resource['prefect.resource.name'] }}: the champion stays.\n"
    "Failing: {{ event.payload.failing | join('; ') }}\n"
    "Flow run: {{ flow_run.name }}"
)
PROMOTED_BODY = (
    "{{ event.resource['prefect.resource.name'] }} is the new champion "
    "(was v{{ event.payload.previous }}): {{ event.payload.reason }}."
)


def automations(block_document_id: UUID) -> list:
    """The automations, as Prefect's own models (validated on construction)."""
    from prefect.events.actions import SendNotification
    from prefect.events.schemas.automations import AutomationCore, EventTrigger, Posture

    def on(event: str) -> EventTrigger:
        return EventTrigger(expect={event}, match={"prefect.resource.id": "mlflow.model-version.*"},
                            posture=Posture.Reactive, threshold=1, within=timedelta(0))

    return [
        AutomationCore(name="rlhf-gate-failed", description="Notify when a candidate actor fails its gate.",
                       trigger=on(GATE_FAILED),
                       actions=[SendNotification(block_document_id=block_document_id,
                                                 subject="rlhf: evaluation gate failed", body=GATE_FAILED_BODY)]),
        AutomationCore(name="rlhf-model-promoted", description="Notify when the champion alias moves.",
                       trigger=on(PROMOTED),
                       actions=[SendNotification(block_document_id=block_document_id,
                                                 subject="rlhf: new champion", body=PROMOTED_BODY)]),
    ]


def create_automations(block_slug: str) -> list[str]:
    """Create (or replace) the automations, notifying through the block ``<type-slug>/<name>``."""
    from prefect.blocks.core import Block
    from prefect.client.orchestration import get_client

    block = Block.load(block_slug)
    block_id = block._block_document_id
    if block_id is None:
        raise ValueError(f"block {block_slug!r} has no saved document")
    created = []
    with get_client(sync_client=True) as client:
        for automation in automations(block_id):
            for existing in client.read_automations_by_name(automation.name):
                client.delete_automation(existing.id)
            created.append(str(client.create_automation(automation)))
    return created
