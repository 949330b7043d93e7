"""Collation on hand-made tokens: prompt masking, pad never counted, left/right padding, packing, pairs."""

from __future__ import annotations

import pytest
import torch

from rlhf_core.data.collate import (
    IGNORE_INDEX,
    PairData,
    PromptTooLongError,
    Ragged,
    TokenizedSequences,
    build_sft_data,
    collate_pairs,
    collate_sft,
    concat_rows,
    keep_last_tokens,
    left_pad_prompts,
)

PAD, EOS = 0, 2


def seqs(prompts, responses, max_length=100):
    """TokenizedSequences from token lists (responses already end with EOS)."""
    p, r = Ragged.from_lists(prompts), Ragged.from_lists(responses)
    tokens, from_r = concat_rows(p, r, max_length)
    truncated = int((p.lengths + r.lengths > max_length).sum())
    return TokenizedSequences(tokens, from_r, p.lengths, truncated)


def test_ragged_pad_right_and_left():
    r = Ragged.from_lists([[5, 6, 7], [8], [9, 10]])
    ids, valid = r.pad(pad_value=PAD)
    assert ids.tolist() == [[5, 6, 7], [8, 0, 0], [9, 10, 0]]
    assert valid.sum(-1).tolist() == [3, 1, 2]
    ids, valid = r.pad(torch.tensor([2, 1]), pad_value=PAD, side="left")
    assert ids.tolist() == [[9, 10], [0, 8]]
    assert valid.tolist() == [[True, True], [False, True]]
    assert r.select(torch.tensor([2, 0])).flat.tolist() == [9, 10, 5, 6, 7]


def test_keep_last_tokens_cuts_on_the_left_only_rows_over_the_limit():
    r = Ragged.from_lists([[1, 2, 3, 4, 5], [6], [7, 8, 9]])
    cut = keep_last_tokens(r, 3)
    assert cut.lengths.tolist() == [3, 1, 3]
    assert cut.flat.tolist() == [3, 4, 5, 6, 7, 8, 9]
    assert keep_last_tokens(r, 5) is r


def test_prompt_tokens_carry_ignore_label_and_pad_is_never_counted():
    s = seqs([[10, 11, 12], [13]], [[20, EOS], [21, 22, 23, EOS]])
    data = build_sft_data(s, loss_on_prompt=False)
    batch = collate_sft(data, torch.tensor([0, 1]), PAD)
    assert batch["input_ids"].tolist() == [[10, 11, 12, 20, EOS], [13, 21, 22, 23, EOS]]
    assert batch["labels"].tolist() == [[-100, -100, -100, 20, EOS], [-100, 21, 22, 23, EOS]]
    assert int(batch["num_tokens"]) == 10
    # mixed lengths: the shorter row is right-padded; pad is masked out of labels and attention
    batch = collate_sft(data, torch.tensor([1, 0]), PAD)
    s2 = seqs([[10], [13, 14, 15, 16]], [[EOS], [21, EOS]])
    b2 = collate_sft(build_sft_data(s2), torch.tensor([0, 1]), PAD)
    assert b2["input_ids"].tolist() == [[10, EOS, 0, 0, 0, 0], [13, 14, 15, 16, 21, EOS]]
    assert b2["labels"].tolist() == [[-100, EOS, -100, -100, -100, -100], [-100, -100, -100, -100, 21, EOS]]
    assert b2["attention_mask"].tolist() == [[1, 1, 0, 0, 0, 0], [1] * 6]
    assert not ((b2["labels"] != IGNORE_INDEX) & (b2["attention_mask"] == 0)).any()


def test_loss_on_prompt_trains_all_but_the_first_token():
    s = seqs([[10, 11], [13]], [[20, EOS], [EOS]])
    batch = collate_sft(build_sft_data(s, loss_on_prompt=True), torch.tensor([0, 1]), PAD)
    assert batch["labels"].tolist() == [[-100, 11, 20, EOS], [-100, EOS, -100, -100]]


def test_overlong_response_is_cut_and_counted():
    s = seqs([[10, 11, 12]], [[20, 21, 22, EOS]], max_length=5)
    assert s.truncated == 1
    assert s.tokens.flat.tolist() == [10, 11, 12, 20, 21]


