"""``README.md`` model cards, Hugging Face style, for every model a stage saves (and the registry version).

Front matter as the Hub reads it (``library_name``, ``pipeline_tag``, ``base_model`` when it is a Hub id,
``tags``), then: what the model is, how it was trained (stage and the keys that shape it), on what (input
hashes, as in ``rlhf_meta.json``), how it scored on held-out data (each ``<metric>_before`` / ``<metric>_after``
pair of the stage's metrics (or ``<metric>_before`` / ``<metric>``), and the RL stage's accuracy / proxy / KL),
lineage, and its limits.
Pure: ``render_model_card(meta, params, metrics) -> str``.
"""

from __future__ import annotations

import json
from typing import Any

import yaml

from rlhf_core.config import Params

CARD_FILE = "README.md"

ROLES: dict[str, tuple[str, str]] = {  # role -> (pipeline_tag, one-line description)
    "sft": ("text-generation", "Causal LM after supervised fine-tuning on prompt/response pairs."),
    "proxy": ("text-classification", "Reward model: a scalar score per (prompt, response), trained on pairwise "
                                     "preferences (Bradley-Terry); a transformers sequence classifier (one "
                                     "label) whose `score` head reads the last non-pad token."),
    "proxy_dpo": ("text-generation", "Reward model: DPO's implicit reward, beta * [log pi(y|x) - log pi_ref(y|x)], "
                                     "pi this causal LM with its `adapter/` on, pi_ref the same weights with it off "
                                     "(`implicit_reward.json` holds beta); trained on pairwise preferences with "
                                     "DPO's loss. Scored by rlhf-ops' `load_scorer`."),
    "proxy_process": ("text-classification", "Process reward model: the value of its `score` head at each step's "
                                             "end (sigmoid: the probability that the chain is still right), "
                                             "trained on the checker's step labels with binary cross-entropy "
                                             "(Math-Shepherd); as a transformers sequence classifier its score "
                                             "is the last step's."),
    "judge": ("text-classification", "Judge reward model, trained on the held-out pairs the proxy RM never saw; "
                                     "used to evaluate, never to train."),
    "actor": ("text-generation", "Policy (actor) after RLHF against the configured reward."),
    "actor_ema": ("text-generation", "Exponential moving average of the RLHF actor's weights."),
    "critic": ("text-classification", "Critic (value model) trained beside the actor by PPO."),
}
KEY_PARAMS: dict[str, tuple[str, ...]] = {
    "sft": ("epochs", "lr", "lr_scheduler", "warmup_steps", "micro_batch_size", "grad_accum", "max_length",
            "packing"),
    "rm": ("objective", "beta", "rpo_alpha", "step_delimiter", "loss", "epochs", "lr", "micro_batch_size", "grad_accum",
           "max_length", "init_from"),
    "rlhf": ("algorithm", "reward_fns", "num_steps", "prompts_per_step", "lr", "kl_coef", "kl_estimator",
             "ptx_coef", "reward_clip", "max_new_tokens", "temperature"),
}
LIMITS = {
    "common": "Trained and evaluated by rlhf-ops on the data named above; figures are on its held-out split only.",
    "demo": "Demo profile: a tiny randomly initialised Llama on a synthetic arithmetic task. It shows the "
            "pipeline works; it is not a useful model.",
    "proxy": "A pairwise RM's score is defined only up to a per-prompt constant: compare scores within a prompt. "
             "A policy optimised against it can exploit its errors (reward hacking): judge such a policy with a "
             "measure this model does not control.",
    "actor": "Optimised against a proxy reward: its proxy score says less than the judge / accuracy rows below.",
}


def _role(meta: dict) -> str:
    role = meta.get("role") or ("proxy" if meta.get("stage") == "rm" else meta.get("stage", "sft"))
    objective = meta.get("objective")
    return f"{role}_{objective}" if role == "proxy" and objective in ("dpo", "process") else role


