"""A character-level Hugging Face tokenizer made in code (nothing downloaded).

Every character of ``chars`` is one token, each of ``words`` (e.g. ``<think>``) is one token too, and
``<pad>``, ``<eos>``, ``<unk>`` are special. The result is a ``PreTrainedTokenizerFast``, so
``generate``, padding and ``decode`` work as with any hub tokenizer. Prompts are padded on the left.
"""

from __future__ import annotations

from typing import Sequence

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")


def char_tokenizer(chars: str, words: Sequence[str] = ()) -> PreTrainedTokenizerFast:
    """A tokenizer with one id per special token, word and character: ``len = 3 + len(words) + len(chars)``."""
    tokens = list(SPECIAL_TOKENS) + list(words) + [c for c in dict.fromkeys(chars)]
    vocab = {token: i for i, token in enumerate(tokens)}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")  # one piece per character
    core.decoder = decoders.Fuse()  # join pieces without spaces
    core.add_special_tokens(list(SPECIAL_TOKENS))
    core.add_tokens(list(words))  # matched before the per-character split
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token="<pad>",
        eos_token="<eos>",
        unk_token="<unk>",
        padding_side="left",
        clean_up_tokenization_spaces=False,
    )
