"""Counting what a model really runs, with a hook that does not change the model's identity.

Hooks are part of a model's live identity, with everything they capture (issue #20): a hook
whose own state changes at every call (a counter in its closure or its ``self``) makes every
call a miss, as it should, since no cache can prove a hook only observes. These hooks keep
their count in a module-level object instead, which code identity names by its type only
(README, Guarantees: objects a function finds among its module's globals), so a counted call
hits exactly as an uncounted one would, once the hook is in place.
"""

from __future__ import annotations

from typing import Any


class _Tally:
    rows = 0  # sequences (batch rows) that ran
    tokens = 0  # token positions that ran
    batches: list[int] = []  # rows of each forward  # noqa: RUF012 - one tally for the whole suite
    stop_after: int | None = None  # raise KeyboardInterrupt once this many forwards ran (an interrupted build)


TALLY = _Tally()


def count_hook(module: Any, args: Any, output: Any) -> None:
    """On an embedding layer: its output is (rows, tokens, width)."""
    out = output[0] if isinstance(output, tuple) else output
    TALLY.rows += int(out.shape[0])
    TALLY.tokens += int(out.shape[0] * out.shape[1]) if out.ndim >= 3 else int(out.shape[0])
    TALLY.batches.append(int(out.shape[0]))
    if TALLY.stop_after is not None and len(TALLY.batches) >= TALLY.stop_after:
        TALLY.stop_after = None
        raise KeyboardInterrupt


class Counting:
    """``with Counting(module) as c: ...`` then ``c.rows`` / ``c.tokens``: what ``module`` ran inside.

    The hook is attached once and stays: attach it when the model is built (``Counting(m)``),
    so that every call, counted or not, runs the same model.
    """

    def __init__(self, module: Any) -> None:
        if not any(h is count_hook for h in module._forward_hooks.values()):
            module.register_forward_hook(count_hook)
        self._rows, self._tokens, self._batches = TALLY.rows, TALLY.tokens, len(TALLY.batches)

    @property
    def batches(self) -> list[int]:
        return TALLY.batches[self._batches:]

    def stop_after(self, forwards: int) -> None:
        """Interrupt the ``forwards``-th forward from now (KeyboardInterrupt, as a user's Ctrl-C)."""
        TALLY.stop_after = len(TALLY.batches) + forwards

    @property
    def rows(self) -> int:
        return TALLY.rows - self._rows

    @property
    def tokens(self) -> int:
        return TALLY.tokens - self._tokens

    def reset(self) -> None:
        self._rows, self._tokens, self._batches = TALLY.rows, TALLY.tokens, len(TALLY.batches)

    def __enter__(self) -> Counting:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass
