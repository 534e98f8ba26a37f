"""The ``promptstore`` command: inspect and maintain a store folder.

    promptstore stats | ls | verify | gc | export BUNDLE | import BUNDLE  [--dir DIR] [--json]
"""

from __future__ import annotations

import argparse
import datetime as _dt
import json
import sys
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from ._sizes import format_size
from ._store import PromptStore, default_path
from .errors import InvalidInputError, PromptStoreError

__all__ = ["main", "build_parser"]


def _common(parser: argparse.ArgumentParser, suppress: bool) -> None:
    default = argparse.SUPPRESS if suppress else None
    parser.add_argument("--dir", default=default, help="store folder (default: $PROMPTSTORE_DIR or the user cache folder)")
    parser.add_argument("--namespace", default=default, help="tenant namespace (default: '')")
    parser.add_argument("--redis-url", default=default, help="also use this Redis tier (redis://host:port/db)")
    parser.add_argument("--redis-prefix", default=default, help="key prefix in Redis (default: promptstore:)")
    parser.add_argument("--json", action="store_true", default=argparse.SUPPRESS if suppress else False,
                        help="print JSON instead of text")


def open_store(args: argparse.Namespace, create: bool = False) -> PromptStore:
    """The store the common options (--dir, --namespace, --redis-url...) name, for adapter commands."""
    return _open(args, create)


def _open(args: argparse.Namespace, create: bool = False) -> PromptStore:
    path = Path(args.dir).expanduser() if args.dir else default_path()
    if not create and not path.is_dir():
        raise PromptStoreError(f"no store at {path}")
    return PromptStore(path, memory_bytes=0, namespace=args.namespace or "", redis_url=args.redis_url or None,
                       redis_prefix=args.redis_prefix or "promptstore:")


def _when(t: float | None) -> str:
    return "-" if not t else _dt.datetime.fromtimestamp(t).strftime("%Y-%m-%d %H:%M:%S")


def _tier_lines(title: str, where: str, t: dict[str, Any]) -> list[str]:
    lines = [f"{title:<6} {where}",
             f"       {_entries(t.get('entries', 0))}, {format_size(t.get('bytes', 0))} of {format_size(t.get('budget', 0))}"]
    if t.get("available") is False:
        lines.append("       unreachable")
    life = t.get("lifetime", {})
    lines.append(f"       evictions {life.get('evictions', 0)} (expired: {life.get('expirations', 0)})")
    kinds = life.get("kinds", {})
    if kinds:
        lines.append(f"       {'kind':<16}{'hits':>10}{'misses':>10}{'hit bytes':>14}{'saved':>12}")
        for kind, c in sorted(kinds.items()):
            lines.append(f"       {kind:<16}{c['hits']:>10}{c['misses']:>10}{format_size(c['hit_bytes']):>14}"
                         f"{c['seconds_saved']:>11.1f}s")
    return lines


def _cmd_stats(args: argparse.Namespace) -> tuple[Any, str, int]:
    with _open(args) as store:
        tiers = store.stats(all_namespaces=args.all_namespaces)["tiers"]
    disk = tiers.get("disk", {})
    lines = _tier_lines("disk", str(disk.get("path")), disk)
    data: dict[str, Any] = dict(disk)
    if "redis" in tiers:
        redis = tiers["redis"]
        lines += _tier_lines("redis", f"{redis.get('url')} (prefix {redis.get('prefix')})", redis)
        data["redis"] = redis
    if not args.all_namespaces:
        lines.append(f"(namespace {args.namespace or ''!r}; lifetime counters cover every namespace: --all-namespaces)")
    return data, "\n".join(lines), 0


def _cmd_ls(args: argparse.Namespace) -> tuple[Any, str, int]:
    with _open(args) as store:
        infos = store.ls(kind=args.kind, all_namespaces=args.all_namespaces)[: args.limit or None]
    rows: list[dict[str, Any]] = [{"key": i.hex, "kind": i.kind, "size": i.size, "cost_s": i.cost_s, "hits": i.hits,
             "created": i.created, "last_hit": i.last_hit, "parent": i.parent.hex() if i.parent else None,
             "expires": i.expires, "namespace": i.namespace} for i in infos]
    lines = [f"{'key':<18}{'kind':<16}{'size':>11}{'cost':>9}{'hits':>7}  last hit"]
    lines += [f"{r['key'][:16]}  {r['kind']:<16}{format_size(r['size']):>11}{r['cost_s']:>8.3f}s{r['hits']:>7}"
              f"  {_when(r['last_hit'])}" for r in rows]
    return rows, "\n".join(lines), 0


def _cmd_verify(args: argparse.Namespace) -> tuple[Any, str, int]:
    with _open(args) as store:
        report = store.verify(all_namespaces=args.all_namespaces)
    text = f"checked {_entries(report['checked'])}: " + ("ok" if report["ok"] else "PROBLEMS")
    other = report.get("other_versions", {})
    if any(other.values()):
        text += f" ({other.get('newer', 0)} of a newer and {other.get('older', 0)} of an older promptstore, left alone)"
    text += "".join(f"\n  {p}" for p in report["problems"])
    return report, text, 0 if report["ok"] else 1


