"""DPO's implicit reward as a reward model (``rm.objective: dpo``): a LoRA adapter on a policy, and the policy.

    r(x, y) = beta * [log pi(y|x) - log pi_ref(y|x)]        log pi(y|x): summed over response + EOS

``pi`` is the model with the adapter on, ``pi_ref`` the same weights with it off: the RM stage's init
(``models/sft`` by default), which is also the RL actor's start and KL reference. The reward reads the
preference through the LM head, where SFT put the task, rather than through a fresh score head.

On disk (``models/rm``): the reference's weights as a causal LM, the adapter in ``adapter/`` (never merged: the
reference is the adapter switched off), the tokenizer, and ``implicit_reward.json`` (``{"beta": ...}``), which
marks the folder. :func:`rlhf_core.models.scorer.load_scorer` reads it as :class:`ImplicitRewardScorer`, the same
``score_responses`` as the score-head RM, so RL, evaluation and serving take either.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import NamedTuple

import torch

from rlhf_core.algos import implicit_reward, logprobs_from_logits, response_logprob_sums
from rlhf_core.data.collate import TokenizedSequences, encode_for_scoring, prompt_batches
from rlhf_core.data.tokenizer import load_tokenizer
from rlhf_core.models.loading import ADAPTER_DIR, save_causal_lm
from rlhf_core.ops.integrity import verify_model_dir
from rlhf_core.passes.generation import response_logits

IMPLICIT_FILE = "implicit_reward.json"


def is_implicit(path: str | Path) -> bool:
    return (Path(path) / IMPLICIT_FILE).is_file()


def read_beta(path: str | Path) -> float:
    spec = Path(path) / IMPLICIT_FILE
    try:
        return float(json.loads(spec.read_text())["beta"])
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"{spec}: not an implicit-reward file (a JSON object with a number `beta`): {err!r}") from err


class PolicyScores(NamedTuple):
    """Per row ``[B]``: the implicit reward (None where the reference pass was skipped), the policy's summed response
    log-prob (with gradients where enabled) and the number of response tokens it sums over."""

    reward: torch.Tensor | None
    logp: torch.Tensor
    tokens: torch.Tensor


def implicit_scores(forward, adapter_off, input_ids: torch.Tensor, attention_mask: torch.Tensor,
                    response_mask: torch.Tensor, beta: float, reference: bool = True) -> PolicyScores:
    """``r`` of each row ``[B]`` (:class:`PolicyScores`): the policy pass ``forward(...)`` (with gradients where
    enabled) and the reference pass, the same under ``adapter_off()`` without gradients, over the same
    right-padded rows. ``forward``: a peft model or the engine around one; ``adapter_off``: that peft model's
    ``disable_adapter``. Without ``reference`` only the policy pass runs (the reward is None)."""
    logits = forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    logp = response_logprob_sums(logits.float(), input_ids, response_mask)
    if not reference:
        return PolicyScores(None, logp, response_mask.sum(dim=-1))
    with torch.no_grad(), adapter_off():
        ref_logits = forward(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        ref_logp = response_logprob_sums(ref_logits.float(), input_ids, response_mask)
    return PolicyScores(implicit_reward(logp, ref_logp, beta), logp, response_mask.sum(dim=-1))


def implicit_scores_on_prompts(forward, adapter_off, prefix_ids: torch.Tensor, prefix_mask: torch.Tensor,
                               owner: torch.Tensor, suffix_ids: torch.Tensor, suffix_mask: torch.Tensor,
                               beta: float, reference: bool = True) -> PolicyScores:
    """``implicit_scores`` of the rows ``cat(prefix_ids[owner[i]], suffix_ids[i])``: prompts ``[U, P]``
    left-padded, responses ``[B, S]`` right-padded (EOS included, ``suffix_mask``). Only the logits that score the
    responses are computed (``generation.response_logits``), and the rows of one prompt share its pass where the
    model can (its KV cache, or its group packed): the same rewards up to float rounding, without the prompt
    positions' ``[B, P, V]`` logits. Without ``reference`` only the policy pass runs (the reward is None)."""
    order = torch.argsort(owner, stable=True)  # the rows of one prompt consecutive, as the group passes want
    ids = torch.cat([prefix_ids[owner], suffix_ids], dim=1)[order]
    mask = torch.cat([prefix_mask[owner], suffix_mask], dim=1).long()[order]
    targets, keep = suffix_ids[order], suffix_mask[order].bool()

    def logp() -> torch.Tensor:
        logits = response_logits(forward, ids, mask, suffix_ids.shape[1], group=owner[order])
        return (logprobs_from_logits(logits.float(), targets) * keep).sum(dim=-1)

    def unsort(x: torch.Tensor) -> torch.Tensor:
        return torch.empty_like(x).index_copy_(0, order, x)

    policy = logp()
    if not reference:
        return PolicyScores(None, unsort(policy), suffix_mask.sum(dim=-1))
    with torch.no_grad(), adapter_off():
        ref = logp()
    return PolicyScores(unsort(implicit_reward(policy, ref, beta)), unsort(policy), suffix_mask.sum(dim=-1))


