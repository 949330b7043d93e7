"""``rlhf stage feedback``: collect comparisons on the current policy's answers (continuous RLHF, docs/rounds.md).

Round ``n = feedback.round`` (0: the base pipeline, nothing to do) writes ``data/feedback/round_<n>/``::

    start/actor/     the policy the round compares and RL continues from (the registry's champion, or
                     models/actor with feedback.policy: workspace), saved with save_pretrained
    start/rm/        the previous round's reward model (feedback.rm_init: previous), which the rm stage starts from
    sampled.json     how many prompts, responses and distinct responses; the prompts' reference answers
    pairs.jsonl      every pair drawn: pair_id, prompt, response_a, response_b (the annotators' export)
    labels.jsonl     feedback.annotator: file -> the annotators' labels go here (or feedback.labels_file)
    pairs.parquet    the labelled pairs (id, prompt, chosen, rejected): what the rm stage trains on
    manifest.json    counts (prompts, responses, distinct, pairs, labelled, dropped by reason), label agreement
                     with the checker where the data has answers, the start models' hashes, the policy's source

Steps: ``feedback.prompts_per_round`` prompts of ``prompts.parquet`` (a seeded draw per round) are answered
``samples_per_prompt`` times by the start actor; up to ``pairs_per_prompt`` pairs of distinct answers per prompt
are drawn; the annotator labels them (``checker``, ``file``, ``rm``). DVC tracks ``data/feedback`` as a persistent
output: the rounds accumulate, and a round whose ``manifest.json`` exists is not collected again.

With ``annotator: file`` the first run exports ``pairs.jsonl`` and stops with exit 65 naming the file the labels
are expected in; the re-run (after the annotators' labels are there) imports them and finishes the round.
"""

from __future__ import annotations

import json
import os
import random
from collections import Counter
from pathlib import Path

import torch

from rlhf_core.config import Params
from rlhf_core.data.collate import left_pad_prompts
from rlhf_core.data.feedback import checker_choices, draw_pairs, labelled_rows, read_labels
from rlhf_core.data.readers import DataError
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.models.loading import load_causal_lm
from rlhf_core.ops import paths, tracking
from rlhf_core.ops.atomic import atomic_dir, copy_dir_atomic, write_json_atomic, write_text_atomic
from rlhf_core.ops.integrity import seal_model_dir
from rlhf_core.ops.meta import dir_sha256, write_meta
from rlhf_core.ops.paths import start_dir
from rlhf_core.passes.generation import GenerationConfig, rollout
from rlhf_core.rewards import get_checker
from rlhf_core.rewards.sources import RewardSources
from rlhf_core.stages.evaluate import load_champion
from rlhf_core.trainers.rlhf.inputs import load_prompts

INDEX = paths.FEEDBACK / "rounds.json"  # one line per collected round: the manifests in order


def run(params: Params, root: str | Path = ".", log=None) -> dict:
    root = Path(root)
    n = params.feedback.round
    (root / paths.FEEDBACK).mkdir(parents=True, exist_ok=True)
    if n == 0:
        if not (root / INDEX).exists():
            write_json_atomic(root / INDEX, {"rounds": []})
        write_json_atomic(root / paths.METRICS / "feedback.json", {"round": 0, "collected": False})
        return {"round": 0, "collected": False}
    out = root / paths.round_dir(n)
    if (out / "manifest.json").exists():  # a finished round is not collected again
        manifest = json.loads((out / "manifest.json").read_text())
        metrics = {**manifest["counts"], "round": n, "collected": False}
        write_json_atomic(root / paths.METRICS / "feedback.json", metrics)
        return metrics
    snapshot_start(params, root, n)
    pairs_file = out / "pairs.jsonl"
    if not pairs_file.exists():
        pairs, sampled = sample_pairs(params, root, n)
        write_json_atomic(out / "sampled.json", sampled)
        write_text_atomic(pairs_file, "".join(json.dumps(p) + "\n" for p in pairs))
    pairs = [json.loads(line) for line in pairs_file.read_text().splitlines() if line.strip()]
    sampled = json.loads((out / "sampled.json").read_text())
    answers = sampled.pop("answers")
    choices, label_counts = annotate(params, root, n, pairs, answers)
    rows, dropped = labelled_rows(pairs, choices)
    dropped.update(label_counts.pop("dropped", Counter()))
    if not rows:
        raise DataError(f"{paths.round_dir(n)}: no labelled pair with a preference ({dict(dropped)}); nothing to "
                        "train the reward model on")
    write_parquet(out / "pairs.parquet", rows)
    counts = {**sampled, "prompts_with_pairs": len({p["prompt_index"] for p in pairs}), "pairs": len(pairs),
              "labelled": len(rows), **label_counts, **{f"dropped_{k}": v for k, v in sorted(dropped.items())}}
    agreement = checker_agreement(pairs, choices, answers, params.eval.checker)
    manifest = {"round": n, "annotator": params.feedback.annotator, "counts": counts,
                "label_agreement_with_checker": agreement,
                "policy": json.loads((start_dir(root, n, "actor") / "rlhf_meta.json").read_text()).get("source"),
                "start": {role: dir_sha256(start_dir(root, n, role)) for role in ("actor", "rm")
                          if (start_dir(root, n, role) / "config.json").exists()},
                "params_hash": params.section_hash("feedback")}
    write_json_atomic(out / "manifest.json", manifest)
    index = json.loads((root / INDEX).read_text()) if (root / INDEX).exists() else {"rounds": []}
    index["rounds"] = [r for r in index["rounds"] if r["round"] != n] + [manifest]
    write_json_atomic(root / INDEX, index)
    metrics = {**counts, "round": n, "collected": True,
               **({"label_agreement_with_checker": agreement} if agreement is not None else {})}
    if log is not None:
        log({k: float(v) for k, v in metrics.items() if isinstance(v, (int, float))}, n)
    write_json_atomic(root / paths.METRICS / "feedback.json", metrics)
    return metrics


