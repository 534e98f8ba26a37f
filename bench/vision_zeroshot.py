"""Zero-shot classifiers and OWL text queries from the store: cold, warm in a fresh process, one new template.

    python bench/vision_zeroshot.py [--model ViT-B-32] [--classes 1000] [--templates 80] [--owl-queries 80]

Random-init towers of real size (no hub here). For the classifier, side by side:
  open_clip          open_clip.build_zero_shot_classifier (what every process pays today)
  cold               zero_shot_classifier on an empty store (encodes and stores every prompt)
  warm, fresh process  a new process builds the model (not timed), then zero_shot_classifier:
                     tower fingerprint, one read of the stored classifier
  new template       one template added to the warm classifier: prompts encoded, seconds
With --cold-classes N < --classes, open_clip's build and the cold build run on the first N
classes only and are scaled to --classes linearly (said so in the output): 80,000 prompts take
hours on two cores. The warm figure is then for the N-class classifier as well, and the row says so.
For OWL (OWLv2 B/16 size, 960 px): the plain call with --owl-queries text queries against
owl_detect with those queries warm; text-tower rows run per image.
Writes vision_zeroshot.json. Not a test.
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
from _common import machine  # noqa: E402

CHILD = r"""
import sys, time, json, torch, open_clip
from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES
from promptstore import PromptStore
from promptstore.vision import zero_shot_classifier
name, classes, templates, folder, device = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4], sys.argv[5]
if device == "cpu":
    torch.set_num_threads(2)
torch.manual_seed(0)
model = open_clip.create_model(name, pretrained=None).eval().to(device)
tok = open_clip.get_tokenizer(name)
rows = []
model.token_embedding.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
t0 = time.perf_counter()
w = zero_shot_classifier(model, tok, list(IMAGENET_CLASSNAMES[:classes]), list(OPENAI_IMAGENET_TEMPLATES[:templates]),
                         device=device, store=PromptStore(folder))
print(json.dumps({"seconds": time.perf_counter() - t0, "encoded": sum(rows), "shape": list(w.shape)}))
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="ViT-B-32")
    parser.add_argument("--classes", type=int, default=1000)
    parser.add_argument("--cold-classes", type=int, default=20, help="classes open_clip's and the cold build run on")
    parser.add_argument("--templates", type=int, default=80)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--owl-queries", type=int, default=80)
    parser.add_argument("--owl-images", type=int, default=3)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = parser.parse_args()

    import open_clip
    import torch
    from open_clip import IMAGENET_CLASSNAMES, OPENAI_IMAGENET_TEMPLATES, build_zero_shot_classifier

    from promptstore import PromptStore
    from promptstore.vision import zero_shot_classifier

    if args.device == "cpu":
        torch.set_num_threads(2)
    torch.manual_seed(0)
    model = open_clip.create_model(args.model, pretrained=None).eval().to(args.device)
    tok = open_clip.get_tokenizer(args.model)
    n = min(args.cold_classes, args.classes)
    classes, templates = list(IMAGENET_CLASSNAMES[:n]), list(OPENAI_IMAGENET_TEMPLATES[: args.templates])
    scale = args.classes / n
    folder = tempfile.mkdtemp(prefix="ps-zs-")
    t0 = time.perf_counter()
    ref = build_zero_shot_classifier(model, tok, classes, templates, device=args.device)
    if args.device != "cpu":
        torch.cuda.synchronize()
    open_clip_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    with PromptStore(folder) as store:
        cold = zero_shot_classifier(model, tok, classes, templates, device=args.device, store=store)
    cold_s = time.perf_counter() - t0
    diff = (cold - ref).abs().max().item()
    print(f"{n} classes x {len(templates)} templates: open_clip {open_clip_s:.1f} s, cold {cold_s:.1f} s "
          f"(max diff {diff:.1e})", flush=True)
    warm = []
    for _ in range(args.repeats):
        out = subprocess.run([sys.executable, "-c", CHILD, args.model, str(n), str(len(templates)), folder, args.device],
                             capture_output=True, text=True, cwd=tempfile.gettempdir())  # not a checkout's promptstore/
        if out.returncode:
            raise SystemExit(f"the fresh process failed:\n{out.stderr[-3000:]}")
        warm.append(json.loads(out.stdout.splitlines()[-1]))
    assert all(w["encoded"] == 0 for w in warm)
    warm_s = statistics.median(w["seconds"] for w in warm)
    extra = [OPENAI_IMAGENET_TEMPLATES[args.templates % len(OPENAI_IMAGENET_TEMPLATES)]] if args.templates < 80 else \
        [lambda c: f"a photo of a {c} in a warehouse."]  # open_clip's templates are callables: so is this one
    rows = []
    model.token_embedding.register_forward_hook(lambda m, a, o: rows.append(a[0].shape[0]))
    t0 = time.perf_counter()
    with PromptStore(folder) as store:
        zero_shot_classifier(model, tok, classes, templates + extra, device=args.device, store=store)
    new_template_s, new_template_encoded = time.perf_counter() - t0, sum(rows)
    zs = {"model": args.model, "device": args.device, "classes": args.classes, "measured_classes": n, "templates": len(templates),
          "open_clip_s": open_clip_s * scale, "cold_s": cold_s * scale, "warm_fresh_s": warm_s,
          "warm_measured_classes": n, "new_template_s": new_template_s * scale,
          "new_template_encoded": int(new_template_encoded * scale), "max_diff": diff,
          "scaled": scale != 1, "speedup": open_clip_s * scale / warm_s}
    print(json.dumps(zs), flush=True)
    owl = owl_bench(args.owl_queries, args.owl_images, 1) if args.owl_queries else None
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / ("vision_zeroshot.json" if args.device == "cpu" else f"vision_zeroshot_{args.device}.json")
    path.write_text(json.dumps({"machine": machine(), "zero_shot": zs, "owl": owl}, indent=1))
    print(f"wrote {path}")


