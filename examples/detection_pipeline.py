"""A detection pipeline whose class prompts come from the store.

    python examples/detection_pipeline.py [IMAGE] [--names forklift pallet ...]

Uses pretrained files when they are on disk (``yoloe-11s-seg.pt``, ``mobileclip_blt.ts`` in the
working folder or ultralytics' weights folder); otherwise YOLOE from its yaml and MobileCLIP2-B
from open_clip, both with random weights: the real compute and cost, but the detections of an
untrained model (usually none).
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from typing import Any

WAREHOUSE = ["forklift", "pallet", "cardboard box", "safety vest", "hard hat", "person", "pallet jack", "shelf",
             "ladder", "truck", "bus", "fire extinguisher"]


def _weights(name: str) -> Path | None:
    from ultralytics.utils import WEIGHTS_DIR

    return next((p for p in (Path(name), Path(WEIGHTS_DIR) / name) if p.is_file()), None)


def build_detector() -> tuple[Any, Any, str]:
    """(model, encoder, description): pretrained files when present, else real architectures, random weights."""
    import torch
    from ultralytics import YOLOE

    from promptstore.vision import OpenCLIPTextEncoder, UltralyticsTextEncoder

    pt, ts = _weights("yoloe-11s-seg.pt"), _weights("mobileclip_blt.ts")
    if pt is not None:
        model, what = YOLOE(str(pt)), f"pretrained {pt}"
    else:
        torch.manual_seed(0)
        model, what = YOLOE("yoloe-11s-seg.yaml"), "yoloe-11s-seg.yaml with random weights (no yoloe-11s-seg.pt on disk)"
    if ts is not None:
        encoder, enc = UltralyticsTextEncoder("mobileclip:blt", weights=ts), f"pretrained {ts}"
    else:
        encoder, enc = OpenCLIPTextEncoder("MobileCLIP2-B", seed=0), "MobileCLIP2-B with random weights (no mobileclip_blt.ts)"
    return model, encoder, f"detector: {what}; text encoder: {enc}"


def main() -> None:
    from ultralytics.utils import ASSETS

    from promptstore import PromptStore
    from promptstore.vision import set_classes

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("image", nargs="?", default=str(ASSETS / "bus.jpg"))
    parser.add_argument("--names", nargs="+", default=WAREHOUSE)
    args = parser.parse_args()
    model, encoder, what = build_detector()
    print(what)
    t0 = time.perf_counter()
    report = set_classes(model, args.names, store=PromptStore(), encoder=encoder)
    print(f"set_classes: {(time.perf_counter() - t0) * 1000:.0f} ms, {report.hits} hits, {report.misses} encoded, "
          f"encoder loaded: {report.encoder_loaded}")
    result = model.predict(args.image, verbose=False, conf=0.25)[0]
    print(f"{len(result.boxes)} boxes on {Path(args.image).name}")
    for box in result.boxes:
        print(f"  {result.names[int(box.cls)]:<16} {float(box.conf):.2f}  {[round(v) for v in box.xyxy[0].tolist()]}")


if __name__ == "__main__":
    main()
