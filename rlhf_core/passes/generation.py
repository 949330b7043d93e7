"""Generation and response bookkeeping shared by RLHF rollouts and evaluation.

Masks are where RLHF code goes wrong, so the rules live here, once:
prompts are left-padded; a response ends at its first EOS, which is kept in
the action mask; everything after it is masked; pad is never taken for EOS
(the mask is built from EOS positions alone, so ``pad == eos`` tokenizers
work); logits at position t score token t+1.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from rlhf_core.algos import entropy_from_logits, logprobs_from_logits
from rlhf_core.data import collate
from rlhf_core.engine import distributed as D
from rlhf_core.passes.group_packing import PACK_MAX_WIDTH, pack_groups, packed_logits, packed_width, supports_packing
from rlhf_core.passes.prefix_cache import (
    checkpointed,
    on_shared_prefixes,
    position_ids,
    response_lengths,
    supports_cache_repeat,
    supports_prefix_cache,
)
from rlhf_core.passes.static_decode import static_rollout, supports_static_decode


def response_mask(responses: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """1 up to and including the first EOS of each row, 0 after it; rows without EOS are all 1.

    ``eos_before[t]`` = number of EOS strictly before t; a token is an action iff none came before.
    """
    is_eos = (responses == eos_token_id).long()
    eos_before = is_eos.cumsum(dim=1) - is_eos
    return (eos_before == 0).long()


def ended_with_eos(responses: torch.Tensor, eos_token_id: int) -> torch.Tensor:
    """True for rows that contain an EOS (the response ended rather than hitting max length)."""
    return (responses == eos_token_id).any(dim=1)


@dataclass
class PromptResponseBatch:
    """Left-padded prompts, responses and their masks: ``sequences = cat(prompt_ids, responses)``, attended
    where ``cat(prompt_mask, action_mask)`` is 1 (so nothing after a response's first EOS is attended)."""

    prompt_ids: torch.Tensor  # [B, P] left-padded
    prompt_mask: torch.Tensor  # [B, P]
    responses: torch.Tensor  # [B, R]
    action_mask: torch.Tensor  # [B, R]: response tokens up to and including the first EOS

    @property
    def sequences(self) -> torch.Tensor:
        return torch.cat([self.prompt_ids, self.responses], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.cat([self.prompt_mask, self.action_mask], dim=1)


@dataclass
class Rollout(PromptResponseBatch):
    """Sampled (or greedy) responses to a batch of prompts."""

    texts: list[str]  # decoded responses (without EOS and what follows)
    eos_token_id: int = -1
    logp: torch.Tensor | None = None  # [B, R] log-probs of the sampled tokens, recorded while sampling

    @property
    def ended(self) -> torch.Tensor:
        """Rows whose response ended with EOS (also when the EOS is the last generated token)."""
        last = (self.action_mask.sum(dim=1) - 1).clamp(min=0)
        return self.responses.gather(1, last[:, None]).squeeze(1) == self.eos_token_id


def encode_prompts(tokenizer, prompts: list[str], max_len: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded prompt ids and mask, tokenised exactly as in training (``collate.encode_prompts``: BOS where
    the tokenizer adds one) and left-truncated to the last ``max_len`` tokens when given."""
    toks = collate.encode_prompts(tokenizer, prompts, max_len)
    ids, valid = toks.pad(pad_value=tokenizer.pad_token_id, side="left")
    return ids, valid.long()


@dataclass(frozen=True)
class GenerationConfig:
    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    do_sample: bool = True
    synced_gpus: bool = False
    min_new_tokens: int = 0  # EOS suppressed before this many tokens (benchmarks: a fixed workload)
    record_logprobs: bool = False  # Rollout.logp: the sampled tokens' log-probs, taken while sampling
    engine: str = "auto"  # "generate", "static" (passes/static_decode.py) or "auto" (static on a GPU)
    compile_step: bool = False  # static engine: torch.compile the decode forward (rlhf.rollout_compile)
    decode_attention: str = "sdpa"  # the compiled step's attention (rlhf.rollout_attention)
    free_finished: bool = True  # static engine: finished rows leave the batch (rlhf.rollout_free_finished)


class SampledLogprobs:
    """A logits processor that records ``log softmax(logits_t / T)[token_t]`` of every sampled token while
    ``generate`` runs: the rollout policy's log-probs without a second forward pass over the sequences.

    ``generate`` calls its processors with the ids so far and the next position's logits; the token drawn from
    step ``t``'s logits is the last id at step ``t + 1``, so each call gathers the previous step's log-prob and
    keeps only the current ``[B, V]`` log-softmax (memory: one step, not ``B x R x V``). ``finish(responses)``
    gathers the last step. Custom processors run before ``generate``'s own warpers (temperature, top-p), so the
    logits seen here are the model's raw ones, and the result is exactly what ``response_logprobs`` computes
    from the same weights (up to float rounding between the KV-cached and the full forward; tested).
    """

    def __init__(self, temperature: float):
        self.temperature = temperature
        self.steps: list[torch.Tensor] = []
        self.last: torch.Tensor | None = None

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self.last is not None:
            self.steps.append(self.last.gather(1, input_ids[:, -1:]).squeeze(1))
        self.last = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def finish(self, responses: torch.Tensor) -> torch.Tensor:
        """``[B, R]`` log-probs of ``responses`` (the tokens generated after the prompt). A step ``generate``
        took and then undid (its deferred stop check) was recorded but is not in ``responses``: dropped."""
        R = responses.shape[1]
        if len(self.steps) < R and self.last is not None:
            self.steps.append(self.last.gather(1, responses[:, -1:].to(self.last.device)).squeeze(1))
        self.last = None
        if len(self.steps) < R:
            raise RuntimeError(f"recorded {len(self.steps)} sampling steps for {R} response tokens")
        return torch.stack(self.steps[:R], dim=1).cpu()


@contextlib.contextmanager
def clean_generation_config(model, tokenizer) -> Iterator[None]:
    """Sample from exactly the distribution the log-probs are computed from.

    ``generate`` fills every setting it is not given from the model's own ``generation_config`` (a
    checkpoint's ``generation_config.json``: ``repetition_penalty``, ``no_repeat_ngram_size``, ``min_p``,
    ``bad_words_ids``, ...), and those processors reshape the sampling distribution while
    ``logits / temperature`` is what the trainer scores: ratios and KL would be off. For the call, every
    module's ``generation_config`` is a fresh one holding only the special token ids; restored after.
    """
    from transformers import GenerationConfig as HFGenerationConfig

    clean = HFGenerationConfig(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                               bos_token_id=getattr(tokenizer, "bos_token_id", None))
    saved = [(m, m.generation_config) for m in model.modules() if hasattr(m, "generation_config")]
    try:
        for m, _ in saved:
            m.generation_config = clean
        yield
    finally:
        for m, cfg in saved:
            m.generation_config = cfg


def rollout(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokenizer, gen: GenerationConfig,
            group_size: int = 1) -> Rollout:
    """Sample one response per (left-padded) prompt row with the KV cache; masks from the first EOS.

    Prompts come pre-tokenised (once per run, with the same special tokens as SFT training); greedy when
    ``do_sample`` is false. Only the settings of ``gen`` shape the distribution (``clean_generation_config``:
    the checkpoint's ``generation_config.json`` is ignored here). Generation runs under
    ``torch.inference_mode()``; the returned tensors are ordinary (cloned) tensors, usable in training passes.

    With ``gen.record_logprobs`` (and no ``min_new_tokens``, whose EOS ban would enter the logits) the rollout
    also carries ``logp``, the sampled tokens' log-probs under ``logits / temperature`` (:class:`SampledLogprobs`).

    ``group_size`` > 1: the rows come in runs of that many copies of one prompt (GRPO's G samples); each prompt
    but its last token is prefilled once and its KV cache repeated to the run (:func:`prefilled_cache`), so
    ``generate`` starts from the last prompt token: the same distribution, G x fewer prefill FLOPs.

    ``gen.engine`` picks the sampler (:func:`uses_static_decode`): transformers' ``generate``, or the static KV
    cache decoder of ``passes/static_decode.py`` (the same tokens for the same seed, each prompt prefilled once).
    """
    device = next(model.parameters()).device
    if uses_static_decode(model, gen, device):
        return _static_rollout(model, prompt_ids, prompt_mask, tokenizer, gen, group_size)
    kwargs = ({"do_sample": True, "temperature": gen.temperature, "top_p": gen.top_p, "top_k": 0}
              if gen.do_sample else {"do_sample": False})
    recorder = SampledLogprobs(gen.temperature) if gen.record_logprobs and not gen.min_new_tokens else None
    if recorder is not None:
        from transformers import LogitsProcessorList

        kwargs["logits_processor"] = LogitsProcessorList([recorder])
    with torch.inference_mode(), clean_generation_config(model, tokenizer):
        cache = prefilled_cache(model, prompt_ids.to(device), prompt_mask.to(device), group_size)
        if cache is not None:
            kwargs["past_key_values"] = cache
        out = model.generate(input_ids=prompt_ids.to(device), attention_mask=prompt_mask.to(device),
                             max_new_tokens=gen.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                             pad_token_id=tokenizer.pad_token_id, use_cache=True, synced_gpus=gen.synced_gpus,
                             **({"min_new_tokens": gen.min_new_tokens} if gen.min_new_tokens else {}), **kwargs)
        responses = out[:, prompt_ids.shape[1]:]
        logp = recorder.finish(responses) if recorder is not None and responses.shape[1] else None
    return _as_rollout(prompt_ids, prompt_mask, responses.cpu().clone(), tokenizer,
                       logp.clone() if logp is not None else None)


def uses_static_decode(model, gen: GenerationConfig, device: torch.device) -> bool:
    """Whether ``gen.engine`` picks the static decoder for ``model``: asked for (``static``, or ``auto`` on a
    GPU), and the model can run it (``supports_static_decode``) with its parameters in place (not ZeRO-3 over
    several processes, whose generation gathers them layer by layer, ``synced_gpus``)."""
    wanted = gen.engine == "static" or (gen.engine == "auto" and device.type == "cuda")
    return (wanted and not gen.synced_gpus and not D.forwards_in_lockstep(model)
            and supports_static_decode(model))


def _static_rollout(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, tokenizer, gen: GenerationConfig,
                    group_size: int) -> Rollout:
    shares = group_size > 1 and prompt_ids.shape[0] % group_size == 0
    with clean_generation_config(model, tokenizer):
        responses, logp = static_rollout(
            model, prompt_ids, prompt_mask, gen.max_new_tokens, tokenizer.eos_token_id, tokenizer.pad_token_id,
            gen.temperature, gen.top_p, gen.do_sample, gen.min_new_tokens, group_size if shares else 1,
            compile=gen.compile_step, free_finished=gen.free_finished, attention=gen.decode_attention)
    keep_logp = gen.record_logprobs and not gen.min_new_tokens
    return _as_rollout(prompt_ids, prompt_mask, responses.cpu(), tokenizer, logp.cpu() if keep_logp else None)


def _as_rollout(prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, responses: torch.Tensor, tokenizer,
                logp: torch.Tensor | None) -> Rollout:
    """The response masks (from the first EOS) and texts of sampled ``responses``."""
    if responses.shape[1] == 0:
        responses = torch.full((prompt_ids.shape[0], 1), tokenizer.eos_token_id, dtype=prompt_ids.dtype)
    mask = response_mask(responses, tokenizer.eos_token_id)
    texts = tokenizer.batch_decode(torch.where(mask.bool(), responses, tokenizer.pad_token_id),
                                   skip_special_tokens=True)
    return Rollout(prompt_ids.cpu(), prompt_mask.cpu(), responses, mask, texts, tokenizer.eos_token_id, logp)


def prefilled_cache(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int):
    """The KV cache of ``prompt_ids[:, :P-1]`` computed once per run of ``group_size`` identical rows and
    repeated to every row; None where nothing is shared, the rows do not come in such runs, a prefix would be
    all padding, or a layer of the model carries a state that cannot be repeated (``supports_cache_repeat``):
    then ``generate`` prefills every row itself. Under ZeRO-3 over several ranks, only where every rank can."""
    B, P = prompt_ids.shape
    firsts, first_mask = prompt_ids[::group_size, :P - 1], prompt_mask[::group_size, :P - 1]
    shares = (group_size > 1 and P > 1 and B % group_size == 0 and bool(first_mask.any(dim=1).all())
              and supports_cache_repeat(model))
    if D.forwards_in_lockstep(model):
        (shares,) = D.all_agree(shares)
    if not shares:
        return None
    if not torch.equal(prompt_ids[::group_size].repeat_interleave(group_size, dim=0), prompt_ids):
        raise ValueError(f"rollout: rows do not come in runs of {group_size} identical prompts")
    out = model(input_ids=firsts, attention_mask=first_mask, position_ids=position_ids(first_mask),
                logits_to_keep=1, use_cache=True)
    cache = out.past_key_values
    cache.batch_repeat_interleave(group_size)
    return cache


def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, temperature: float = 1.0,
             top_p: float = 1.0, do_sample: bool = True, max_prompt_len: int | None = None) -> Rollout:
    """Sample (or greedily decode, with ``do_sample=False`` or ``temperature == 0``) one response per prompt
    text: ``encode_prompts`` then ``rollout``."""
    prompt_ids, prompt_mask = encode_prompts(tokenizer, prompts, max_prompt_len)
    gen = GenerationConfig(max_new_tokens, temperature, top_p, do_sample=do_sample and temperature > 0)
    return rollout(model, prompt_ids, prompt_mask, tokenizer, gen)


def response_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                    temperature: float = 1.0, group: torch.Tensor | None = None, pack: bool = False) -> torch.Tensor:
    """Logits ``[B, R, V]`` that score the last ``R = response_len`` tokens of ``sequences``, divided by
    ``temperature`` (the distribution that sampled them; TRL and OpenRLHF do the same).

    The logits at position ``t`` score token ``t + 1``: positions ``-R-1 .. -2`` score the response, so the last
    token is not fed and only the ``R`` last positions of the rest are computed (``logits_to_keep``). Positions
    ignore left padding.

    ``group`` (``[B]``, rows of one prompt consecutive, e.g. GRPO's G samples) computes each prompt once: with
    ``pack`` and a model whose every layer is SDPA attention without a window (``supports_packing``), the
    group's responses packed after its prompt in one row (``group_packing``, up to ``PACK_MAX_WIDTH`` columns,
    checked before the mask is built); otherwise the prompt's KV cache indexed out to buckets of response
    lengths (:func:`shared_prefix_logits`, ``supports_prefix_cache``; not in a checkpointed training forward,
    ``prefix_cache.checkpointed``, whose layers re-run in backward); otherwise one plain forward. The same
    logits (and gradients) at the response's masked-in positions up to float rounding, fewer FLOPs; 0 past
    them. Under ZeRO-3 over several ranks every rank takes the same path (the first that all ranks can take),
    so that all make the same forward passes.
    """
    split = shared_prefix_split(sequences, attention_mask, response_len, group) if group is not None else None
    packs = split is not None and pack and supports_packing(model) and (
        packed_width(attention_mask, response_len, split[0], split[1]) <= PACK_MAX_WIDTH)
    shares = split is not None and not checkpointed(model) and supports_prefix_cache(model)
    lockstep = D.forwards_in_lockstep(model)
    if lockstep:
        packs, shares = D.all_agree(packs, shares)
    logits = None
    if packs:
        logits = packed_logits(model, pack_groups(sequences, attention_mask, response_len, split[0], split[1]))
    elif shares:
        logits = _cached_prefix_logits(model, sequences, attention_mask, response_len, *split, lockstep)
    if logits is None:
        mask = attention_mask[:, :-1]
        logits = model(input_ids=sequences[:, :-1], attention_mask=mask, position_ids=position_ids(mask),
                       logits_to_keep=response_len, use_cache=False).logits
    return logits / temperature if temperature != 1.0 else logits


def shared_prefix_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                         group: torch.Tensor) -> torch.Tensor | None:
    """``response_logits`` (temperature 1) with each shared prompt computed once, or None where nothing is
    shared (every row its own group), a prefix would be all padding, or the model's cache cannot be shared
    (``prefix_cache.supports_prefix_cache``) or indexed.

    With ``P`` prompt columns, the prompt of each run of equal ``group`` ids minus its last token goes through
    the model once (``P - 1`` positions, one logit kept; the head all runs open with once for all of them:
    ``prefix_cache.prefix_cache``). The rows are cut into buckets by response length
    (``prefix_cache.length_buckets``); per bucket of width ``w`` the runs' KV cache is indexed out to its rows
    (``prefix_cache.select_rows``: a gather, differentiable, so each prompt's gradient is the sum over its
    rows), and every row's last prompt token and first ``w - 1`` response tokens go through on top of it::

        prefix:  x_g[:P-1]                          for the first row g of each run     (G x fewer prompt FLOPs)
        suffix:  [x_i[P-1], y_i[:w-1]]  attending to cache[g(i)]   ->  logits scoring y_i[:w]

    Positions and the attention mask are those of the full rows, so the logits are those of one forward over
    ``sequences`` at every masked-in response position; past a row's bucket width they are 0. Rows of one run
    must carry identical prompts (checked).
    """
    split = shared_prefix_split(sequences, attention_mask, response_len, group)
    if split is None or checkpointed(model) or not supports_prefix_cache(model):
        return None
    return _cached_prefix_logits(model, sequences, attention_mask, response_len, *split)


def _cached_prefix_logits(model, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                          first: torch.Tensor, owner: torch.Tensor, P: int,
                          lockstep: bool = False) -> torch.Tensor | None:
    def cache_forward(ids, mask, pos, cache):
        return model(input_ids=ids, attention_mask=mask, position_ids=pos, past_key_values=cache, logits_to_keep=1,
                     use_cache=True).past_key_values

    def suffix_logits(ids, mask, cache):  # positions: the full rows', counted from the mask
        return model(input_ids=ids, attention_mask=mask, position_ids=position_ids(mask)[:, -ids.shape[1]:],
                     past_key_values=cache, logits_to_keep=ids.shape[1], use_cache=True).logits

    return on_shared_prefixes(cache_forward, suffix_logits, sequences[first, :P - 1], attention_mask[first, :P - 1],
                              owner, sequences[:, P - 1:], attention_mask[:, P - 1:],
                              response_lengths(attention_mask[:, P:]), response_len, lockstep)


def shared_prefix_split(sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                        group: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int] | None:
    """How :func:`shared_prefix_logits` (and the critic's ``sequence_values``) split rows whose runs of equal
    ``group`` ids share their ``P`` prompt columns: ``(first, owner, P)`` with ``first`` the first row of each
    run and ``owner`` each row's run index (on ``sequences``' device); None where nothing is shared or a
    prefix (the prompt minus its last token) would be all padding. Rows of one run must carry identical
    prompts (checked)."""
    P = sequences.shape[1] - response_len
    first = torch.ones_like(group, dtype=torch.bool)
    first[1:] = group[1:] != group[:-1]
    if int(first.sum()) == len(group) or P < 2 or not bool(attention_mask[first, :P - 1].any(dim=1).all()):
        return None
    owner = first.long().cumsum(0) - 1  # row -> its run's index among the prefixes
    prompts = sequences[:, :P]
    if not torch.equal(prompts[first][owner], prompts):
        raise ValueError("shared_prefix_logits: rows with the same group id carry different prompts")
    return first, owner.to(sequences.device), P


def response_logprobs(model, sequences: torch.Tensor, attention_mask: torch.Tensor, response_len: int,
                      temperature: float = 1.0, return_entropy: bool = False, entropy_grad: bool = False,
                      group: torch.Tensor | None = None, pack: bool = False):
    """Log-probs ``[B, R]`` of the last ``R`` tokens of ``sequences`` under ``model`` (``response_logits``;
    ``group``: shared prompts computed once): the one log-prob pass of rollouts, training, the reference and tests.

    ``return_entropy`` also gives the per-token entropy ``[B, R]`` (differentiable only with ``entropy_grad``;
    otherwise computed without a graph, for logging).
    """
    logits = response_logits(model, sequences, attention_mask, response_len, temperature, group, pack)
    logp = logprobs_from_logits(logits, sequences[:, -response_len:])
    if return_entropy:
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
        return logp, entropy
    return logp
