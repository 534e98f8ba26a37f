"""Content-addressed keys: a canonical, length-prefixed framing hashed with BLAKE2b-256.

Keys never depend on Python's ``hash()``, pickle or the process: the same fields give the
same 32 bytes on every machine and Python version (golden vectors in tests/test_keys.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Sequence

import numpy as np

from .errors import InvalidKeyError

__all__ = ["FORMAT_TAG", "KEY_BYTES", "Key", "make_key", "chain_keys", "coerce_key"]

FORMAT_TAG = b"promptstore/1"
KEY_BYTES = 32
Key = bytes

_INT32_MAX = 2**31 - 1


def _field(value: bytes | str) -> bytes:
    data = value.encode("utf-8") if isinstance(value, str) else bytes(value)
    return len(data).to_bytes(8, "little") + data


def _digest(*fields: bytes | str) -> bytes:
    h = hashlib.blake2b(digest_size=KEY_BYTES)
    for f in fields:
        h.update(_field(f))
    return h.digest()


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, (str, bytes)):
        raise InvalidKeyError(f"{name} must be str or bytes, got {type(value).__name__}")


def make_key(
    kind: str,
    payload: bytes | str = b"",
    *,
    namespace: str = "",
    fingerprints: Iterable[bytes | str] = (),
) -> Key:
    """Return the 32-byte key of one entry.

    The digest covers, each length-prefixed: the format tag ``promptstore/1``, the kind,
    the namespace (tenant salt), the number of fingerprints and each fingerprint, then the
    payload. Changing any of them gives an unrelated key.

    Args:
        kind: what the entry holds, e.g. ``"vision.text"`` or ``"llm.kv"``.
        payload: the input the tensors were computed from (a class name, a token block...).
        namespace: tenant salt; keys of different namespaces never collide.
        fingerprints: names of exactly what produced the tensors (model weights, tokenizer...).

    Returns:
        32 bytes.

    Raises:
        InvalidKeyError: a field is not str/bytes.
    """
    fps = list(fingerprints)
    for name, value in (("kind", kind), ("namespace", namespace), ("payload", payload)):
        _check_text(name, value)
    for fp in fps:
        _check_text("fingerprint", fp)
    return _digest(
        FORMAT_TAG, b"entry", kind, namespace, len(fps).to_bytes(8, "little"), *fps, payload
    )


def chain_keys(root: bytes, tokens: Sequence[int] | np.ndarray, block_tokens: int) -> list[Key]:
    """Return the chained keys of every *full* block of ``tokens``.

    ``k_1 = H(root, block_1)``, ``k_i = H(k_{i-1}, block_i)`` with each block's token ids as
    int32 little-endian, so a key names the whole prefix up to the end of its block.
    The longest cached prefix is found by walking this list until the first miss.

    Args:
        root: the chain's root key (from :func:`make_key`, naming model, namespace...).
        tokens: token ids, each in ``[0, 2**31)``.
        block_tokens: tokens per block (> 0). A trailing partial block gets no key.

    Raises:
        InvalidKeyError: bad root, block size or token ids.
    """
    parent = coerce_key(root)
    if not isinstance(block_tokens, (int, np.integer)) or isinstance(block_tokens, bool) or block_tokens <= 0:
        raise InvalidKeyError(f"block_tokens must be a positive int, got {block_tokens!r}")
    ids = np.asarray(tokens)
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise InvalidKeyError("tokens must be a 1-D sequence of ints")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > _INT32_MAX):
        raise InvalidKeyError("token ids must lie in [0, 2**31)")
    data = ids.astype("<i4", copy=False).tobytes()
    step = 4 * int(block_tokens)
    keys = []
    for start in range(0, len(data) - step + 1, step):
        parent = _digest(FORMAT_TAG, b"block", parent, data[start : start + step])
        keys.append(parent)
    return keys


def coerce_key(key: object) -> Key:
    """Return ``key`` as 32 bytes; accepts bytes-like of length 32 or 64 hex characters.

    Raises:
        InvalidKeyError: wrong type or length, or not hex.
    """
    if type(key) is bytes and len(key) == KEY_BYTES:
        return key
    if isinstance(key, (bytes, bytearray, memoryview)):
        raw = bytes(key)
        if len(raw) != KEY_BYTES:
            raise InvalidKeyError(f"a key is {KEY_BYTES} bytes, got {len(raw)}")
        return raw
    if isinstance(key, str):
        if len(key) != 2 * KEY_BYTES:
            raise InvalidKeyError(f"a hex key is {2 * KEY_BYTES} characters, got {len(key)}")
        try:
            return bytes.fromhex(key)
        except ValueError:
            raise InvalidKeyError(f"not a hex key: {key!r}") from None
    raise InvalidKeyError(f"a key is bytes or a hex str, got {type(key).__name__}")
