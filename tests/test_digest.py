"""Weight digests: any change to any element changes them, on the host and on a device (issue #10)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import promptstore._digest as digest
from promptstore import digest_tensors


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 5000), where=st.data(), dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16,
                                                                       torch.int8, torch.float64]))
def test_one_element_changed_anywhere_changes_both_digests(n, where, dtype):
    t = (torch.randn(n) * 10).to(dtype)
    i = where.draw(st.integers(0, n - 1))
    u = t.clone()
    u.view(torch.uint8)[i * t.element_size()] ^= 1  # flip one bit of element i
    host = digest_tensors("w", [("w", t)])
    assert host == digest_tensors("w", [("w", t.clone())]) != digest_tensors("w", [("w", u)])
    dev = digest.device_word_digest(torch, t).tobytes()
    assert dev == digest.device_word_digest(torch, t.clone()).tobytes() != digest.device_word_digest(torch, u).tobytes()


def test_device_digest_does_not_depend_on_chunking(monkeypatch):
    t = torch.randn(10_001)
    whole = digest.device_word_digest(torch, t).tobytes()
    monkeypatch.setattr(digest, "_CHUNK_WORDS", 997)
    assert digest.device_word_digest(torch, t).tobytes() == whole


def test_names_dtypes_shapes_and_ties_are_part_of_the_digest():
    w = torch.ones(4, 4)
    base = digest_tensors("m", [("a", w), ("b", w)])  # b tied to a
    assert base != digest_tensors("m", [("a", w), ("b", w.clone())])  # same bytes, no longer tied
    assert base != digest_tensors("m", [("a", w.reshape(16)), ("b", w.reshape(16))])
    assert base != digest_tensors("m", [("a", w.double()), ("b", w.double())])
    assert base != digest_tensors("m", [("x", w), ("b", w)])
    assert digest_tensors("m", [("s", torch.tensor(2.0))]) != digest_tensors("m", [("s", torch.tensor(3.0))])  # 0-dim
    assert digest_tensors("m", [("a", np.ones(3, np.float32))]) == digest_tensors("m", [("a", np.ones(3, np.float32))])
    with pytest.raises(TypeError):
        digest_tensors("m", [("a", [1, 2, 3])])
