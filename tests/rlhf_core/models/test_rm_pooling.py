"""A reward model's score is read where transformers reads it: the rightmost token that is not ``pad_token_id``.

Checked against ``AutoModelForSequenceClassification`` on the same token ids, for a Hub-format RM whose pad is
its EOS (SmolLM2's tokenizer: the score is the token before the trailing EOS), one whose pad differs from EOS
(read at the EOS), and one of ours as the RM stage builds, trains and saves it."""

from __future__ import annotations

import shutil

import torch

from rlhf_core.algos.masking import gather_pooled, pooled_index
from rlhf_core.models.loading import save_value_model
from rlhf_core.models.scorer import RewardScorer
from rlhf_core.models.value_head import ValueHeadModel
from rlhf_core.trainers.rm import pooled_at

PROMPTS = ["<|im_start|>user\nAntonym of hot?<|im_end|>\n<|im_start|>assistant\n"] * 2 + [
    "<|im_start|>user\nName a colour.<|im_end|>\n<|im_start|>assistant\n"]
RESPONSES = ["cold", "warm, surely, or maybe tepid", "red"]


def test_pooled_index_by_hand():
    pad = 2
    ids = torch.tensor([[5, 6, 2, 2, 2],    # right-padded, pad = EOS: the 6 at 1 (the EOS at 2 is skipped too)
                        [2, 2, 5, 6, 7],    # left-padded: the last token, 4
                        [2, 2, 2, 2, 2],    # pad ids only, valid from 1: its first valid position, 1
                        [5, 6, 7, 8, 9]])   # nothing valid: -1
    mask = torch.tensor([[1, 1, 1, 0, 0], [0, 0, 1, 1, 1], [0, 1, 1, 1, 0], [0, 0, 0, 0, 0]])
    assert pooled_index(ids, mask, pad).tolist() == [1, 4, 1, -1]
    assert pooled_index(ids, mask, None).tolist() == [2, 4, 3, -1]  # no pad id: the last valid position
    x = torch.arange(20, dtype=torch.float).view(4, 5)
    assert gather_pooled(x, ids, mask, pad).tolist() == [1.0, 9.0, 11.0, 0.0]


def hf_scores(path: str, rows: list[list[int]]) -> torch.Tensor:
    """transformers' own scores, one unpadded row at a time (no padding for it to misread)."""
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():
        return torch.stack([model(torch.tensor([r])).logits[0, 0] for r in rows])


def our_scores(path: str) -> tuple[torch.Tensor, list[list[int]]]:
    scorer = RewardScorer.from_pretrained(path, device="cpu")
    seqs = scorer.encode(PROMPTS, RESPONSES)
    t = seqs.tokens
    rows = [t.flat[t.offsets[i]:t.offsets[i + 1]].tolist() for i in range(len(t))]
    return scorer.score_responses(PROMPTS, RESPONSES), rows


def test_a_hub_rm_with_pad_eos_scores_as_transformers(user_rm_dir):
    ours, rows = our_scores(user_rm_dir)
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(user_rm_dir).eos_token_id
    assert all(r[-1] == eos for r in rows)
    torch.testing.assert_close(ours, hf_scores(user_rm_dir, rows), atol=1e-5, rtol=0)
    # and on the text alone (no EOS): transformers reads the same last response token
    plain = [r[:-1] for r in rows]
    torch.testing.assert_close(ours, hf_scores(user_rm_dir, plain), atol=1e-5, rtol=0)


