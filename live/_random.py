"""The random generators code can draw from without being handed one: whether a computation drew from them.

What a computation that draws computes is one draw, not what a later call computes: no cache may keep it,
and no key can say beforehand that a forward will draw (a user's hook adding noise, a layer that samples).
"""

from __future__ import annotations

import random
from typing import Any

import numpy as np

__all__ = ["Generators"]

class Generators:
    """The random generators code can draw from without being handed one, as they stand when this is made:
    torch's (the CPU one, and CUDA's where a CUDA context exists), numpy's global one and Python's ``random``.

    Process-wide, as the generators are: a draw by another thread meanwhile also counts as moved. A generator
    of the caller's own (``torch.Generator``, ``numpy.random.default_rng``), and a draw made inside
    ``torch.random.fork_rng`` (which puts the state back itself), are not seen.
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
        if self._cuda is not None:
            now = torch.cuda.get_rng_state_all()
            return len(now) != len(self._cuda) or any(not torch.equal(a, b) for a, b in zip(now, self._cuda, strict=True))
        if torch.cuda.is_initialized():
            return _cuda_drawn_since_start(torch)  # the context was made meanwhile: its generators start unused
        return False

    def undo(self) -> bool:
        """Put the generators back if any moved since (:meth:`restore`); whether any had."""
        if not self.moved():
            return False
        self.restore()
        return True

    def restore(self) -> None:
        """Put every generator back as it stood, as if nothing had been drawn since (as ``torch.random.fork_rng``
        does on leaving: another thread's draws meanwhile are undone too, and its numbers come again)."""
        import torch

        torch.random.set_rng_state(self._torch)
        if self._cuda is not None:
            torch.cuda.set_rng_state_all(self._cuda)
        np.random.set_state(self._numpy)
        random.setstate(self._python)


def _cuda_drawn_since_start(torch: Any) -> bool:
    """Whether a CUDA generator made during the call has been drawn from (its Philox offset left 0)."""
    try:
        return any(g.get_offset() != 0 for g in torch.cuda.default_generators)
    except (AttributeError, RuntimeError):
        return True  # cannot tell: as if drawn
