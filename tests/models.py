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


def tiny_omdet_config(**overrides: Any) -> Any:
    """A small OmDet-Turbo config (transformers' Swin and CLIP text classes, random weights) that builds and runs
    in a second: transformers' Swin returns channels first, so the layer norms for timm's maps are off."""
    from transformers import CLIPTextConfig, OmDetTurboConfig, SwinConfig

    return OmDetTurboConfig(
        use_timm_backbone=False, backbone=None, apply_layernorm_after_vision_backbone=False,
        backbone_config=SwinConfig(embed_dim=32, depths=[1, 1, 1, 1], num_heads=[1, 2, 4, 8], out_indices=[2, 3, 4],
                                   window_size=7, image_size=224),
        text_config=CLIPTextConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                   vocab_size=49408, max_position_embeddings=77),
        # the task features are the text tower's hidden states: class_embed_dim is its width
        text_projection_in_dim=32, text_projection_out_dim=32, class_embed_dim=32, encoder_in_channels=[64, 128, 256],
        vision_features_channels=[64, 64, 64], encoder_hidden_dim=64, decoder_hidden_dim=64, num_queries=20,
        encoder_dim_feedforward=128, decoder_num_layers=2, encoder_layers=1, decoder_num_heads=4,
        encoder_attention_heads=4, **overrides)
