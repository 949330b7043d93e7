"""A process reward model from the preference pairs (``rm.objective: process``; Math-Shepherd, DeepSeekMath 4.1.3).

Every chosen and rejected response is a chain of steps that end at ``rm.step_delimiter`` (the last one at the
response's last token, its EOS). The checker labels each step (``rewards.multistep.step_labels``: right while
the chain can still be right), once, when the pairs are read. The model is the score head's
(``ValueHeadModel``), read at every step end::

    ends    e(i, t)   token t ends a step of row i                                  (algos.process.step_ends)
    loss    L = mean over step ends of BCE(sigmoid(v(i, t)), y(i, t))             (algos.process.step_bce_loss)
    step accuracy     share of step ends where (v(i, t) > 0) == y(i, t)

A row whose token-level steps do not match its text's lines (the delimiter merged into another token, a cut
response) is left unlabelled: it takes no part in the loss, and the count is reported. The outcome score, what
RL's ``rm`` source and serving read, is the value at the last token: the last step's score.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from rlhf_core.algos.process import step_bce_loss, step_ends
from rlhf_core.data.collate import PairData, Ragged, TokenizedSequences, collate_pairs
from rlhf_core.engine import distributed as D
from rlhf_core.engine.errors import TrainingInputError
from rlhf_core.evaluation import shard_for_eval
from rlhf_core.rewards import multistep


@dataclass
class StepPairData(PairData):
    """Pairs with each response's step labels (``[n_steps]`` per row; empty: the row is unlabelled)."""

    chosen_labels: Ragged = None
    rejected_labels: Ragged = None
    delimiter_id: int = -1
    unlabelled: int = 0


def delimiter_token(tokenizer, delimiter: str) -> int:
    """The one token id of ``rm.step_delimiter``; a delimiter the tokenizer splits is an error naming the key."""
    ids = tokenizer(delimiter, add_special_tokens=False)["input_ids"]
    if len(ids) != 1:
        raise TrainingInputError(f"rm.step_delimiter {delimiter!r} is {len(ids)} tokens for this tokenizer "
                                 f"({ids}); a step must end at one token")
    return ids[0]


def _labels(seqs: TokenizedSequences, prompts: list[str], texts: list[str], delimiter: str,
            delimiter_id: int) -> tuple[Ragged, int]:
    """Each row's step labels from the checker, kept where the token-level step ends count the same steps."""
    labels = [multistep.step_labels(text, multistep.problem_from_prompt(prompt))[:len(_lines(text, delimiter))]
              for prompt, text in zip(prompts, texts, strict=True)]
    ids, _ = seqs.tokens.pad(pad_value=0)
    response, _ = seqs.tokens.like(seqs.response_mask).pad(pad_value=False)
    ends, empty = step_ends(ids, response, delimiter_id)
    matches = (ends.sum(dim=1) == torch.tensor([len(x) for x in labels])) & ~empty
    kept = [x if ok else [] for x, ok in zip(labels, matches.tolist(), strict=True)]
    return Ragged.from_lists(kept, dtype=torch.float32), int((~matches).sum())


def _lines(text: str, delimiter: str) -> list[str]:
    return text.rstrip(delimiter).split(delimiter) if text.strip() else []


def with_step_labels(data: PairData, rows: dict, tokenizer, delimiter: str) -> StepPairData:
    """``data`` with the checker's step labels of its chosen and rejected responses (``rows``: the pairs' text)."""
    delimiter_id = delimiter_token(tokenizer, delimiter)
    chosen, n_c = _labels(data.chosen, rows["prompt"], rows["chosen"], delimiter, delimiter_id)
    rejected, n_r = _labels(data.rejected, rows["prompt"], rows["rejected"], delimiter, delimiter_id)
    return StepPairData(data.chosen, data.rejected, chosen, rejected, delimiter_id, n_c + n_r)


def collate_steps(data: StepPairData, idx: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """``collate_pairs`` plus ``step_ends`` ``[2B, T]`` (labelled rows only) and ``step_labels`` ``[2B, T]`` (the
    label of the step ending at each end, 0 elsewhere)."""
    batch = collate_pairs(data, idx, pad_id)
    ends, _ = step_ends(batch["input_ids"], batch["response_mask"], data.delimiter_id)
    lengths = torch.cat([data.chosen_labels.lengths[idx], data.rejected_labels.lengths[idx]])
    ends &= (lengths > 0)[:, None]
    flat = []
    for labels in (data.chosen_labels, data.rejected_labels):
        values, valid = labels.pad(idx)
        flat.append(values[valid])
    targets = torch.zeros(ends.shape, dtype=torch.float32)
    targets[ends] = torch.cat(flat)  # row-major: the ends of each row in order, as its labels are
    return batch | {"step_ends": ends, "step_labels": targets}


def step_loss(engine, batch: dict) -> tuple[torch.Tensor, dict]:
    """The PRM loss of one batch and its step accuracy."""
    dev = engine.device
    values = engine(batch["input_ids"].to(dev), batch["attention_mask"].to(dev)).values.float()
    ends, targets = batch["step_ends"].to(dev), batch["step_labels"].to(dev)
    right = ((values > 0) == (targets > 0.5)) & ends
    return step_bce_loss(values, targets, ends), {"tokens": ends.sum().float(),
                                                   "accuracy": right.sum() / ends.sum().clamp(min=1)}


@torch.no_grad()
def eval_steps(model, data: StepPairData, batch_size: int, pad_id: int, device) -> dict[str, float]:
    """``step_accuracy`` and ``step_loss`` over the labelled step ends of ``data`` (all ranks),
    ``step_accuracy_wrong``: the accuracy on the steps labelled wrong alone, and ``unlabelled_rows``."""
    was_training = model.training
    model.eval()
    idx, weight = shard_for_eval(len(data))
    sums = torch.zeros(5, dtype=torch.float64)  # right, ends, loss sum, right on wrong steps, wrong steps
    for i in range(0, len(idx), batch_size):
        batch = collate_steps(data, idx[i:i + batch_size], pad_id)
        values = model(batch["input_ids"].to(device), batch["attention_mask"].to(device)).values.double().cpu()
        ends, targets = batch["step_ends"], batch["step_labels"].double()
        w = weight[i:i + batch_size].double().repeat(2)[:, None] * ends
        right = ((values > 0) == (targets > 0.5)).double()
        bce = torch.nn.functional.binary_cross_entropy_with_logits(values, targets, reduction="none")
        wrong = w * (targets < 0.5)
        sums += torch.stack([(right * w).sum(), w.sum(), (bce * w).sum(), (right * wrong).sum(), wrong.sum()])
    model.train(was_training)
    sums = D.all_reduce_sum(sums)
    return {"step_accuracy": float(sums[0] / sums[1].clamp(min=1)), "step_loss": float(sums[2] / sums[1].clamp(min=1)),
            "step_accuracy_wrong": float(sums[3] / sums[4].clamp(min=1)), "step_ends": float(sums[1]),
            "unlabelled_rows": float(data.unlabelled)}


def check_process(params, init_kind: str) -> None:
    """Step labels come from the multi-step task's checker; the steps are scored by the value head."""
    problems = [msg for bad, msg in (
        (params.data.source != "multistep",
         f"data.source must be multistep (the step labels come from its checker), not {params.data.source}"),
        (params.rm.loss != "sequence", f"rm.loss must be sequence, not {params.rm.loss}"),
    ) if bad]
    if problems:
        raise TrainingInputError("rm.objective: process: " + "; ".join(problems))
