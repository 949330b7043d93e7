"""Tokenisation and vectorised collation for SFT and reward-model training.

Token sequences are stored ragged (one flat tensor + offsets) and batches are cut out of it with
index arithmetic: no per-sample Python loops when building ids, masks, labels or positions.

Conventions
- A training row is ``prompt + response + EOS``.  Prompts are tokenised with the tokenizer's special
  tokens (a BOS where the model uses one), responses without; EOS is appended explicitly.
- Training batches are right-padded; generation prompts are left-padded.
- ``labels`` carry ``-100`` on pad and (unless ``loss_on_prompt``) on prompt tokens; the first token of
  every example is never a target (it has no predecessor in its example — this matters for packing).
- Packed rows reset ``position_ids`` at every example; with ``attention_mask=None`` transformers then
  builds a block-diagonal causal mask, so packed examples do not attend to each other.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from rlhf_core.algos.losses import IGNORE_INDEX


# --------------------------------------------------------------------------- ragged storage
@dataclass
class Ragged:
    """Variable-length rows in one flat tensor: row ``i`` is ``flat[offsets[i]:offsets[i+1]]``."""

    flat: torch.Tensor
    offsets: torch.Tensor  # [n + 1]

    @classmethod
    def from_lists(cls, rows: Sequence[Sequence[int]], dtype=torch.long) -> Ragged:
        lengths = torch.tensor([len(r) for r in rows], dtype=torch.long)
        flat = torch.tensor([t for r in rows for t in r], dtype=dtype)
        return cls.from_lengths(flat, lengths)

    @classmethod
    def from_lengths(cls, flat: torch.Tensor, lengths: torch.Tensor) -> Ragged:
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(lengths, 0)
        return cls(flat, offsets)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    @property
    def lengths(self) -> torch.Tensor:
        return self.offsets[1:] - self.offsets[:-1]

    def like(self, flat: torch.Tensor) -> Ragged:
        """Same row structure, other per-token values."""
        return Ragged(flat, self.offsets)

    def pad(self, idx: torch.Tensor | None = None, pad_value: int | float = 0, side: str = "right",
            length: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Rows ``idx`` as a padded ``[B, T]`` tensor and its validity mask."""
        idx = torch.arange(len(self)) if idx is None else idx
        lens = self.lengths[idx]
        T = int(length if length is not None else (lens.max() if len(lens) else 0))
        pos = torch.arange(T).unsqueeze(0)
        if side == "right":
            valid = pos < lens[:, None]
            src = self.offsets[idx][:, None] + pos
        else:
            start = T - lens[:, None]
            valid = pos >= start
            src = self.offsets[idx][:, None] + pos - start
        src = src.clamp(0, max(len(self.flat) - 1, 0))
        gathered = self.flat[src] if len(self.flat) else torch.zeros_like(src, dtype=self.flat.dtype)
        out = torch.where(valid, gathered, torch.tensor(pad_value, dtype=self.flat.dtype))
        return out, valid

    def select(self, idx: torch.Tensor) -> Ragged:
        """Rows ``idx`` (in that order) as a new Ragged."""
        padded, valid = self.pad(idx)
        return Ragged.from_lengths(padded[valid], self.lengths[idx])


def concat_rows(a: Ragged, b: Ragged, max_length: int) -> tuple[Ragged, torch.Tensor]:
    """Row-wise ``a[i] + b[i]`` cut to ``max_length``; also returns a per-token bool 'comes from b'."""
    la, lb = a.lengths, b.lengths
    total = torch.clamp(la + lb, max=max_length)
    T = int(total.max()) if len(total) else 0
    A, _ = a.pad(length=max(T, 1))
    B, _ = b.pad(length=max(T, 1))
    pos = torch.arange(T).unsqueeze(0)
    from_b = pos >= la[:, None]
    b_pos = (pos - la[:, None]).clamp(min=0, max=max(B.shape[1] - 1, 0))
    combined = torch.where(from_b, torch.gather(B, 1, b_pos), A[:, :T])
    valid = pos < total[:, None]
    return Ragged.from_lengths(combined[valid], total), from_b[valid]


# --------------------------------------------------------------------------- tokenisation
def _added_special_tokens(tokenizer) -> tuple[bool, bool]:
    """Whether the tokenizer adds a BOS in front and an EOS at the end of a text (one probe)."""
    ids = tokenizer("a", add_special_tokens=True)["input_ids"]
    bos = tokenizer.bos_token_id is not None and bool(ids) and ids[0] == tokenizer.bos_token_id
    return bos, bool(ids) and ids[-1] == tokenizer.eos_token_id


