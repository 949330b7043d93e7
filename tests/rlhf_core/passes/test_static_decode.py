"""The static-cache decoder (``passes/static_decode.py``): the same tokens and log-probs as transformers'
``generate`` for the same seed, the sampling steps by hand, early stops, and the models it refuses."""

from __future__ import annotations

import math

import pytest
import torch

from rlhf_core.passes.generation import (
    GenerationConfig,
    response_logprobs,
    response_mask,
    rollout,
    uses_static_decode,
)
from rlhf_core.passes.static_decode import StaticDecoder, compiled_forward, next_token, static_rollout, top_p_filter
from tests.rlhf_core.passes.test_generation import EOS, PAD, _tiny_lm, _Tok

PROMPTS = torch.tensor([[PAD, PAD, 1, 7, 8], [1, 7, 8, 9, 7], [PAD, 1, 9, 9, 3]]).repeat_interleave(4, dim=0)


def _eos_prone_lm():
    """The tiny model with EOS likely enough that rows stop at different steps, some before the end."""
    model = _tiny_lm()
    with torch.no_grad():
        model.lm_head.weight[EOS] = model.lm_head.weight[5] + 0.5
    return model


@pytest.mark.parametrize("group", [1, 4])
@pytest.mark.parametrize("sampling", [
    {"do_sample": False},
    {"temperature": 0.7},
    {"temperature": 1.3, "top_p": 0.8},
    {"temperature": 1.0, "min_new_tokens": 6},
])
def test_same_tokens_and_log_probs_as_generate(group, sampling):
    """Left-padded prompts in runs of 4, fp32: for the same seed the static decoder draws the tokens ``generate``
    draws, and records their log-probs under ``softmax(logits / T)``."""
    model = _eos_prone_lm()
    mask = (PROMPTS != PAD).long()
    gen = GenerationConfig(10, record_logprobs=True, **sampling)
    torch.manual_seed(11)
    ref = rollout(model, PROMPTS, mask, _Tok(), gen, group_size=group)
    torch.manual_seed(11)
    ours = rollout(model, PROMPTS, mask, _Tok(), GenerationConfig(10, record_logprobs=True, engine="static",
                                                                   **sampling), group_size=group)
    assert torch.equal(ref.responses, ours.responses) and torch.equal(ref.action_mask, ours.action_mask)
    assert ref.texts == ours.texts
    if "min_new_tokens" in sampling:  # the EOS ban enters the logits: nothing recorded, as with generate
        assert ours.logp is None and bool((ours.responses[:, :6] != EOS).all())
        return
    m = ours.action_mask.bool()
    assert torch.allclose(ref.logp[m], ours.logp[m], atol=1e-5)
    with torch.no_grad():
        scored = response_logprobs(model, ours.sequences, ours.attention_mask, ours.responses.shape[1],
                                   temperature=gen.temperature)
    assert torch.allclose(ours.logp[m], scored[m], atol=1e-5)  # top-p shapes the draw, not the log-probs


def test_rows_that_stop_early_are_padded_and_the_output_cut():
    """Every row ends before ``max_new_tokens``: pad after each row's EOS, and the output as wide as the last
    row's EOS (what ``generate`` returns), read although the stop check comes every few steps."""
    model = _eos_prone_lm()
    with torch.no_grad():
        model.lm_head.weight[EOS] = model.lm_head.weight[5] + 3.0
    mask = (PROMPTS != PAD).long()
    torch.manual_seed(2)
    tokens, logp = static_rollout(model, PROMPTS, mask, 40, EOS, PAD, check_every=4)
    first_eos = (tokens == EOS).int().argmax(dim=1)
    assert bool((tokens == EOS).any(dim=1).all()) and tokens.shape[1] == int(first_eos.max()) + 1 < 40
    after = torch.arange(tokens.shape[1])[None, :] > first_eos[:, None]
    assert bool((tokens[after] == PAD).all()) and after.any()
    torch.manual_seed(2)
    ref = rollout(model, PROMPTS, mask, _Tok(), GenerationConfig(40))
    assert torch.equal(ref.responses, tokens)