def owl_bench(n_queries: int, n_images: int, repeats: int) -> dict:
    """OWLv2 B/16 size: the plain call against owl_detect with a warm vocabulary, per image."""
    import numpy as np
    import torch
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    from promptstore import PromptStore
    from promptstore.vision import owl_detect

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
    from test_owl import clip_tokenizer_in  # noqa: E402 - the offline CLIP tokenizer the tests build

    torch.manual_seed(0)
    model = Owlv2ForObjectDetection(Owlv2Config(vision_config={"image_size": 960, "patch_size": 16})).eval()  # owlv2-base
    processor = Owlv2Processor(image_processor=Owlv2ImageProcessor(), tokenizer=clip_tokenizer_in(tempfile.mkdtemp()))
    from open_clip import IMAGENET_CLASSNAMES

    queries = [f"a photo of a {c}" for c in list(dict.fromkeys(IMAGENET_CLASSNAMES))[:n_queries]]
    rng = np.random.default_rng(0)
    images = [rng.integers(0, 255, (480, 640, 3), dtype=np.uint8) for _ in range(n_images)]
    text_s: list[float] = []
    base = model.owlv2
    t_start = {}
    base.text_model.register_forward_pre_hook(lambda m, a, k: t_start.__setitem__("t", time.perf_counter()),
                                              with_kwargs=True)
    base.text_model.register_forward_hook(lambda m, a, o: text_s.append(time.perf_counter() - t_start["t"]))
    plain, ours = [], []
    folder = tempfile.mkdtemp(prefix="ps-owl-")
    with PromptStore(folder) as store:
        owl_detect(model, processor, queries, images=images[:1], store=store)  # warm the vocabulary
        for _ in range(repeats):
            for image in images:
                t0 = time.perf_counter()
                inputs = processor(text=[queries], images=[image], return_tensors="pt")
                with torch.no_grad():
                    model(**inputs)
                plain.append(time.perf_counter() - t0)
        plain_text = statistics.median(text_s[1:])
        text_s.clear()
        for _ in range(repeats):
            for image in images:
                t0 = time.perf_counter()
                owl_detect(model, processor, queries, images=[image], store=store)
                ours.append(time.perf_counter() - t0)
    out = {"queries": n_queries, "plain_per_image_s": statistics.median(plain), "plain_text_tower_s": plain_text,
           "warm_per_image_s": statistics.median(ours), "warm_text_tower_runs": len(text_s)}
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