def test_packing_resets_positions_and_masks_each_example():
    s = seqs([[10, 11], [12], [13, 14]], [[20, EOS], [21, EOS], [EOS]])  # lengths 4, 3, 3
    data = build_sft_data(s, loss_on_prompt=False, packing=True, max_length=7, seed=0)
    assert data.packed and data.n_examples == 3 and len(data) == 2
    assert sorted(data.tokens.lengths.tolist()) == [3, 7]
    batch = collate_sft(data, torch.arange(len(data)), PAD)
    assert "attention_mask" not in batch
    for row, pos, lab in zip(batch["input_ids"], batch["position_ids"], batch["labels"], strict=True):
        n = int((row != PAD).sum())
        starts = torch.nonzero(pos[:n] == 0).flatten().tolist()
        assert starts[0] == 0
        for a, b in zip(starts, [*starts[1:], n], strict=True):
            assert pos[a:b].tolist() == list(range(b - a))  # positions restart per example
            assert lab[a] == IGNORE_INDEX  # never predict an example's first token from the previous one
        assert (lab[n:] == IGNORE_INDEX).all()
        targets = lab[lab != IGNORE_INDEX].tolist()
        assert set(targets) <= {20, 21, EOS}  # only response tokens are targets
    assert int(batch["num_tokens"]) == 10


def test_pairs_are_concatenated_in_one_batch_and_prompts_left_padded():
    c = seqs([[10, 11], [12]], [[20, EOS], [21, 22, EOS]])
    r = seqs([[10, 11], [12]], [[30, 31, EOS], [EOS]])
    batch = collate_pairs(PairData(c, r), torch.tensor([0, 1]), PAD)
    assert batch["input_ids"].tolist() == [[10, 11, 20, EOS, 0], [12, 21, 22, EOS, 0],
                                           [10, 11, 30, 31, EOS], [12, EOS, 0, 0, 0]]
    assert batch["attention_mask"].sum(-1).tolist() == [4, 4, 5, 2]
    # the same pairs with each prompt once (the RM scores them so): prompts left-padded, responses right-padded
    assert batch["prefix_ids"].tolist() == [[10, 11], [0, 12]] and batch["prefix_mask"].tolist() == [[1, 1], [0, 1]]
    assert batch["suffix_ids"].tolist() == [[20, EOS, 0], [21, 22, EOS], [30, 31, EOS], [EOS, 0, 0]]
    assert batch["suffix_mask"].sum(-1).tolist() == [2, 3, 3, 1]
    # a pair whose prompts differ, or an empty prompt: no shared layout, the full rows only
    apart = seqs([[10, 11], [13]], [[20, EOS], [21, EOS]])
    assert "prefix_ids" not in collate_pairs(PairData(c, apart), torch.tensor([0, 1]), PAD)
    empty = seqs([[], [12]], [[20, EOS], [21, EOS]])
    assert "prefix_ids" not in collate_pairs(PairData(empty, empty), torch.tensor([0, 1]), PAD)
    assert "prefix_ids" in collate_pairs(PairData(empty, empty), torch.tensor([1]), PAD)
    prompts = Ragged.from_lists([[5, 6, 7], [8]])
    gen = left_pad_prompts(prompts, torch.tensor([0, 1]), PAD)
    assert gen["input_ids"].tolist() == [[5, 6, 7], [0, 0, 8]]
    assert gen["attention_mask"].tolist() == [[1, 1, 1], [0, 0, 1]]


def test_prompt_without_room_is_a_clear_error():
    from rlhf_core.data.collate import check_prompt_room

    with pytest.raises(PromptTooLongError, match=r"data/x.parquet: 1 prompt\(s\) have no room.*row 1 \(id b\) has 9 "
                                                 r"prompt tokens but sft.max_length is 8"):
        check_prompt_room(torch.tensor([3, 9]), 8, "data/x.parquet", "sft.max_length", ["a", "b"])


def _bos_tokenizer():
    """The demo tokenizer with a post-processor that adds a BOS, as Llama's does."""
    from tokenizers import processors

    from rlhf_core.data.tokenizer import train_demo_tokenizer

    tok = train_demo_tokenizer(["Human: What is 1 + 2?\n\nAssistant: 3"] * 50, 64)
    tok._tokenizer.post_processor = processors.TemplateProcessing(single="<s> $A",
                                                                  special_tokens=[("<s>", tok.bos_token_id)])
    return tok


