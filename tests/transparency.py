"""The one property every adapter must have: a cached call returns what the plain call returns.

``assert_transparent(cached, plain)`` runs the plain call, then the cached call twice (the
first may fill the store, the second must be served from it), and compares every output:
arrays within ``atol``, everything else (token ids, names, counts) exactly. A new adapter
gets the same suite by handing its two calls to this helper.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np


def _as_array(x: Any) -> np.ndarray | None:
    if hasattr(x, "detach"):
        return x.detach().float().cpu().numpy()
    if isinstance(x, np.ndarray) and x.dtype.kind == "f":
        return x.astype(np.float64)
    return None


def assert_same(got: Any, want: Any, atol: float, where: str = "output") -> None:
    """``got`` equals ``want``: floating arrays within ``atol``, anything else exactly."""
    a, b = _as_array(got), _as_array(want)
    if a is not None or b is not None:
        assert a is not None and b is not None, f"{where}: {type(got).__name__} vs {type(want).__name__}"
        assert a.shape == b.shape, f"{where}: shape {a.shape} vs {b.shape}"
        diff = float(np.abs(a - b).max()) if a.size else 0.0
        assert diff <= atol, f"{where}: cached differs from plain by {diff:.3g} > {atol}"
        return
    if isinstance(want, Mapping):
        assert isinstance(got, Mapping) and sorted(got) == sorted(want), f"{where}: keys {sorted(got)} vs {sorted(want)}"
        for k in want:
            assert_same(got[k], want[k], atol, f"{where}[{k!r}]")
        return
    if isinstance(want, Sequence) and not isinstance(want, str):
        assert isinstance(got, Sequence) and len(got) == len(want), f"{where}: length {len(got)} vs {len(want)}"
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            assert_same(g, w, atol, f"{where}[{i}]")
        return
    assert got == want, f"{where}: {got!r} vs {want!r}"


def assert_transparent(cached: Callable[[], Any], plain: Callable[[], Any], *, atol: float = 1e-4,
                       repeats: int = 2, what: str = "") -> Any:
    """Cache-on equals cache-off: ``cached()`` (run ``repeats`` times) matches ``plain()``.

    Returns the plain output, so a caller can chain further checks on it.
    """
    want = plain()
    for i in range(repeats):
        assert_same(cached(), want, atol, f"{what or 'cached call'} (run {i + 1})")
    return want
