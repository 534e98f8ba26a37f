"""Bundles: move entries between folders; a bad bundle changes nothing."""

from __future__ import annotations

import json
import struct
import tracemalloc
import zipfile

import numpy as np
import pytest

from promptstore import PromptStore
from promptstore.errors import BundleError, FormatVersionError, InvalidInputError

from conftest import assert_same_tensors


def arr(i: int) -> np.ndarray:
    return np.random.default_rng(i).standard_normal(32).astype(np.float32)


@pytest.fixture
def filled(tmp_path):
    s = PromptStore(tmp_path / "src", memory_bytes=0)
    chain = [s.key("llm.kv", f"block{i}") for i in range(4)]
    for i, k in enumerate(chain):
        s.put(k, {"k": arr(i), "v": arr(100 + i)}, kind="llm.kv", cost_s=0.1, parent=chain[i - 1] if i else None)
    names = [s.key("vision.text", n) for n in ("cat", "dog", "forklift")]
    for i, k in enumerate(names):
        s.put(k, {"emb": arr(200 + i)}, kind="vision.text", cost_s=0.05, meta={"name": str(i)}, ttl_s=3600.0)
    yield s, chain, names
    s.close()


def contents(store: PromptStore) -> dict:
    return {i.key: (i.kind, i.parent) for i in store.ls()}


def test_roundtrip_moves_everything(tmp_path, filled):
    src, chain, names = filled
    bundle = tmp_path / "all.psb"
    assert src.export_bundle(bundle) == 7
    with PromptStore(tmp_path / "dst", memory_bytes=0) as dst:
        assert dst.import_bundle(bundle) == 7
        assert contents(dst) == contents(src)
        for i, k in enumerate(chain):
            assert_same_tensors(dst.get(k).tensors, {"k": arr(i), "v": arr(100 + i)})
        e = dst.get(names[2])
        assert e.meta == {"name": "2"} and e.ttl_s == 3600.0 and e.cost_s == 0.05
        assert dst.verify()["ok"]
        dst.delete(chain[0])  # chain links survived the trip
        assert all(k not in dst for k in chain)


def test_export_by_kind_and_by_key_brings_ancestors(tmp_path, filled):
    src, chain, names = filled
    assert src.export_bundle(tmp_path / "v.psb", kind="vision.text") == 3
    assert src.export_bundle(tmp_path / "k.psb", keys=[chain[2].hex()]) == 3  # block 2 and its 2 ancestors
    with zipfile.ZipFile(tmp_path / "k.psb") as zf:
        manifest = json.loads(zf.read("manifest.json"))
    assert [e["key"] for e in manifest["entries"]] == [k.hex() for k in chain[:3]]  # parents first


def test_bundle_bytes_are_reproducible(tmp_path, filled):
    src, _, _ = filled
    src.export_bundle(tmp_path / "a.psb", kind="llm.kv")
    src.export_bundle(tmp_path / "b.psb", kind="llm.kv")
    with zipfile.ZipFile(tmp_path / "a.psb") as a, zipfile.ZipFile(tmp_path / "b.psb") as b:
        for name in a.namelist():
            if name != "manifest.json":
                assert a.read(name) == b.read(name)


