"""Response masks on hand-made sequences, and log-probs scored at the right positions."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.passes.generation import Rollout, position_ids, response_logprobs, response_mask

EOS, PAD = 2, 0


def test_mask_eos_in_middle_at_end_and_missing():
    responses = torch.tensor([
        [5, 6, EOS, PAD, PAD],   # EOS in the middle: kept, the rest masked
        [5, 6, 7, 8, EOS],       # EOS at the end
        [5, 6, 7, 8, 9],         # no EOS: hit max length, all valid
        [EOS, PAD, PAD, PAD, PAD],  # empty response: only the EOS
    ])
    assert response_mask(responses, EOS).tolist() == [
        [1, 1, 1, 0, 0],
        [1, 1, 1, 1, 1],
        [1, 1, 1, 1, 1],
        [1, 0, 0, 0, 0],
    ]


def test_mask_when_pad_equals_eos():
    """With pad == eos the padding after the first EOS is masked, and the first EOS is kept."""
    responses = torch.tensor([[5, EOS, EOS, EOS], [5, 6, 7, EOS], [5, 6, 7, 8]])
    assert response_mask(responses, EOS).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 1, 1, 1]]


def test_pad_token_is_not_taken_for_eos():
    """A pad id inside a response (pad != eos) does not end it."""
    responses = torch.tensor([[5, PAD, 6, EOS, 9]])
    assert response_mask(responses, EOS).tolist() == [[1, 1, 1, 1, 0]]


def test_rollout_ended():
    resp = torch.tensor([[5, EOS, PAD], [5, 6, 7], [EOS, PAD, PAD], [5, 6, EOS]])
    r = Rollout(torch.zeros(4, 2, dtype=torch.long), torch.ones(4, 2, dtype=torch.long), resp,
                response_mask(resp, EOS), ["a", "b", "", "c"], EOS)
    assert r.ended.tolist() == [True, False, True, True]  # EOS in the last column still ends the row


def test_position_ids_ignore_left_padding():
    assert position_ids(torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]])).tolist() == [[0, 0, 0, 1, 2],
                                                                                       [0, 1, 2, 3, 4]]


class _Bigram(torch.nn.Module):
    """logits[t] = table[token[t]]: a model whose log-probs can be written down by hand."""

    def __init__(self, table):
        super().__init__()
        self.table = torch.nn.Parameter(table)

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
        logits = self.table[input_ids]
        if logits_to_keep:
            logits = logits[:, -logits_to_keep:]
        return type("Out", (), {"logits": logits})()


def test_response_logprobs_score_token_t_plus_one():
    vocab = 4
    table = torch.log_softmax(torch.arange(vocab * vocab, dtype=torch.float).reshape(vocab, vocab) / 4, dim=-1)
    model = _Bigram(table.clone())
    seq = torch.tensor([[0, 1, 3, 2]])  # prompt [0, 1], response [3, 2]
    logp = response_logprobs(model, seq, torch.ones_like(seq), response_len=2)
    # token 3 is scored by the logits at the position of token 1, token 2 by those at token 3
    expected = torch.tensor([[table[1, 3], table[3, 2]]])
    assert torch.allclose(logp, expected, atol=1e-6)


def _bos_tokenizer():
    """A word-level tokenizer whose post-processor prepends BOS, like Llama's."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, "a": 4, "b": 5, "c": 6}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                   unk_token="<unk>")


def test_generation_prompts_are_tokenised_like_sft_training_rows():
    """Eval/RL prompts carry the BOS that SFT rows were trained with, left-padded and left-truncated."""
    from rlhf_core.data.collate import encode_sequences
    from rlhf_core.passes.generation import encode_prompts

    tok = _bos_tokenizer()
    ids, mask = encode_prompts(tok, ["a b c", "b"])
    assert ids.tolist() == [[1, 4, 5, 6], [0, 0, 1, 5]]
    assert mask.tolist() == [[1, 1, 1, 1], [0, 0, 1, 1]]
    trained = encode_sequences(tok, ["a b c"], ["a"], 16, "sft.parquet", "sft.max_length")
    assert trained.tokens.flat[: int(trained.prompt_lens[0])].tolist() == ids[0].tolist()
    ids, mask = encode_prompts(tok, ["a b c", "b"], max_len=2)  # the BOS stays in front of the last 2 tokens
    assert ids.tolist() == [[1, 5, 6], [0, 1, 5]]


