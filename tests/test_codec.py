"""The entry format: dtypes, golden bytes, safetensors compatibility, corruption."""

from __future__ import annotations

import hashlib
import json

import ml_dtypes
import numpy as np
import pytest
import safetensors
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from promptstore._codec import decode, encode, prepare
from promptstore.errors import CorruptEntryError, EntryVersionError, InvalidEntryError, InvalidKeyError, UnsupportedDtypeError

from conftest import make_entry

KEY = bytes(range(32))


def roundtrip(tensors, **kw):
    blob = encode(prepare(KEY, tensors, kind=kw.pop("kind", "t"), **kw))
    return decode(bytes(memoryview(blob)), expect_key=KEY)


@pytest.mark.parametrize(
    "dtype", ["float64", "float32", "float16", "int64", "int32", "int16", "int8", "uint64", "uint32", "uint16",
              "uint8", "bool"]
)
def test_numpy_dtypes_roundtrip(dtype):
    arr = (np.arange(24).reshape(2, 3, 4) % 7).astype(dtype)
    e = roundtrip({"t": arr})
    assert e.tensors["t"].dtype == arr.dtype
    assert np.array_equal(e.tensors["t"], arr)


def test_bfloat16_raw_bits_roundtrip():
    bits = np.array([0x3F80, 0xC000, 0x7F80, 0xFFC1], dtype=np.uint16)  # 1, -2, inf, a NaN payload
    e = roundtrip({"k": (bits, "BF16")})
    assert e.dtypes["k"] == "BF16"
    assert e.tensors["k"].tobytes() == bits.tobytes()


def test_ml_dtypes_bfloat16_is_recognised():
    arr = np.array([1.0, -2.5, 3.140625], dtype=ml_dtypes.bfloat16)
    e = roundtrip({"k": arr})
    assert e.dtypes["k"] == "BF16"
    assert np.array_equal(e.tensors["k"].view(ml_dtypes.bfloat16), arr)
    f8 = np.array([1.0, 0.5], dtype=ml_dtypes.float8_e4m3fn)
    assert roundtrip({"f": f8}).dtypes["f"] == "F8_E4M3"


def test_scalars_empty_and_noncontiguous_arrays():
    base = np.arange(20, dtype=np.float32).reshape(4, 5)
    e = roundtrip({"scalar": np.float64(2.5) * np.ones(()), "empty": np.zeros((0, 3), np.int32),
                   "strided": base[:, ::2], "fortran": np.asfortranarray(base)})
    assert e.tensors["scalar"].shape == () and float(e.tensors["scalar"]) == 2.5
    assert e.tensors["empty"].shape == (0, 3)
    assert np.array_equal(e.tensors["strided"], base[:, ::2])
    assert np.array_equal(e.tensors["fortran"], base)


def test_big_endian_input_is_stored_little_endian():
    arr = np.arange(5, dtype=">i4")
    e = roundtrip({"be": arr})
    assert e.tensors["be"].dtype == np.dtype("<i4")
    assert e.tensors["be"].tolist() == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "value",
    [np.array([object()], dtype=object), np.array(["a", "b"]), np.array([1 + 2j]),
     np.zeros(2, dtype=[("a", "i4"), ("b", "f4")]), np.array([1, 2], dtype="datetime64[s]")],
)
def test_unsupported_dtypes_are_typed_errors(value):
    with pytest.raises(UnsupportedDtypeError):
        prepare(KEY, {"x": value}, kind="t")


@pytest.mark.parametrize(
    ("tensors", "kw"),
    [
        ({"x": [1, 2, 3]}, {}),  # not an array
        ({"": np.zeros(1)}, {}),
        ({"__metadata__": np.zeros(1)}, {}),
        ({"x": (np.zeros(2, np.float32), "BF16")}, {}),  # raw bits of the wrong width
        ({"x": (np.zeros(2, np.uint16), "NOPE")}, {}),
        ({"x": np.zeros(1)}, {"kind": ""}),
        ({"x": np.zeros(1)}, {"cost_s": -1.0}),
        ({"x": np.zeros(1)}, {"cost_s": float("nan")}),
        ({"x": np.zeros(1)}, {"ttl_s": 0}),
        ({"x": np.zeros(1)}, {"meta": {"a": 1}}),
        ([np.zeros(1)], {}),
    ],
)
def test_invalid_entries_are_typed_errors(tensors, kw):
    kw.setdefault("kind", "t")
    with pytest.raises(InvalidEntryError):
        prepare(KEY, tensors, **kw)