# --------------------------------------------------------------------------- the round's starting models
def snapshot_start(params: Params, root: Path, n: int) -> None:
    """Save the policy (champion or workspace actor) and the previous RM as the round's starting models, once.

    DVC removes a stage's outputs before it re-runs it, so ``models/rm`` and ``models/actor`` would be gone by the
    time the rm and rlhf stages of this round start: what they start from is kept here, under the round."""
    actor = start_dir(root, n, "actor")
    if not (actor / "config.json").exists():
        policy = params.feedback.policy
        if policy == "champion":
            uri = os.environ.get(tracking.ENV_CHAMPION)
            if not uri:
                raise DataError(f"feedback.policy: champion, but no champion actor is registered "
                                f"({tracking.ENV_CHAMPION} is unset: the flow sets it once a version was promoted); "
                                "run the base pipeline first, or set feedback.policy: workspace to continue from "
                                "models/actor")
            model, tok = load_champion(uri)
            with atomic_dir(actor) as tmp:
                model.save_pretrained(tmp)
                tok.save_pretrained(tmp)
                write_meta(tmp, {"stage": "feedback", "role": "round start actor", "round": n, "source": uri})
                seal_model_dir(Path(tmp))
        else:
            src = root / paths.ACTOR_MODEL
            if not (src / "config.json").exists():
                raise DataError(f"{paths.ACTOR_MODEL}: no actor to continue from (feedback.policy: workspace); "
                                "run the base pipeline first")
            def name_source(copy: Path) -> None:  # inside the copy, before it is renamed into place
                meta = json.loads((copy / "rlhf_meta.json").read_text()) if (copy / "rlhf_meta.json").exists() else {}
                write_meta(copy, {**meta, "source": str(paths.ACTOR_MODEL)})
                seal_model_dir(copy)  # its meta changed

            copy_dir_atomic(src, actor, name_source)
    rm = start_dir(root, n, "rm")
    if params.feedback.rm_init == "previous" and not (rm / "config.json").exists():
        src = root / paths.RM_MODEL
        if not (src / "config.json").exists():
            raise DataError(f"{paths.RM_MODEL}: no reward model to continue from (feedback.rm_init: previous); run "
                            "the base pipeline first, or set feedback.rm_init: sft")
        copy_dir_atomic(src, rm)


# --------------------------------------------------------------------------- sampling and labelling
def sample_pairs(params: Params, root: Path, n: int) -> tuple[list[dict], dict]:
    """Pairs of distinct answers of the start actor to this round's prompts, and what was sampled: counts of
    prompts, responses and distinct responses, and the prompts' reference answers (or None)."""
    fb = params.feedback
    actor_dir = start_dir(root, n, "actor")
    tok = load_tokenizer(actor_dir, params.model.trust_remote_code)
    model = load_causal_lm(actor_dir, trust_remote_code=params.model.trust_remote_code).eval()
    prompts = load_prompts(params, root, tok)
    rng = random.Random(params.project.seed * 1_000_003 + n)
    chosen = sorted(rng.sample(range(len(prompts.texts)), min(fb.prompts_per_round, len(prompts.texts))))
    torch.manual_seed(params.project.seed * 1_000_003 + n)
    k, gen = fb.samples_per_prompt, GenerationConfig(params.rlhf.max_new_tokens, fb.temperature)
    texts = []
    for start in range(0, len(chosen), params.eval.batch_size):
        rows = torch.tensor(chosen[start:start + params.eval.batch_size])
        batch = left_pad_prompts(prompts.tokens, rows, tok.pad_token_id)
        ids, mask = batch["input_ids"].repeat_interleave(k, 0), batch["attention_mask"].repeat_interleave(k, 0)
        roll = rollout(model, ids, mask, tok, gen, group_size=k)
        texts += [roll.texts[i * k:(i + 1) * k] for i in range(len(rows))]
    prompt_texts = [prompts.texts[i] for i in chosen]
    pairs = draw_pairs(n, prompt_texts, texts, fb.pairs_per_prompt, rng)
    answers = [prompts.answers[i] for i in chosen] if prompts.has_answers else None
    return pairs, {"prompts": len(chosen), "responses": sum(map(len, texts)),
                   "distinct_responses": sum(len(set(t)) for t in texts), "answers": answers}