def _tiny_lm(vocab: int = 32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64,
                      bos_token_id=1, eos_token_id=EOS, pad_token_id=PAD)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        model.lm_head.weight[EOS] = 0.0  # logit 0: never the argmax, so greedy runs to max_new_tokens
    return model


class _Tok:
    bos_token_id, eos_token_id, pad_token_id = 1, EOS, PAD

    def batch_decode(self, ids, skip_special_tokens=True):
        return [" ".join(map(str, row.tolist())) for row in ids]


def test_rollout_ignores_the_checkpoints_generation_config():
    """A checkpoint's generation_config.json (here repetition_penalty 1.5, no_repeat_ngram_size 2) must not
    shape the rollout: greedy tokens are the argmax of the raw logits that the trainer scores."""
    from rlhf_core.passes.generation import GenerationConfig, rollout

    model = _tiny_lm()
    model.generation_config.repetition_penalty = 1.5
    model.generation_config.no_repeat_ngram_size = 2
    prompt = torch.tensor([[1, 7, 8, 9, 7, 8]])
    roll = rollout(model, prompt, torch.ones_like(prompt), _Tok(), GenerationConfig(12, do_sample=False))
    seq = prompt.clone()
    with torch.no_grad():
        for _ in range(roll.responses.shape[1]):
            nxt = model(input_ids=seq).logits[:, -1].argmax(-1, keepdim=True)
            seq = torch.cat([seq, nxt], dim=1)
            if int(nxt) == EOS:
                break
    expected = seq[0, prompt.shape[1]:].tolist()
    assert roll.responses[0, :len(expected)].tolist() == expected
    assert model.generation_config.repetition_penalty == 1.5  # restored for saving and serving


def test_sampled_rollout_log_probs_match_the_sampling_distribution():
    """Sampling with a repetition penalty in the checkpoint's config: the tokens' log-probs under the raw
    policy (what the trainer computes) equal the scores generate sampled from."""
    from rlhf_core.passes.generation import clean_generation_config

    model = _tiny_lm()
    model.generation_config.repetition_penalty = 1.5
    prompt = torch.tensor([[1, 7, 8, 9, 7, 8]] * 4)
    torch.manual_seed(3)
    with torch.no_grad(), clean_generation_config(model, _Tok()):
        out = model.generate(input_ids=prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6,
                             do_sample=True, top_k=0, temperature=1.0, output_scores=True,
                             return_dict_in_generate=True, eos_token_id=EOS, pad_token_id=PAD)
    sampled = torch.log_softmax(torch.stack(out.scores, dim=1), dim=-1)
    R = sampled.shape[1]
    seqs = out.sequences
    scored = response_logprobs(model, seqs, torch.ones_like(seqs), R)
    picked = sampled.gather(-1, seqs[:, -R:, None]).squeeze(-1)
    mask = response_mask(seqs[:, -R:], EOS).bool()
    assert torch.allclose(picked[mask], scored[mask], atol=1e-4)


def test_rollout_records_the_log_probs_the_trainer_recomputes():
    """The log-probs recorded while sampling (``record_logprobs``: no second forward pass) are those of the full
    forward over the finished sequences, with left padding, temperature 0.7, a checkpoint's repetition penalty
    ignored, and rows that stop at EOS early."""
    from rlhf_core.passes.generation import GenerationConfig, rollout

    model = _tiny_lm()
    model.generation_config.repetition_penalty = 1.5
    prompt = torch.tensor([[PAD, PAD, 1, 7, 8], [1, 7, 8, 9, 7], [PAD, 1, 9, 9, 3]] * 8)
    mask = (prompt != PAD).long()
    torch.manual_seed(5)
    roll = rollout(model, prompt, mask, _Tok(), GenerationConfig(10, temperature=0.7, record_logprobs=True))
    R = roll.responses.shape[1]
    assert roll.logp is not None and roll.logp.shape == (len(prompt), R)
    with torch.no_grad():
        scored = response_logprobs(model, roll.sequences, roll.attention_mask, R, temperature=0.7)
    m = roll.action_mask.bool()
    assert (~m).any() and m.sum() > 20  # some rows ended early: their padding is outside the comparison
    assert torch.allclose(roll.logp[m], scored[m], atol=1e-5), (roll.logp[m] - scored[m]).abs().max()
    # the same generation without recording samples the same tokens (the recorder changes nothing)
    torch.manual_seed(5)
    plain = rollout(model, prompt, mask, _Tok(), GenerationConfig(10, temperature=0.7))
    assert plain.logp is None and torch.equal(plain.responses, roll.responses)
    # min_new_tokens bans EOS inside the logits: nothing recorded rather than a wrong distribution
    banned = rollout(model, prompt, mask, _Tok(), GenerationConfig(4, min_new_tokens=4, record_logprobs=True))
    assert banned.logp is None