def encode_prompts(tokenizer, prompts: Sequence[str], max_len: int | None = None) -> Ragged:
    """Prompt token ids with the tokenizer's special tokens: exactly one BOS where it adds one (a chat template
    that already wrote its BOS into the text does not get a second), never a trailing EOS. With ``max_len``
    the prompt text is cut to its last ``max_len`` tokens and the BOS kept in front (``keep_last_tokens``), so
    a prompt that prepare cut to ``max_len`` tokens is encoded exactly as in SFT training."""
    ids = tokenizer(list(prompts), add_special_tokens=True)["input_ids"]
    adds_bos, adds_eos = _added_special_tokens(tokenizer)
    if adds_eos:
        ids = [r[:-1] if r and r[-1] == tokenizer.eos_token_id else r for r in ids]
    bos = tokenizer.bos_token_id if adds_bos else None
    if bos is not None:
        ids = [r[1:] if len(r) > 1 and r[0] == r[1] == bos else r for r in ids]
    rows = Ragged.from_lists(ids)
    return rows if max_len is None else keep_last_tokens(rows, max_len, keep_first=bos)


def encode_responses(tokenizer, responses: Sequence[str]) -> Ragged:
    """Response token ids followed by EOS (no other special tokens)."""
    ids = tokenizer(list(responses), add_special_tokens=False)["input_ids"]
    r = Ragged.from_lists(ids)
    eos = Ragged.from_lengths(torch.full((len(r),), tokenizer.eos_token_id, dtype=torch.long),
                              torch.ones(len(r), dtype=torch.long))
    out, _ = concat_rows(r, eos, max_length=1 << 30)
    return out


class PromptTooLongError(ValueError):
    pass


def check_prompt_room(prompt_lens: torch.Tensor, max_length: int, source: str, key: str,
                      ids: Sequence[str] | None = None) -> None:
    """Every prompt must leave room for at least one response token."""
    bad = torch.nonzero(prompt_lens >= max_length).flatten()
    if len(bad):
        i = int(bad[torch.argmax(prompt_lens[bad])])
        row = f"row {i}" + (f" (id {ids[i]})" if ids is not None else "")
        raise PromptTooLongError(
            f"{source}: {len(bad)} prompt(s) have no room for a response: {row} has {int(prompt_lens[i])} prompt "
            f"tokens but {key} is {max_length}; raise {key} or lower data.max_prompt_len")


@dataclass
class TokenizedSequences:
    """``prompt + response + EOS`` rows: tokens, per-token 'is response', and how many were cut."""

    tokens: Ragged
    response_mask: torch.Tensor  # flat bool aligned with tokens.flat
    prompt_lens: torch.Tensor
    truncated: int

    def __len__(self) -> int:
        return len(self.tokens)

    @functools.cached_property
    def split(self) -> tuple[Ragged, Ragged]:
        """``(prompt rows, response rows)``: each row's first ``prompt_lens`` tokens, and the rest."""
        rows = self.tokens
        return (Ragged.from_lengths(rows.flat[~self.response_mask], self.prompt_lens),
                Ragged.from_lengths(rows.flat[self.response_mask], rows.lengths - self.prompt_lens))


def encode_sequences(tokenizer, prompts: Sequence[str], responses: Sequence[str], max_length: int,
                     source: str = "<data>", key: str = "max_length",
                     ids: Sequence[str] | None = None, keep_eos: bool = False) -> TokenizedSequences:
    """Tokenise prompt/response pairs into training rows; responses that overflow ``max_length`` are cut.

    ``keep_eos`` (reward models, whose score is read at the EOS): a cut row ends with EOS in place of its last
    kept token, so a truncated response is scored where every other one is (OpenRLHF forces the EOS too).
    """
    p = encode_prompts(tokenizer, prompts)
    r = encode_responses(tokenizer, responses)
    check_prompt_room(p.lengths, max_length, source, key, ids)
    cut = p.lengths + r.lengths > max_length
    tokens, from_response = concat_rows(p, r, max_length)
    if keep_eos and cut.any():
        last = tokens.offsets[1:][cut] - 1
        tokens.flat[last] = tokenizer.eos_token_id
    return TokenizedSequences(tokens, from_response, p.lengths, int(cut.sum()))


