"""``rm.external``: a reward model of your own in place of the one the RM stage would train.

The stage does not train: it loads the model (``RewardScorer.from_pretrained``: a decoder
``*ForSequenceClassification`` with one label and its tokenizer, a local folder or a Hub id), scores the
held-out pairs with it (its pairwise accuracy is ``metrics/rm.json``'s ``accuracy``, as a trained RM's), and
saves it as ``models/rm`` (the same weights as safetensors, its tokenizer, ``rlhf_meta.json``, a model card and
the manifest), which RL, evaluation and the registry read as they read a trained one. It scores where
transformers does (``algos.masking.pooled_index``), so its rewards are the ones its authors measured. The
folder it names is only read: nothing is written there, and ``dvc repro`` restores ``models/rm``, never it.
"""

from __future__ import annotations

import time
from pathlib import Path

from rlhf_core.config import Params
from rlhf_core.engine import distributed as D
from rlhf_core.model_source import ModelSourceError, check_hub, locate
from rlhf_core.models.reward_format import RewardModelFormatError
from rlhf_core.models.scorer import RewardScorer
from rlhf_core.ops import paths
from rlhf_core.ops.atomic import commit_dir, make_temp_dir, write_text_atomic
from rlhf_core.ops.integrity import seal_model_dir
from rlhf_core.ops.meta import build_meta, dir_sha256, write_meta
from rlhf_core.ops.model_card import CARD_FILE, render_model_card
from rlhf_core.trainers.common import TrainingInputError, read_split, write_outputs

STAGE = "rm"
PAIR_COLUMNS = ("prompt", "chosen", "rejected")


def external_source(params: Params, root: Path) -> str:
    """``rm.external`` as a path (relative to ``root``) when it is a local folder, else as the Hub id given, checked
    as ``model.name_or_path`` is (:func:`~rlhf_core.model_source.check_hub`: a Hub id offline and not cached is one
    line naming the key, not a minute of ``from_pretrained`` retries)."""
    spec = params.rm.external
    path = Path(spec).expanduser()
    path = path if path.is_absolute() else root / path
    if path.exists() or spec.startswith((".", "/", "~")):
        if not path.is_dir():
            raise TrainingInputError(f"rm.external: {spec}: no such folder (a reward model folder or a Hub id)")
        return str(path.resolve())
    try:
        source = locate(spec, key="rm.external")
        check_hub(source)
    except ModelSourceError as err:
        raise TrainingInputError(str(err)) from None
    if source.kind != "hub":  # a GGUF file or a pkg: source holds a causal LM
        raise TrainingInputError(f"rm.external {spec}: a GGUF file holds a causal LM, not a reward model; name a "
                                 "sequence-classification folder or Hub id")
    return spec


def adopt_external_rm(params: Params, root: Path, log=None) -> dict:
    """Score the held-out pairs with ``rm.external`` and save it as ``models/rm``; returns the metrics."""
    t_start = time.perf_counter()
    src = external_source(params, root)
    try:
        scorer = RewardScorer.from_pretrained(src, batch_size=params.eval.batch_size,
                                              trust_remote_code=params.model.trust_remote_code)
    except (RewardModelFormatError, OSError, ValueError) as err:
        raise TrainingInputError(f"rm.external: {src}: not a reward model this pipeline can score with: {err}") from err
    pad = scorer.model.pad_token_id
    if pad is None:
        raise TrainingInputError(f"rm.external: {src}: its config.json has no pad_token_id, so transformers cannot "
                                 "score a padded batch with it; set the tokenizer's pad id there")
    evals = read_split(root, "pairs", eval_split=True, columns=PAIR_COLUMNS)
    chosen = scorer.score_responses(evals["prompt"], evals["chosen"]).double()
    rejected = scorer.score_responses(evals["prompt"], evals["rejected"]).double()
    both = chosen.new_tensor([*chosen.tolist(), *rejected.tolist()])
    metrics = {"accuracy": float((chosen > rejected).double().mean()), "chosen_mean": float(chosen.mean()),
               "rejected_mean": float(rejected.mean()), "margin_mean": float((chosen - rejected).mean()),
               "score_std": float(both.std(unbiased=False)), "n_eval": len(chosen), "n_train": 0, "steps": 0,
               "external": src, "objective": "external"}
    metrics |= {f"{k}_before": metrics[k] for k in ("accuracy", "chosen_mean", "rejected_mean", "margin_mean")}
    if D.is_main():
        target = root / paths.RM_MODEL
        inputs = {"external": dir_sha256(src) if Path(src).is_dir() else src}
        meta = build_meta(STAGE, params.section_hash("project", "data", "model", "rm"), inputs, role="proxy",
                          external=src, objective="external", score="the model's own score head (rm.external)")
        tmp = make_temp_dir(target)
        scorer.model.save_pretrained(tmp, pad)
        scorer.tokenizer.save_pretrained(tmp)
        write_meta(tmp, meta)
        write_text_atomic(Path(tmp) / CARD_FILE, render_model_card(meta, params, metrics))
        seal_model_dir(Path(tmp))
        commit_dir(tmp, target)
        metrics["wall_time_s"] = round(time.perf_counter() - t_start, 2)
        write_outputs(root, STAGE, metrics, f"{STAGE}_accuracy.csv", [], ("step", "accuracy", "loss"))  # no curve
        if log is not None:
            log({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, 0)
    D.barrier()
    return metrics
