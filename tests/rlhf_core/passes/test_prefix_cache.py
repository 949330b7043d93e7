"""The head every prompt of a batch opens with goes through the model once (rlhf_core/passes/prefix_cache.py)."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.passes.prefix_cache import common_head, length_buckets, position_ids, prefix_cache, response_lengths

PAD, EOS = 0, 2


def test_common_head_by_hand():
    ids = torch.tensor([[PAD, PAD, 1, 7, 8, 9],
                        [PAD, 1, 7, 8, 5, 6],
                        [1, 7, 8, 4, 4, 3]])
    K, moved, mask = common_head(ids, (ids != PAD).long())
    # real tokens: 1 7 8 9 / 1 7 8 5 6 / 1 7 8 4 4 3 -> head "1 7 8", at most 4 - 1 = 3 tokens
    assert K == 3
    assert moved.tolist() == [[1, 7, 8, PAD, PAD, 9], [1, 7, 8, PAD, 5, 6], [1, 7, 8, 4, 4, 3]]
    assert mask.tolist() == [[1, 1, 1, 0, 0, 1], [1, 1, 1, 0, 1, 1], [1, 1, 1, 1, 1, 1]]
    # the positions of the real tokens are those of the left-padded rows
    old, new = position_ids((ids != PAD).long()), position_ids(mask)
    assert sorted(new[0][mask[0].bool()].tolist()) == old[0][ids[0] != PAD].tolist() == [0, 1, 2, 3]

    # each row keeps a token of its own: a row that is all head caps K at its length - 1
    short = torch.tensor([[PAD, PAD, 1, 7], [1, 7, 8, 9]])
    assert common_head(short, (short != PAD).long())[0] == 1
    # rows that part at the first token, one row, right padding: nothing hoisted, the rows as they were
    for rows in (torch.tensor([[PAD, 1, 7], [3, 7, 8]]), torch.tensor([[1, 7, 8]]),
                 torch.tensor([[1, 7, PAD], [1, 7, 8]])):
        K, same, same_mask = common_head(rows, (rows != PAD).long())
        assert K == 0 and torch.equal(same, rows) and torch.equal(same_mask, (rows != PAD).long())


def _tiny_lm():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(
        vocab_size=16, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=2, max_position_embeddings=64, bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD))


def test_the_head_runs_once_and_the_logits_and_gradients_are_the_full_forwards():
    """Three prompts under a 4-token head, each left-padded differently, in groups of 2, 1 and 3 rows: the head
    goes through the model once (one row), then each prompt's rest, then the responses; logits and parameter
    gradients equal one forward over the full rows."""
    from rlhf_core.passes.generation import response_logits, response_mask

    model = _tiny_lm()
    prompts = torch.tensor([[PAD, PAD, 1, 7, 8, 9, 5, 6],
                            [1, 7, 8, 9, 3, 3, 4, 6],
                            [PAD, 1, 7, 8, 9, 11, 12, 6]])
    group = torch.tensor([0, 0, 1, 2, 2, 2])
    responses = torch.tensor([[4, 5, EOS], [6, EOS, PAD], [4, 4, 4], [9, 3, EOS], [EOS, PAD, PAD], [5, 6, 7]])
    seq = torch.cat([prompts[group], responses], dim=1)
    att = torch.cat([(prompts[group] != PAD).long(), response_mask(responses, EOS)], dim=1)
    calls = []
    hook = model.model.register_forward_pre_hook(lambda m, a, kw: calls.append(tuple(kw["input_ids"].shape)),
                                                  with_kwargs=True)

    def run(g):
        model.zero_grad()
        calls.clear()
        logits = response_logits(model, seq, att, 3, group=g)
        (logits * att[:, -3:, None]).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    full, full_grads = run(None)
    assert calls == [(6, 10)]  # the last token scores nothing: not fed
    shared, shared_grads = run(group)
    hook.remove()
    # head "1 7 8 9" once; each of the 3 prompts' other 3 of its 7 prefix columns; every row's last prompt token
    # and response but its last token (lengths 3 2 3 3 1 3: two buckets would save 2 of 18, one bucket):
    # 4 + 9 + 18 positions instead of 60
    assert calls == [(1, 4), (3, 3), (6, 3)]
    m = att[:, -3:].bool()
    torch.testing.assert_close(shared[m], full[m], atol=1e-5, rtol=1e-5)
    for a, b in zip(full_grads, shared_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_prefix_cache_returns_no_cache_a_model_cannot_index():
    """A model whose cache is a plain tuple (remote code) gets None: its caller scores the full rows."""
    ids = torch.tensor([[PAD, 1, 7, 8], [1, 7, 8, 9]])
    cache, mask = prefix_cache(lambda i, m, p, c: ((torch.zeros(1),),), ids, (ids != PAD).long())
    assert cache is None and mask.tolist() == [[1, 1, 0, 1], [1, 1, 1, 1]]


def test_length_buckets_by_hand():
    # one long row among short ones: cut at 1 -> 5 x 1 + 1 x 5 = 10 positions instead of 6 x 5 = 30
    (short, w1), (long, w2) = length_buckets(torch.tensor([1, 1, 5, 1, 1, 1]))
    assert (short.tolist(), w1, long.tolist(), w2) == ([0, 1, 3, 4, 5], 1, [2], 5)
    # the best cut (at 2: 2 x 2 + 4 x 3 = 16 of 18) saves less than MIN_BUCKET_SAVING: one bucket
    [(rows, w)] = length_buckets(torch.tensor([3, 2, 3, 3, 1, 3]))
    assert rows.tolist() == list(range(6)) and w == 3
    # three lengths: the cut is where it saves most (at 2: 3 x 2 + 1 x 8 = 14; at 1: 1 + 3 x 8 = 25)
    assert [(r.tolist(), w) for r, w in length_buckets(torch.tensor([2, 1, 8, 2]))] == [([0, 1, 3], 2), ([2], 8)]
    # all-masked rows still get one column; equal lengths are one bucket
    assert [(r.tolist(), w) for r, w in length_buckets(torch.tensor([0, 0]))] == [([0, 1], 1)]
    assert response_lengths(torch.tensor([[1, 1, 0, 0], [1, 0, 1, 0], [0, 0, 0, 0]])).tolist() == [2, 3, 0]


def test_responses_bucketed_by_length_give_the_full_forwards_logits_values_and_gradients():
    """Five one-token responses and one of four: the rows go through in two buckets (widths 1 and 4), and the
    actor's logits and the critic's values at every masked-in response position, and their parameter gradients,
    are those of one forward over the full rows (past a row's bucket width they are 0); the RM's scores too."""
    from rlhf_core.models.value_head import ValueHeadModel
    from rlhf_core.passes.generation import response_logits, response_mask
    from rlhf_core.passes.values import sequence_values

    model = _tiny_lm()
    prompts = torch.tensor([[PAD, 1, 7, 8, 5, 6], [1, 7, 8, 9, 3, 6]])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    responses = torch.tensor([[EOS, PAD, PAD, PAD], [4, 5, 6, EOS], [EOS, PAD, PAD, PAD],
                              [EOS, PAD, PAD, PAD], [EOS, PAD, PAD, PAD], [EOS, PAD, PAD, PAD]])
    seq = torch.cat([prompts[group], responses], dim=1)
    att = torch.cat([(prompts[group] != PAD).long(), response_mask(responses, EOS)], dim=1)
    m = att[:, -4:].bool()
    calls = []
    hook = model.model.register_forward_pre_hook(lambda mod, a, kw: calls.append(tuple(kw["input_ids"].shape)),
                                                  with_kwargs=True)

    def run(net, fn, g):
        net.zero_grad()
        calls.clear()
        out = fn(g)
        (out * m.reshape(*m.shape, *[1] * (out.dim() - 2))).sum().backward()
        return out.detach(), [p.grad.clone() for p in net.parameters()]

    actor = lambda g: response_logits(model, seq, att, 4, group=g)  # noqa: E731
    full, full_grads = run(model, actor, None)
    shared, shared_grads = run(model, actor, group)
    # head "1 7 8" once, each prompt's other 2 prefix columns, then 5 rows x 1 column and 1 row x 4 columns
    assert calls == [(1, 3), (2, 2), (5, 1), (1, 4)]
    torch.testing.assert_close(shared[m], full[m], atol=1e-5, rtol=1e-5)
    assert shared[~m].abs().sum() == 0
    for a, b in zip(full_grads, shared_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    hook.remove()

    critic = ValueHeadModel(model.model)
    value = lambda g: sequence_values(critic, seq, att, 4, g)  # noqa: E731
    full, full_grads = run(critic, value, None)
    shared, shared_grads = run(critic, value, group)
    torch.testing.assert_close(shared[m], full[m], atol=1e-5, rtol=1e-5)
    assert shared[~m].abs().sum() == 0
    for a, b in zip(full_grads, shared_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)

    calls.clear()
    model.model.register_forward_pre_hook(lambda mod, a, kw: calls.append(tuple(kw["input_ids"].shape)),
                                          with_kwargs=True)
    with torch.no_grad():
        pmask = (prompts != PAD).long()
        scores = critic.shared_prefix_scores(prompts, pmask, group, responses, att[:, -4:])
        assert calls == [(1, 3), (2, 3), (5, 1), (1, 4)]  # the RM's prefix is the whole prompt
        torch.testing.assert_close(scores, critic(seq, att).scores, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("arch", ["sliding_window", "conv_layer"])
def test_models_whose_cache_cannot_be_shared_run_the_full_rows(arch):
    """A sliding window counts columns, which the head-first re-layout moves; an LFM2's convolution state
    cannot be indexed by rows (its cache fallback crashed in ``batch_select_indices``). The actor's log-prob
    pass, the critic's values and the RM's scores of such models run the full rows and equal the plain forward;
    the rollout's shared prefill is kept for the window (a windowed KV cache repeats to rows) and dropped for
    the convolution (its state cannot be repeated)."""
    from rlhf_core.models.value_head import ValueHeadModel
    from rlhf_core.passes.generation import prefilled_cache, response_logits, response_mask
    from rlhf_core.passes.values import sequence_values
    from tests.tiny import tiny_lm

    model = tiny_lm(arch)
    prompts = torch.tensor([[PAD, 1, 7, 8, 5, 6], [1, 7, 8, 9, 3, 6]])
    group = torch.tensor([0, 0, 0, 1, 1, 1])
    responses = torch.tensor([[EOS, PAD, PAD, PAD], [4, 5, 6, EOS], [9, EOS, PAD, PAD],
                              [3, 3, EOS, PAD], [EOS, PAD, PAD, PAD], [5, 6, 7, 8]])
    seq = torch.cat([prompts[group], responses], dim=1)
    att = torch.cat([(prompts[group] != PAD).long(), response_mask(responses, EOS)], dim=1)
    m = att[:, -4:].bool()
    calls = []
    model.model.register_forward_pre_hook(lambda mod, a, kw: calls.append(tuple(kw["input_ids"].shape)),
                                          with_kwargs=True)

    shared = response_logits(model, seq, att, 4, group=group)
    assert calls == [(6, 9)]
    torch.testing.assert_close(shared[m], response_logits(model, seq, att, 4)[m], atol=1e-5, rtol=1e-5)

    critic = ValueHeadModel(model.model)
    calls.clear()
    values = sequence_values(critic, seq, att, 4, group)
    assert calls == [(6, 9)]
    torch.testing.assert_close(values[m], sequence_values(critic, seq, att, 4)[m], atol=1e-5, rtol=1e-5)
    with torch.no_grad():
        assert critic.shared_prefix_scores(prompts, (prompts != PAD).long(), group, responses, att[:, -4:]) is None

    with torch.no_grad():
        cache = prefilled_cache(model, prompts[group], (prompts[group] != PAD).long(), 3)
    assert (cache is None) == (arch == "conv_layer")