def annotate(params: Params, root: Path, n: int, pairs: list[dict], answers: list | None) -> tuple[dict, dict]:
    """``{pair_id: choice}`` from the configured annotator, and its counts (``dropped``: a Counter)."""
    fb = params.feedback
    if fb.annotator == "checker":
        if answers is None:
            raise DataError("feedback.annotator: checker needs reference answers (an `answer` column in the "
                            "prompts); use the file or rm annotator")
        a_ok, b_ok = correctness(pairs, answers, params.eval.checker)
        choices, flipped = checker_choices(a_ok, b_ok, fb.label_noise,
                                           random.Random(params.project.seed * 7919 + n))
        return dict(zip([p["pair_id"] for p in pairs], choices, strict=True)), {"flipped": flipped}
    if fb.annotator == "rm":
        return judge_choices(params, root, pairs), {}
    labels = Path(fb.labels_file) if fb.labels_file else root / paths.round_dir(n) / "labels.jsonl"
    if not labels.exists():
        raise DataError(f"{paths.round_dir(n) / 'pairs.jsonl'}: {len(pairs)} pairs exported for labelling; "
                        f"waiting for their labels in {labels} (one JSON line per pair: "
                        f"{{{fb.label_columns.id!r}: pair id, {fb.label_columns.choice!r}: a|b|tie}}), "
                        "then re-run the round")
    choices, dropped = read_labels(labels, fb.label_columns.model_dump(), {p["pair_id"] for p in pairs},
                                   drop=params.data.on_malformed == "drop")
    return choices, {"dropped": dropped}


def correctness(pairs: list[dict], answers: list, checker: str = "exact") -> tuple[list[bool], list[bool]]:
    check_answer = get_checker(checker)
    a = [bool(check_answer(p["response_a"], answers[p["prompt_index"]])) for p in pairs]
    b = [bool(check_answer(p["response_b"], answers[p["prompt_index"]])) for p in pairs]
    return a, b


def judge_choices(params: Params, root: Path, pairs: list[dict]) -> dict[str, str]:
    """AI feedback: the judge RM's higher-scored response is chosen (``tie`` within 1e-3)."""
    judge_dir = Path(params.feedback.judge_model) if params.feedback.judge_model else root / paths.JUDGE_MODEL
    if not (judge_dir / "config.json").exists():
        raise DataError(f"{judge_dir}: no judge reward model (feedback.annotator: rm); train one with rm.judge: "
                        "true or set feedback.judge_model")
    tok = load_tokenizer(judge_dir, params.model.trust_remote_code)
    score = RewardSources({"rm": 1.0}, judge_dir, tok, "retokenize")
    prompts = [p["prompt"] for p in pairs]
    with torch.inference_mode():
        sa = score(prompts, [p["response_a"] for p in pairs]).float()
        sb = score(prompts, [p["response_b"] for p in pairs]).float()
    diff = (sa - sb).tolist()
    return {p["pair_id"]: ("tie" if abs(d) < 1e-3 else "a" if d > 0 else "b") for p, d in zip(pairs, diff, strict=True)}


def checker_agreement(pairs: list[dict], choices: dict[str, str], answers: list | None,
                      checker: str = "exact") -> float | None:
    """Share of the labelled, checker-decidable pairs (one answer right, one wrong) whose label prefers the right
    one: 1 - label noise for the simulated annotator, the annotators' accuracy for imported labels."""
    if answers is None:
        return None
    a_ok, b_ok = correctness(pairs, answers, checker)
    agree = [choices[p["pair_id"]] == ("a" if a else "b") for p, a, b in zip(pairs, a_ok, b_ok, strict=True)
             if a != b and choices.get(p["pair_id"]) in ("a", "b")]
    return sum(agree) / len(agree) if agree else None


def write_parquet(path: Path, rows: list[dict]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(pa.Table.from_pylist(rows), tmp)
    os.replace(tmp, path)
