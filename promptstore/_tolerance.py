"""How far a recomputed KV may stand from a stored one before a hit is taken for another model's."""

from __future__ import annotations

__all__ = ["KV_TOLERANCE", "kv_tolerance"]

# The largest relative L2 error (per layer, K or V, pooled over the recomputed positions) that an
# unchanged model shows between a stored prefill and a recompute of some of its positions: the two run
# the same arithmetic in other batch shapes, so they round differently. Measured in
# bench/verify_calibration.py over SmolLM2 (2k tokens) and the zoo's architectures, sdpa and eager; the
# bound is a few times the worst seen, and below the smallest edit measured there (docs/guarantees.md).
KV_TOLERANCE = {"F64": 1e-9, "F32": 5e-5, "F16": 2e-3, "BF16": 1e-2}


def kv_tolerance(*dtypes: str) -> float:
    """The bound for KV computed or stored in any of ``dtypes`` (safetensors names; the coarsest wins)."""
    return max(KV_TOLERANCE.get(d, KV_TOLERANCE["BF16"]) for d in dtypes)
