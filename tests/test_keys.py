"""Keys: pinned golden vectors, the framing spelled out, namespaces and block chains."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from promptstore import PromptStore, chain_keys, make_key
from promptstore.errors import InvalidKeyError

from conftest import run_python

# Pinned: if one of these changes, every stored cache in the world goes cold. Bump the
# format tag (promptstore/2) instead of editing them.
GOLDEN = {
    ("vision.text", "person", "", ()): "73d64be79af2853062a25150377190e785dcb5dc2a89657aa97ba2e1aa0587ae",
    ("vision.text", "person", "acme", ()): "62527d6250f649c337a0eae117698fd34dda15e2a2af33fc818be155117d898e",
    ("llm.kv", b"", "", ("model:abc", "tok:def")): "f779c5b7b69bc457ec3d236c5ff7ddeb77be809bf33576942f18a039393173e9",
    ("", "", "", ()): "52be66d6660d6388317f8bd9328dcc4607ccdb3d9f4fc017b65683ab518aa753",
}
GOLDEN_CHAIN = [
    "351810034da5b545169c34bf532886050674999eb042696cfb5982471e6aa9aa",
    "fb48c6a938043968b6b7fb4a978a0a7972c134401b957b9046db0d65d6616ff2",
]


@pytest.mark.parametrize(("fields", "expected"), list(GOLDEN.items()))
def test_golden_keys(fields, expected):
    kind, payload, namespace, fps = fields
    assert make_key(kind, payload, namespace=namespace, fingerprints=fps).hex() == expected


def _frame(*fields: bytes) -> bytes:
    return b"".join(len(f).to_bytes(8, "little") + f for f in fields)


def test_framing_is_the_documented_one():
    """BLAKE2b-256 over length-prefixed fields: tag, 'entry', kind, namespace, n, fps..., payload."""
    expected = hashlib.blake2b(
        _frame(b"promptstore/1", b"entry", b"llm.kv", b"", (2).to_bytes(8, "little"), b"model:abc", b"tok:def", b""),
        digest_size=32,
    ).digest()
    assert make_key("llm.kv", b"", fingerprints=["model:abc", "tok:def"]) == expected


def test_golden_chain_and_its_framing():
    root = make_key("llm.kv", b"", fingerprints=["m"])
    keys = chain_keys(root, list(range(10)), 4)
    assert [k.hex() for k in keys] == GOLDEN_CHAIN  # 10 tokens, blocks of 4: two full blocks
    block1 = np.arange(4, dtype="<i4").tobytes()
    k1 = hashlib.blake2b(_frame(b"promptstore/1", b"block", root, block1), digest_size=32).digest()
    assert keys[0] == k1


def test_keys_are_the_same_in_another_process():
    out = run_python(
        "from promptstore import make_key, chain_keys\n"
        "r = make_key('llm.kv', b'', fingerprints=['m'])\n"
        "print(make_key('vision.text', 'person', namespace='acme').hex())\n"
        "print(chain_keys(r, list(range(10)), 4)[-1].hex())\n",
        env={"PYTHONHASHSEED": "12345"},
    )
    assert out.stdout.split() == [GOLDEN[("vision.text", "person", "acme", ())], GOLDEN_CHAIN[-1]]


def test_fields_do_not_run_together():
    # Length prefixes: moving bytes between fields changes the key.
    assert make_key("ab", "c") != make_key("a", "bc")
    assert make_key("k", "x", fingerprints=["a", "b"]) != make_key("k", "x", fingerprints=["ab"])
    assert make_key("k", "x", fingerprints=["a"]) != make_key("k", "ax")


def test_namespace_salts_every_key():
    assert make_key("k", "x", namespace="a") != make_key("k", "x", namespace="b")
    assert PromptStore(memory_bytes="1MiB", disk_bytes=0, namespace="a").key("k", "x") == make_key(
        "k", "x", namespace="a"
    )


def test_chain_prefix_property():
    root = make_key("llm.kv", "", fingerprints=["m"])
    tokens = np.random.default_rng(0).integers(0, 50_000, size=300)
    full = chain_keys(root, tokens, 64)
    assert len(full) == 4  # 300 // 64, the partial tail gets no key
    assert chain_keys(root, tokens[:200], 64) == full[:3]
    changed = tokens.copy()
    changed[130] += 1  # inside block 3
    other = chain_keys(root, changed, 64)
    assert other[:2] == full[:2] and other[2] != full[2] and other[3] != full[3]
    assert chain_keys(root, tokens, 32)[1] != full[0]  # block size is part of the chain


def test_chain_accepts_lists_and_arrays_alike():
    root = make_key("r")
    assert chain_keys(root, [1, 2, 3, 4], 2) == chain_keys(root, np.array([1, 2, 3, 4], dtype=np.int64), 2)
    assert chain_keys(root, [], 2) == []


@pytest.mark.parametrize("bad", [b"short", "zz" * 32, "ab" * 31, 123, None, 1.5, ["x"]])
def test_bad_keys_are_typed_errors(bad):
    with pytest.raises(InvalidKeyError):
        PromptStore(memory_bytes="1MiB", disk_bytes=0).get(bad)


@pytest.mark.parametrize(
    ("tokens", "block"), [([-1, 2], 1), ([2**31], 1), ([[1, 2]], 1), ([1.5, 2.5], 1), ([1, 2], 0), ([1, 2], -3)]
)
def test_bad_chain_input(tokens, block):
    with pytest.raises(InvalidKeyError):
        chain_keys(make_key("r"), tokens, block)


def test_bad_key_fields():
    with pytest.raises(InvalidKeyError):
        make_key(3, "x")  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError):
        make_key("k", "x", fingerprints=[None])  # type: ignore[list-item]


def test_chain_limits_are_inclusive():
    """The largest token id and a one-token block are valid; a bool is not a block size."""
    root = make_key("r")
    assert len(chain_keys(root, [0, 2**31 - 1], 1)) == 2
    assert chain_keys(root, [5, 6, 7], np.int64(1)) == chain_keys(root, [5, 6, 7], 1)
    for bad in (True, False, 2.0, "2"):
        with pytest.raises(InvalidKeyError):
            chain_keys(root, [1, 2], bad)


def test_the_default_payload_is_empty():
    assert make_key("k") == make_key("k", b"") == make_key("k", "")


@pytest.mark.parametrize(("kwargs", "field"), [({"kind": 3}, "kind"), ({"payload": 3}, "payload"),
                                               ({"namespace": 3}, "namespace"), ({"fingerprints": [3]}, "fingerprint")])
def test_a_bad_key_field_is_named_in_the_error(kwargs, field):
    args = {"kind": "k", **kwargs}
    with pytest.raises(InvalidKeyError, match=f"^{field} must be str or bytes"):
        make_key(args.pop("kind"), **args)


def test_a_hex_key_is_the_key_it_spells():
    store = PromptStore(memory_bytes="1MiB", disk_bytes=0)
    key = make_key("k", "x")
    store.put(key, {"x": np.ones(2, np.float32)}, kind="t")
    assert store.get(key.hex()) is not None and store.get(bytearray(key)) is not None
