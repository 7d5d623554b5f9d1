"""Byte-level tokenizer for the tiny test models, built offline.

Invariant protected: the ``tokenizer.json`` written here is exactly the
pipeline that transformers' ``Qwen2Tokenizer`` rebuilds from its vocab and
merges (NFC normalizer, Qwen2 split regex, byte-level pre-tokenizer, BPE,
byte-level decoder). ``AutoTokenizer`` may pick ``Qwen2Tokenizer`` whatever
``tokenizer_class`` says (transformers forces it for ``model_type=qwen2``) and
then rebuilds the backend from vocab/merges, dropping the file's pipeline; with
a file that already is that pipeline, the raw ``tokenizers`` object,
``AutoTokenizer`` and vLLM (which calls ``AutoTokenizer``) give identical ids.

Vocabulary: the 256 byte symbols (id == byte value), then the special tokens,
then (only when `words` are given) one token per prefix of each word, with
the merges that build a word left to right, so a word of a known corpus is
one token (what a BPE vocabulary trained on that corpus gives its frequent
words). Any text round-trips either way: what no merge covers stays bytes.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from tokenizers import AddedToken, Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE

__all__ = [
    "CHAT_TEMPLATE",
    "EOS_TOKEN",
    "EOS_TOKEN_ID",
    "SPECIAL_TOKENS",
    "TOKENIZER_VOCAB_SIZE",
    "build_tokenizer",
    "tokenizer_vocab_size",
    "write_tokenizer_files",
]

# Same split regex as transformers' Qwen2Tokenizer (digits split one by one).
_SPLIT_REGEX = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

EOS_TOKEN = "<|endoftext|>"
"""End-of-sequence token; also the pad token. There is no BOS token."""

SPECIAL_TOKENS: tuple[str, ...] = (EOS_TOKEN, "<|im_start|>", "<|im_end|>")
"""Special tokens, with ids 256, 257, ... in this order."""

EOS_TOKEN_ID = 256
TOKENIZER_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
"""Number of ids the tokenizer can produce; a model's vocab_size must be >= this."""

CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
"""Minimal ChatML template (Qwen style), stored in tokenizer_config.json."""


def _bytes_to_unicode() -> list[str]:
    """GPT-2's reversible byte -> printable-char map, indexed by byte value."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("\xa1"), ord("\xac") + 1))
        + list(range(ord("\xae"), ord("\xff") + 1))
    )
    chars = {b: b for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = 256 + extra
            extra += 1
    return [chr(chars[b]) for b in range(256)]


def _word_merges(words: tuple[str, ...], vocab: dict[str, int]) -> list[tuple[str, str]]:
    """Adds every prefix of each word (in byte-level symbols) to vocab, and returns
    the merges that build each word one symbol at a time."""
    symbols = _bytes_to_unicode()
    merges: list[tuple[str, str]] = []
    for word in words:
        u = "".join(symbols[b] for b in word.encode())
        for i in range(1, len(u)):
            if u[: i + 1] not in vocab:
                vocab[u[: i + 1]] = len(vocab)
                merges.append((u[:i], u[i]))
    return merges


def tokenizer_vocab_size(words: tuple[str, ...] = ()) -> int:
    """Ids `build_tokenizer(words)` can produce (a model's vocab_size must be >= it)."""
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    vocab.update({t: 256 + i for i, t in enumerate(SPECIAL_TOKENS)})
    return len(vocab) + len(_word_merges(words, vocab))


def build_tokenizer(words: tuple[str, ...] = ()) -> Tokenizer:
    """Builds the byte-level tokenizer (no training, no download).

    Args:
        words: texts to encode as one token each (e.g. " apples": the split
            regex keeps a word's leading space with it), in the order their
            prefixes get ids; () = bytes only.

    Returns:
        A ``tokenizers.Tokenizer``: id ``b`` is byte ``b`` for ``b < 256``, then
        ``SPECIAL_TOKENS``, then the words' prefixes (``tokenizer_vocab_size(words)``
        ids in all). No BOS/EOS is added on encode.
    """
    vocab = {ch: i for i, ch in enumerate(_bytes_to_unicode())}
    for i, token in enumerate(SPECIAL_TOKENS):
        vocab[token] = 256 + i
    merges = _word_merges(tuple(words), vocab)
    # Same BPE options as the model Qwen2Tokenizer.__init__ builds.
    tok = Tokenizer(
        BPE(
            vocab=vocab,
            merges=merges,
            dropout=None,
            unk_token=None,
            continuing_subword_prefix="",
            end_of_word_suffix="",
            fuse_unk=False,
            byte_fallback=False,
        )
    )
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_SPLIT_REGEX), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIAL_TOKENS])
    assert tok.get_vocab_size(with_added_tokens=True) == len(vocab)
    return tok


def _tokenizer_config(model_max_length: int) -> dict:
    added = {
        str(256 + i): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for i, t in enumerate(SPECIAL_TOKENS)
    }
    return {
        # Qwen2Tokenizer for every architecture: transformers forces it for
        # model_type qwen2/qwen3 anyway; for llama it is used as named.
        "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": added,
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "errors": "replace",
        "model_max_length": model_max_length,
        "chat_template": CHAT_TEMPLATE,
    }


def write_tokenizer_files(path: str | os.PathLike, *, model_max_length: int = 512,
                          words: tuple[str, ...] = ()) -> None:
    """Writes ``tokenizer.json`` and ``tokenizer_config.json`` into ``path``.

    Args:
        path: an existing folder.
        model_max_length: stored in tokenizer_config.json (the model's
            max_position_embeddings).
        words: texts encoded as one token each (`build_tokenizer`).
    """
    folder = Path(path)
    build_tokenizer(words).save(str(folder / "tokenizer.json"))
    config = _tokenizer_config(model_max_length)
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
