"""``rlhf_core.evaluation.heldout_eval`` reports an accuracy only where a checker has answers to check."""

from __future__ import annotations

import pytest


def test_no_answers_no_accuracy(tiny_chat_tokenizer_dir):
    """Prompts without answers (a user's own task, no checker): no ``accuracy`` at all, where a 0 used to be
    reported, and so no accuracy-based hacking verdict; with answers, the checker's share of right ones."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rlhf_core.data.collate import encode_prompts
    from rlhf_core.data.tokenizer import load_tokenizer
    from rlhf_core.evaluation import HeldOut, hacking_suspected, heldout_eval
    from tests.conftest import make_params

    tok = load_tokenizer(tiny_chat_tokenizer_dir)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                         num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
                                         pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)).eval()
    prompts = ["Human: What is 12 + 345?\n\nAssistant:", "Human: What is 67 + 89?\n\nAssistant:"]
    ev = make_params("eval.max_new_tokens=3", "eval.batch_size=2").eval
    unjudged = heldout_eval(model, tok, HeldOut(prompts, None, encode_prompts(tok, prompts)), ev, "cpu")
    assert "accuracy" not in unjudged and 0.0 <= unjudged["eos_share"] <= 1.0
    assert hacking_suspected({"proxy_reward": 0.0, **unjudged}, {"proxy_reward": 1.0, **unjudged}) is None
    judged = heldout_eval(model, tok, HeldOut(prompts, ["357", "156"], encode_prompts(tok, prompts)), ev, "cpu")
    assert judged["accuracy"] == pytest.approx(0.0)  # a random model writes neither sum
    assert {k: v for k, v in judged.items() if k != "accuracy"} == unjudged