def test_a_hub_rm_whose_pad_is_not_eos_is_read_at_the_eos(user_rm_dir, tmp_path):
    from transformers import AutoConfig, AutoTokenizer

    path = tmp_path / "rm_pad0"
    shutil.copytree(user_rm_dir, path)
    tok = AutoTokenizer.from_pretrained(path)
    tok.pad_token = tok.convert_ids_to_tokens(0)  # <|endoftext|>, not the EOS <|im_end|>
    tok.save_pretrained(path)
    config = AutoConfig.from_pretrained(path)
    config.pad_token_id = 0
    config.save_pretrained(path)
    ours, rows = our_scores(str(path))
    torch.testing.assert_close(ours, hf_scores(str(path), rows), atol=1e-5, rtol=0)
    with_eos = hf_scores(str(path), rows)
    without_eos = hf_scores(str(path), [r[:-1] for r in rows])
    assert (with_eos - without_eos).abs().min() > 1e-4  # the EOS position is a different read: the test can fail


def test_our_rm_trains_where_its_saved_checkpoint_is_read(user_model_dir, tmp_path):
    """An RM as the RM stage builds it from a causal folder (fresh head, pad set from the tokenizer), scores equal
    in training (its forward, and the shared-prompt pass) and after save, in transformers."""
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(user_model_dir)
    torch.manual_seed(0)
    backbone = AutoModel.from_pretrained(user_model_dir)
    backbone.config.pad_token_id = None  # a base config without one: the stage's tokenizer decides
    model = pooled_at(ValueHeadModel(backbone), tok.pad_token_id).eval()
    with torch.no_grad():
        model.value_head.weight.normal_(0, 1.0)
    path = tmp_path / "rm"
    save_value_model(model, path, pad_token_id=tok.pad_token_id)
    tok.save_pretrained(path)
    ours, rows = our_scores(str(path))
    torch.testing.assert_close(ours, hf_scores(str(path), rows), atol=1e-5, rtol=0)
    with torch.no_grad():
        training = torch.stack([model(torch.tensor([r])).scores[0] for r in rows])
    torch.testing.assert_close(training, ours, atol=1e-5, rtol=0)


def test_shared_prompt_scoring_matches_full_rows_even_for_an_eos_only_response(user_rm_dir):
    """With pad = EOS an empty response's row is read in its prompt: the shared-prompt pass must not read the
    suffix's EOS instead (it falls back to the full rows)."""
    from transformers import AutoTokenizer

    scorer = RewardScorer.from_pretrained(user_rm_dir, device="cpu")
    eos = AutoTokenizer.from_pretrained(user_rm_dir).eos_token_id
    prompt = scorer.tokenizer(PROMPTS[0], return_tensors="pt").input_ids
    suffixes = torch.tensor([[eos, eos, eos], [3000, eos, eos], [3000, 3001, eos]])
    suffix_mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 1, 1]])
    owner = torch.zeros(3, dtype=torch.long)
    with torch.no_grad():
        shared = scorer.model.shared_prefix_scores(prompt, torch.ones_like(prompt), owner, suffixes, suffix_mask)
    rows = [prompt[0].tolist() + s[m.bool()].tolist() for s, m in zip(suffixes, suffix_mask, strict=True)]
    expected = hf_scores(user_rm_dir, rows)
    assert shared is None  # the EOS-only suffix: full rows
    full = torch.cat([scorer.score_tokens(torch.tensor([r]), torch.ones(1, len(r), dtype=torch.long)) for r in rows])
    torch.testing.assert_close(full, expected, atol=1e-5, rtol=0)
    with torch.no_grad():  # without that row, the shared pass runs and agrees
        shared = scorer.model.shared_prefix_scores(prompt, torch.ones_like(prompt), owner[1:], suffixes[1:],
                                                   suffix_mask[1:])
    assert shared is not None
    torch.testing.assert_close(shared, expected[1:], atol=1e-5, rtol=0)


def test_reading_at_the_appended_eos_would_differ(user_rm_dir):
    """The checks above can fail: reading at the appended EOS (what scoring did before) gives other numbers."""
    ours, _ = our_scores(user_rm_dir)
    scorer = RewardScorer.from_pretrained(user_rm_dir, device="cpu")
    scorer.model.pad_token_id = None  # the last valid token: the EOS
    assert (scorer.score_responses(PROMPTS, RESPONSES) - ours).abs().min() > 1e-4
