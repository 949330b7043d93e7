"""Sampling over a static KV cache, one fixed-shape decode step per call: on CUDA the step is captured once in a
CUDA graph and replayed, so a token costs one graph launch instead of hundreds of kernel launches from Python.

The rollout interface is narrow: left-padded prompt ids + sampling settings -> response token ids + their
log-probs (:func:`static_rollout`); any other engine (vLLM, transformers' ``generate``) fits behind it.

With ``P`` prompt columns, ``R`` new tokens and ``L = P + R`` cache columns, the prompt is prefilled once per
group (GRPO's ``G`` identical rows share it, the cache is repeated to the rows) and the first token sampled
from its last position. Step ``t = 1 .. R-1`` then runs, every tensor fixed in shape and address::

    mask[:, P + t - 1] = 1                              the input token's own column
    z_t      = model(y_{t-1}, pos_{t-1}, mask, cache)   float32 logits of the next token
    z_t[eos] = -inf                                     while t < min_new_tokens
    s_t      = z_t / T
    y_t      ~ softmax(top_p(s_t))                       argmax when greedy
    logp_t   = log_softmax(s_t)[y_t]                     the trainer's distribution: no top-p
    y_t      = pad where the row had finished;   finished |= (y_t == eos)

That is the processing order of transformers' ``generate`` (minimum length, temperature, top-p, then
``multinomial`` over the softmax), and the draw is ``multinomial``'s own one-sample algorithm,
``argmax(p / q)`` with ``q ~ Exp(1)``, minus its check of ``p`` on the host (a sync a CUDA graph cannot hold):
the same seed draws the same tokens up to float rounding between the static and the growing cache (tested in
float32). Whether all rows finished is read every ``check_every`` steps,
not every step (a host sync). Finished rows keep their slot until freed (below); what follows their EOS is pad,
cut from the output after the last row's EOS.

Finished rows are freed (``free_finished``): at a check where the live rows fit in half the batch, they move to a
decoder of ``b`` rows, the power of two that holds them (at least ``min_rows``; a few finished rows fill it up),
with their cache rows, masks and the tokens so far, and the finished rows' tokens go to the output. Each later
step then costs ``b`` rows, not ``B``. The draw stays the full batch's: ``q`` is drawn ``[B, V]`` and the live
rows take theirs (``rows``), so every row draws what it would have drawn in the full batch, and the same seed
gives the same tokens as without freeing and as ``generate`` (which keeps every row to the end; tested). Each
batch size is one more capture, and with ``compile`` one more compile the first time it is met (sizes are
powers of two, at most ``log2(B / min_rows)`` of them).

With ``compile`` the model's decode forward is ``torch.compile``d (inductor, static shapes) before the capture:
the step's elementwise work (RMSNorm, rotary, SiLU x up, residual adds) runs as a few fused kernels instead of
~30 per layer. Traced, transformers' SDPA path repeats a GQA model's KV heads to the query heads for one query
token (eagerly it groups the queries instead), which cost more than the fusion saved on an H100
(docs/results/benchmarks-gpu-rollout.md); the compiled step therefore runs under ``grouped_attention``'s SDPA,
which groups the queries traced too (its speed against the graph alone: the same page), or with ``attention``
``product`` under its two-product attention. It is compiled
once per model (:func:`compiled_forward`; the optimizer updates the parameters in place, so the code stays
valid), and only the model: the sampling stays eager, so a seed draws the same tokens up to the fused kernels'
float rounding. A compile that fails is reported once and the step runs eagerly.

Only for models whose every layer attends to all earlier positions through SDPA (``group_packing.supports_packing``),
with parameters that stay in place (no ZeRO-3 gathering): :func:`supports_static_decode`.
"""

from __future__ import annotations

import logging

import torch

from rlhf_core.passes.group_packing import supports_packing
from rlhf_core.passes.grouped_attention import DECODE_ATTENTION, grouped_decode
from rlhf_core.passes.grouped_attention import register as register_grouped_attention
from rlhf_core.passes.prefix_cache import model_config, position_ids

log = logging.getLogger(__name__)


def supports_static_decode(model) -> bool:
    """True for a model the static decoder can run: every layer full SDPA attention (``supports_packing``)."""
    return supports_packing(model)