# --------------------------------------------------------------------------- SFT
@dataclass
class SFTData:
    """Training rows for SFT: tokens, per-token loss mask and position ids (packed or one example per row)."""

    tokens: Ragged
    loss_mask: torch.Tensor  # flat bool
    positions: torch.Tensor  # flat long
    packed: bool
    n_examples: int
    truncated: int

    def __len__(self) -> int:
        return len(self.tokens)


def build_sft_data(seqs: TokenizedSequences, loss_on_prompt: bool = False, packing: bool = False,
                   max_length: int | None = None, seed: int = 0) -> SFTData:
    """Loss mask (response tokens, or all but each example's first) and positions; optionally packed."""
    tok = seqs.tokens
    n = len(tok)
    starts = torch.repeat_interleave(tok.offsets[:-1], tok.lengths)
    positions = torch.arange(len(tok.flat)) - starts
    loss_mask = (positions > 0) if loss_on_prompt else (seqs.response_mask & (positions > 0))
    if not packing:
        return SFTData(tok, loss_mask, positions, False, n, seqs.truncated)
    if max_length is None:
        raise ValueError("packing needs max_length")
    order = torch.randperm(n, generator=torch.Generator().manual_seed(seed))
    lengths = tok.lengths[order].tolist()
    row_lengths, current = [], 0
    for length in lengths:  # greedy next-fit over integers (data preparation, not a per-token loop)
        if current and current + length > max_length:
            row_lengths.append(current)
            current = 0
        current += length
    row_lengths.append(current)
    sel = tok.select(order)
    perm_pos = Ragged(positions, tok.offsets).select(order).flat
    perm_mask = Ragged(loss_mask.long(), tok.offsets).select(order).flat.bool()
    rows = Ragged.from_lengths(sel.flat, torch.tensor(row_lengths, dtype=torch.long))
    return SFTData(rows, perm_mask, perm_pos, True, n, seqs.truncated)


