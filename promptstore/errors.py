"""Every error and warning promptstore raises.

Each error is also the matching built-in error (``InvalidKeyError`` is a ``ValueError``,
``StorePathError`` a ``NotADirectoryError``...), so callers may catch either.
Faults of a cache tier (disk full, Redis gone, a corrupt entry) are never raised to the
caller: they become misses with a :class:`PromptStoreWarning`.
"""

from __future__ import annotations

__all__ = [
    "PromptStoreError",
    "InvalidKeyError",
    "InvalidEntryError",
    "UnsupportedDtypeError",
    "CorruptEntryError",
    "EntryVersionError",
    "FormatVersionError",
    "BundleError",
    "StorePathError",
    "InvalidSizeError",
    "ConfigError",
    "TierUnavailableError",
    "InvalidInputError",
    "ModelUnavailableError",
    "UnsupportedModelError",
    "PromptStoreWarning",
]


class PromptStoreError(Exception):
    """Base class of every promptstore error."""


class InvalidKeyError(PromptStoreError, ValueError):
    """A key is not 32 bytes (or 64 hex characters), or not bytes/str at all."""


class InvalidEntryError(PromptStoreError, ValueError):
    """An entry to store is malformed: tensors, kind, metadata, cost, parent or TTL."""


class UnsupportedDtypeError(InvalidEntryError, TypeError):
    """A tensor's dtype cannot be stored (object, string, complex, ...)."""


class CorruptEntryError(PromptStoreError, ValueError):
    """Encoded entry bytes fail to parse or their checksum does not match.

    Raised by the codec; the store turns it into a miss and drops the entry.
    """


class EntryVersionError(PromptStoreError, ValueError):
    """An entry was written by another entry format version (a newer or an older promptstore).

    Raised by the codec; the tiers treat it as a miss and never delete the entry for it, so
    two releases can share one folder. ``newer`` says which way the versions differ.
    """

    def __init__(self, version: int, newer: bool) -> None:
        super().__init__(f"entry format version {version} ({'newer' if newer else 'older'} than this promptstore's)")
        self.version, self.newer = version, newer


class FormatVersionError(PromptStoreError, RuntimeError):
    """A store folder or bundle was written by a newer promptstore format."""


class BundleError(PromptStoreError, ValueError):
    """A bundle file is malformed, truncated or fails its checksums; nothing was imported."""


class StorePathError(PromptStoreError, NotADirectoryError):
    """The store path is not usable as a store folder (it is a file, or a foreign folder)."""


class InvalidSizeError(PromptStoreError, ValueError):
    """A byte size such as ``"2GiB"`` could not be parsed, or is negative."""


class ConfigError(PromptStoreError, ValueError):
    """An invalid store option (namespace type, Redis URL, ...)."""


class TierUnavailableError(PromptStoreError, ConnectionError):
    """A tier cannot be used at construction time (e.g. wrong Redis credentials)."""


class InvalidInputError(PromptStoreError, ValueError):
    """Input to an adapter is unusable: empty or out-of-vocabulary token ids, a padded
    batch, empty or duplicate class names, a malformed prompt-embedding file..."""


class ModelUnavailableError(PromptStoreError, FileNotFoundError):
    """A model or weights file is not on this machine; the message says how to get it."""


class UnsupportedModelError(PromptStoreError, TypeError):
    """The model's structure is not one the adapter can cache exactly (e.g. sliding-window KV)."""


class PromptStoreWarning(UserWarning):
    """A cache fault that was absorbed: the operation became a miss or a skipped write."""
