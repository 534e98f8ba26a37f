"""Behaviours that planted one-line bugs showed no test pinned down (issue #11).

Each test here fails on one plausible bug that the rest of the suite let through.
"""

from __future__ import annotations

import json
import os
import sqlite3

import numpy as np
import pytest
import xxhash

from promptstore._codec import _canonical, decode, encode, prepare
from promptstore._tiers import DiskTier
from promptstore.errors import CorruptEntryError

from conftest import FakeClock, key_of, make_entry


def _entry_bytes() -> bytes:
    return bytes(encode(prepare(key_of("c"), {"a": np.arange(4, dtype=np.float32), "b": np.ones(2, np.float64)},
                                kind="t", cost_s=0.5, meta={"m": "v"})))


def test_every_digit_of_the_stored_checksum_is_checked():
    blob = _entry_bytes()
    start = blob.index(b'"xxh3_128:') + len(b'"xxh3_128:')
    for pos in range(start, start + 32):
        for digit in b"0123456789abcdef":
            if blob[pos] == digit:
                continue
            bad = bytearray(blob)
            bad[pos] = digit
            with pytest.raises(CorruptEntryError, match="checksum"):
                decode(bytes(bad))


def test_hidden_bytes_between_tensors_are_refused_even_under_a_valid_checksum():
    blob = _entry_bytes()
    hlen = int.from_bytes(blob[:8], "little")
    header = json.loads(blob[8 : 8 + hlen])
    data = blob[8 + hlen :]
    md = header.pop("__metadata__")
    # Move tensor "b" 8 bytes further and put 8 hidden bytes in the gap.
    first, second = sorted(("a", "b"), key=lambda n: header[n]["data_offsets"][0])
    f0, f1 = header[first]["data_offsets"]
    s0, s1 = header[second]["data_offsets"]
    header[second]["data_offsets"] = [s0 + 8, s1 + 8]
    new_data = data[f0:f1] + b"HIDDEN!!" + data[s0:s1]
    unchecked = {k: v for k, v in md.items() if k != "checksum"}
    digest = xxhash.xxh3_128(new_data)
    digest.update(_canonical({**header, "__metadata__": unchecked}))
    md["checksum"] = f"xxh3_128:{digest.hexdigest()}"
    text = json.dumps({**header, "__metadata__": md}).encode()
    text += b" " * (-len(text) % 8)
    crafted = len(text).to_bytes(8, "little") + text + new_data
    with pytest.raises(CorruptEntryError, match="gap"):
        decode(crafted)


def test_the_index_row_commits_only_after_the_file_is_in_place(tmp_path, monkeypatch):
    """Deterministic: at the moment of the rename no reader can see the row yet."""
    tier = DiskTier(tmp_path / "d", 1 << 20, clock=FakeClock())
    key = key_of("order")
    seen_at_rename = []
    real_replace = os.replace

    def replace(src, dst):
        with sqlite3.connect(tmp_path / "d" / "index.sqlite") as other:
            seen_at_rename.append(other.execute("SELECT count(*) FROM entries WHERE key = ?", (key,)).fetchone()[0])
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace)
    assert tier.put(make_entry(key))
    monkeypatch.setattr(os, "replace", real_replace)
    assert seen_at_rename == [0]
    assert tier.get(key) is not None
    tier.close()