def test_parent_must_be_a_key_and_not_self():
    with pytest.raises(InvalidKeyError):
        prepare(KEY, {}, kind="t", parent=b"nope")
    with pytest.raises(InvalidEntryError):
        prepare(KEY, {}, kind="t", parent=KEY)


GOLDEN_SHA256 = "70153014b1cb04e0696acdea3ad55efda43f265647c41e48687161d2da2ccc0f"


def golden_entry():
    return make_entry(
        bytes(range(32)),
        {"f32": np.array([[1.5, -2.0], [0.25, 3.0]], np.float32), "bf16": (np.array([0x3F80, 0xC000], np.uint16), "BF16"),
         "i8": np.array([-1, 2, 3], np.int8), "i64": np.array([2**40], np.int64)},
        kind="golden", cost_s=1.25, parent=bytes(32 * [7]), ttl_s=60.0, meta={"a": "b"}, namespace="ns",
    )


def test_golden_bytes():
    """The exact bytes of one entry: a change here is a format change (bump ENTRY_VERSION)."""
    blob = bytes(memoryview(golden_entry().blob))
    assert len(blob) == 615
    assert hashlib.sha256(blob).hexdigest() == GOLDEN_SHA256
    hlen = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + hlen])
    assert header["__metadata__"]["checksum"] == "xxh3_128:823134e4177371b18d586ee96686e9e0"
    assert header["i64"] == {"data_offsets": [0, 8], "dtype": "I64", "shape": [1]}
    assert (8 + hlen) % 8 == 0


def test_safetensors_reads_our_files(tmp_path):
    e = make_entry(KEY, {"a": np.arange(6, dtype=np.float32).reshape(2, 3), "b": np.array([7], np.int64),
                         "c": (np.array([0x3F80], np.uint16), "BF16")}, kind="vision.text", cost_s=0.5)
    path = tmp_path / "e.safetensors"
    path.write_bytes(memoryview(e.blob))
    with safetensors.safe_open(str(path), framework="numpy") as f:
        md = f.metadata()
        assert md["kind"] == "vision.text" and md["key"] == KEY.hex() and md["checksum"].startswith("xxh3_128:")
        assert set(f.keys()) == {"a", "b", "c"}
        assert np.array_equal(f.get_tensor("a"), np.arange(6, dtype=np.float32).reshape(2, 3))
        assert f.get_tensor("b").tolist() == [7]
        assert f.get_slice("c").get_dtype() == "BF16"


def test_we_read_files_safetensors_wrote():
    """Any valid layout parses (safetensors orders and pads its header its own way)."""
    ours = make_entry(KEY, {"a": np.arange(6, dtype=np.float32), "z": np.array([1, 2], np.int8)}, kind="k", cost_s=2.0)
    hlen = int.from_bytes(memoryview(ours.blob)[:8], "little")
    metadata = json.loads(bytes(memoryview(ours.blob)[8 : 8 + hlen]))["__metadata__"]
    a, z = np.arange(6, dtype=np.float32), np.array([1, 2], np.int8)
    specs = {n: safetensors.TensorSpec(dtype=t.dtype.name, shape=list(t.shape), data_ptr=t.ctypes.data, data_len=t.nbytes)
             for n, t in {"a": a, "z": z}.items()}
    theirs = safetensors.serialize(specs, metadata=metadata)
    e = decode(theirs, expect_key=KEY)
    assert e.tensors["a"].tolist() == a.tolist() and e.tensors["z"].tolist() == [1, 2]
    assert (e.kind, e.cost_s) == ("k", 2.0)


def test_plain_safetensors_file_is_not_an_entry():
    from safetensors.numpy import save

    with pytest.raises(CorruptEntryError, match="not a promptstore"):
        decode(save({"a": np.zeros(2, np.float32)}))


def test_checksum_catches_every_flipped_tensor_byte():
    blob = bytearray(memoryview(golden_entry().blob))
    hlen = int.from_bytes(blob[:8], "little")
    for pos in range(8 + hlen, len(blob)):
        bad = bytearray(blob)
        bad[pos] ^= 0x10
        with pytest.raises(CorruptEntryError):
            decode(bytes(bad))


