import io
import json

from rich.console import Console

from rlhf_core.ops.progress import StageProgress


def test_plain_json_lines_when_not_a_terminal():
    buf = io.StringIO()
    with StageProgress("sft", Console(file=buf, width=200), interactive=False) as log:
        log({"loss": 1.5, "lr": 0.001}, 3)
    assert json.loads(buf.getvalue().strip()) == {"stage": "sft", "step": 3, "loss": 1.5, "lr": 0.001}


def test_progress_bar_on_a_terminal_shows_steps_and_loss():
    buf = io.StringIO()
    console = Console(file=buf, width=200, force_terminal=True)
    with StageProgress("sft", console, interactive=True) as log:
        log({"loss": 0.25, "total_steps": 10}, 4)
        assert log.progress.tasks[0].completed == 4 and log.progress.tasks[0].total == 10
        assert log.progress.tasks[0].fields["m"] == "loss=0.25"
