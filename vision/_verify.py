"""Verified hits, vision side: a call that runs its text encoder anyway re-encodes one stored prompt and compares.

Keys name the encoder as it runs (weights, settings, hooks, code, ambient torch state); the
check is the second defence, for what a description cannot enumerate (a patched function, an
object the tower calls). It runs only where the encoder runs anyway, in the batch it runs: a
full hit never loads the encoder (YOLOE) or runs no text at all, and is served on its keys.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from promptstore._live import Generators
from promptstore.errors import PromptStoreWarning

__all__ = ["FEATURE_TOLERANCE", "Drew", "Refuted", "check_draws", "check_feature", "feature_error", "warn_refuted"]

# The largest relative L2 error between a stored text feature and the same prompt encoded again in
# another batch, per dtype the encoder returns: unchanged towers measured at 0 to 2e-7 in float32
# (tests/test_vision_verify.py); the bounds leave the rounding of other batch shapes on other CPUs.
FEATURE_TOLERANCE = {"float64": 1e-9, "float32": 1e-4, "float16": 4e-3, "bfloat16": 2e-2}


class Refuted(Exception):
    """A stored feature differs from what the encoder computes now: nothing stored may be served or added."""

    def __init__(self, prompt: str, error: float) -> None:
        super().__init__(f"{prompt!r}: relative error {error:.2g}")
        self.prompt, self.error = prompt, error


class Drew(Refuted):
    """The encoder drew random numbers while it ran (a user's hook, a layer that samples): what it computed is
    one draw, not what a later call computes. Nothing of it may be stored, and the call is computed as without
    the store, from the generators as they stood before the encoder ran."""

    def __init__(self, what: str) -> None:
        super().__init__(what, float("inf"))
        self.args = (f"{what} drew random numbers",)

    def __str__(self) -> str:
        return str(self.args[0])


def check_draws(before: Generators, what: str) -> None:
    """Raise :class:`Drew` where any generator moved since ``before`` was taken, the generators put back first."""
    if before.undo():
        raise Drew(what)


def feature_error(stored: Any, fresh: Any) -> float:
    """Relative L2 distance of two feature vectors (inf when either is not finite)."""
    a, b = np.asarray(stored, np.float64).ravel(), np.asarray(fresh, np.float64).ravel()
    if a.shape != b.shape or not (np.isfinite(a).all() and np.isfinite(b).all()):
        return float("inf")
    scale = float(np.linalg.norm(a))
    diff = float(np.linalg.norm(a - b))
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def check_feature(prompt: str, stored: Any, fresh: Any, dtype: str = "float32") -> None:
    """Raise :class:`Refuted` when ``fresh`` is not ``stored`` within the bound for ``dtype``."""
    error = feature_error(stored, fresh)
    if not error <= FEATURE_TOLERANCE.get(dtype.replace("torch.", ""), FEATURE_TOLERANCE["bfloat16"]):
        raise Refuted(prompt, error)


def warn_refuted(what: str, exc: Refuted) -> None:
    if isinstance(exc, Drew):
        warnings.warn(f"promptstore: {what}: {exc}: it is computed as without the store, and nothing of it is "
                      "stored", PromptStoreWarning, stacklevel=3)
        return
    warnings.warn(f"promptstore: {what}: a stored text feature differs from what the encoder computes now ({exc}). "
                  "The encoder changed in a way its key does not name: this call is computed without the store, "
                  "and nothing is stored from it", PromptStoreWarning, stacklevel=3)
