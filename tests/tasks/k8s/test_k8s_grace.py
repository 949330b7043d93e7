"""A pod's grace must leave the launcher's workers time to checkpoint: torchrun SIGKILLs them
``--shutdown-timeout`` (= grace - the kubelet's margin) after the SIGTERM, so a grace at or under the margin
would render a negative or zero timeout."""

from __future__ import annotations

import pytest

from rlhf_core.ops.launch import KUBELET_MARGIN_S
from tasks.k8s.options import StageJobOptions
from tasks.k8s.render import render_stage_job


@pytest.mark.parametrize("kw", [{"gpus": 2}, {"gpus": 1, "nnodes": 2}])
def test_a_grace_under_the_kubelet_margin_is_refused_for_a_launched_stage(kw):
    with pytest.raises(ValueError, match=r"termination_grace_s 10 .* \(--shutdown-timeout=-20\)"):
        StageJobOptions("sft", termination_grace_s=10, **kw)
    with pytest.raises(ValueError, match=rf"termination_grace_s {KUBELET_MARGIN_S} "):
        StageJobOptions("sft", termination_grace_s=KUBELET_MARGIN_S, **kw)


def test_the_smallest_grace_that_fits_renders_a_positive_timeout_and_one_process_needs_no_launcher():
    job = render_stage_job(StageJobOptions("sft", gpus=2, termination_grace_s=KUBELET_MARGIN_S + 1))
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert "--shutdown-timeout=1" in command
    one = render_stage_job(StageJobOptions("sft", gpus=1, termination_grace_s=10))  # no launcher: nothing to check
    assert not any(a.startswith("--shutdown-timeout") for a in one["spec"]["template"]["spec"]["containers"][0]
                   ["command"])