def corrupt_variants(good: bytes, tmp_path):
    with zipfile.ZipFile(tmp_path / "good.psb") as zf:
        manifest = json.loads(zf.read("manifest.json"))
        members = {n: zf.read(n) for n in zf.namelist()}

    def rezip(name, members, manifest_obj):
        p = tmp_path / name
        with zipfile.ZipFile(p, "w") as out:
            for n, data in members.items():
                if n != "manifest.json":
                    out.writestr(n, data)
            out.writestr("manifest.json", json.dumps(manifest_obj))
        return p

    first = manifest["entries"][0]["key"]
    name0 = f"entries/{first}.safetensors"
    flipped = dict(members)
    flipped[name0] = members[name0][:-1] + bytes([members[name0][-1] ^ 1])
    missing = {n: d for n, d in members.items() if n != name0}
    newer = dict(manifest, version=2)
    wrong_sum = json.loads(json.dumps(manifest))
    wrong_sum["entries"][-1]["xxh3_128"] = "0" * 32
    dup = json.loads(json.dumps(manifest))
    dup["entries"].append(dup["entries"][0])
    traversal = json.loads(json.dumps(manifest))
    traversal["entries"][0]["key"] = "../../../etc/passwd"
    truncated = tmp_path / "truncated.psb"
    truncated.write_bytes(good[: len(good) // 2])
    notzip = tmp_path / "notzip.psb"
    notzip.write_bytes(b"PK\x03\x04 but not really a zip" * 10)
    return [
        ("bzip2 manifest lying about its size", bomb(tmp_path, members, manifest), BundleError),
        ("flipped byte", rezip("flipped.psb", flipped, manifest), BundleError),
        ("missing member", rezip("missing.psb", missing, manifest), BundleError),
        ("newer format", rezip("newer.psb", members, newer), FormatVersionError),
        ("wrong checksum", rezip("sum.psb", members, wrong_sum), BundleError),
        ("duplicate key", rezip("dup.psb", members, dup), BundleError),
        ("path traversal key", rezip("trav.psb", members, traversal), BundleError),
        ("no manifest", rezip("noman.psb", {n: d for n, d in members.items()}, {"format": "other"}), BundleError),
        ("truncated", truncated, BundleError),
        ("not a zip", notzip, BundleError),
    ]


def bomb(tmp_path, members, manifest):
    """A bzip2 manifest that inflates to 64 MiB while its headers claim the size of the real JSON."""
    text = json.dumps(manifest).encode()
    p = tmp_path / "bomb.psb"
    with zipfile.ZipFile(p, "w") as out:
        for n, data in members.items():
            if n != "manifest.json":
                out.writestr(n, data)
        out.writestr("manifest.json", text + b" " * (64 << 20), compress_type=zipfile.ZIP_BZIP2)
        offset = out.getinfo("manifest.json").header_offset
    raw = bytearray(p.read_bytes())
    size = struct.pack("<I", len(text))
    raw[offset + 22 : offset + 26] = size
    central = raw.rindex(b"PK\x01\x02")  # the manifest was written last: the last central record
    assert raw[central + 46 : central + 59] == b"manifest.json"
    raw[central + 24 : central + 28] = size
    p.write_bytes(raw)
    with zipfile.ZipFile(p) as zf:
        assert zf.getinfo("manifest.json").file_size == len(text)
    return p


def test_bad_bundles_change_nothing(tmp_path, filled):
    src, _, _ = filled
    src.export_bundle(tmp_path / "good.psb")
    good = (tmp_path / "good.psb").read_bytes()
    with PromptStore(tmp_path / "dst", memory_bytes=0) as dst:
        dst.put(dst.key("t", "mine"), {"x": arr(9)}, kind="t")
        before = contents(dst)
        for label, path, error in corrupt_variants(good, tmp_path):
            with pytest.raises(error):
                dst.import_bundle(path)
            assert contents(dst) == before, label
        assert dst.verify()["ok"]
        assert not list((tmp_path).glob("etc"))


def test_compressed_manifest_is_refused_before_it_is_inflated(tmp_path, filled):
    src, _, _ = filled
    src.export_bundle(tmp_path / "good.psb")
    with zipfile.ZipFile(tmp_path / "good.psb") as zf:
        members = {n: zf.read(n) for n in zf.namelist()}
    path = bomb(tmp_path, members, json.loads(members["manifest.json"]))
    with PromptStore(tmp_path / "dst", memory_bytes=0) as dst:
        tracemalloc.start()
        try:
            with pytest.raises(BundleError, match="compressed"):
                dst.import_bundle(path)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < 8 << 20, f"{peak / 2**20:.0f} MiB allocated while refusing a 64 MiB bomb"
        assert dst.ls() == []


def test_bundle_of_another_namespace_is_refused(tmp_path, filled):
    src, _, _ = filled
    src.export_bundle(tmp_path / "b.psb")
    with PromptStore(tmp_path / "dst", memory_bytes=0, namespace="tenant") as dst:
        with pytest.raises(BundleError, match="namespace"):
            dst.import_bundle(tmp_path / "b.psb")
        assert dst.ls() == []


@pytest.mark.parametrize("where", ["", ".", "..", "folder"])
def test_export_to_a_path_that_names_no_file(tmp_path, filled, where, monkeypatch):
    """Found by the CLI fuzzer: `promptstore export ''` raised a bare ValueError from pathlib."""
    src, _, _ = filled
    monkeypatch.chdir(tmp_path)
    (tmp_path / "folder").mkdir()
    with pytest.raises(InvalidInputError, match="must name a file"):
        src.export_bundle(where)
    assert not list(tmp_path.rglob("*.partial"))  # this test's folder only: others may be writing beside it


@pytest.mark.parametrize("memory", ["16MiB", 0])
def test_hits_travel_with_a_bundle_and_merge_on_reimport(tmp_path, memory):
    """Issue #11: re-importing reset 4 hits to 1. Now they travel, and merge with the larger count."""
    with PromptStore(tmp_path / "a", memory_bytes=memory) as a:
        key = a.key("t", "hot")
        a.put(key, {"x": np.ones(4, np.float32)}, kind="t", cost_s=0.25)
        for _ in range(3):
            a.get(key)
        assert {i.hits for i in a.ls()} == {4}
        a.export_bundle(tmp_path / "b.zip")
        a.import_bundle(tmp_path / "b.zip")
        assert max(i.hits for i in a.ls()) == 4  # neither reset nor doubled
    with PromptStore(tmp_path / "elsewhere", memory_bytes=memory) as b:
        b.import_bundle(tmp_path / "b.zip")
        (info,) = b.ls()
        assert info.hits == 4 and info.cost_s == 0.25
