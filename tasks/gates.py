"""The evaluation gate: decide from ``reports/eval.json`` and ``params.gates`` whether to promote.

A failed gate is a decided outcome, not a crash: the task completes and
returns ``GateResult(passed=False, ...)``; the flow records it and leaves the
champion in place.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from prefect import task

from rlhf_core.config import GatesConfig


@dataclass
class GateCheck:
    name: str
    value: float | None
    threshold: float | None
    op: str  # ">=" or "<=" or "finite"
    passed: bool
    note: str = ""


UNJUDGED = "none (gates.allow_unjudged)"  # GateResult.judge of a decision taken without a judge, by the params' leave


@dataclass
class GateResult:
    passed: bool
    checks: list[GateCheck] = field(default_factory=list)
    judge: str | None = None  # what decided on the judge gate: the report's judge_source, UNJUDGED, or None

    @property
    def failing(self) -> list[GateCheck]:
        return [c for c in self.checks if not c.passed]

    def to_dict(self) -> dict:
        return {"passed": self.passed, "judge": self.judge, "checks": [asdict(c) for c in self.checks]}


def _numbers(d, prefix=""):
    if isinstance(d, dict):
        for k, v in d.items():
            yield from _numbers(v, f"{prefix}{k}.")
    elif isinstance(d, int | float) and not isinstance(d, bool):
        yield prefix.rstrip("."), float(d)


def judge_check(report: dict, proxy_gain: float, min_gain: float, allow_unjudged: bool = False) -> GateCheck:
    """The judge must improve on the reference by ``min_gain`` whatever the proxy says (reward hacking check).
    Without a judge the check fails, unless ``allow_unjudged`` (``gates.allow_unjudged``) says to pass it."""
    judge = report.get("judge_gain_vs_reference")
    if judge is None:
        if allow_unjudged:
            return GateCheck("judge_gain_vs_reference", None, min_gain, ">=", True,
                             "no judge: passed unjudged because gates.allow_unjudged is true; reward hacking "
                             "cannot be detected")
        return GateCheck("judge_gain_vs_reference", None, min_gain, ">=", False,
                         "no judge scored the candidate (no checker answers, no eval.judge_model, no rm.judge): "
                         "nothing is promoted unjudged unless gates.allow_unjudged is true")
    passed = judge >= min_gain
    note = f"judge: {report.get('judge_source', '?')}"
    if not passed and proxy_gain > 0:
        note = f"reward hacking suspected: proxy {proxy_gain:+.4g}, judge {judge:+.4g}"
    elif not passed:
        note = f"no improvement: proxy {proxy_gain:+.4g}, judge {judge:+.4g}"
    return GateCheck("judge_gain_vs_reference", judge, min_gain, ">=", passed, note)


def step_check(report: dict, min_gain: float) -> GateCheck:
    """The step judge (process supervision): held-out step accuracy must not fall below the reference's by more
    than ``-min_gain``; passes with a note where the task labels no steps."""
    gain = report.get("step_accuracy_gain_vs_reference")
    if gain is None:
        return GateCheck("step_accuracy_gain_vs_reference", None, min_gain, ">=", True, "the task labels no steps")
    return GateCheck("step_accuracy_gain_vs_reference", gain, min_gain, ">=", gain >= min_gain, "judge: step labels")


def decide(report: dict, gates: GatesConfig) -> GateResult:
    """Apply every gate to an eval report (see ``docs/operations.md`` for the report schema)."""
    cand, ref = report["candidate"], report["reference"]
    checks = []
    bad = [k for k, v in _numbers(report) if not math.isfinite(v)]
    checks.append(GateCheck("no_nan", float(len(bad)), 0.0, "finite", not bad, ", ".join(bad)))
    gain = cand["reward_mean"] - ref["reward_mean"]
    checks.append(GateCheck("reward_gain_vs_reference", gain, gates.min_reward_gain, ">=",
                            gain >= gates.min_reward_gain, "proxy: the training reward"))
    checks.append(judge_check(report, gain, gates.min_judge_gain, gates.allow_unjudged))
    win = report.get("win_rate_vs_champion")
    if win is None:
        checks.append(GateCheck("win_rate_vs_champion", None, gates.min_win_rate_vs_champion, ">=", True,
                                "no champion yet"))
    else:
        checks.append(GateCheck("win_rate_vs_champion", win, gates.min_win_rate_vs_champion, ">=",
                                win >= gates.min_win_rate_vs_champion))
    kl = cand["kl_to_reference"]
    checks.append(GateCheck("kl_to_reference", kl, gates.max_kl, "<=", kl <= gates.max_kl))
    checks.append(step_check(report, gates.min_step_accuracy_gain))
    acc = cand.get("accuracy")
    if acc is None:
        checks.append(GateCheck("accuracy", None, gates.min_accuracy, ">=", True, "task has no checker"))
    else:
        checks.append(GateCheck("accuracy", acc, gates.min_accuracy, ">=", acc >= gates.min_accuracy))
    judge = report.get("judge_source") or (UNJUDGED if gates.allow_unjudged else None)
    return GateResult(passed=all(c.passed for c in checks), checks=checks, judge=judge)


def failing_reasons(gate: dict) -> list[str]:
    """``["judge_gain_vs_reference=-0.2 (needs >= 0.01; reward hacking suspected ...)", ...]`` of a gate dict."""
    return [f"{c['name']}={c['value']} (needs {c['op']} {c['threshold']}{'; ' + c['note'] if c.get('note') else ''})"
            for c in gate["checks"] if not c["passed"]]


def _fmt(x) -> str:
    return "—" if x is None else f"{x:.4g}" if isinstance(x, float) else str(x)


def render_report(report: dict, result: GateResult, plots: dict[str, str] | None = None) -> str:
    """The markdown gate report: candidate vs reference vs champion, then pass/fail per gate."""
    rows = ["reward_mean", "judge_mean", "accuracy", "step_accuracy", "kl_to_reference", "response_length",
            "eos_share"]
    champ = report.get("champion") or {}
    lines = [f"# Gate report: {'PASSED' if result.passed else 'FAILED'}", "",
             f"Candidate `{report.get('candidate_label', 'candidate')}` on {report.get('n_prompts', '?')} held-out "
             f"prompts; champion: {report.get('champion_label') or 'none'}. Proxy (`reward_mean`, what RL "
             f"optimised): {report.get('reward_source', '?')}; judge: {report.get('judge_source') or 'none'}.", "",
             *[f"**{c.note}.**" for c in result.failing if c.note.startswith("reward hacking")], "",
             "| metric | candidate | reference (SFT) | champion |", "|---|---|---|---|"]
    for key in rows:
        lines.append(f"| {key} | {_fmt(report['candidate'].get(key))} | {_fmt(report['reference'].get(key))} | "
                     f"{_fmt(champ.get(key))} |")
    lines += [f"| win_rate_vs_reference | {_fmt(report.get('win_rate_vs_reference'))} | | |",
              f"| win_rate_vs_champion | {_fmt(report.get('win_rate_vs_champion'))} | | |", "",
              "| gate | value | threshold | result |", "|---|---|---|---|"]
    for c in result.checks:
        mark = "pass" if c.passed else "**FAIL**"
        note = f" ({c.note})" if c.note else ""
        lines.append(f"| {c.name} | {_fmt(c.value)} | {c.op} {_fmt(c.threshold)} | {mark}{note} |")
    for name, url in (plots or {}).items():
        lines.append(f"\n[{name}]({url})")
    return "\n".join(lines) + "\n"


@task(name="evaluation-gate", task_run_name="gate")
def evaluation_gate(report: dict, gates: dict) -> dict:
    """Prefect task wrapper: returns ``GateResult.to_dict()`` and publishes the markdown report artifact."""
    from prefect.artifacts import create_markdown_artifact

    result = decide(report, GatesConfig.model_validate(gates))
    create_markdown_artifact(render_report(report, result), key="gate-report",
                             description="Evaluation gate: candidate vs reference vs champion")
    return result.to_dict()
