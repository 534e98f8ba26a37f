"""Checks of a request's arguments, shared by PrefixCache and ChunkCache, made before any lookup or forward."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from promptstore.errors import InvalidInputError

__all__ = ["check_generation", "check_lengths", "refuse_padding", "resolve_generation"]


def refuse_padding(mask: Any) -> None:
    """A prompt's attention mask must be all ones: one unpadded sequence."""
    if mask is not None and not bool(np.all(np.asarray(mask.detach().cpu() if hasattr(mask, "detach") else mask))):
        raise InvalidInputError("padded prompts are not supported: pass one unpadded sequence")


def check_lengths(kwargs: Mapping[str, Any], n_prompt: int) -> None:
    """generate's length arguments, checked before any work (transformers checks them after the prefill).

    Raises:
        InvalidInputError: a length that is not a positive int, or that leaves nothing to generate.
    """
    def whole(name: str) -> int | None:
        value = kwargs.get(name)
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise InvalidInputError(f"{name} must be a non-negative int, got {value!r}")
        return int(value)

    new, least, total = whole("max_new_tokens"), whole("min_new_tokens"), whole("max_length")
    if new == 0:
        raise InvalidInputError("max_new_tokens must be at least 1")
    if new is not None and least is not None and least > new:
        raise InvalidInputError(f"min_new_tokens ({least}) is more than max_new_tokens ({new})")
    if new is None and total is not None and total <= n_prompt:
        raise InvalidInputError(f"max_length ({total}) leaves nothing to generate after a {n_prompt}-token prompt")


# generate's own arguments, which its generation config does not take.
_GENERATE_ARGS = ("logits_processor", "stopping_criteria", "prefix_allowed_tokens_fn", "synced_gpus", "streamer",
                  "negative_prompt_ids", "negative_prompt_attention_mask", "use_model_defaults", "custom_generate",
                  "tokenizer", "past_key_values", "cache")


def resolve_generation(model: Any, kwargs: Mapping[str, Any]) -> Any:
    """The generation config ``model.generate(**kwargs)`` would run with: the model's
    ``generation_config``, then a passed ``generation_config``, then kwargs (transformers' own merge)."""
    import copy

    passed = kwargs.get("generation_config")
    rest = {k: v for k, v in kwargs.items() if k not in _GENERATE_ARGS and k not in ("generation_config", "assistant_model")}
    prepare = getattr(model, "_prepare_generation_config", None)
    if prepare is not None:
        try:
            return prepare(passed, **rest)[0]
        except (TypeError, ValueError) as exc:
            raise InvalidInputError(f"generation settings rejected: {exc}") from None
    config = copy.deepcopy(passed if passed is not None else model.generation_config)  # older transformers
    config.update(**rest)
    return config


def check_generation(model: Any, kwargs: Mapping[str, Any], what: str = "PrefixCache.generate") -> None:
    """Refuse the generation settings PrefixCache cannot serve, wherever they were set.

    One sequence, greedy or sampled, over the dynamic cache PrefixCache hands in: beams and
    several sequences reorder or copy the cache, a static or offloaded cache is another
    structure, and assisted or contrastive decoding crop it behind the cache's back.

    Raises:
        InvalidInputError: naming the setting and where it came from.
    """
    config = resolve_generation(model, kwargs)
    refused = []
    if getattr(config, "num_beams", 1) not in (None, 1):
        refused.append(f"num_beams={config.num_beams}")
    if getattr(config, "num_return_sequences", 1) not in (None, 1):
        refused.append(f"num_return_sequences={config.num_return_sequences}")
    if getattr(config, "cache_implementation", None) not in (None, "dynamic"):
        refused.append(f"cache_implementation={config.cache_implementation!r}")
    if (getattr(config, "penalty_alpha", None) or 0) > 0 and (getattr(config, "top_k", 1) or 1) > 1:
        refused.append("contrastive search (penalty_alpha)")
    if kwargs.get("assistant_model") is not None or getattr(config, "prompt_lookup_num_tokens", None) \
            or getattr(config, "assistant_early_exit", None):
        refused.append("assisted decoding")
    if getattr(config, "return_dict_in_generate", False) and (getattr(config, "output_hidden_states", False)
                                                              or getattr(config, "output_attentions", False)):
        refused.append("output_hidden_states/output_attentions (they would cover only the tokens computed now)")
    if getattr(config, "dola_layers", None) is not None:
        refused.append("dola_layers")
    if kwargs.get("custom_generate") is not None:
        refused.append("custom_generate")
    if kwargs.get("inputs_embeds") is not None:
        # Served KV is keyed by token ids: embeddings that differ from the ids' would be served the ids' KV.
        refused.append("inputs_embeds (the cache is keyed by token ids: pass the ids)")
    if refused:
        raise InvalidInputError(f"{what} serves one sequence over its own dynamic cache; these "
                                f"generation settings (kwargs, generation_config or the model's own) cannot be "
                                f"served: {', '.join(refused)}")