def _cmd_gc(args: argparse.Namespace) -> tuple[Any, str, int]:
    with _open(args) as store:
        report = store.gc(all_namespaces=args.all_namespaces)
    disk: dict[str, Any] = next((r for r in report["tiers"] if r.get("tier") == "disk"), {})
    text = (f"expired {disk.get('expired', 0)}, evicted {disk.get('evicted', 0)}, temp files "
            f"{disk.get('temp_files', 0)}, orphan files {disk.get('orphan_files', 0)}, missing "
            f"{disk.get('missing_files', 0)}; freed {format_size(disk.get('freed_bytes', 0))}")
    return report, text, 0


def _entries(n: int) -> str:
    return f"{n} entr{'y' if n == 1 else 'ies'}"


def _resolve(store: PromptStore, prefixes: list[str]) -> list[bytes]:
    """Full keys for the hex prefixes given (as ``ls`` prints them): each must name exactly one entry."""
    keys = [i.key for i in store.ls()]
    out = []
    for p in prefixes:
        p = p.strip().lower()
        if len(p) < 8 or any(c not in "0123456789abcdef" for c in p):
            raise InvalidInputError(f"--key takes a key or a prefix of at least 8 hex characters, got {p!r}")
        found = [k for k in keys if k.hex().startswith(p)]
        if len(found) != 1:
            raise InvalidInputError(f"--key {p}: {'no entry' if not found else f'{len(found)} entries'} in this "
                                    f"namespace {'has' if not found else 'share'} that key{' prefix' if len(p) < 64 else ''}")
        out.append(found[0])
    return out


def _cmd_export(args: argparse.Namespace) -> tuple[Any, str, int]:
    with _open(args) as store:
        keys = _resolve(store, args.key) if args.key else None
        n = store.export_bundle(args.bundle, keys=keys, kind=args.kind)
    size = Path(args.bundle).stat().st_size
    return {"entries": n, "bundle": args.bundle, "bytes": size}, f"wrote {_entries(n)} ({format_size(size)}) to {args.bundle}", 0


def _cmd_import(args: argparse.Namespace) -> tuple[Any, str, int]:
    with _open(args, create=True) as store:
        n = store.import_bundle(args.bundle)
    return {"entries": n, "bundle": args.bundle}, f"imported {_entries(n)} from {args.bundle}", 0


Command = Callable[[argparse.Namespace], "tuple[Any, str, int]"]
# Adapters' commands: from entry points (see _load_adapter_commands), or registered here directly.
EXTRA_COMMANDS: dict[str, tuple[str, Callable[[argparse.ArgumentParser], None], Command]] = {}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (exposed for docs and tests)."""
    parser = argparse.ArgumentParser(prog="promptstore", description="Inspect and maintain a promptstore folder.")
    _common(parser, suppress=False)
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    def add(name: str, help_: str, fn: Command) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        _common(p, suppress=True)
        p.set_defaults(fn=fn)
        return p

    def admin(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
        p.add_argument("--all-namespaces", action="store_true",
                       help="the administrator's view: every tenant's entries (default: only --namespace's)")
        return p

    admin(add("stats", "entries, bytes, hits and misses per kind", _cmd_stats))
    p = admin(add("ls", "list entries, most recently hit first", _cmd_ls))
    p.add_argument("--kind")
    p.add_argument("--limit", type=int, default=50, help="rows to show (0: all)")
    admin(add("verify", "checksum every entry; drop broken ones (exit 1 if any)", _cmd_verify))
    admin(add("gc", "drop expired entries and leftovers of interrupted writes", _cmd_gc))
    p = add("export", "write entries to a bundle file", _cmd_export)
    p.add_argument("bundle")
    p.add_argument("--kind")
    p.add_argument("--key", action="append", help="a key, or a unique prefix of 8+ hex characters as ls prints it; repeatable")
    p = add("import", "verify a bundle, then store its entries", _cmd_import)
    p.add_argument("bundle")
    for name, (help_, configure, fn) in EXTRA_COMMANDS.items():
        configure(add(name, help_, fn))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status."""
    # A warning is one line for a person at a terminal, not a Python source excerpt.
    warnings.showwarning = _show_warning
    _load_adapter_commands()
    args = build_parser().parse_args(argv)
    try:
        data, text, code = args.fn(args)
    except (PromptStoreError, OSError) as exc:
        print(f"promptstore: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("promptstore: interrupted; finished work is stored, run the command again to continue", file=sys.stderr)
        return 130
    print(json.dumps(data, indent=1, default=str) if args.json else text)
    return int(code)


COMMANDS_GROUP = "promptstore.commands"


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    print(f"promptstore: warning: {message}", file=sys.stderr)


def _load_adapter_commands() -> None:
    """Commands that adapters declare as entry points (``promptstore.commands``), e.g. ``warm-classes``.

    The core never imports an adapter: an adapter whose extra is not installed fails to load
    and its command is simply absent.
    """
    from importlib.metadata import entry_points

    for ep in entry_points(group=COMMANDS_GROUP):
        if ep.name in EXTRA_COMMANDS:
            continue
        try:
            EXTRA_COMMANDS[ep.name] = ep.load()
        except ImportError:
            continue


if __name__ == "__main__":
    sys.exit(main())