def collate_sft(data: SFTData, idx: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """Right-padded batch with ``labels`` (-100 on pad / masked tokens), ``num_tokens`` (non-pad tokens) and
    ``attention_mask`` or, for packed rows, ``position_ids`` (restarting at each example, no attention mask)."""
    ids, valid = data.tokens.pad(idx, pad_value=pad_id)
    loss_mask, _ = data.tokens.like(data.loss_mask).pad(idx, pad_value=False)
    labels = torch.where(loss_mask & valid, ids, torch.tensor(IGNORE_INDEX))
    batch = {"input_ids": ids, "labels": labels, "num_tokens": valid.sum()}
    if data.packed:
        positions, _ = data.tokens.like(data.positions).pad(idx, pad_value=0)
        batch["position_ids"] = positions
    else:
        batch["attention_mask"] = valid.long()
    return batch


# --------------------------------------------------------------------------- pairs
@dataclass
class PairData:
    chosen: TokenizedSequences
    rejected: TokenizedSequences

    def __len__(self) -> int:
        return len(self.chosen)

    @property
    def truncated(self) -> int:
        return self.chosen.truncated + self.rejected.truncated


def collate_pairs(data: PairData, idx: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """Chosen rows then rejected rows in one right-padded ``[2B, T]`` batch (one forward pass), with the
    ``response_mask`` of their response tokens (EOS included)."""
    T = int(torch.maximum(data.chosen.tokens.lengths[idx], data.rejected.tokens.lengths[idx]).max())
    c, cm = data.chosen.tokens.pad(idx, pad_value=pad_id, length=T)
    r, rm = data.rejected.tokens.pad(idx, pad_value=pad_id, length=T)
    cr, _ = data.chosen.tokens.like(data.chosen.response_mask).pad(idx, pad_value=False, length=T)
    rr, _ = data.rejected.tokens.like(data.rejected.response_mask).pad(idx, pad_value=False, length=T)
    return {"input_ids": torch.cat([c, r]), "attention_mask": torch.cat([cm, rm]).long(),
            "response_mask": torch.cat([cr, rr]), **shared_prompt_layout(data, idx, pad_id)}


def shared_prompt_layout(data: PairData, idx: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """The same pairs with each prompt once: ``prefix_ids`` ``[B, P]`` left-padded, and the responses (EOS
    included; chosen rows then rejected, as ``collate_pairs``) ``suffix_ids`` ``[2B, S]`` right-padded, with
    their masks. Empty (score the full rows) when a prompt is empty or a pair's two prompts differ."""
    (chosen_prompts, chosen), (rejected_prompts, rejected) = data.chosen.split, data.rejected.split
    prefix, prefix_mask = chosen_prompts.pad(idx, pad_value=pad_id, side="left")
    other, _ = rejected_prompts.pad(idx, pad_value=pad_id, side="left")
    if not bool(prefix_mask.any(dim=1).all()) or not torch.equal(prefix, other):
        return {}
    S = int(torch.maximum(chosen.lengths[idx], rejected.lengths[idx]).max())
    c, cm = chosen.pad(idx, pad_value=pad_id, length=S)
    r, rm = rejected.pad(idx, pad_value=pad_id, length=S)
    return {"prefix_ids": prefix, "prefix_mask": prefix_mask.long(), "suffix_ids": torch.cat([c, r]),
            "suffix_mask": torch.cat([cm, rm]).long()}


def distinct_rows(ids: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(first, owner)`` of the padded rows ``ids`` ``[N, T]``: ``first[u]`` the first row of each distinct row
    (padding ignored), ``owner[i]`` the distinct row of row ``i``, so ``ids[first][owner]`` equals ``ids``."""
    unique, owner = torch.unique(torch.where(mask.bool(), ids, -1), dim=0, return_inverse=True)
    first = torch.full((len(unique),), len(ids)).scatter_reduce(0, owner, torch.arange(len(ids)), "amin")
    return first, owner


class PromptBatch(NamedTuple):
    """Rows of a batch split at the prompt: each distinct prompt once (``prefix[first]``; row ``i``'s is
    ``owner[i]``, ``distinct_rows``), every response after its own."""

    rows: torch.Tensor  # the batch's row indices
    prefix: torch.Tensor  # [b, P] the prompts, left-padded
    prefix_mask: torch.Tensor
    first: torch.Tensor
    owner: torch.Tensor
    suffix: torch.Tensor  # [b, S] the responses, right-padded
    suffix_mask: torch.Tensor


def prompt_batches(seqs: TokenizedSequences, batch_size: int, pad_id: int) -> Iterator[PromptBatch]:
    """``seqs`` in consecutive batches of ``batch_size`` rows, each as a :class:`PromptBatch`."""
    prompts, responses = seqs.split
    for start in range(0, len(seqs), batch_size):
        idx = torch.arange(start, min(start + batch_size, len(seqs)))
        prefix, prefix_mask = prompts.pad(idx, pad_value=pad_id, side="left")
        suffix, suffix_mask = responses.pad(idx, pad_value=pad_id, side="right")
        yield PromptBatch(idx, prefix, prefix_mask, *distinct_rows(prefix, prefix_mask), suffix, suffix_mask)


def encode_for_scoring(tokenizer, prompts: Sequence[str], responses: Sequence[str],
                       max_length: int) -> TokenizedSequences:
    """``prompt + response + EOS`` rows tokenised as a reward model is trained (a cut row ends in EOS)."""
    return encode_sequences(tokenizer, prompts, responses, int(max_length), "<score_responses>", keep_eos=True)


def keep_last_tokens(rows: Ragged, limit: int, keep_first: int | None = None) -> Ragged:
    """Each row cut to its last ``limit`` tokens (left truncation, as ``data.truncation: left``).

    ``keep_first`` (a BOS id): a row that starts with it keeps it in front of its last ``limit`` other tokens.
    """
    if not len(rows) or int(rows.lengths.max()) <= limit:
        return rows
    ids, valid = rows.pad(side="left")
    if keep_first is None:
        ids, valid = ids[:, -limit:], valid[:, -limit:]
        return Ragged.from_lengths(ids[valid], valid.sum(dim=1))
    lengths = rows.lengths
    first = ids.gather(1, (ids.shape[1] - lengths).clamp(max=ids.shape[1] - 1)[:, None]).squeeze(1)
    has = (lengths > 0) & (first == keep_first)
    body = (lengths - has.long()).clamp(max=limit)
    keep = torch.arange(ids.shape[1])[None, :] >= ids.shape[1] - body[:, None]
    ids = torch.cat([torch.full_like(ids[:, :1], keep_first), ids], dim=1)
    keep = torch.cat([has[:, None], keep], dim=1)
    return Ragged.from_lengths(ids[keep], body + has.long())


def left_pad_prompts(prompts: Ragged, idx: torch.Tensor, pad_id: int) -> dict[str, torch.Tensor]:
    """Left-padded prompt batch for generation."""
    ids, valid = prompts.pad(idx, pad_value=pad_id, side="left")
    return {"input_ids": ids, "attention_mask": valid.long()}
