"""Checks of a request's arguments, shared by PrefixCache and ChunkCache, made before any lookup or forward."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from promptstore.errors import InvalidInputError

__all__ = ["check_lengths", "refuse_padding"]


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