@pytest.mark.parametrize("sampling", [{"do_sample": False}, {"temperature": 0.7, "group_size": 4},
                                      {"temperature": 1.3, "top_p": 0.8}, {"min_new_tokens": 3}])
def test_freeing_finished_rows_draws_the_same_tokens(monkeypatch, sampling):
    """Rows freed as they finish (12 rows, then 8, 4, 2 or 1 as EOS comes): for the same seed, the tokens and
    log-probs of the decoder that keeps every row to the end, which are ``generate``'s (the test above)."""
    model = _eos_prone_lm()
    mask = (PROMPTS != PAD).long()
    torch.manual_seed(5)
    kept, kept_logp = static_rollout(model, PROMPTS, mask, 24, EOS, PAD, free_finished=False, **sampling)
    sizes = []
    init = StaticDecoder.__init__
    monkeypatch.setattr(StaticDecoder, "__init__", lambda self, m, batch, *a, **k: (sizes.append(batch),
                                                                                   init(self, m, batch, *a, **k))[1])
    torch.manual_seed(5)
    freed, freed_logp = static_rollout(model, PROMPTS, mask, 24, EOS, PAD, check_every=1, min_rows=1, **sampling)
    greedy = sampling.get("do_sample") is False  # greedy rows end in runs of 4 (their prompts'): one freeing
    assert sizes[0] == 12 and len(sizes) >= (2 if greedy else 3) and sizes == sorted(sizes, reverse=True)
    assert all(b & (b - 1) == 0 for b in sizes[1:])  # powers of two
    assert torch.equal(kept, freed)
    action = response_mask(freed, EOS).bool()
    torch.testing.assert_close(kept_logp[action], freed_logp[action], atol=1e-5, rtol=0)


def test_freed_rows_draw_the_full_batchs_noise_rows():
    """``next_token`` on rows [3, 0] of a batch of 4 draws what those rows draw in the whole batch."""
    logits = torch.randn(4, 50)
    rows = torch.tensor([3, 0])
    args = {"eos_token_id": 1, "temperature": 1.0, "top_p": 1.0, "do_sample": True, "min_new_tokens": 0}
    torch.manual_seed(0)
    y_all, lp_all = next_token(logits, torch.tensor(1), **args)
    torch.manual_seed(0)
    y, lp = next_token(logits[rows], torch.tensor(1), rows=rows, batch=4, **args)
    assert torch.equal(y, y_all[rows]) and torch.equal(lp, lp_all[rows])


def test_freed_batch_sizes():
    """A decoder of 12 rows frees into the power of two that holds the live rows, at least ``min_rows``, only when
    that is at most half of 12."""
    mask = (PROMPTS != PAD).long()
    decoder = StaticDecoder(_tiny_lm(), 12, PROMPTS.shape[1], 4, torch.device("cpu"), torch.float32,
                            {"eos_token_id": EOS, "temperature": 1.0, "top_p": 1.0, "do_sample": True,
                             "min_new_tokens": 0}, PAD, use_graph=False)
    with torch.inference_mode():
        decoder.start(PROMPTS, mask, 1)
        decoder.finished[:] = True
        decoder.finished[[2, 9, 10]] = False
        assert decoder.freed(7, 1) is None and decoder.freed(5, 1) is None  # 8 rows: not half of 12
        small = decoder.freed(3, 1)
        assert small.batch == 4 and small.rows[:3].tolist() == [2, 9, 10] and bool(small.finished[3])
        assert torch.equal(small.cache.layers[0].keys[:3], decoder.cache.layers[0].keys[[2, 9, 10]])
        assert decoder.freed(3, 8) is None and decoder.freed(1, 1).batch == 1


