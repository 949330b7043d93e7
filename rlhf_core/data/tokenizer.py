"""Tokenizers: the model's own, or a small BPE trained offline for the demo.

The demo tokenizer splits digits individually (arithmetic stays learnable),
keeps spaces (Metaspace) and has distinct special tokens
``<pad>`` / ``<s>`` / ``</s>`` / ``<unk>`` — pad is never EOS.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from rlhf_core.config import ModelConfig, TinyModelConfig
from rlhf_core.model_source import load_source_tokenizer, locate

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"

# Renders a messages list as DeepSpeed-Chat style "Human: ...\n\nAssistant: ..." text.
DEMO_CHAT_TEMPLATE = (
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}{{ m['content'] }}\n\n"
    "{% elif m['role'] == 'user' %}Human: {{ m['content'] }}\n\n"
    "{% else %}Assistant: {{ m['content'] }}{{ eos_token }}\n\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)


def train_demo_tokenizer(texts: Iterable[str], vocab_size: int):
    """A ``PreTrainedTokenizerFast`` trained on ``texts`` with ``tokenizers`` (no network)."""
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=UNK))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="never"),
        pre_tokenizers.Digits(individual_digits=True),
    ])
    tok.decoder = decoders.Metaspace(replacement="▁", prepend_scheme="never")
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=[PAD, BOS, EOS, UNK],
                                  min_frequency=2, show_progress=False)
    tok.train_from_iterator(texts, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token=PAD, bos_token=BOS, eos_token=EOS,
                                   unk_token=UNK, padding_side="left", truncation_side="left")
    fast.chat_template = DEMO_CHAT_TEMPLATE
    return fast


def tiny_model_config(tokenizer, tiny: TinyModelConfig):
    """A Llama-style ``LlamaConfig`` sized by ``model.tiny`` over ``tokenizer``'s vocab."""
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=tiny.hidden_size,
        intermediate_size=tiny.intermediate_size,
        num_hidden_layers=tiny.num_hidden_layers,
        num_attention_heads=tiny.num_attention_heads,
        num_key_value_heads=tiny.num_key_value_heads,
        max_position_embeddings=tiny.max_position_embeddings,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=True,
    )


def same_tokenizer(a, b) -> bool:
    """Whether two tokenizers turn text into the same ids: same vocabulary and EOS."""
    return a.get_vocab() == b.get_vocab() and a.eos_token == b.eos_token


# A tokenizer saved with ``save_pretrained`` writes at least one of these (fast, slow SentencePiece, BPE, WordPiece).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def load_tokenizer(path: str | Path, trust_remote_code: bool = False):
    """Load a tokenizer for training: left padding, and a pad token that is not EOS if one can be had (a
    missing pad, or one equal to EOS as in SmolLM2's and TinyLlama's, becomes the UNK token when that is
    distinct). ``path``: a folder, or anything ``model.name_or_path`` takes (``model_source.locate``).

    Raises ``ValueError`` naming the path when a local directory holds no tokenizer files (a model saved without
    its tokenizer) or the tokenizer has no pad token at all.
    """
    from transformers import AutoTokenizer

    if Path(path).is_dir():
        if not any((Path(path) / name).is_file() for name in TOKENIZER_FILES):
            raise ValueError(f"{path}: no tokenizer files ({', '.join(TOKENIZER_FILES[:2])}, ...); a model here is "
                             "read from text with its own tokenizer: save it beside the weights "
                             "(tokenizer.save_pretrained)")
        tok = AutoTokenizer.from_pretrained(str(path), trust_remote_code=trust_remote_code)
    else:
        tok = load_source_tokenizer(locate(str(path)), trust_remote_code)
    if (tok.pad_token is None or tok.pad_token == tok.eos_token) and tok.unk_token not in (None, tok.eos_token):
        tok.pad_token = tok.unk_token
    if tok.pad_token is None:
        raise ValueError(f"tokenizer at {path} has no pad token; set one (distinct from EOS) and save it")
    if tok.eos_token is None:
        raise ValueError(f"tokenizer at {path} has no EOS token")
    tok.padding_side = "left"
    return tok


def source_tokenizer_path(model: ModelConfig) -> str | None:
    """Where prepare takes the tokenizer from; None means train the demo tokenizer."""
    return model.tokenizer or model.name_or_path


def chat_renderer(tokenizer):
    """``messages -> prompt text`` with the generation prompt appended."""
    if not getattr(tokenizer, "chat_template", None):
        return None

    def render(messages: list[dict]) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    return render
