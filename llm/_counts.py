"""Token counters behind ``PrefixCache.stats`` and ``ChunkCache.stats``."""

from __future__ import annotations

__all__ = ["Counts"]


class Counts:
    """Token counters of a request, or of all requests (``add``)."""

    # verified: hits whose served KV was recomputed in part and compared; refuted: those that
    # disagreed (computed from scratch instead); declined: stored tokens recomputed because that
    # was expected to be faster than running the rest over them (PrefixCache's reuse="auto").
    FIELDS: tuple[str, ...] = ("queried", "served", "computed", "generated", "requests", "verified", "refuted",
                               "declined")
    # The FIELDS, declared for the type checker (set in __init__ by name).
    queried: int
    served: int
    computed: int
    generated: int
    requests: int
    verified: int
    refuted: int
    declined: int

    def __init__(self) -> None:
        for name in self.FIELDS:
            setattr(self, name, 0)

    def as_dict(self) -> dict[str, int]:
        return {n: getattr(self, n) for n in self.FIELDS}

    def add(self, other: Counts) -> None:
        for name in self.FIELDS:
            setattr(self, name, getattr(self, name) + getattr(other, name))
