"""A tiny Qwen2 causal LM and prompt batches for the generation and GRPO tests (nothing downloaded)."""

from __future__ import annotations

import torch

from ds_odc.recipes.toy_text import char_tokenizer  # noqa: F401  (the examples' tokenizer: the tests train what they run)

VOCAB = 256
PAD = 0


def tiny_qwen2(seed: int = 0, vocab: int = VOCAB, hidden_size: int = 32):
    """Random-init 2-layer Qwen2 (about 40k params at the default width), built outside any zero.Init so copies
    start identical. 4 attention heads: ``hidden_size`` 128 gives the head width GPU flash kernels take."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    torch.manual_seed(seed)
    config = Qwen2Config(hidden_size=hidden_size, intermediate_size=2 * hidden_size, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, vocab_size=vocab, max_position_embeddings=256,
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


def prompt_dataset(n: int, seed: int = 0):
    """Prompts of varied length ("Q: <words>\\nA:")."""
    import random

    from datasets import Dataset
    rng = random.Random(seed)
    words = ["alpha", "beta", "gamma", "delta", "odc", "zero", "rank", "step"]
    return Dataset.from_dict({"prompt": ["Q: " + " ".join(rng.choices(words, k=rng.randint(1, 3))) + "\nA:"
                                         for _ in range(n)]})


def scripted_rollout(max_new_tokens: int):
    """A deterministic stand-in for generation (TRL's ``rollout_func``): each completion's tokens and length follow
    from its prompt, its position in the call and the optimizer step, so stock and ODC runs train the same
    completions. Lengths vary from 1 token to ``max_new_tokens``; most end with EOS."""
    import random

    def rollout(prompts, trainer):
        tok = trainer.processing_class
        prompt_ids = tok(text=prompts)["input_ids"]
        completions = []
        for k, prompt in enumerate(prompts):
            rng = random.Random(f"{prompt}|{k}|{trainer.state.global_step}")
            n = rng.choice([1, 2, 3, max_new_tokens // 4, max_new_tokens])
            ids = [rng.randint(3 + 65, 3 + 90) for _ in range(n)]  # letters a..z
            if n < max_new_tokens and rng.random() < 0.8:
                ids[-1] = tok.eos_token_id
            completions.append(ids)
        return {"prompt_ids": prompt_ids, "completion_ids": completions, "logprobs": None}

    return rollout


def letter_reward(completions, **kwargs):
    """A verifiable toy reward: the share of vowels in the completion (varies within every prompt group)."""
    return [sum(ch in "aeiou" for ch in c) / max(len(c), 1) for c in completions]
