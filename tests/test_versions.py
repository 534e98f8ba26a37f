"""Two releases share one folder: entries of another format version are misses, never deleted (issue #11).

A child process plays the next release (entry format version 3) or, in the other direction,
the reader of an older release's entries. Rule, both ways: an entry of another version is a
miss, never served and never deleted on read; ``verify`` counts it apart from corrupt ones;
``gc`` leaves it; its own release still reads it.
"""

from __future__ import annotations

import json

import numpy as np

from promptstore import PromptStore

from conftest import run_python

CHILD = """
import json, sys
import numpy as np
import promptstore._codec as codec
codec.ENTRY_VERSION = int(sys.argv[2])  # the other release
from promptstore import PromptStore

folder, mode = sys.argv[1], sys.argv[3]
with PromptStore(folder, memory_bytes=0) as s:
    if mode == "write":
        for i in range(3):
            s.put(s.key("t", f"v{codec.ENTRY_VERSION}-{i}"), {"x": np.full(4, i, np.float32)}, kind="t")
        print(json.dumps("ok"))
    else:
        mine = [s.get(s.key("t", f"v{codec.ENTRY_VERSION}-{i}")) is not None for i in range(3)]
        theirs = [s.get(s.key("t", f"v2-{i}")) is not None for i in range(3)]
        report = s.verify()
        s.gc()
        print(json.dumps({"mine": mine, "theirs": theirs, "ok": report["ok"], "other": report["other_versions"],
                          "listed": len(s.ls())}))
"""


def _child(folder, version, mode):
    return json.loads(run_python(CHILD, str(folder), str(version), mode).stdout.splitlines()[-1])


def test_a_newer_releases_entries_survive_an_older_reader(tmp_path):
    folder = tmp_path / "shared"
    assert _child(folder, 3, "write") == "ok"
    with PromptStore(folder, memory_bytes=0) as s:
        for i in range(3):
            assert s.get(s.key("t", f"v3-{i}")) is None  # a miss, not served
        report = s.verify()
        assert report["ok"] and report["other_versions"] == {"newer": 3, "older": 0}
        s.gc()
        s.gc(all_namespaces=True)
        assert len(s.ls()) == 3  # never deleted: read, verify and gc all left them
        s.put(s.key("t", "v2-0"), {"x": np.zeros(4, np.float32)}, kind="t")
    back = _child(folder, 3, "read")
    assert back["mine"] == [True, True, True]  # the newer release still reads its entries
    assert back["theirs"] == [False, False, False]  # the v2 entry is a miss for v3 (the others never existed)
    assert back["other"]["older"] >= 1 and back["ok"]


def test_an_older_releases_entries_are_misses_and_left_to_eviction(tmp_path):
    folder = tmp_path / "shared"
    assert _child(folder, 1, "write") == "ok"  # as an older release would have written them
    with PromptStore(folder, memory_bytes=0) as s:
        assert all(s.get(s.key("t", f"v1-{i}")) is None for i in range(3))
        report = s.verify()
        assert report["ok"] and report["other_versions"] == {"newer": 0, "older": 3}
        s.gc(all_namespaces=True)
        assert len(s.ls()) == 3
    with PromptStore(folder, memory_bytes=0, disk_bytes=4096) as small:
        for i in range(40):  # eviction takes them like any entry: never hit, they go early
            small.put(small.key("t", f"new-{i}"), {"x": np.full(64, i, np.float32)}, kind="t", cost_s=0.01)
        keys = {small.key("t", f"v1-{i}") for i in range(3)}
        assert not keys & {i.key for i in small.ls()}


def test_a_corrupt_version_field_is_corruption_not_a_version(tmp_path):
    from promptstore._codec import decode, encode, prepare
    from promptstore.errors import CorruptEntryError, EntryVersionError

    blob = bytes(encode(prepare(b"k" * 32, {"x": np.ones(2, np.float32)}, kind="t")))
    for bad, err in ((b'"version":"2"', None), (b'"version":"x"', CorruptEntryError), (b'"version":"9"', EntryVersionError)):
        data = blob.replace(b'"version":"2"', bad)
        if err is None:
            assert decode(data).kind == "t"
            continue
        try:
            decode(data)
        except err:
            pass
        else:
            raise AssertionError(f"{bad!r} decoded")
