"""Entry <-> bytes: one safetensors file per entry, with a checksum of everything in it.

Layout (the safetensors format): an 8-byte little-endian header length, a JSON header
padded with spaces to a multiple of 8, then the tensor bytes back to back. The header's
``__metadata__`` carries the format version, key, kind, namespace, parent, cost, TTL, the
user's metadata (as JSON) and ``xxh3_128:<hex>``: the tensor bytes, then the canonical
(sorted, compact) JSON of the header without the checksum field. Covering the header too
matters: a flipped byte in a tensor's name, dtype or shape would otherwise decode to
different tensors with a valid checksum.

We write the container ourselves instead of calling ``safetensors.serialize`` because
its ``__metadata__`` comes out in a per-process random order (a Rust HashMap), and entry
bytes must be a pure function of their content: golden-bytes tests, reproducible bundles.
tests/test_codec.py proves both ways that ``safetensors`` reads our files and we read its.
Decoding is zero-copy: arrays are read-only views of the buffer the file was read into.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from typing import Any, NamedTuple

import numpy as np
import xxhash

from ._entry import Entry
from ._keys import coerce_key
from .errors import CorruptEntryError, EntryVersionError, InvalidEntryError, UnsupportedDtypeError

__all__ = ["ENTRY_VERSION", "encode", "build", "decode", "prepare", "parse_header", "check_digest", "make_entry", "Header"]

ENTRY_VERSION = 2
MAX_HEADER_BYTES = 16 * 1024 * 1024
MAX_NDIM = 16

# safetensors dtype name -> numpy dtype holding it. Dtypes numpy lacks keep their raw bits.
_ST_TO_NP: dict[str, np.dtype] = {
    "F64": np.dtype("<f8"), "F32": np.dtype("<f4"), "F16": np.dtype("<f2"),
    "BF16": np.dtype("<u2"), "F8_E4M3": np.dtype("u1"), "F8_E5M2": np.dtype("u1"),
    "I64": np.dtype("<i8"), "I32": np.dtype("<i4"), "I16": np.dtype("<i2"), "I8": np.dtype("i1"),
    "U64": np.dtype("<u8"), "U32": np.dtype("<u4"), "U16": np.dtype("<u2"), "U8": np.dtype("u1"),
    "BOOL": np.dtype("?"),
}
_NP_KIND_TO_ST = {
    ("f", 8): "F64", ("f", 4): "F32", ("f", 2): "F16",
    ("i", 8): "I64", ("i", 4): "I32", ("i", 2): "I16", ("i", 1): "I8",
    ("u", 8): "U64", ("u", 4): "U32", ("u", 2): "U16", ("u", 1): "U8",
    ("b", 1): "BOOL",
}
# ml_dtypes (JAX, ONNX) names for dtypes numpy itself lacks; recognised by name so the
# core never imports ml_dtypes.
_EXTENSION_NAMES = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def _st_dtype(arr: np.ndarray) -> str:
    name = _EXTENSION_NAMES.get(arr.dtype.name)
    if name is not None:
        return name
    st = _NP_KIND_TO_ST.get((arr.dtype.kind, arr.dtype.itemsize))
    if st is None:
        raise UnsupportedDtypeError(
            f"cannot store dtype {arr.dtype} (supported: {', '.join(sorted(_ST_TO_NP))})"
        )
    return st


def _normalise(name: object, value: Any) -> tuple[str, str, np.ndarray]:
    if not isinstance(name, str) or not name or name == "__metadata__" or len(name) > 1024:
        raise InvalidEntryError(f"tensor names are non-empty str (not '__metadata__'), got {name!r}")
    if isinstance(value, tuple):
        if len(value) != 2 or not isinstance(value[1], str):
            raise InvalidEntryError(f"tensor {name!r}: expected an array or (raw_array, 'BF16')")
        arr, st = value
        if st not in _ST_TO_NP:
            raise UnsupportedDtypeError(f"tensor {name!r}: unknown safetensors dtype {st!r}")
        if not isinstance(arr, np.ndarray):
            raise InvalidEntryError(f"tensor {name!r}: expected a numpy array, got {type(arr).__name__}")
        if arr.dtype.itemsize != _ST_TO_NP[st].itemsize or arr.dtype.kind not in "ui":
            raise UnsupportedDtypeError(
                f"tensor {name!r}: raw {st} bits need a {_ST_TO_NP[st].itemsize}-byte integer array, got {arr.dtype}"
            )
        arr = arr.view(_ST_TO_NP[st])
    else:
        if isinstance(value, np.generic):
            value = np.asarray(value)
        if not isinstance(value, np.ndarray):
            raise InvalidEntryError(f"tensor {name!r}: expected a numpy array, got {type(value).__name__}")
        arr = value
        if arr.dtype.hasobject or arr.dtype.fields is not None:
            raise UnsupportedDtypeError(f"tensor {name!r}: object and structured arrays cannot be stored")
        st = _st_dtype(arr)
        if arr.dtype.name in _EXTENSION_NAMES:
            arr = arr.view(_ST_TO_NP[st])
    if arr.ndim > MAX_NDIM:
        raise InvalidEntryError(f"tensor {name!r}: at most {MAX_NDIM} dimensions")
    target = _ST_TO_NP[st]
    if arr.dtype != target:
        arr = arr.astype(target)
    # not np.ascontiguousarray: it turns 0-d arrays into 1-d ones.
    return name, st, arr if arr.flags.c_contiguous else arr.copy(order="C")


def _text(name: str, value: object, *, allow_empty: bool = False, limit: int = 1024) -> str:
    if not isinstance(value, str) or (not value and not allow_empty) or len(value) > limit:
        raise InvalidEntryError(f"{name} must be a{'' if allow_empty else ' non-empty'} str of at most {limit} chars, got {value!r}")
    return value


def prepare(
    key: object,
    tensors: Mapping[str, Any],
    *,
    kind: str,
    cost_s: float = 0.0,
    meta: Mapping[str, str] | None = None,
    parent: object = None,
    ttl_s: float | None = None,
    namespace: str = "",
) -> dict[str, Any]:
    """Validate everything about a new entry before anything is written.

    Raises:
        InvalidKeyError: bad key or parent.
        InvalidEntryError / UnsupportedDtypeError: bad tensors, kind, meta, cost or TTL.
    """
    raw_key = coerce_key(key)
    raw_parent = None if parent is None else coerce_key(parent)
    if raw_parent == raw_key:
        raise InvalidEntryError("an entry cannot be its own parent")
    if not isinstance(tensors, Mapping):
        raise InvalidEntryError(f"tensors must be a dict of name -> array, got {type(tensors).__name__}")
    items = [_normalise(n, v) for n, v in tensors.items()]
    _text("kind", kind, limit=128)
    _text("namespace", namespace, allow_empty=True)
    if isinstance(cost_s, bool) or not isinstance(cost_s, (int, float)) or not math.isfinite(cost_s) or cost_s < 0:
        raise InvalidEntryError(f"cost_s must be a finite number >= 0, got {cost_s!r}")
    if ttl_s is not None and (
        isinstance(ttl_s, bool) or not isinstance(ttl_s, (int, float)) or not math.isfinite(ttl_s) or ttl_s <= 0
    ):
        raise InvalidEntryError(f"ttl_s must be None or a finite number > 0, got {ttl_s!r}")
    user_meta = dict(meta or {})
    for k, v in user_meta.items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise InvalidEntryError(f"meta must map str to str, got {k!r}: {v!r}")
    return {
        "key": raw_key, "tensors": items, "kind": kind, "cost_s": float(cost_s), "meta": user_meta,
        "parent": raw_parent, "ttl_s": None if ttl_s is None else float(ttl_s), "namespace": namespace,
    }


def encode(prepared: dict[str, Any]) -> np.ndarray:
    """Encode a :func:`prepare` result into the bytes of one safetensors file (a uint8 array)."""
    return _encode(prepared)[0]


def build(prepared: dict[str, Any]) -> Entry:
    """Encode a :func:`prepare` result and return its :class:`Entry` directly.

    The tensors are read-only views of the encoded bytes, exactly as :func:`decode` would
    give them, without parsing back the header that was just written.
    """
    buf, header, start = _encode(prepared)
    tensors: dict[str, np.ndarray] = {}
    dtypes: dict[str, str] = {}
    for name in sorted(n for n in header if n != "__metadata__"):
        info = header[name]
        b, e = info["data_offsets"]
        dtype = _ST_TO_NP[info["dtype"]]
        arr = (np.frombuffer(buf, dtype=dtype, count=(e - b) // dtype.itemsize, offset=start + b) if e > b
               else np.empty(0, dtype=dtype)).reshape(tuple(info["shape"]))
        arr.flags.writeable = False
        tensors[name], dtypes[name] = arr, info["dtype"]
    return Entry(
        key=prepared["key"], kind=prepared["kind"], tensors=tensors, dtypes=dtypes, meta=dict(prepared["meta"]),
        parent=prepared["parent"], cost_s=prepared["cost_s"], size=int(buf.size), namespace=prepared["namespace"],
        ttl_s=prepared["ttl_s"], blob=buf,
    )


def _encode(prepared: dict[str, Any]) -> tuple[np.ndarray, dict[str, Any], int]:
    # Widest items first keeps every tensor aligned to its itemsize (the header is padded to 8).
    items = sorted(prepared["tensors"], key=lambda t: (-t[2].dtype.itemsize, t[0]))
    digest = xxhash.xxh3_128()
    header: dict[str, Any] = {}
    offset = 0
    for name, st, arr in items:
        header[name] = {"dtype": st, "shape": list(arr.shape), "data_offsets": [offset, offset + arr.nbytes]}
        offset += arr.nbytes
        if arr.nbytes:
            digest.update(memoryview(arr).cast("B"))
    parent = prepared["parent"]
    header["__metadata__"] = {
        "format": "promptstore",
        "version": str(ENTRY_VERSION),
        "key": prepared["key"].hex(),
        "kind": prepared["kind"],
        "namespace": prepared["namespace"],
        "parent": parent.hex() if parent else "",
        "cost_s": repr(prepared["cost_s"]),
        "ttl_s": "" if prepared["ttl_s"] is None else repr(prepared["ttl_s"]),
        "meta": json.dumps(prepared["meta"], sort_keys=True, separators=(",", ":")),
    }
    digest.update(_canonical(header))
    header["__metadata__"]["checksum"] = "xxh3_128:" + digest.hexdigest()
    text = _canonical(header)
    text += b" " * (-len(text) % 8)
    start = 8 + len(text)
    # np.empty, not bytearray: no zero-fill pass over bytes that are overwritten next.
    buf = np.empty(start + offset, dtype=np.uint8)
    buf[:8] = np.frombuffer(len(text).to_bytes(8, "little"), dtype=np.uint8)
    buf[8:start] = np.frombuffer(text, dtype=np.uint8)
    for name, _, arr in items:
        b, e = header[name]["data_offsets"]
        if e > b:
            buf[start + b : start + e] = arr.reshape(-1).view(np.uint8)
    return buf, header, start


def _canonical(header: dict[str, Any]) -> bytes:
    """The header as the checksum sees it: sorted, compact JSON (the padding is not covered)."""
    return json.dumps(header, sort_keys=True, separators=(",", ":")).encode("ascii")


def _corrupt(msg: str) -> CorruptEntryError:
    return CorruptEntryError(msg)


class Header(NamedTuple):
    """An entry's parsed and validated header (everything but the tensor bytes and the checksum's result)."""

    key: bytes
    kind: str
    namespace: str
    parent: bytes | None
    cost_s: float
    ttl_s: float | None
    meta: dict[str, str]
    checksum: str
    unchecked: dict[str, Any]  # the header as the checksum covers it
    spans: list[tuple[int, int, str, str, np.dtype, list[int]]]  # begin, end, name, st dtype, np dtype, shape
    start: int  # where the tensor bytes begin
    total: int
    text: bytes  # the header's JSON as stored (padding included)


def parse_header(view: memoryview, total: int, *, expect_key: bytes | None = None) -> Header:
    """Parse and validate the header at the start of ``view`` for an entry of ``total`` bytes.

    ``view`` needs only to hold the header (8 bytes of length, then the JSON).

    Raises:
        CorruptEntryError: anything malformed, or a key other than ``expect_key``.
        EntryVersionError: a well-formed entry of another format version.
    """
    if total < 8 or view.nbytes < 8:
        raise _corrupt(f"{total} bytes is too short for an entry")
    hlen = int.from_bytes(view[:8], "little")
    if hlen > total - 8 or hlen > MAX_HEADER_BYTES:
        raise _corrupt(f"header length {hlen} does not fit in {total} bytes")
    if view.nbytes < 8 + hlen:
        raise _corrupt(f"short read: {view.nbytes} bytes for a {hlen}-byte header")
    text = bytes(view[8 : 8 + hlen])
    try:
        header = json.loads(text)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise _corrupt(f"header is not JSON: {exc}") from None
    if not isinstance(header, dict):
        raise _corrupt("header is not a JSON object")
    md = header.pop("__metadata__", None)
    if not isinstance(md, dict) or not all(isinstance(v, str) for v in md.values()):
        raise _corrupt("not a promptstore entry: missing or malformed __metadata__")
    version = md.get("version")
    if md.get("format") != "promptstore" or not isinstance(version, str) or not version.isdecimal() or len(version) > 6:
        raise _corrupt(f"not a promptstore entry (format={md.get('format')!r}, version={version!r})")
    if int(version) != ENTRY_VERSION:
        # Another release's entry: a miss here, never corruption (it may be in use by that release).
        raise EntryVersionError(int(version), int(version) > ENTRY_VERSION)
    try:
        key = bytes.fromhex(md["key"])
        parent = bytes.fromhex(md["parent"]) if md["parent"] else None
        cost_s = float(md["cost_s"])
        ttl_s = float(md["ttl_s"]) if md["ttl_s"] else None
        meta = {} if md["meta"] == "{}" else json.loads(md["meta"])
        kind, namespace, checksum = md["kind"], md["namespace"], md["checksum"]
    except (KeyError, ValueError, TypeError) as exc:
        raise _corrupt(f"malformed metadata: {exc!r}") from None
    if len(key) != 32 or (parent is not None and len(parent) != 32):
        raise _corrupt("malformed key or parent")
    if expect_key is not None and key != expect_key:
        raise _corrupt(f"entry holds key {key.hex()[:16]}…, expected {expect_key.hex()[:16]}…")
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise _corrupt("malformed user metadata")
    start = 8 + hlen
    data_len = total - start
    spans = []
    for name, info in header.items():
        try:
            st, shape, (b, e) = info["dtype"], info["shape"], info["data_offsets"]
            dtype = _ST_TO_NP[st]
        except (KeyError, TypeError, ValueError):
            raise _corrupt(f"tensor {name!r}: malformed header entry") from None
        if (
            not isinstance(shape, list) or len(shape) > MAX_NDIM
            or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in (b, e))
        ):
            raise _corrupt(f"tensor {name!r}: malformed shape or offsets")
        if math.prod(shape) * dtype.itemsize != e - b:
            raise _corrupt(f"tensor {name!r}: shape {shape} does not match {e - b} bytes")
        spans.append((b, e, name, st, dtype, shape))
    spans.sort()
    cursor = 0
    for b, e, name, *_ in spans:
        if b != cursor:
            raise _corrupt(f"tensor {name!r}: data offsets leave a gap or overlap")
        cursor = e
    if cursor != data_len:
        raise _corrupt(f"tensor bytes cover {cursor} of {data_len} bytes (truncated or padded file)")
    unchecked = {**header, "__metadata__": {k: v for k, v in md.items() if k != "checksum"}}
    return Header(key, kind, namespace, parent, cost_s, ttl_s, meta, checksum, unchecked, spans, start, total, text)


def check_digest(head: Header, digest: Any) -> None:
    """Finish ``digest`` (xxh3-128 already fed the tensor bytes in file order) and compare it.

    Raises:
        CorruptEntryError: a checksum mismatch or an unknown checksum.
    """
    algo, _, want = head.checksum.partition(":")
    if algo != "xxh3_128":
        raise _corrupt(f"unknown checksum {algo!r}")
    # What the checksum covers is the canonical header without its checksum: as this library writes a
    # header, that is the stored text with the checksum's member cut out, hashed here without serialising
    # the header again (~15 us an entry). Bytes that hash right are the bytes written, so the header parsed
    # from them is the one written; any other spelling of a header is checked the long way.
    member = b'"checksum":"' + head.checksum.encode("ascii", "replace") + b'",'
    text = head.text.rstrip(b" ")
    quick = text.replace(member, b"", 1)
    if len(quick) != len(text):
        trial = digest.copy()
        trial.update(quick)
        if trial.hexdigest() == want:
            return
    try:
        digest.update(_canonical(head.unchecked))
    except (RecursionError, ValueError) as exc:
        raise _corrupt(f"header cannot be checked: {exc!r}") from None
    if digest.hexdigest() != want:
        raise _corrupt("checksum mismatch: the entry changed since it was written")


def make_entry(head: Header, tensors: dict[str, np.ndarray], blob: Any) -> Entry:
    """The :class:`Entry` of a parsed header and its tensors."""
    return Entry(
        key=head.key, kind=head.kind, tensors=tensors, dtypes={s[2]: s[3] for s in head.spans}, meta=head.meta,
        parent=head.parent, cost_s=head.cost_s, size=head.total, namespace=head.namespace, ttl_s=head.ttl_s,
        blob=blob,
    )


def decode(buf: bytes | bytearray | memoryview | np.ndarray[Any, Any], *, expect_key: bytes | None = None,
           verify: bool = True) -> Entry:
    """Decode one entry from its bytes; arrays are read-only views of ``buf``.

    Raises:
        CorruptEntryError: anything malformed, a checksum mismatch, or a key other than ``expect_key``.
        EntryVersionError: a well-formed entry of another format version (checked before its checksum,
            whose definition may differ between versions).
    """
    view = buf.data if isinstance(buf, np.ndarray) else memoryview(buf)
    head = parse_header(view, view.nbytes, expect_key=expect_key)
    if verify:
        check_digest(head, xxhash.xxh3_128(view[head.start :]))
    tensors: dict[str, np.ndarray] = {}
    for b, e, name, _, dtype, shape in sorted(head.spans, key=lambda s: s[2]):
        if e > b:
            arr = np.frombuffer(buf, dtype=dtype, count=(e - b) // dtype.itemsize,
                                offset=head.start + b).reshape(tuple(shape))
        else:
            arr = np.empty(tuple(shape), dtype=dtype)
        arr.flags.writeable = False
        tensors[name] = arr
    return make_entry(head, tensors, buf)