def test_every_truncation_is_corrupt():
    blob = bytes(memoryview(golden_entry().blob))
    for n in range(len(blob)):
        with pytest.raises(CorruptEntryError):
            decode(blob[:n])


def test_wrong_key_is_corrupt():
    with pytest.raises(CorruptEntryError, match="expected"):
        decode(bytes(memoryview(golden_entry().blob)), expect_key=bytes(32))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.binary(max_size=2048))
def test_random_bytes_never_crash(data):
    try:
        decode(data)
    except (CorruptEntryError, EntryVersionError):
        pass


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(st.data())
def test_header_mutations_never_crash(data):
    blob = bytearray(memoryview(golden_entry().blob))
    hlen = int.from_bytes(blob[:8], "little")
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, 8 + hlen - 1))
        blob[pos] = data.draw(st.integers(0, 255))
    try:
        e = decode(bytes(blob))
    except (CorruptEntryError, EntryVersionError):  # a mutated version digit: another release's entry, a miss
        return
    # Only a mutation the JSON parser ignores (whitespace in the padding) may still decode,
    # and then to exactly the same entry: names, dtypes, shapes, bytes and metadata.
    assert _described(e) == _described(decode(bytes(memoryview(golden_entry().blob))))


def _described(e):
    return (e.key, e.kind, e.namespace, e.parent, e.cost_s, e.ttl_s, e.meta, e.dtypes,
            {n: (t.shape, t.tobytes()) for n, t in e.tensors.items()})


def test_every_header_byte_is_covered_by_the_checksum():
    blob = bytes(memoryview(golden_entry().blob))
    hlen = int.from_bytes(blob[:8], "little")
    want = _described(decode(blob))
    for pos in range(8 + hlen):
        for new in {0x20, 0x30, 0x31, blob[pos] ^ 0x01}:
            if new == blob[pos]:
                continue
            bad = bytearray(blob)
            bad[pos] = new
            try:
                got = _described(decode(bytes(bad)))
            except (CorruptEntryError, EntryVersionError):  # a flipped version digit reads as another release's: a miss
                continue
            assert got == want, f"byte {pos} -> {new:#x} decoded to a different entry"


_dtypes = st.sampled_from([np.float32, np.float16, np.float64, np.int8, np.int32, np.int64, np.uint8, np.bool_])


@settings(max_examples=100, deadline=None)
@given(st.dictionaries(st.text(min_size=1, max_size=8).filter(lambda s: s != "__metadata__"),
                       _dtypes.flatmap(lambda d: hnp.arrays(d, hnp.array_shapes(min_dims=0, max_dims=3, max_side=5))),
                       max_size=4),
       st.dictionaries(st.text(max_size=5), st.text(max_size=10), max_size=3))
def test_any_entry_roundtrips(tensors, meta):
    from promptstore._codec import build

    built = build(prepare(bytes(32), tensors, kind="test", meta=meta))  # what put() stores: no header re-parse
    assert _described(built) == _described(decode(bytes(memoryview(built.blob))))
    e = roundtrip(tensors, meta=meta)
    assert e.meta == meta
    assert set(e.tensors) == set(tensors)
    for name, arr in tensors.items():
        assert e.tensors[name].shape == arr.shape
        assert e.tensors[name].tobytes() == np.ascontiguousarray(arr).tobytes()


# -- what decoding returns, field by field, and where the header's limits lie (#21) --------------------
def test_decoding_returns_every_field_the_entry_was_written_with():
    e = decode(bytes(memoryview(golden_entry().blob)), expect_key=bytes(range(32)))
    assert (e.key, e.kind, e.namespace, e.parent, e.cost_s, e.ttl_s, e.meta) == (
        bytes(range(32)), "golden", "ns", bytes(32 * [7]), 1.25, 60.0, {"a": "b"})
    assert e.size == len(memoryview(golden_entry().blob)) and e.blob is not None
    assert e.dtypes == {"f32": "F32", "bf16": "BF16", "i8": "I8", "i64": "I64"}
    assert e.tensors["f32"].tolist() == [[1.5, -2.0], [0.25, 3.0]] and e.tensors["i64"].tolist() == [2**40]
    assert not any(t.flags.writeable for t in e.tensors.values())
    assert list(e.tensors) == sorted(e.tensors)  # by name, whatever order the file holds them in
    plain = roundtrip({"x": np.zeros(2, np.float32)})
    assert (plain.parent, plain.ttl_s, plain.meta, plain.namespace) == (None, None, {}, "")


