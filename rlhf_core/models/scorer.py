"""``RewardScorer``: score texts (or prompt/response pairs, or token tensors) with a saved reward model (ours, or
any decoder ``*ForSequenceClassification`` reward model with its tokenizer: ``rlhf_core.models.reward_format``).

Example::

    scorer = RewardScorer.from_pretrained("models/rm")
    scorer.score(["Human: What is 2 + 3?\\n\\nAssistant: 5"])          # tensor([..]) one score per text
    scorer.score_responses(["Human: What is 2 + 3?\\n\\nAssistant:"], [" 5"])   # tokenised exactly as in training

Texts are scored as ``text + EOS`` (training rows end with EOS; the score is read at the last token).
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path

import torch

from rlhf_core.data.collate import (
    Ragged,
    TokenizedSequences,
    concat_rows,
    encode_for_scoring,
    encode_prompts,
    prompt_batches,
)
from rlhf_core.data.tokenizer import load_tokenizer, same_tokenizer
from rlhf_core.models.implicit_reward import ImplicitRewardScorer, is_implicit
from rlhf_core.models.value_head import ValueHeadModel
from rlhf_core.passes.values import worth_sharing


class RewardScorer:
    def __init__(self, model: ValueHeadModel, tokenizer, max_length: int | None = None, batch_size: int = 32,
                 device: str | torch.device | None = None):
        self.device = torch.device(device) if device is not None else next(model.parameters()).device
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.max_length = max_length or getattr(model.config, "max_position_embeddings", None) or 1 << 30
        self.batch_size = batch_size

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device | None = None, batch_size: int = 32,
                        trust_remote_code: bool = False, dtype: torch.dtype | None = None) -> RewardScorer:
        """Load a reward model and the tokenizer saved beside it: ``models/rm``, or any ``*ForSequenceClassification``
        reward model with its own tokenizer (a directory or a Hub id), or the previous value-head layout
        (``reward_format``). Texts are tokenised with the RM's own tokenizer, whatever the actor's; a directory
        without tokenizer files, or that is no reward model, is an error naming it."""
        tokenizer = load_tokenizer(path, trust_remote_code=trust_remote_code)
        model = ValueHeadModel.from_pretrained(path, trust_remote_code=trust_remote_code, dtype=dtype,
                                               require_head=True)
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        return cls(model, tokenizer, batch_size=batch_size, device=device)

    @torch.no_grad()
    def score_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """Scores of already tokenised rows (left or right padded) ``[B, T] -> [B]``."""
        out = []
        for i in range(0, len(input_ids), self.batch_size):
            ids = input_ids[i:i + self.batch_size].to(self.device)
            mask = attention_mask[i:i + self.batch_size].to(self.device)
            out.append(self.model(ids, mask).scores.float().cpu())
        return torch.cat(out) if out else torch.empty(0)

    def _score_ragged(self, rows: Ragged) -> torch.Tensor:
        ids, valid = rows.pad(pad_value=self.tokenizer.pad_token_id, side="right")
        return self.score_tokens(ids, valid.long())

    def score(self, texts: Sequence[str]) -> torch.Tensor:
        """One float score per text (``text + EOS``), shape ``[len(texts)]``."""
        toks = encode_prompts(self.tokenizer, texts)
        eos = Ragged.from_lengths(torch.full((len(toks),), self.tokenizer.eos_token_id, dtype=torch.long),
                                  torch.ones(len(toks), dtype=torch.long))
        rows, _ = concat_rows(toks, eos, int(self.max_length))
        rows.flat[rows.offsets[1:] - 1] = self.tokenizer.eos_token_id  # a cut text is scored at an EOS too
        return self._score_ragged(rows)

    def score_responses(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        """Scores of ``prompt + response + EOS`` tokenised exactly as the RM was trained.

        Rows of one batch (``batch_size`` consecutive rows) that carry the same prompt, such as the G samples of
        a GRPO group, compute it once (:meth:`ValueHeadModel.shared_prefix_scores`) where that skips at least a
        quarter of the positions (``passes.values.worth_sharing``): the same scores up to float rounding.
        """
        return self.score_encoded(self.encode(prompts, responses))

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> TokenizedSequences:
        """``prompt + response + EOS`` rows tokenised as the RM was trained (a cut row ends in EOS)."""
        return encode_for_scoring(self.tokenizer, prompts, responses, self.max_length)

    def score_encoded(self, seqs: TokenizedSequences) -> torch.Tensor:
        """Scores of rows from :meth:`encode` (``score_responses`` without the tokenisation)."""
        dev, out = self.device, []
        for b in prompt_batches(seqs, self.batch_size, self.tokenizer.pad_token_id):
            scores = None
            if worth_sharing(len(b.first), b.prefix.shape[1], len(b.rows), b.suffix.shape[1]) and bool(
                    b.prefix_mask.any(dim=1).all()):
                with torch.no_grad():
                    scores = self.model.shared_prefix_scores(b.prefix[b.first].to(dev), b.prefix_mask[b.first].to(dev),
                                                             b.owner.to(dev), b.suffix.to(dev), b.suffix_mask.to(dev))
            out.append(scores.float().cpu() if scores is not None else self._score_ragged(seqs.tokens.select(b.rows)))
        return torch.cat(out) if out else torch.empty(0)


ENSEMBLE_FILE = "ensemble.json"  # in models/rm when rm.ensemble > 1: the members and their standardisation
MEMBERS_DIR = "members"  # models/rm/members/<k>: members 1..K-1 (member 0 is models/rm itself)


class EnsembleScorer:
    """The mean standardised score of K reward models (``rm.ensemble``; the mean objective of Coste et al. 2024,
    "Reward Model Ensembles Help Mitigate Overoptimization")::

        s(x, y) = 1/K sum_k (s_k(x, y) - c_k) / a_k

    ``c_k`` and ``a_k`` are member k's mean and std score over the held-out pairs' chosen and rejected responses
    (``models/rm/ensemble.json``). A Bradley-Terry score has an arbitrary offset and scale per model; standardising
    puts the members on one footing before they are averaged. Same scoring API as :class:`RewardScorer`.
    """

    def __init__(self, members: Sequence[RewardScorer], center: Sequence[float], scale: Sequence[float]):
        if not members or not len(members) == len(center) == len(scale):
            raise ValueError(f"an ensemble needs one center and one scale per member: {len(members)} members, "
                             f"{len(center)} centers, {len(scale)} scales")
        if min(scale) <= 0:
            raise ValueError(f"ensemble member scales must be > 0, got {list(scale)}")
        self.members = list(members)
        self.center = torch.tensor(center, dtype=torch.float)
        self.scale = torch.tensor(scale, dtype=torch.float)
        self.tokenizer = self.members[0].tokenizer
        self.one_encoding = self.tokenizer is not None and all(  # same tokens for every member: encode once
            m.max_length == self.members[0].max_length and m.tokenizer is not None
            and same_tokenizer(m.tokenizer, self.tokenizer) for m in self.members[1:])

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device | None = None, batch_size: int = 32,
                        trust_remote_code: bool = False, dtype: torch.dtype | None = None) -> EnsembleScorer:
        """Load the ensemble that ``path / ensemble.json`` lists (member paths relative to ``path``)."""
        paths, center, scale = read_ensemble_spec(path)
        scorers = [load_one_scorer(Path(path) / p, device=device, batch_size=batch_size,
                                   trust_remote_code=trust_remote_code, dtype=dtype) for p in paths]
        return cls(scorers, center, scale)

    def combine(self, per_member: list[torch.Tensor]) -> torch.Tensor:
        """The ensemble's scores from each member's raw scores (``K`` tensors of one shape)."""
        stacked = torch.stack(per_member)
        shape = (-1,) + (1,) * (stacked.dim() - 1)
        return ((stacked - self.center.view(shape)) / self.scale.view(shape)).mean(dim=0)

    def score_tokens(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.combine([m.score_tokens(input_ids, attention_mask) for m in self.members])

    def score(self, texts: Sequence[str]) -> torch.Tensor:
        return self.combine([m.score(texts) for m in self.members])

    def score_responses(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        """Tokenised once where every member has the first one's vocabulary and length limit (the RM stage
        trains them so), else by each member."""
        if self.one_encoding:
            seqs = self.members[0].encode(prompts, responses)
            return self.combine([m.score_encoded(seqs) for m in self.members])
        return self.combine([m.score_responses(prompts, responses) for m in self.members])


def read_ensemble_spec(path: str | Path) -> tuple[list[str], list[float], list[float]]:
    """The member paths, centers and scales that ``path / ensemble.json`` lists (an error names the file)."""
    spec_file = Path(path) / ENSEMBLE_FILE
    try:
        members = json.loads(spec_file.read_text())["members"]
        paths, center, scale = ([m[key] for m in members] for key in ("path", "center", "scale"))
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{spec_file}: not an ensemble file (a `members` list of path/center/scale): "
                         f"{err!r}") from err
    return paths, center, scale


def load_one_scorer(path: str | Path, **kwargs) -> RewardScorer | ImplicitRewardScorer:
    """One reward model: DPO's implicit reward where the folder holds ``implicit_reward.json``, else a score head."""
    if is_implicit(path):
        return ImplicitRewardScorer.from_pretrained(path, **kwargs)
    return RewardScorer.from_pretrained(path, **kwargs)


def load_scorer(path: str | Path, **kwargs) -> RewardScorer | ImplicitRewardScorer | EnsembleScorer:
    """``models/rm``'s scorer: the ensemble when the directory holds ``ensemble.json``, else the single RM (a score
    head, or DPO's implicit reward: ``rlhf_core.models.implicit_reward``)."""
    if (Path(path) / ENSEMBLE_FILE).is_file():
        return EnsembleScorer.from_pretrained(path, **kwargs)
    return load_one_scorer(path, **kwargs)