def _front_matter(meta: dict, params: Params, role: str) -> dict[str, Any]:
    fm: dict[str, Any] = {"library_name": "transformers", "pipeline_tag": ROLES.get(role, ROLES["sft"])[0],
                          "tags": ["rlhf-ops", meta.get("stage", "")] + ([meta["algorithm"]] if meta.get("algorithm")
                                                                          else [])}
    base = params.model.name_or_path
    if base and not base.startswith((".", "/")) and base.count("/") == 1:  # a Hub id, not a local path
        fm["base_model"] = base
    return fm


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return f"`{json.dumps(value)}`"
    return f"`{value}`" if value not in (None, "") else "—"


def _evaluation_rows(metrics: dict) -> list[str]:
    rows = []
    for key in (k for k in metrics if k.endswith("_before")):
        name = key[: -len("_before")]
        after = next((a for a in (f"{name}_after", name) if a in metrics), None)  # RM: accuracy_before/accuracy
        if after is not None:
            rows.append(f"| {name} | {_fmt(metrics[key])} | {_fmt(metrics[after])} |")
    if "sft_accuracy" in metrics and "accuracy" in metrics:  # the RL stage names its pairs differently
        rows.append(f"| accuracy | {_fmt(metrics['sft_accuracy'])} | {_fmt(metrics['accuracy'])} |")
    if "sft_proxy_reward" in metrics and "proxy_reward" in metrics:
        rows.append(f"| proxy reward | {_fmt(metrics['sft_proxy_reward'])} | {_fmt(metrics['proxy_reward'])} |")
    if metrics.get("kl_to_reference") is not None:
        rows.append(f"| KL to the reference (nats/response) | 0 | {_fmt(metrics['kl_to_reference'])} |")
    return rows


def render_model_card(meta: dict, params: Params, metrics: dict | None = None) -> str:
    """The card's Markdown (front matter included) for the model ``meta`` (its ``rlhf_meta.json``) describes."""
    metrics = metrics or {}
    stage, role = meta.get("stage", "sft"), _role(meta)
    section = getattr(params, stage, None)
    title = f"{params.project.name} {role}"
    lines = ["---", yaml.safe_dump(_front_matter(meta, params, role), sort_keys=False).strip(), "---", "",
             f"# {title}", "", ROLES.get(role, ("", ""))[1], ""]
    base = params.model.name_or_path or "the tiny demo Llama built offline (`models/base`)"
    lines += ["## Training", "", f"Stage `{stage}` of the rlhf-ops pipeline, from {base}.", "",
              "| key | value |", "|---|---|"]
    for key in KEY_PARAMS.get(stage, ()):
        if section is not None and hasattr(section, key):
            lines.append(f"| `{stage}.{key}` | {_fmt(getattr(section, key))} |")
    lines += [f"| `compute.lora.enabled` | {_fmt(params.compute.lora.enabled)} |",
              f"| params hash | {_fmt(meta.get('params_hash'))} |", ""]
    lines += ["## Data", "", "Inputs and their content hashes (`rlhf_meta.json`):", "", "| input | sha256 |",
              "|---|---|"]
    lines += [f"| `{k}` | `{v}` |" for k, v in sorted((meta.get("inputs") or {}).items())]
    for k, v in sorted((meta.get("data") or {}).items()):
        lines.append(f"| `{k}` | `{v}` |")
    lines.append("")
    evaluation = _evaluation_rows(metrics)
    if evaluation:
        lines += ["## Evaluation", "", f"Held-out split, decoding `{json.dumps(params.eval.model_dump())}`.", "",
                  "| metric | before | after |", "|---|---|---|", *evaluation, ""]
    lines += ["## Lineage", "", f"- git sha: `{meta.get('git_sha', 'unknown')}`",
              f"- created: {meta.get('created_at', '—')}",
              "- versions: " + ", ".join(f"{k} {v}" for k, v in sorted((meta.get("versions") or {}).items())),
              *([f"- image: `{meta['image']}`"] if meta.get("image") else []), ""]
    limits = [LIMITS["common"]] + ([LIMITS["demo"]] if params.model.name_or_path is None else [])
    limits += [LIMITS[k] for k in ("proxy", "actor") if k == role.removesuffix("_dpo").removesuffix("_process")]
    lines += ["## Limitations", "", *[f"- {text}" for text in limits], ""]
    return "\n".join(lines)