def test_empty_tensors_keep_their_dtype_and_shape():
    e = roundtrip({"a": np.zeros((0, 3), np.int32), "b": np.zeros((2, 0), np.float16), "c": np.ones(2, np.int8)})
    assert (e.tensors["a"].dtype, e.tensors["a"].shape) == (np.dtype("<i4"), (0, 3))
    assert (e.tensors["b"].dtype, e.tensors["b"].shape) == (np.dtype("<f2"), (2, 0))


def resealed(blob: bytes, edit) -> bytes:
    """``blob`` with its header edited by ``edit(header)`` and a valid checksum again: only the edit is wrong."""
    import xxhash

    from promptstore._codec import _canonical

    hlen = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + hlen])
    data = blob[8 + hlen :]
    edit(header)
    header["__metadata__"].pop("checksum", None)
    digest = xxhash.xxh3_128(data)
    digest.update(_canonical(header))
    header["__metadata__"]["checksum"] = "xxh3_128:" + digest.hexdigest()
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text + data


def test_a_resealed_header_is_read_as_it_says():
    """The helper itself: an edit that changes nothing decodes; one that changes the meta is read."""
    blob = bytes(memoryview(golden_entry().blob))
    assert decode(resealed(blob, lambda h: None)).meta == {"a": "b"}
    assert decode(resealed(blob, lambda h: h["__metadata__"].update(meta='{"a":"c"}'))).meta == {"a": "c"}


def _set_meta(field, value):
    return lambda h: h["__metadata__"].update({field: value})


@pytest.mark.parametrize("edit", [
    _set_meta("meta", '{"a":1}'),  # user metadata values are strings
    _set_meta("meta", '{"a":"b","c":["d"]}'),
    _set_meta("meta", '["a"]'),
    _set_meta("parent", "07" * 31),  # a parent is a 32-byte key
    _set_meta("key", "00" * 31),
    _set_meta("version", "0000002"),  # seven digits
    # Each below keeps the byte count right, so that only the rule it breaks can refuse it.
    lambda h: h["f32"].update(shape=[4, True]),  # a bool is not a dimension
    lambda h: h["f32"].update(shape=[-4, -1]),
    lambda h: h["i64"].update(data_offsets=[False, 8]),  # i64 comes first (widest): bytes 0-8
    lambda h: h["f32"].update(shape=[2, 2] + [1] * 15),  # 17 dimensions
], ids=["meta-int", "meta-list", "meta-not-dict", "short-parent", "short-key", "long-version", "bool-dim",
        "negative-dim", "bool-offset", "17-dims"])
def test_headers_that_break_a_rule_are_corrupt_even_with_a_valid_checksum(edit):
    blob = bytes(memoryview(golden_entry().blob))
    with pytest.raises(CorruptEntryError):
        decode(resealed(blob, edit))


def test_the_byte_counts_of_the_edits_above_are_right():
    blob = bytes(memoryview(golden_entry().blob))
    hlen = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + hlen])
    assert header["i64"]["data_offsets"] == [0, 8] and header["f32"]["shape"] == [2, 2]


def test_the_header_limits_are_inclusive():
    from promptstore._codec import MAX_NDIM

    e = roundtrip({"x": np.zeros((1,) * MAX_NDIM, np.float32)})  # exactly the most dimensions
    assert e.tensors["x"].ndim == MAX_NDIM
    blob = bytes(memoryview(golden_entry().blob))
    assert decode(resealed(blob, _set_meta("version", "000002"))).kind == "golden"  # six digits, version 2
    assert decode(blob[:8] + blob[8:]).kind == "golden"


def test_a_header_of_exactly_the_largest_size_is_read(monkeypatch):
    import promptstore._codec as codec

    blob = bytes(memoryview(golden_entry().blob))
    hlen = int.from_bytes(blob[:8], "little")
    monkeypatch.setattr(codec, "MAX_HEADER_BYTES", hlen)
    assert decode(blob).kind == "golden"
    monkeypatch.setattr(codec, "MAX_HEADER_BYTES", hlen - 1)
    with pytest.raises(CorruptEntryError):
        decode(blob)


@pytest.mark.parametrize("total", [0, 7, 8])
def test_entries_too_short_for_a_header_are_corrupt(total):
    with pytest.raises(CorruptEntryError):
        decode(bytes(memoryview(golden_entry().blob))[:total])
