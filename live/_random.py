"""The random generators code can draw from without being handed one: whether a computation drew from them.

What a computation that draws computes is one draw, not what a later call computes: no cache may keep it,
and no key can say beforehand that a forward will draw (a user's hook adding noise, a layer that samples).
"""

from __future__ import annotations

import random

import numpy as np

__all__ = ["Generators"]


class Generators:
    """The random generators code can draw from without being handed one, as they stand now: torch's
    (the CPU one, and CUDA's where a CUDA context exists), numpy's global one and Python's ``random``.

    A generator of the caller's own (``torch.Generator``, ``numpy.random.default_rng``) is not seen.
    """

    def __init__(self) -> None:
        import torch

        self._torch = torch.random.get_rng_state()
        self._cuda = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
        self._numpy = np.random.get_state()
        self._python = random.getstate()

    def moved(self) -> bool:
        """Whether any of them was drawn from (or reseeded) since."""
        import torch

        if not torch.equal(torch.random.get_rng_state(), self._torch) or self._python != random.getstate():
            return True
        numpy_now = np.random.get_state()
        if any(not np.array_equal(a, b) if isinstance(a, np.ndarray) else a != b
               for a, b in zip(numpy_now, self._numpy, strict=True)):
            return True
        if self._cuda is not None or torch.cuda.is_initialized():
            now = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else []
            return self._cuda is None or len(now) != len(self._cuda) or any(
                not torch.equal(a, b) for a, b in zip(now, self._cuda, strict=True))
        return False

    def restore(self) -> None:
        """Put every generator back as it stood (as if nothing had been drawn since)."""
        import torch

        torch.random.set_rng_state(self._torch)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
        np.random.set_state(self._numpy)
        random.setstate(self._python)