def test_rl_prompts_keep_one_bos_like_sft_rows():
    """A prompt cut to exactly max_len keeps its BOS (was: cut away); a chat-templated prompt that already
    carries a BOS does not get a second; both equal the SFT encoding of the same prompt."""
    from rlhf_core.data.collate import encode_prompts

    tok = _bos_tokenizer()
    bos = tok.bos_token_id
    body = tok("Human: What is 1 + 2?", add_special_tokens=False)["input_ids"]
    plain = encode_prompts(tok, ["Human: What is 1 + 2?"])
    assert plain.flat.tolist() == [bos, *body]
    cut = encode_prompts(tok, ["Human: What is 1 + 2?"], max_len=len(body))  # exactly max_len tokens
    assert cut.flat.tolist() == [bos, *body]
    shorter = encode_prompts(tok, ["Human: What is 1 + 2?"], max_len=3)
    assert shorter.flat.tolist() == [bos, *body[-3:]]
    templated = encode_prompts(tok, ["<s>Human: What is 1 + 2?", "Human: What is 1 + 2?"], max_len=len(body))
    assert templated.lengths.tolist() == [len(body) + 1] * 2 and templated.flat.tolist() == [bos, *body] * 2


def test_keep_last_tokens_keeps_the_first_token_vectorised():
    rows = Ragged.from_lists([[1, 5, 6, 7, 8], [5, 6, 7, 8, 9], [1, 5], []])
    out = keep_last_tokens(rows, 2, keep_first=1)
    assert [out.flat[a:b].tolist() for a, b in zip(out.offsets[:-1], out.offsets[1:], strict=True)] == [
        [1, 7, 8], [8, 9], [1, 5], []]


def test_rm_rows_cut_by_max_length_still_end_with_eos():
    """The RM's score is read at the EOS: a response cut by rm.max_length ends with EOS (OpenRLHF forces it);
    SFT rows are cut plainly (the response goes on)."""
    from rlhf_core.data.collate import encode_sequences

    tok = _bos_tokenizer()
    prompts, responses = ["Human: What is 1 + 2?"] * 2, [" 3", " 3 3 3 3 3 3 3 3 3 3"]
    p_len = len(tok("Human: What is 1 + 2?")["input_ids"])
    rm = encode_sequences(tok, prompts, responses, p_len + 4, keep_eos=True)
    sft = encode_sequences(tok, prompts, responses, p_len + 4)
    ends = rm.tokens.flat[rm.tokens.offsets[1:] - 1].tolist()
    assert ends == [tok.eos_token_id, tok.eos_token_id] and rm.truncated == sft.truncated == 1
    assert sft.tokens.flat[sft.tokens.offsets[2] - 1] != tok.eos_token_id
    assert rm.tokens.lengths.tolist() == sft.tokens.lengths.tolist()


def test_distinct_rows_ignore_padding_and_point_back_to_their_first_row():
    from rlhf_core.data.collate import distinct_rows

    ids = torch.tensor([[0, 5, 6], [7, 5, 6], [9, 5, 6], [0, 8, 6]])  # rows 0 and 2 differ only in padding
    mask = torch.tensor([[0, 1, 1], [1, 1, 1], [0, 1, 1], [0, 1, 1]])
    first, owner = distinct_rows(ids, mask)
    assert len(first) == 3 and owner[0] == owner[2] and len(set(owner[[0, 1, 3]].tolist())) == 3
    assert first[owner].tolist() == [0, 1, 0, 3]


def test_prompt_batches_split_each_batch_at_its_prompts_by_hand():
    """Rows [prompt | response]: (1 2 | 7), (3 | 8 9), (1 2 | 6) in batches of 2: the first batch has two distinct
    prompts, left-padded, and its responses right-padded; the second holds the last row alone."""
    from rlhf_core.data.collate import TokenizedSequences, prompt_batches

    rows = Ragged.from_lists([[1, 2, 7], [3, 8, 9], [1, 2, 6]])
    response = torch.tensor([0, 0, 1, 0, 1, 1, 0, 0, 1], dtype=torch.bool)
    seqs = TokenizedSequences(rows, response, torch.tensor([2, 1, 2]), 0)
    first, second = prompt_batches(seqs, 2, pad_id=0)
    assert first.rows.tolist() == [0, 1] and second.rows.tolist() == [2]
    assert first.prefix.tolist() == [[1, 2], [0, 3]] and first.prefix_mask.tolist() == [[1, 1], [0, 1]]
    assert first.suffix.tolist() == [[7, 0], [8, 9]] and first.suffix_mask.tolist() == [[1, 0], [1, 1]]
    assert first.prefix[first.first][first.owner].tolist() == first.prefix.tolist() and len(first.first) == 2
    assert second.prefix.tolist() == [[1, 2]] and second.suffix.tolist() == [[6]] and second.owner.tolist() == [0]