def save_implicit_rm(model, directory: str | Path, beta: float) -> None:
    """The reference's weights, the adapter beside them (``adapter/``) and ``implicit_reward.json``."""
    save_causal_lm(model, directory, merge_lora=False)
    (Path(directory) / IMPLICIT_FILE).write_text(json.dumps({"beta": beta}) + "\n")


class ImplicitRewardScorer:
    """``score_responses(prompts, responses) -> Tensor[B]``: the implicit reward of ``prompt + response + EOS``,
    tokenised as the RM stage trained it."""

    def __init__(self, model, tokenizer, beta: float, batch_size: int = 32, device: str | torch.device = "cpu"):
        self.device = torch.device(device)
        self.model = model.to(self.device).eval()
        self.tokenizer = tokenizer
        self.beta = beta
        self.batch_size = batch_size
        self.max_length = getattr(model.config, "max_position_embeddings", None) or 1 << 30

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device | None = None, batch_size: int = 32,
                        trust_remote_code: bool = False, dtype: torch.dtype | None = None) -> ImplicitRewardScorer:
        """Load ``path`` (the reference, its ``adapter/``, the tokenizer, ``implicit_reward.json``); a folder
        without the adapter is an error naming it."""
        from peft import PeftModel
        from transformers import AutoModelForCausalLM

        path = Path(path)
        beta = read_beta(path)
        if not (path / ADAPTER_DIR).is_dir():
            raise ValueError(f"{path}: an implicit reward model needs its adapter in {path / ADAPTER_DIR} (the "
                             "reference is the same weights with it disabled)")
        verify_model_dir(path)
        model = AutoModelForCausalLM.from_pretrained(str(path), use_safetensors=True,
                                                     trust_remote_code=trust_remote_code,
                                                     **({"dtype": dtype} if dtype is not None else {}))
        model = PeftModel.from_pretrained(model, str(path / ADAPTER_DIR))
        device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        return cls(model, load_tokenizer(path, trust_remote_code=trust_remote_code), beta, batch_size, device)

    def encode(self, prompts: Sequence[str], responses: Sequence[str]) -> TokenizedSequences:
        return encode_for_scoring(self.tokenizer, prompts, responses, self.max_length)

    @torch.no_grad()
    def score_encoded(self, seqs: TokenizedSequences) -> torch.Tensor:
        """Per batch of ``batch_size`` rows, each distinct prompt once (``implicit_scores_on_prompts``)."""
        dev = self.device
        out = [implicit_scores_on_prompts(self.model, self.model.disable_adapter, b.prefix[b.first].to(dev),
                                          b.prefix_mask[b.first].to(dev), b.owner.to(dev), b.suffix.to(dev),
                                          b.suffix_mask.to(dev), self.beta).reward.float().cpu()
               for b in prompt_batches(seqs, self.batch_size, self.tokenizer.pad_token_id)]
        return torch.cat(out) if out else torch.empty(0)

    def score_responses(self, prompts: Sequence[str], responses: Sequence[str]) -> torch.Tensor:
        return self.score_encoded(self.encode(prompts, responses))

    def score(self, texts: Sequence[str]) -> torch.Tensor:
        raise ValueError("an implicit reward scores a response given its prompt (log pi(y|x)): pass prompt and "
                         "response columns, not whole texts")