def split_front_matter(card: str) -> tuple[dict, str]:
    """A card's YAML front matter (``{}`` when it has none) and its body."""
    if card.startswith("---\n") and "\n---\n" in card[4:]:
        head, body = card[4:].split("\n---\n", 1)
        data = yaml.safe_load(head)
        return (data if isinstance(data, dict) else {}), body.lstrip()
    return {}, card


REGISTRY_TAGS = (
    ("rlhf.params_hash", "params hash"),
    ("rlhf.git_sha", "git sha"),
    ("rlhf.dvc.data_prepared", "prepared data (DVC md5)"),
    ("rlhf.gate", "gate"),
    ("rlhf.gate.failing", "failing gates"),
    ("rlhf.promoted_at", "promoted at"),
    ("rlhf.promoted_by", "promoted by"),
    ("rlhf.promotion_reason", "promotion reason"),
    ("rlhf.previous_champion", "previous champion"),
    ("rlhf.content_hash", "content hash"),
)


def render_export_card(card: str | None, registry: dict) -> str:
    """The ``README.md`` of an exported registered version: the registered card's body (or a title) under Hub
    front matter (the card's own, with ``library_name: transformers``, ``pipeline_tag``, ``base_model`` when it
    is a Hub id and the tags ``rlhf-ops``, ``rlhf`` and the RL algorithm added), then a registry section.

    ``registry``: ``name``, ``version``, ``kind`` (actor / reward / critic), ``aliases`` (list), ``run_id``,
    ``tags`` (the version's tags), optional ``algorithm`` and ``base_model`` (the training run's params).
    """
    front, body = split_front_matter(card or "")
    kind = registry["kind"]
    front["library_name"] = "transformers"
    front["pipeline_tag"] = "text-generation" if kind == "actor" else "text-classification"
    base = registry.get("base_model")
    if base and not str(base).startswith((".", "/", "pkg:")) and str(base).count("/") == 1:
        front["base_model"] = base
    tags = [t for t in front.get("tags") or [] if t]
    for tag in ("rlhf-ops", "rlhf", registry.get("algorithm"), kind):
        if tag and tag not in tags:
            tags.append(tag)
    front["tags"] = tags
    name, version = registry["name"], registry["version"]
    if not body.strip():
        role = {"actor": "sft", "reward": "proxy"}.get(kind)
        line = ROLES[role][1] if role else "Value model (critic) of a PPO run: a scalar value per token."
        body = f"# {name} v{version}\n\n{line}\n"
    aliases = ", ".join(registry.get("aliases") or []) or "none"
    rows = [
        f"| registered model | `{name}` version {version} (aliases: {aliases}) |",
        f"| MLflow run | {_fmt(registry.get('run_id'))} |",
    ]
    tags_of = registry.get("tags") or {}
    rows += [f"| {label} | {_fmt(tags_of.get(key))} |" for key, label in REGISTRY_TAGS if tags_of.get(key)]
    rows += [
        f"| input `{k.removeprefix('rlhf.input.')}` | {_fmt(v)} |"
        for k, v in sorted(tags_of.items())
        if k.startswith("rlhf.input.")
    ]
    loader = "AutoModelForCausalLM" if kind == "actor" else "AutoModelForSequenceClassification"
    lines = [
        "---",
        yaml.safe_dump(front, sort_keys=False).strip(),
        "---",
        "",
        body.rstrip(),
        "",
        "## Registry",
        "",
        "Exported by `rlhf export` from the MLflow model registry.",
        "",
        "| key | value |",
        "|---|---|",
        *rows,
        "",
        f"Load it with `{loader}.from_pretrained(folder)` and `AutoTokenizer.from_pretrained(folder)`.",
        "",
    ]
    return "\n".join(lines)