def test_next_token_by_hand():
    """Logits [ln 1, ln 2, ln 5] (EOS = 2), T = 1: greedy takes the EOS with log-prob ln 5/8; while EOS is banned
    (step 0 < min_new_tokens 1) it takes token 1, ln 2/3; T = 2 halves the logits: ln(sqrt 5 / (1 + sqrt 2 +
    sqrt 5))."""
    logits = torch.log(torch.tensor([[1.0, 2.0, 5.0]]))
    args = {"eos_token_id": 2, "top_p": 1.0, "do_sample": False}
    y, lp = next_token(logits, torch.tensor(0), temperature=1.0, min_new_tokens=0, **args)
    assert y.item() == 2 and lp.item() == pytest.approx(math.log(5 / 8))
    y, lp = next_token(logits, torch.tensor(0), temperature=1.0, min_new_tokens=1, **args)
    assert y.item() == 1 and lp.item() == pytest.approx(math.log(2 / 3))
    y, lp = next_token(logits, torch.tensor(1), temperature=1.0, min_new_tokens=1, **args)
    assert y.item() == 2
    y, lp = next_token(logits, torch.tensor(0), temperature=2.0, min_new_tokens=0, **args)
    r2, r5 = math.sqrt(2), math.sqrt(5)
    assert y.item() == 2 and lp.item() == pytest.approx(math.log(r5 / (1 + r2 + r5)))


def test_top_p_by_hand_and_as_transformers():
    """Probabilities [0.05, 0.5, 0.15, 0.3], top-p 0.8: sorted ascending the cumulative mass is 0.05, 0.2, 0.5,
    1.0; the tokens at or below 1 - 0.8 = 0.2 go (0 and 2), 1 and 3 stay; as transformers' ``TopPLogitsWarper``."""
    from transformers.generation.logits_process import TopPLogitsWarper

    scores = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3], [0.97, 0.01, 0.01, 0.01]]))
    out = top_p_filter(scores, 0.8)
    assert torch.isinf(out[0]).tolist() == [True, False, True, False]
    assert torch.isinf(out[1]).tolist() == [False, True, True, True]  # the most likely token always stays
    torch.testing.assert_close(out, TopPLogitsWarper(0.8)(None, scores.clone()))


def test_which_engine_runs():
    """``auto`` is generate on the CPU; ``static`` runs where every layer is full SDPA attention and falls back to
    ``generate`` for a sliding-window model and under ZeRO-3 generation (``synced_gpus``)."""
    from transformers import MistralConfig, MistralForCausalLM

    model, cpu = _tiny_lm(), torch.device("cpu")
    assert GenerationConfig(4).engine == "auto"  # evaluation and feedback sampling: static on a GPU only
    assert not uses_static_decode(model, GenerationConfig(4, engine="auto"), cpu)
    assert not uses_static_decode(model, GenerationConfig(4, engine="generate"), cpu)
    assert uses_static_decode(model, GenerationConfig(4, engine="static"), cpu)
    assert not uses_static_decode(model, GenerationConfig(4, engine="static", synced_gpus=True), cpu)
    windowed = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=32, intermediate_size=64,
                                                num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                                sliding_window=4, attn_implementation="sdpa"))
    assert not uses_static_decode(windowed, GenerationConfig(4, engine="static"), cpu)


def test_refuses_rows_that_are_not_runs_of_one_prompt():
    mask = (PROMPTS != PAD).long()
    with pytest.raises(ValueError, match="runs of 3 identical prompts"):
        static_rollout(_tiny_lm(), PROMPTS, mask, 4, EOS, PAD, group_size=3)
    with pytest.raises(ValueError, match="12 rows do not come in runs of 5"):
        static_rollout(_tiny_lm(), PROMPTS, mask, 4, EOS, PAD, group_size=5)


@pytest.mark.slow
def test_compiled_step_draws_the_same_tokens_and_compiles_once():
    """``compile``: the model's decode forward through inductor draws, for the same seed, the tokens of the eager
    step, with log-probs equal up to the fused kernels' rounding; a second rollout (a new cache) reuses the code,
    which ``error_on_recompile`` would refuse."""
    model = _eos_prone_lm()
    mask = (PROMPTS != PAD).long()
    settings = {"temperature": 0.7, "group_size": 4}
    torch.manual_seed(11)
    eager = static_rollout(model, PROMPTS, mask, 10, EOS, PAD, compile=False, **settings)
    for _ in range(2):
        torch.manual_seed(11)
        with torch._dynamo.config.patch(error_on_recompile=True):
            compiled = static_rollout(model, PROMPTS, mask, 10, EOS, PAD, compile=True, **settings)
        assert model.__dict__["_static_decode_forward"] is not model.forward  # no fall-back to eager
        assert torch.equal(eager[0], compiled[0])
        torch.testing.assert_close(eager[1], compiled[1], atol=1e-5, rtol=0)


