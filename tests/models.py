"""Model builders and references the suites share: a small random Llama, seeded and built offline, and what
the plain model computes (the other side of every differential test)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# Three layers, grouped-query attention (4 query heads over 2 KV heads), a 500-token vocabulary: small
# enough to run hundreds of prompts in a test, shaped like the models the library serves.
TINY_LLAMA: dict[str, Any] = dict(vocab_size=500, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=1024)


def tiny_llama(seed: int = 0, attn: str | None = None, **config: Any) -> LlamaForCausalLM:
    """The tiny Llama with random weights from ``seed`` (``config`` overrides ``TINY_LLAMA``), in eval mode.

    ``attn``: an attention implementation set on the config before the model is built ("sdpa", "eager").
    """
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY_LLAMA, **config})
    if attn is not None:
        cfg._attn_implementation = attn
    return LlamaForCausalLM(cfg).eval()


def full_logits(model: Any, ids: Sequence[int]) -> torch.Tensor:
    """The next-token scores of one plain forward over ``ids`` (no cache)."""
    with torch.no_grad():
        return model(torch.as_tensor([list(ids)], device=model.device)).logits[0, -1]


def greedy(model: Any, ids: Sequence[int], n: int = 32) -> list[int]:
    """``model.generate`` without a cache: the prompt's ids followed by ``n`` greedy tokens."""
    with torch.no_grad():
        out = model.generate(torch.as_tensor([list(ids)]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, do_sample=False)
    return out[0].tolist()