def next_token(logits: torch.Tensor, step: torch.Tensor, eos_token_id: int, temperature: float, top_p: float,
               do_sample: bool, min_new_tokens: int, rows: torch.Tensor | None = None,
               batch: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(y_t, logp_t)`` from the float32 logits ``[B, V]`` of step ``step`` (a 0-dim long tensor, so a
    captured graph reads it at replay): the processing of ``generate`` in its order (module docstring).
    ``rows``: these logits are rows ``rows`` of a batch of ``batch``, and draw that batch's noise rows."""
    z = logits.float()
    if min_new_tokens:
        is_eos = torch.arange(z.shape[-1], device=z.device) == eos_token_id
        z = z.masked_fill(is_eos & (step < min_new_tokens), -float("inf"))
    s = z / temperature
    kept = top_p_filter(s, top_p) if do_sample and top_p < 1.0 else s
    if do_sample:  # torch.multinomial's one-sample path, without its host-side check of the probabilities
        probs = torch.softmax(kept, dim=-1)
        q = (torch.empty_like(probs).exponential_(1) if rows is None
             else probs.new_empty(batch, probs.shape[-1]).exponential_(1).index_select(0, rows))
        y = (probs / q).argmax(dim=-1, keepdim=True)
    else:
        y = kept.argmax(dim=-1, keepdim=True)
    return y.squeeze(1), torch.log_softmax(s, dim=-1).gather(1, y).squeeze(1)


def top_p_filter(scores: torch.Tensor, top_p: float) -> torch.Tensor:
    """transformers' ``TopPLogitsWarper``: sorted ascending, the tokens whose cumulative probability stays at
    or below ``1 - top_p`` are set to ``-inf``; the most likely token is always kept."""
    sorted_scores, order = torch.sort(scores, descending=False)
    cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
    remove_sorted = cumulative <= (1 - top_p)
    remove_sorted[:, -1] = False
    remove = remove_sorted.scatter(1, order, remove_sorted)
    return scores.masked_fill(remove, -float("inf"))


def compiled_forward(model, backend="inductor", attention: str = "sdpa"):
    """``torch.compile(model.forward)`` (static shapes), made once per model and ``attention`` and kept on it. It
    is traced and called under ``grouped_attention.DECODE_ATTENTION[attention]``: a GQA model's decode step reads
    the KV cache as it is, through SDPA or written out as two products (``product``)."""
    slot = forward_slot(attention)
    fn = model.__dict__.get(slot)
    if fn is None:
        register_grouped_attention()
        compiled, config = torch.compile(model.forward, backend=backend, dynamic=False), model_config(model)
        implementation = DECODE_ATTENTION[attention]

        def fn(**kwargs):
            with grouped_decode(config, implementation):
                return compiled(**kwargs)

        model.__dict__[slot] = fn
    return fn


def forward_slot(attention: str) -> str:
    """Where :func:`compiled_forward` keeps the compiled forward for ``attention`` on the model."""
    return "_static_decode_forward" + ("" if attention == "sdpa" else f"_{attention}")


def unguard_cache(cache) -> None:
    """transformers marks a static cache's tensors as static inputs *with* an identity guard, so a compiled step
    would recompile for every new cache (one per rollout); the addresses stay static, the guard goes."""
    for layer in cache.layers:
        for t in (layer.keys, layer.values, layer.cumulative_length):
            torch._dynamo.mark_static_address(t, guard=False)


class StaticDecoder:
    """The buffers of one rollout of ``B`` rows over ``L`` cache columns, and its step (captured on CUDA).
    ``full_batch`` > ``batch``: these are rows ``rows`` of a rollout of ``full_batch`` (finished rows freed)."""

    def __init__(self, model, batch: int, prompt_len: int, max_new_tokens: int, device: torch.device,
                 dtype: torch.dtype, settings: dict, pad_token_id: int, use_graph: bool, compile: bool = False,
                 full_batch: int = 0, attention: str = "sdpa"):
        from transformers import StaticCache

        config = model_config(model)
        self.model, self.pad_token_id, self.use_graph, self.compile = model, pad_token_id, use_graph, compile
        self.attention = attention  # the compiled step's (grouped_attention.DECODE_ATTENTION)
        self.batch, self.full_batch = batch, full_batch or batch
        self.rows = torch.arange(batch, device=device)
        self.sampling = settings  # next_token's settings; a freed decoder also draws the full batch's noise rows
        self.settings = settings if self.full_batch == batch else {**settings, "rows": self.rows,
                                                                      "batch": self.full_batch}
        self.P, self.R = prompt_len, max_new_tokens
        L = prompt_len + max_new_tokens
        self.cache = StaticCache(config=config, max_cache_len=L)
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.cache.early_initialization(batch, kv_heads, head_dim, dtype, device)
        self.forward = model.forward
        if compile:
            unguard_cache(self.cache)
            self.forward = compiled_forward(model, attention=attention)
        self.mask = torch.zeros(batch, L, dtype=torch.bool, device=device)
        self.token = torch.zeros(batch, dtype=torch.long, device=device)
        self.pos = torch.zeros(batch, dtype=torch.long, device=device)
        self.step = torch.zeros((), dtype=torch.long, device=device)  # t: the token the next call samples
        self.finished = torch.zeros(batch, dtype=torch.bool, device=device)
        self.tokens = torch.zeros(batch, max_new_tokens, dtype=torch.long, device=device)
        self.logp = torch.zeros(batch, max_new_tokens, dtype=torch.float32, device=device)
        self.columns = torch.arange(L, device=device)
        self.graph = None
        if use_graph:
            self._capture()
        elif compile:
            self.warm_up()

    def _step(self) -> None:
        """One decode step on the buffers (the module docstring's loop body). ``forward`` is called without the
        model's own hooks: a training engine's (DeepSpeed's timers) synchronise, which a capture cannot hold."""
        s = self.settings
        self.mask |= self.columns == (self.P + self.step - 1)
        out = self.forward(input_ids=self.token[:, None], position_ids=self.pos[:, None],
                           attention_mask=self.mask[:, None, None, :], past_key_values=self.cache, use_cache=True,
                           logits_to_keep=1)
        y, lp = next_token(out.logits[:, -1], self.step, **s)
        self._record(y, lp)
        self.pos += 1

    def _record(self, y: torch.Tensor, lp: torch.Tensor) -> None:
        pad, eos = self.pad_token_id, self.settings["eos_token_id"]
        y = torch.where(self.finished, torch.full_like(y, pad), y)
        here = self.columns[:self.R] == self.step
        self.tokens.copy_(torch.where(here, y[:, None], self.tokens))
        self.logp.copy_(torch.where(here, lp[:, None], self.logp))
        self.finished |= y == eos
        self.token.copy_(y)
        self.step += 1

    def warm_up(self) -> None:
        """Two steps (lazy inits, cuBLAS workspaces, the compile) that leave the random state as it was; the
        buffers they change are reset by :meth:`start`. A compile that fails falls back to the eager forward,
        said once."""
        device = self.mask.device
        with torch.random.fork_rng(devices=[device] if device.type == "cuda" else [], device_type=device.type):
            try:
                self._step()
            except Exception as e:  # inductor/dynamo raise many types; the eager step re-raises real faults
                if self.forward == self.model.forward:  # eager already (a bound method is new on each access)
                    raise
                root = e  # dynamo wraps the backend's error (``inner_exception``) or chains it
                while (inner := getattr(root, "inner_exception", None) or root.__cause__) is not None:
                    root = inner
                log.warning("static decode: torch.compile of %s failed (%s: %s); decoding eagerly",
                            type(self.model).__name__, type(root).__name__, (str(root).splitlines() or [""])[0])
                self.model.__dict__[forward_slot(self.attention)] = self.forward = self.model.forward
                self._step()
            self._step()

    def _capture(self) -> None:
        """Warm the step up on a side stream, then capture it."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self.warm_up()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._step()

    def take_rows(self, other: StaticDecoder, keep: torch.Tensor) -> None:
        """Continue rows ``keep`` of ``other`` (a larger decoder of the same rollout) in this one's buffers."""
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.keys.copy_(theirs.keys.index_select(0, keep))
            mine.values.copy_(theirs.values.index_select(0, keep))
            mine.cumulative_length.copy_(theirs.cumulative_length)
        for name in ("mask", "token", "pos", "finished", "tokens", "logp"):
            getattr(self, name).copy_(getattr(other, name).index_select(0, keep))
        self.rows.copy_(other.rows.index_select(0, keep))
        self.step.copy_(other.step)

    def freed(self, live: int, min_rows: int) -> StaticDecoder | None:
        """A decoder of the power of two rows that holds the ``live`` unfinished rows (at least ``min_rows``),
        carrying them on, when that is at most half of this one; else None."""
        batch = max(min_rows, 1 << max(0, live - 1).bit_length())
        if 2 * batch > self.batch:
            return None
        finished = self.finished
        keep = torch.cat([(~finished).nonzero().squeeze(1), finished.nonzero().squeeze(1)])[:batch]
        small = StaticDecoder(self.model, batch, self.P, self.R, self.mask.device, self.cache.layers[0].keys.dtype,
                              self.sampling, self.pad_token_id, self.use_graph, self.compile, self.full_batch,
                              self.attention)
        small.take_rows(self, keep)
        return small

    def start(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, group_size: int) -> None:
        """Prefill the prompts (each run of ``group_size`` identical rows once), sample the first token."""
        P = self.P
        firsts, first_mask = prompt_ids[::group_size], prompt_mask[::group_size]
        out = self.model(input_ids=firsts, attention_mask=first_mask, position_ids=position_ids(first_mask),
                         use_cache=True, logits_to_keep=1)
        for static, grown in zip(self.cache.layers, out.past_key_values.layers, strict=True):
            static.keys[:, :, :P].copy_(grown.keys.repeat_interleave(group_size, dim=0))
            static.values[:, :, :P].copy_(grown.values.repeat_interleave(group_size, dim=0))
            static.cumulative_length.fill_(P)
        self.mask.zero_()
        self.mask[:, :P] = prompt_mask.bool()
        self.pos.copy_(prompt_mask.long().sum(dim=1))
        self.step.zero_()
        self.finished.zero_()
        self.tokens.fill_(self.pad_token_id)  # what finished rows show, also where a freed row no longer writes
        self.logp.zero_()
        y, lp = next_token(out.logits[:, -1].repeat_interleave(group_size, dim=0), self.step, **self.settings)
        self._record(y, lp)

    def decode(self, check_every: int, min_rows: int = 0) -> StaticDecoder | None:
        """Steps up to ``R-1``, stopping early once every row finished (read every ``check_every`` steps); with
        ``min_rows``, returns a smaller decoder (:meth:`freed`) as soon as one would do, else None at the end."""
        t = int(self.step)
        while t < self.R:
            if t % check_every == 0:
                live = int((~self.finished).sum())
                if live == 0:
                    break
                if min_rows and (small := self.freed(live, min_rows)) is not None:
                    return small
            if self.graph is not None:
                self.graph.replay()
            else:
                self._step()
            t += 1
        return None


def static_rollout(model, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, max_new_tokens: int,
                   eos_token_id: int, pad_token_id: int, temperature: float = 1.0, top_p: float = 1.0,
                   do_sample: bool = True, min_new_tokens: int = 0, group_size: int = 1,
                   use_graph: bool | None = None, check_every: int = 8,
                   compile: bool = False, free_finished: bool = True,
                   min_rows: int = 8, attention: str = "sdpa") -> tuple[torch.Tensor, torch.Tensor]:
    """``(responses [B, R'], logp [B, R'])``: tokens sampled after the left-padded ``prompt_ids`` and their
    log-probs under ``softmax(logits / T)`` (before top-p, as the trainer scores them; with ``min_new_tokens``,
    the EOS ban included),
    ``R' <= max_new_tokens`` (cut after the last row's EOS), pad after a row's EOS. ``group_size`` > 1: the rows
    come in runs of identical prompts, each prefilled once. ``use_graph`` (default: on CUDA) captures the step,
    ``compile`` compiles the model's forward first (its attention for the decode token: ``attention``, a key of
    ``grouped_attention.DECODE_ATTENTION``), ``free_finished`` frees finished rows down to batches of
    ``min_rows`` (module docstring).
    Runs under ``torch.inference_mode()``; the model must pass ``supports_static_decode``."""
    device = next(model.parameters()).device
    B, P = prompt_ids.shape
    if B % group_size:
        raise ValueError(f"static_rollout: {B} rows do not come in runs of {group_size}")
    if use_graph is None:
        use_graph = device.type == "cuda"
    dtype = next(model.parameters()).dtype
    settings = {"eos_token_id": eos_token_id, "temperature": temperature, "top_p": top_p, "do_sample": do_sample,
                "min_new_tokens": min_new_tokens}
    prompt_ids, prompt_mask = prompt_ids.to(device), prompt_mask.to(device)
    if not torch.equal(prompt_ids[::group_size].repeat_interleave(group_size, dim=0), prompt_ids):
        raise ValueError(f"static_rollout: rows do not come in runs of {group_size} identical prompts")
    with torch.inference_mode():
        decoder = StaticDecoder(model, B, P, max_new_tokens, device, dtype, settings, pad_token_id, use_graph,
                                compile, attention=attention)
        decoder.start(prompt_ids, prompt_mask, group_size)
        tokens, logp = decoder.tokens, decoder.logp  # the full batch's: a freed decoder writes its rows back

        def write_back(d: StaticDecoder) -> None:
            if d.batch < B:
                tokens.index_copy_(0, d.rows, d.tokens)
                logp.index_copy_(0, d.rows, d.logp)

        while (small := decoder.decode(check_every, min_rows if free_finished else 0)) is not None:
            write_back(decoder)  # the rows it leaves behind are final
            decoder = small
        write_back(decoder)
        width = int(decoder.step)
        if bool(decoder.finished.all()):  # every row ended (rows left behind had): cut after the last EOS
            first_eos = torch.where(tokens == eos_token_id, decoder.columns[:max_new_tokens], max_new_tokens)
            width = int(first_eos.min(dim=1).values.max()) + 1
        return tokens[:, :width].clone(), logp[:, :width].clone()
