"""A character-level tokenizer made in code, so nothing is downloaded: what the TRL examples, the GRPO benchmark and
the tests train with."""

from __future__ import annotations

__all__ = ["char_tokenizer"]


def char_tokenizer():
    """Printable ASCII, one token per character; ``<pad>`` = 0, ``<eos>`` = 1, ``<unk>`` = 2."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    chars = [chr(c) for c in range(32, 127)]
    vocab = {tok: i for i, tok in enumerate(["<pad>", "<eos>", "<unk>"] + chars)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>")
