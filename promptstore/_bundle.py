"""Bundles: any set of entries in one file, to move a cache between folders or machines.

A bundle is an uncompressed zip (inspect it with ``unzip -l``) holding ``manifest.json``
and one ``entries/<key hex>.safetensors`` per entry, byte for byte the entry files of the
disk tier. Import never extracts anything to disk by member name: it reads each member,
checks it against the manifest and its own checksum, and hands it to the store. Every
entry is verified before the first one is stored, so a bad bundle changes nothing.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import time
import zipfile
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import xxhash
from tqdm import tqdm

from ._codec import decode
from ._entry import Entry
from ._keys import coerce_key
from .errors import BundleError, CorruptEntryError, EntryVersionError, FormatVersionError, InvalidInputError, InvalidKeyError

if TYPE_CHECKING:
    from ._store import PromptStore

__all__ = ["BUNDLE_VERSION", "export_bundle", "import_bundle"]

BUNDLE_FORMAT = "promptstore-bundle"
BUNDLE_VERSION = 1
MANIFEST = "manifest.json"
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
_FIXED_TIME = (1980, 1, 1, 0, 0, 0)  # reproducible bundles: no wall-clock times inside


def _member(key_hex: str) -> str:
    return f"entries/{key_hex}.safetensors"


def _select(store: PromptStore, keys: Iterable[Any] | None, kind: str | None) -> tuple[list[bytes], dict[bytes, int]]:
    infos = {i.key: i for i in store.ls()}
    if keys is None:
        chosen = [k for k, i in infos.items() if kind is None or i.kind == kind]
    else:
        chosen = [coerce_key(k) for k in keys]
        chosen = [k for k in chosen if k in infos and (kind is None or infos[k].kind == kind)]
    selected: dict[bytes, int] = {}

    def depth(k: bytes) -> int:
        d, p, seen = 0, infos[k].parent, {k}
        while p is not None and p in infos and p not in seen:
            seen.add(p)
            d, p = d + 1, infos[p].parent
        return d

    for k in chosen:
        # A chained entry is useless without its ancestors: they come along.
        node: bytes | None = k
        while node is not None and node in infos and node not in selected:
            selected[node] = depth(node)
            node = infos[node].parent
    return sorted(selected, key=lambda k: (selected[k], k)), {k: infos[k].hits for k in selected}


def export_bundle(store: PromptStore, path: str | os.PathLike[str], keys: Iterable[Any] | None = None,
                  kind: str | None = None) -> int:
    """See :meth:`PromptStore.export_bundle`."""
    if not isinstance(path, (str, os.PathLike)) or Path(path).name in ("", "..") or Path(path).is_dir():
        raise InvalidInputError(f"a bundle path must name a file, got {path!r}")
    path = Path(path)
    order, hits = _select(store, keys, kind)
    tmp = path.with_name(f".{path.name}.{os.getpid()}-{secrets.token_hex(4)}.partial")
    manifest: list[dict[str, Any]] = []
    try:
        with zipfile.ZipFile(tmp, "w", compression=zipfile.ZIP_STORED, allowZip64=True) as zf:
            for key in tqdm(order, desc="promptstore: exporting", unit="entry", disable=None, leave=False):
                entry = store.peek(key)
                if entry is None:
                    continue  # evicted since it was listed
                data = memoryview(entry.blob).cast("B")
                info = zipfile.ZipInfo(_member(entry.hex), date_time=_FIXED_TIME)
                info.file_size = data.nbytes
                with zf.open(info, "w", force_zip64=data.nbytes > 2**31) as out:
                    out.write(data)
                manifest.append({
                    "key": entry.hex, "kind": entry.kind, "namespace": entry.namespace,
                    "parent": entry.parent.hex() if entry.parent else None, "size": data.nbytes,
                    "xxh3_128": xxhash.xxh3_128_hexdigest(data), "hits": hits.get(key, 1),
                })
            body = {"format": BUNDLE_FORMAT, "version": BUNDLE_VERSION, "created": time.time(), "entries": manifest}
            zf.writestr(zipfile.ZipInfo(MANIFEST, date_time=_FIXED_TIME), json.dumps(body, indent=1))
        os.replace(tmp, path)
    finally:
        with contextlib.suppress(FileNotFoundError):
            tmp.unlink()
    return len(manifest)


def _manifest(zf: zipfile.ZipFile, limit: int) -> list[dict[str, Any]]:
    try:
        info = zf.getinfo(MANIFEST)
    except KeyError:
        raise BundleError("not a promptstore bundle: no manifest.json") from None
    if info.file_size > MAX_MANIFEST_BYTES or info.file_size > limit or info.compress_type != zipfile.ZIP_STORED:
        # We write it stored. A compressed manifest whose header lies about its size would be
        # inflated whole before zipfile truncates it (bzip2/LZMA have no output bound): a bomb.
        raise BundleError("manifest.json is implausibly large or compressed")
    try:
        body = json.loads(zf.read(MANIFEST))
    except Exception as exc:  # noqa: BLE001 - any failure to read the manifest is a bad bundle
        raise BundleError(f"manifest.json is unreadable: {type(exc).__name__}: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != BUNDLE_FORMAT:
        raise BundleError("not a promptstore bundle (manifest format)")
    version = body.get("version")
    if not isinstance(version, int) or isinstance(version, bool):
        raise BundleError(f"bundle version {version!r} is not an integer")
    if version > BUNDLE_VERSION:
        raise FormatVersionError(
            f"bundle format {version} is newer than this promptstore reads ({BUNDLE_VERSION}); upgrade promptstore"
        )
    entries = body.get("entries")
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise BundleError("manifest entries must be a list of objects")
    seen: set[str] = set()
    for e in entries:
        try:
            key_hex, size, digest = e["key"], e["size"], e["xxh3_128"]
            coerce_key(key_hex)
        except (KeyError, InvalidKeyError) as exc:
            raise BundleError(f"malformed manifest entry {e!r}: {exc}") from None
        if not isinstance(size, int) or isinstance(size, bool) or size < 0 or not isinstance(digest, str):
            raise BundleError(f"malformed manifest entry {e!r}")
        hits = e.get("hits", 1)  # bundles written before hits travelled have none
        if not isinstance(hits, int) or isinstance(hits, bool) or not 0 <= hits < 2**62:
            raise BundleError(f"malformed hit count in manifest entry {e!r}")
        if key_hex in seen:
            raise BundleError(f"key {key_hex} appears twice in the manifest")
        seen.add(key_hex)
    return entries


def _read_entry(zf: zipfile.ZipFile, item: dict[str, Any], limit: int) -> Entry:
    name = _member(item["key"])
    try:
        info = zf.getinfo(name)
    except KeyError:
        raise BundleError(f"entry {item['key'][:16]}… is listed but missing") from None
    if info.compress_type != zipfile.ZIP_STORED or info.file_size != item["size"] or info.file_size > limit:
        # Stored, never compressed, and no bigger than the bundle file: a lying header
        # cannot make the import allocate more memory than the bundle's own size.
        raise BundleError(f"entry {item['key'][:16]}… has the wrong size or compression")
    try:
        data = zf.read(name)
    except Exception as exc:  # noqa: BLE001 - any failure to read a member is a bad bundle
        raise BundleError(f"entry {item['key'][:16]}… is unreadable: {type(exc).__name__}: {exc}") from None
    if len(data) != item["size"] or xxhash.xxh3_128_hexdigest(data) != item["xxh3_128"]:
        raise BundleError(f"entry {item['key'][:16]}… fails its manifest checksum")
    try:
        entry = decode(data, expect_key=bytes.fromhex(item["key"]))
    except EntryVersionError as exc:
        if exc.newer:
            raise FormatVersionError(f"entry {item['key'][:16]}… has {exc}: upgrade promptstore") from None
        raise BundleError(f"entry {item['key'][:16]}… has {exc}, which this promptstore does not read") from None
    except CorruptEntryError as exc:
        raise BundleError(f"entry {item['key'][:16]}… is corrupt: {exc}") from None
    return entry


def import_bundle(store: PromptStore, path: str | os.PathLike[str]) -> int:
    """See :meth:`PromptStore.import_bundle`."""
    try:
        zf = zipfile.ZipFile(path)
    except Exception as exc:  # noqa: BLE001 - zipfile also raises NotImplementedError, struct.error... (fuzzing found them)
        raise BundleError(f"{path} is not a readable bundle: {type(exc).__name__}: {exc}") from None
    with zf:
        limit = os.path.getsize(path)  # no member may claim more bytes than the bundle holds
        entries = _manifest(zf, limit)
        # Pass 1 verifies everything and keeps nothing in memory; pass 2 stores.
        for item in tqdm(entries, desc="promptstore: verifying bundle", unit="entry", disable=None, leave=False):
            entry = _read_entry(zf, item, limit)
            if entry.namespace != store.namespace:
                raise BundleError(
                    f"bundle holds entries of namespace {entry.namespace!r}; this store is "
                    f"namespace {store.namespace!r}"
                )
        # Hits travel with the entries and merge with what is already stored (the larger
        # count: a re-import of the same entries neither resets nor doubles them).
        held = {i.key: i.hits for i in store.ls()}
        n = 0
        for item in tqdm(entries, desc="promptstore: importing", unit="entry", disable=None, leave=False):
            entry = _read_entry(zf, item, limit)
            entry.hits = max(item.get("hits", 1), held.get(entry.key, 0))
            n += store.put_entry(entry, persistent_only=True)
    return n
