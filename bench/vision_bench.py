"""Vision benchmark: YOLOE set_classes for 80 COCO and 1203 LVIS names, side by side in one run.

    python bench/vision_bench.py [--repeats 5] [--out bench/out]

  ultralytics-style cold path   build the text encoder, encode every name at the 77-token context, map with
                                the head (what YOLOE.set_classes does with cache_clip_model=False)
  promptstore miss path         set_classes on an empty store: build, encode length-sorted batches with the
                                context trimmed to each batch, map, store
  promptstore warm hit          set_classes in a fresh process, from the disk tier (memory tier off)
  ultralytics NPZ load          YOLOE.load_prompt_embeddings of the same classes

MobileCLIP2-B (open_clip, random weights: real shapes and cost) and YOLOE from yoloe-11s-seg.yaml.
The cold path runs once per vocabulary (it takes minutes); the rest are medians over repeats.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine, save_bar_chart  # noqa: E402


def vocabularies() -> dict[str, list[str]]:
    import ultralytics
    import yaml

    root = Path(ultralytics.__file__).parent / "cfg" / "datasets"
    out = {}
    for name, file in (("COCO 80", "coco.yaml"), ("LVIS 1203", "lvis.yaml")):
        names = yaml.safe_load((root / file).read_text())["names"]
        out[name] = list(names.values()) if isinstance(names, dict) else list(names)
    return out


def build_yoloe():
    import torch
    from ultralytics import YOLOE

    torch.manual_seed(0)
    return YOLOE("yoloe-11s-seg.yaml")


def child(args: argparse.Namespace) -> None:
    """Fresh process: warm set_classes from the disk tier, and ultralytics' NPZ load."""
    from promptstore import PromptStore
    from promptstore.vision import OpenCLIPTextEncoder, set_classes

    names = json.loads(Path(args.names).read_text())
    model = build_yoloe()
    warm, npz = [], []
    for _ in range(args.repeats):
        store = PromptStore(args.store, memory_bytes=0)
        encoder = OpenCLIPTextEncoder("MobileCLIP2-B")
        t0 = time.perf_counter()
        report = set_classes(model, names, store=store, encoder=encoder)
        warm.append(time.perf_counter() - t0)
        assert report.hits == len(names) and not report.encoder_loaded
        store.close()
        t0 = time.perf_counter()
        model.load_prompt_embeddings(args.npz)
        npz.append(time.perf_counter() - t0)
    print(json.dumps({"warm": statistics.median(warm), "npz": statistics.median(npz)}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    parser.add_argument("--only", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    parser.add_argument("--names", help=argparse.SUPPRESS)
    parser.add_argument("--npz", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    import numpy as np
    import torch

    from promptstore import PromptStore
    from promptstore.vision import OpenCLIPTextEncoder, set_classes

    info = machine()
    print(f"vision benchmark on {info['summary']}; MobileCLIP2-B text tower, YOLOE-11s-seg")
    results = {}
    for vocab, names in vocabularies().items():
        if args.only and args.only not in vocab:
            continue
        row = {"names": len(names)}
        # ultralytics-style cold path: build, then 77-token batches of 80 (its default batch)
        t0 = time.perf_counter()
        cold_encoder = OpenCLIPTextEncoder("MobileCLIP2-B", trim=False, batch=80)
        cold_encoder._build()
        row["encoder build"] = time.perf_counter() - t0
        t1 = time.perf_counter()
        feats77 = cold_encoder.encode(names)
        row["encode 77-token"] = time.perf_counter() - t1
        model = build_yoloe()
        with torch.inference_mode():
            pe77 = model.model.model[-1].get_tpe(torch.from_numpy(feats77)[None])
        row["ultralytics-style cold path"] = time.perf_counter() - t0
        del cold_encoder
        # promptstore miss path (an empty store), encoder build included
        folder = Path(tempfile.mkdtemp(prefix="ps-vision-"))
        store = PromptStore(folder)
        t0 = time.perf_counter()
        encoder = OpenCLIPTextEncoder("MobileCLIP2-B")
        report = set_classes(model, names, store=store, encoder=encoder)
        row["promptstore miss path"] = time.perf_counter() - t0
        row["miss path encode only"] = report.seconds - 0  # set_classes' own seconds (build happens inside)
        row["max |pe diff| vs 77-token"] = (model.model.pe - pe77).abs().max().item()
        assert report.misses == len(names)
        t1 = time.perf_counter()
        trimmed = encoder.encode(names)
        row["encode trimmed+sorted"] = time.perf_counter() - t1
        row["max |feature diff| trimmed vs 77"] = float(np.abs(trimmed - feats77).max())
        store.close()
        # fresh process: warm hit from disk, and ultralytics' NPZ load
        npz = folder / "classes.npz"
        model.save_prompt_embeddings(npz)
        names_file = folder / "names.json"
        names_file.write_text(json.dumps(names))
        proc = subprocess.run([sys.executable, __file__, "--child", "--store", str(folder), "--names", str(names_file),
                               "--npz", str(npz), "--repeats", str(args.repeats)], capture_output=True, text=True,
                              check=True)
        child_res = json.loads(proc.stdout.strip().splitlines()[-1])
        row["promptstore warm hit (fresh process, disk)"] = child_res["warm"]
        row["ultralytics NPZ load"] = child_res["npz"]
        results[vocab] = row
        print(f"  {vocab}: cold {row['ultralytics-style cold path']:.2f}s | miss {row['promptstore miss path']:.2f}s | "
              f"warm {row['promptstore warm hit (fresh process, disk)'] * 1000:.1f} ms | NPZ "
              f"{row['ultralytics NPZ load'] * 1000:.1f} ms | encode 77 {row['encode 77-token']:.2f}s vs trimmed "
              f"{row['encode trimmed+sorted']:.2f}s (max diff {row['max |feature diff| trimmed vs 77']:.1e})", flush=True)
    write(results, info, args)


def write(results: dict, info: dict, args: argparse.Namespace) -> None:
    lines = ["| vocabulary | ultralytics-style cold | promptstore miss | promptstore warm (fresh process) | "
             "ultralytics NPZ load | cold / warm | warm vs NPZ | encode 77-token | encode trimmed | 77 / trimmed | "
             "max feature diff |", "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for vocab, r in results.items():
        warm, npz = r["promptstore warm hit (fresh process, disk)"], r["ultralytics NPZ load"]
        lines.append(
            f"| {vocab} | {r['ultralytics-style cold path']:.2f} s | {r['promptstore miss path']:.2f} s | "
            f"{warm * 1000:.1f} ms | {npz * 1000:.1f} ms | {r['ultralytics-style cold path'] / warm:,.0f}x | "
            f"{warm / npz:.2f}x the time | {r['encode 77-token']:.2f} s | {r['encode trimmed+sorted']:.2f} s | "
            f"{r['encode 77-token'] / r['encode trimmed+sorted']:.1f}x | {r['max |feature diff| trimmed vs 77']:.1e} |")
    table = "\n".join(lines)
    print()
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vision_bench.json").write_text(json.dumps({"machine": info, "results": results, "table": table},
                                                           indent=1))
    series = {k: [results[v][k] for v in results] for k in ("ultralytics-style cold path", "promptstore miss path",
                                                             "promptstore warm hit (fresh process, disk)",
                                                             "ultralytics NPZ load")}
    save_bar_chart(args.out / "vision_bench.png", title="YOLOE set_classes (seconds, log; lower is better)",
                   groups=list(results), series=series, ylabel="seconds (log)", log=True)
    print(f"\nwrote {args.out / 'vision_bench.json'} and {args.out / 'vision_bench.png'}")


if __name__ == "__main__":
    main()