def test_a_compile_that_fails_falls_back_to_the_eager_step(caplog):
    """A backend that raises: the rollout says so once and decodes eagerly, with the eager step's tokens."""
    def failing_backend(gm, example_inputs):
        raise RuntimeError("no compiler here")

    model = _eos_prone_lm()
    mask = (PROMPTS != PAD).long()
    torch.manual_seed(3)
    eager = static_rollout(model, PROMPTS, mask, 6, EOS, PAD, compile=False)
    compiled_forward(model, backend=failing_backend)
    torch.manual_seed(3)
    with caplog.at_level("WARNING", logger="rlhf_core.passes.static_decode"):
        fallen = static_rollout(model, PROMPTS, mask, 6, EOS, PAD, compile=True)
    assert [r.message for r in caplog.records if "decoding eagerly" in r.message] and "no compiler here" in caplog.text
    assert torch.equal(eager[0], fallen[0]) and torch.equal(eager[1], fallen[1])
    assert model.__dict__["_static_decode_forward"] == model.forward  # the next rollout does not try again


def _sdpa_key_shapes(graphs) -> list:
    return [n.args[1].meta["example_value"].shape for g in graphs for n in g.graph.nodes
            if "scaled_dot_product" in str(n.target)]


def test_the_compiled_step_groups_gqa_queries_which_transformers_does_only_eagerly():
    """For one query token, eager SDPA groups a GQA model's query heads over its KV heads (key ``[B, kv, L, d]``),
    but the graph ``torch.compile`` traces of transformers' forward repeats the KV heads to the query heads (key
    ``[B, heads, L, d]``: the whole cache copied per layer and step; should transformers change this, the first
    assertion fails and ``grouped_attention`` can go). ``compiled_forward`` traces under ``GROUPED_SDPA``: the
    traced step reads the 2 KV heads as they are, decodes the eager step's tokens and log-probs, and leaves the
    model's own attention set after."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    settings = {"eos_token_id": 1, "temperature": 1.0, "top_p": 1.0, "do_sample": True, "min_new_tokens": 0}
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    model.__dict__["_static_decode_forward"] = torch.compile(model.forward, backend=keep_graph, dynamic=False)
    with torch.inference_mode():
        StaticDecoder(model, 8, 4, 4, torch.device("cpu"), torch.float32, settings, PAD, use_graph=False,
                      compile=True)
    assert _sdpa_key_shapes(graphs) and all(k[1] == 4 for k in _sdpa_key_shapes(graphs))  # transformers' own

    graphs.clear()
    del model.__dict__["_static_decode_forward"]
    compiled_forward(model, backend=keep_graph)
    prompts = torch.tensor([[PAD, 1, 7, 8], [1, 7, 8, 9]]).repeat_interleave(4, dim=0)
    mask = (prompts != PAD).long()
    torch.manual_seed(5)
    eager = static_rollout(model, prompts, mask, 5, 1, PAD, compile=False, group_size=4)
    torch.manual_seed(5)
    traced = static_rollout(model, prompts, mask, 5, 1, PAD, compile=True, group_size=4)
    assert _sdpa_key_shapes(graphs) and all(k[1] == 2 for k in _sdpa_key_shapes(graphs))  # grouped
    assert torch.equal(eager[0], traced[0])
    torch.testing.assert_close(eager[1], traced[1], atol=1e-6, rtol=0)
    assert model.config._attn_implementation == "sdpa"


def test_grouped_sdpa_equals_transformers_sdpa_for_one_and_many_query_tokens():
    """The grouped function against transformers' SDPA on the same inputs: one query token of a GQA layer
    (grouped), a prefill of three (delegated), masked columns included."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rlhf_core.passes.grouped_attention import grouped_sdpa

    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = 3, True
    torch.manual_seed(1)
    for q_len in (1, 3):
        q, k, v = torch.randn(2, 6, q_len, 8), torch.randn(2, 2, 5, 8), torch.randn(2, 2, 5, 8)
        mask = torch.ones(2, 1, q_len, 5, dtype=torch.bool)
        mask[0, ..., :2] = False
        want, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)
        got, _ = grouped_sdpa(layer, q, k, v, mask, scaling=0.3)
        assert got.shape == want.shape == (2, q_len, 6, 8)
        torch.testing.assert_close(got, want, atol=1e-6, rtol=0)


