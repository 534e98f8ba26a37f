"""Move class prompts between machines: a bundle for promptstore, an NPZ for plain ultralytics.

    python examples/prompt_bundles.py

1. Warm the 80 COCO names into store A (encoder runs once).
2. Export them as a bundle; import it into store B (another folder, another machine): set_classes there
   hits every name and never builds the encoder.
3. Export the model's classes as ultralytics' own NPZ (YOLOE.load_prompt_embeddings reads it), and import
   an NPZ into store C.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from ultralytics import YOLOE

from promptstore import PromptStore
from promptstore.vision import OpenCLIPTextEncoder, export_npz, import_npz, set_classes
from promptstore.vision._cli import read_names


def detector() -> YOLOE:
    torch.manual_seed(0)  # the same (random) weights on both "machines"
    return YOLOE("yoloe-11s-seg.yaml")


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="promptstore-bundles-"))
    names = read_names("coco")
    a = PromptStore(work / "machine-a")
    report = set_classes(detector(), names, store=a, encoder=OpenCLIPTextEncoder("MobileCLIP2-B"))
    print(f"A: {report.misses} names encoded in {report.seconds:.1f} s")
    n = a.export_bundle(work / "coco-classes.psb", kind="vision.pe")
    print(f"A: exported {n} class embeddings to {(work / 'coco-classes.psb').name}")

    b = PromptStore(work / "machine-b")
    print(f"B: imported {b.import_bundle(work / 'coco-classes.psb')} entries")
    model = detector()
    report = set_classes(model, names, store=b, encoder=OpenCLIPTextEncoder("MobileCLIP2-B"))
    print(f"B: set_classes {report.seconds * 1000:.0f} ms, {report.hits} hits, encoder loaded: {report.encoder_loaded}")

    export_npz(model, work / "coco.npz")
    plain = detector()
    plain.load_prompt_embeddings(work / "coco.npz")  # ultralytics alone reads it
    print(f"ultralytics loaded {len(plain.model.names)} classes from coco.npz")
    c = PromptStore(work / "machine-c")
    imported = import_npz(detector(), work / "coco.npz", store=c)
    # Served only as that file's content, never as an encoder's text features for these names.
    later = set_classes(detector(), names[:5], store=c, source=imported.source)
    print(f"C: imported coco.npz as {imported.source[:16]}...; 5 of its classes set from it, "
          f"encoder loaded: {later.encoder_loaded}")


if __name__ == "__main__":
    main()
