"""The head every prompt of a batch opens with goes through the model once (rlhf_core/prefix_cache.py)."""

from __future__ import annotations

import torch

from rlhf_core.prefix_cache import common_head, position_ids, prefix_cache

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
    from rlhf_core.generation import response_logits, response_mask

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
    assert calls == [(6, 11)]
    shared, shared_grads = run(group)
    hook.remove()
    # head "1 7 8 9" once; each of the 3 prompts' other 3 of its 7 prefix columns; every row's last prompt token
    # and response: 4 + 9 + 24 positions instead of 66
    assert calls == [(1, 4), (3, 3), (6, 4)]
    m = att[:, -3:].bool()
    torch.testing.assert_close(shared[m], full[m], atol=1e-5, rtol=1e-5)
    for a, b in zip(full_grads, shared_grads, strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_prefix_cache_returns_no_cache_a_model_cannot_index():
    """A model whose cache is a plain tuple (remote code) gets None: its caller scores the full rows."""
    ids = torch.tensor([[PAD, 1, 7, 8], [1, 7, 8, 9]])
    cache, mask = prefix_cache(lambda i, m, p, c: ((torch.zeros(1),),), ids, (ids != PAD).long(),
                               torch.tensor([0, 0, 1]))
    assert cache is None and mask.tolist() == [[1, 1, 0, 1], [1, 1, 0, 1], [1, 1, 1, 1]]