def test_sampled_logprobs_drop_a_step_generate_undid():
    from rlhf_core.passes.generation import SampledLogprobs

    rec = SampledLogprobs(1.0)
    logits = torch.log(torch.tensor([[0.5, 0.25, 0.25], [0.1, 0.1, 0.8]]))
    ids = torch.tensor([[0], [0]])
    rec(ids, logits)
    ids = torch.cat([ids, torch.tensor([[1], [2]])], dim=1)
    rec(ids, logits)
    ids = torch.cat([ids, torch.tensor([[0], [0]])], dim=1)
    rec(ids, logits)  # a third step, whose token generate then removed
    out = rec.finish(ids[:, 1:])
    assert torch.allclose(out, torch.log(torch.tensor([[0.25, 0.5], [0.8, 0.1]])))
    with pytest.raises(RuntimeError, match="recorded 0 sampling steps for 2"):
        SampledLogprobs(1.0).finish(ids[:, 1:])


def test_shared_prefix_logits_and_gradients_equal_the_full_forward():
    """Groups of rows sharing a left-padded prompt (one group cut to 1 row, one of 3): each prompt computed once
    gives the full forward's logits and the same parameter gradients."""
    from rlhf_core.passes.generation import response_logits, shared_prefix_logits

    model = _tiny_lm()
    prompts = torch.tensor([[PAD, PAD, 1, 7, 8], [1, 7, 8, 9, 7], [PAD, 1, 9, 9, 3]])
    group = torch.tensor([0, 0, 0, 1, 2, 2])
    responses = torch.tensor([[4, 5, EOS], [6, EOS, PAD], [4, 4, 4], [9, 3, EOS], [EOS, PAD, PAD], [5, 6, 7]])
    seq = torch.cat([prompts[group], responses], dim=1)
    att = torch.cat([(prompts[group] != PAD).long(), response_mask(responses, EOS)], dim=1)

    def run(g):
        model.zero_grad()
        logits = response_logits(model, seq, att, 3, temperature=0.7, group=g)
        (logits * att[:, -3:, None]).sum().backward()
        return logits.detach(), [p.grad.clone() for p in model.parameters()]

    full, full_grads = run(None)
    shared, shared_grads = run(group)
    m = att[:, -3:].bool()
    assert torch.allclose(full[m], shared[m], atol=1e-5)
    for a, b in zip(full_grads, shared_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-4)
    # nothing shared (every row its own group): None, the caller runs the plain forward
    assert shared_prefix_logits(model, seq, att, 3, torch.arange(6)) is None
    with pytest.raises(ValueError, match="different prompts"):
        shared_prefix_logits(model, seq, att, 3, torch.tensor([0, 0, 0, 0, 2, 2]))


def test_grouped_rollout_prefills_each_prompt_once_and_samples_the_same():
    """Runs of 4 copies of a (left-padded) prompt: prefilling each prompt once and repeating its KV cache samples
    the same tokens under the same seed, with the same recorded log-probs; rows that are not such runs are
    refused."""
    from rlhf_core.passes.generation import GenerationConfig, prefilled_cache, rollout

    model = _tiny_lm()
    prompt = torch.tensor([[PAD, PAD, 1, 7, 8], [1, 7, 8, 9, 7], [PAD, 1, 9, 9, 3]]).repeat_interleave(4, dim=0)
    mask = (prompt != PAD).long()
    gen = GenerationConfig(10, temperature=0.7, record_logprobs=True)
    torch.manual_seed(11)
    plain = rollout(model, prompt, mask, _Tok(), gen)
    torch.manual_seed(11)
    grouped = rollout(model, prompt, mask, _Tok(), gen, group_size=4)
    assert torch.equal(plain.responses, grouped.responses)
    m = grouped.action_mask.bool()
    assert torch.allclose(plain.logp[m], grouped.logp[m], atol=1e-5)
    with torch.no_grad():
        cache = prefilled_cache(model, prompt, mask, 4)
    assert cache.get_seq_length() == prompt.shape[1] - 1
    assert prefilled_cache(model, prompt, mask, 5) is None  # 12 rows are not runs of 5: every row prefilled
    with pytest.raises(ValueError, match="runs of 3 identical prompts"):
        prefilled_cache(model, prompt, mask, 3)
