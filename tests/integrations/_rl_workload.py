"""A tiny Qwen2 causal LM and prompt batches for the generation and GRPO tests (nothing downloaded)."""

from __future__ import annotations

import torch

VOCAB = 256
PAD = 0


def tiny_qwen2(seed: int = 0, vocab: int = VOCAB):
    """Random-init 2-layer Qwen2 (about 40k params), built outside any zero.Init so copies start identical."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
                         tie_word_embeddings=False, attn_implementation="sdpa", pad_token_id=PAD,
                         bos_token_id=None, eos_token_id=None)
    return Qwen2ForCausalLM(config)


def prompt_batch(lengths: list[int], seed: int) -> dict[str, torch.Tensor]:
    """Left-padded prompts of the given lengths (random tokens, never the pad token), with their attention mask."""
    g = torch.Generator().manual_seed(seed)
    width = max(lengths, default=0)
    ids = torch.full((len(lengths), width), PAD, dtype=torch.long)
    mask = torch.zeros((len(lengths), width), dtype=torch.long)
    for row, n in enumerate(lengths):
        ids[row, width - n:] = torch.randint(1, VOCAB, (n,), generator=g)
        mask[row, width - n:] = 1
    return {"input_ids": ids, "attention_mask": mask}