@pytest.mark.parametrize("groups", [3, 1])
def test_the_two_product_attention_equals_transformers_sdpa(groups):
    """``grouped_product`` against transformers' SDPA on the same float64 inputs: one query token of a GQA layer
    (3 query heads per KV head) and of an MHA layer, with a boolean mask (left padding and unwritten columns) and
    an additive one; a prefill of three tokens is delegated to SDPA itself."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    from rlhf_core.passes.grouped_attention import grouped_product

    layer = torch.nn.Module()
    layer.num_key_value_groups, layer.is_causal = groups, True
    torch.manual_seed(2)
    for q_len in (1, 3):
        q = torch.randn(2, 2 * groups, q_len, 8, dtype=torch.float64)
        k, v = torch.randn(2, 2, 6, 8, dtype=torch.float64), torch.randn(2, 2, 6, 8, dtype=torch.float64)
        keep = torch.ones(2, 1, q_len, 6, dtype=torch.bool)
        keep[0, ..., :2] = False  # a left-padded row
        keep[..., 5] = False  # a cache column not written yet
        additive = torch.zeros(2, 1, q_len, 6, dtype=torch.float64).masked_fill(~keep, float("-inf"))
        for mask in (keep, additive, None):
            want, _ = sdpa_attention_forward(layer, q, k, v, mask, scaling=0.3)
            got, _ = grouped_product(layer, q, k, v, mask, scaling=0.3)
            assert got.shape == want.shape == (2, q_len, 2 * groups, 8)
            torch.testing.assert_close(got, want, atol=1e-12, rtol=0)


def test_the_compiled_step_with_two_product_attention_draws_the_eager_steps_tokens():
    """``attention="product"``: the traced decode step has no SDPA call left for the decode token (only the
    prefill's, outside it), draws the eager step's tokens for the same seed, and is kept apart from the SDPA
    step's compiled forward."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.passes.static_decode import forward_slot

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attn_implementation="sdpa")
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).eval()
    graphs = []

    def keep_graph(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    compiled_forward(model, backend=keep_graph, attention="product")
    prompts = torch.tensor([[PAD, 1, 7, 8], [1, 7, 8, 9]]).repeat_interleave(4, dim=0)
    mask = (prompts != PAD).long()
    torch.manual_seed(5)
    eager = static_rollout(model, prompts, mask, 6, 1, PAD, compile=False, group_size=4)
    torch.manual_seed(5)
    traced = static_rollout(model, prompts, mask, 6, 1, PAD, compile=True, group_size=4, attention="product")
    assert graphs and not _sdpa_key_shapes(graphs)
    assert torch.equal(eager[0], traced[0])
    torch.testing.assert_close(eager[1], traced[1], atol=1e-5, rtol=0)
    assert forward_slot("product") in model.__dict__ and forward_slot("sdpa") not in model.__dict__
    assert model.config._attn_implementation == "sdpa"


def test_a_fault_in_the_eager_warm_up_is_raised_as_it_is(caplog):
    """Without a compile, an error in the warm-up step (the step before a CUDA graph's capture) is the model's own:
    raised unchanged, with no word of a compile."""

    class Broken(type(_tiny_lm())):
        def forward(self, *args, **kwargs):
            raise RuntimeError("broken step")

    model = Broken(_tiny_lm().config).eval()
    settings = {"eos_token_id": EOS, "temperature": 1.0, "top_p": 1.0, "do_sample": True, "min_new_tokens": 0}
    with torch.inference_mode():
        decoder = StaticDecoder(model, 4, 5, 4, torch.device("cpu"), torch.float32, settings, PAD, use_graph=False)
        with caplog.at_level("WARNING", logger="rlhf_core.passes.static_decode"), \
                pytest.raises(RuntimeError, match="broken step"):
            decoder.warm_up()
    assert "decoding eagerly" not in caplog.text
