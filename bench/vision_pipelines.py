"""Vision text prompts where users call them, plain and from the store: transformers' zero-shot pipelines
(promptstore.vision.pipeline), OmDet-Turbo (serve_omdet) and SAM 3's set_classes (serve_sam3).

    python bench/vision_pipelines.py [--repeats 3] [--processes 1] [--cases ...]
                                     [--out bench/results/vision_pipelines_<date>.json]

Random weights at the released checkpoints' sizes, with the CLIP BPE tokenizer (and for Grounding
DINO a small BERT vocabulary) built offline: the shapes and the cost are real. Grounding DINO:
Swin-T and BERT-base; OmDet-Turbo: Swin-T and CLIP's text tower, the call ``model(**processor(...))``
with a task prompt; SAM 3: ultralytics' builder (the 354M-parameter text encoder), the call
``set_classes``, compared by its text embeddings. Per model, fresh processes (the model built
before the clock starts): the plain pipeline, and the served one over a store another process
warmed with the same labels. Each times making the pipeline (or serving the model: promptstore
describes the text tower then), then its first call (the headline) and ``--repeats`` more (steady
state), on one image. With ``--processes P``, P fresh processes per mode, plain and served
alternating: two processes running the same code can differ by several percent, more than a
served call's text side weighs in most rows. Writes medians (over the processes, of each one's
first call and of its steady median); the served outputs are compared with the plain ones (labels,
scores). The library's modules run from compiled bytecode, as an installed package's do
(bench/_common.py compiles them).

The served calls' **text cost**: wall time inside promptstore's text side during the call (the
fingerprint of the live text tower, the store's reads, the rows assembled), summed over the outermost
of its entry points so nested ones count once. Its floor is zero: a call handed its text features.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(BENCH.parent / "tests"))
from _common import save_results  # noqa: E402

CASES = {
    "CLIP ViT-B/32, 10 labels": ("zero-shot-image-classification", "clip", 10),
    "SigLIP base, 10 labels": ("zero-shot-image-classification", "siglip", 10),
    "OWLv2 base, 3 labels": ("zero-shot-object-detection", "owlv2", 3),
    "Grounding DINO tiny, 3 labels": ("zero-shot-object-detection", "grounding_dino", 3),
    "OmDet-Turbo tiny, 10 classes + task": ("omdet", "omdet", 10),
    "SAM 3 set_classes, 10 prompts": ("sam3", "sam3", 10),
}
LABELS = ["a forklift", "a pallet", "a person in a hard hat", "a cardboard box", "a ladder", "a truck", "a fire extinguisher",
          "a safety cone", "a shelf", "a conveyor belt"]


def build(family: str, folder: str):
    import torch
    from transformers import (CLIPConfig, CLIPImageProcessor, CLIPModel, Owlv2Config, Owlv2ForObjectDetection,
                              Owlv2ImageProcessor, SiglipConfig, SiglipImageProcessor, SiglipModel)

    from test_owl import clip_tokenizer_in

    torch.manual_seed(0)
    if family == "grounding_dino":
        from transformers import BertTokenizer, GroundingDinoConfig, GroundingDinoForObjectDetection
        from transformers import GroundingDinoImageProcessor

        vocab = Path(folder) / "vocab.txt"
        vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", ".", "a", "an", "in", *(
            w for label in LABELS for w in label.split() if w not in ("a", "in"))]) + "\n")
        return (GroundingDinoForObjectDetection(GroundingDinoConfig()).eval(), BertTokenizer(str(vocab)),
                GroundingDinoImageProcessor())
    if family == "omdet":
        from transformers import CLIPTextConfig, DetrImageProcessor, OmDetTurboConfig, OmDetTurboForObjectDetection
        from transformers import OmDetTurboProcessor, SwinConfig

        tokenizer = clip_tokenizer_in(folder)
        tokenizer.model_max_length = 77
        # transformers' Swin backbone returns channels first, so the layer norms the timm
        # backbone's (channels-last) maps get are left out: a few thousand operations of a call's billions.
        config = OmDetTurboConfig(use_timm_backbone=False, backbone=None, text_config=CLIPTextConfig(),
                                  apply_layernorm_after_vision_backbone=False,
                                  backbone_config=SwinConfig(embed_dim=96, depths=[2, 2, 6, 2], num_heads=[3, 6, 12, 24],
                                                             out_indices=[2, 3, 4]))
        processor = OmDetTurboProcessor(image_processor=DetrImageProcessor(size={"height": 640, "width": 640}),
                                        tokenizer=tokenizer)
        return OmDetTurboForObjectDetection(config).eval(), tokenizer, processor
    if family == "sam3":
        import types

        from open_clip.tokenizer import SimpleTokenizer

        clip = types.ModuleType("clip")  # what ultralytics' SAM 3 tokenizer imports
        clip.simple_tokenizer = types.SimpleNamespace(SimpleTokenizer=SimpleTokenizer)
        sys.modules.setdefault("clip", clip)
        from ultralytics.models.sam.build_sam3 import build_sam3_image_model

        empty = Path(folder) / "random.pt"
        torch.save({"model": {}}, empty)
        model = build_sam3_image_model(str(empty))
        with torch.no_grad():  # created empty (the checkpoint fills it)
            torch.nn.init.normal_(model.backbone.language_backbone.encoder.positional_embedding, std=0.01)
            encoder = model.backbone.language_backbone.encoder
            torch.nn.init.normal_(encoder.text_projection, std=encoder.text_projection.shape[0] ** -0.5)
        return model.eval(), None, None
    tokenizer = clip_tokenizer_in(folder)
    if family == "clip":
        tokenizer.model_max_length = 77
        return CLIPModel(CLIPConfig()).eval(), tokenizer, CLIPImageProcessor()
    if family == "siglip":
        tokenizer.model_max_length = 64
        return (SiglipModel(SiglipConfig(text_config={"vocab_size": 49408})).eval(), tokenizer,
                SiglipImageProcessor())
    # owlv2-base-patch16-ensemble: ViT-B/16 at 960 pixels, as its image processor resizes
    return Owlv2ForObjectDetection(Owlv2Config(vision_config={"image_size": 960})).eval(), tokenizer, Owlv2ImageProcessor()


def save(family: str, folder: Path) -> Path | None:
    """The model, tokenizer and processor saved as transformers saves them (a hub checkpoint's form), or None
    where the model does not load that way (SAM 3: ultralytics' builder)."""
    if family == "sam3":
        return None
    model, tokenizer, images = build(family, tempfile.mkdtemp())
    where = folder / "model"
    model.save_pretrained(where)
    tokenizer.save_pretrained(where)
    images.save_pretrained(where)
    return where


def load(family: str, where: str):
    """What a user's process holds after ``from_pretrained``: the weights mapped from the saved files."""
    import transformers

    cls = getattr(transformers, transformers.AutoConfig.from_pretrained(where).architectures[0])
    model = cls.from_pretrained(where).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(where)
    images = (transformers.OmDetTurboProcessor if family == "omdet" else transformers.AutoImageProcessor).from_pretrained(where)
    return model, tokenizer, images


def text_side_timer() -> list[float]:
    """Time promptstore's text side from now on (see the module docstring): the seconds, in a one-item list."""
    import functools
    import threading

    from promptstore import PromptStore
    from promptstore.vision import _omdet, _pipelines, _sam3

    spent, depth = [0.0], threading.local()

    def wrap(owner: object, name: str) -> None:
        fn = getattr(owner, name)

        @functools.wraps(fn)
        def timed(*args, **kwargs):
            level = getattr(depth, "n", 0)
            depth.n = level + 1
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                depth.n = level
                if level == 0:
                    spent[0] += time.perf_counter() - t0

        setattr(owner, name, timed)

    for owner, name in [(PromptStore, "get"), (_pipelines._TextSide, "fingerprint"), (_pipelines._TextSide, "pooled"),
                        (_pipelines, "_read"), (_omdet._Backbone, "new_call"), (_omdet._Backbone, "fingerprint"),
                        (_omdet._StoredCache, "has"), (_omdet._StoredCache, "get"), (_sam3._Sam3Text, "set_classes")]:
        wrap(owner, name)
    return spent


def child(args: argparse.Namespace) -> None:
    import numpy as np
    import torch
    from PIL import Image
    from transformers import pipeline as transformers_pipeline

    from promptstore import PromptStore
    from promptstore.vision import pipeline

    torch.set_num_threads(args.threads)
    task, family, n = CASES[args.case]
    model, tokenizer, images = load(family, args.model) if args.model else build(family, tempfile.mkdtemp())
    picture = Image.fromarray(np.random.default_rng(0).integers(0, 255, (480, 640, 3), dtype=np.uint8))
    text = text_side_timer() if args.mode == "served" else [0.0]
    with PromptStore(args.store) as store:
        served = args.mode == "served"
        set_up = time.perf_counter()
        if task == "omdet":
            from promptstore.vision import serve_omdet

            detector = serve_omdet(model, store) if served else model
            set_up = time.perf_counter() - set_up
            batch = images(images=[picture], text=[LABELS[:n]], task=["Detect {}.".format(", ".join(LABELS[:n]))],
                           return_tensors="pt")

            def pipe(_):
                with torch.no_grad():
                    out = detector(**batch)
                return {"logits": out.decoder_class_logits.flatten()[:50].tolist(),
                        "boxes": out.decoder_coord_logits.flatten()[:50].tolist()}
        elif task == "sam3":
            from promptstore.vision import serve_sam3

            sam = serve_sam3(model, store) if served else model
            set_up = time.perf_counter() - set_up

            def pipe(_):
                sam.set_classes(LABELS[:n])
                return {k: v.float().flatten()[:50].tolist() for k, v in sorted(sam.text_embeddings.items())}
        else:
            kwargs = dict(model=model, tokenizer=tokenizer, image_processor=images)
            call = dict(candidate_labels=LABELS[:n], **({"threshold": 0.0, "top_k": 10} if "detection" in task else {}))
            made = pipeline(task, store=store, **kwargs) if served else transformers_pipeline(task, **kwargs)
            set_up = time.perf_counter() - set_up

            def pipe(image):
                return made(image, **call)
        times, texts, outputs = [], [], []
        for _ in range(1 + args.repeats):
            text[0] = 0.0
            t0 = time.perf_counter()
            outputs.append(pipe(picture))
            times.append(time.perf_counter() - t0)
            texts.append(text[0])
    print(json.dumps({"set_up": set_up, "first": times[0], "steady": times[1:], "text_first": texts[0], "text_steady": texts[1:],
                      "output": outputs[0]}))


def run(args: argparse.Namespace, case: str, mode: str, store: Path, model: Path | None) -> dict:
    cmd = [sys.executable, __file__, "--child", "--case", case, "--mode", mode, "--store", str(store), "--repeats",
           str(args.repeats), "--threads", str(args.threads), *(["--model", str(model)] if model else [])]
    # The case's own digest memo: the warming process hashes the weights' files once, as a user's first process does.
    env = {**os.environ, "PROMPTSTORE_DIGESTS": str(store.parent / "digests.sqlite3")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"child failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def close(a: list[dict] | dict, b: list[dict] | dict) -> bool:
    if isinstance(a, dict):  # raw outputs: lists of floats per name
        return a.keys() == b.keys() and all(abs(x - y) <= 1e-5 for k in a for x, y in zip(a[k], b[k], strict=True))
    return [x["label"] for x in a] == [x["label"] for x in b] and all(
        abs(x["score"] - y["score"]) <= 1e-5 and x.get("box") == y.get("box") for x, y in zip(a, b, strict=True))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--processes", type=int, default=1,
                        help="fresh processes per mode (plain and served, alternating): medians over them, since two "
                             "processes running the same code can differ by several percent")
    parser.add_argument("--cases", nargs="+", default=list(CASES), help="which rows (default: all)")
    parser.add_argument("--out", default=str(BENCH / "results" / f"vision_pipelines_{time.strftime('%Y-%m-%d')}.json"))
    parser.add_argument("--built", action="store_true",
                        help="build each model in each process (random weights in anonymous memory, hashed on every "
                             "call) rather than load it from saved files as from_pretrained does")
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--case", help=argparse.SUPPRESS)
    parser.add_argument("--mode", help=argparse.SUPPRESS)
    parser.add_argument("--store", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return
    rows = []
    for case in args.cases:
        folder = Path(tempfile.mkdtemp(prefix="vision-pipelines-"))
        try:
            model = save(CASES[case][1], folder) if not args.built else None
            if model is not None:
                time.sleep(2.5)  # a downloaded checkpoint's files are older than this: their digests may be remembered
            run(args, case, "served", folder / "store", model)  # warms the store (its own first call encodes)
            plains, serveds = [], []
            for p in range(args.processes):  # alternating which mode goes first: drift weighs on both
                for mode in ("plain", "served") if p % 2 == 0 else ("served", "plain"):
                    got = run(args, case, mode, folder / ("unused" if mode == "plain" else "store"), model)
                    (plains if mode == "plain" else serveds).append(got)
        finally:
            shutil.rmtree(folder, ignore_errors=True)

        def med(runs: list[dict], key: str) -> float:
            return statistics.median(r[key] if not isinstance(r[key], list) else statistics.median(r[key]) for r in runs)

        row = {"case": case, "processes": args.processes,
               "plain_set_up_s": med(plains, "set_up"), "served_set_up_s": med(serveds, "set_up"),
               "plain_first_s": med(plains, "first"), "served_first_s": med(serveds, "first"),
               "plain_steady_s": med(plains, "steady"), "served_steady_s": med(serveds, "steady"),
               "served_text_first_s": med(serveds, "text_first"), "served_text_steady_s": med(serveds, "text_steady"),
               "plain_firsts_s": [r["first"] for r in plains], "served_firsts_s": [r["first"] for r in serveds],
               "same_output": all(close(plains[0]["output"], r["output"]) for r in serveds),
               "weights": "from_pretrained" if model is not None else "built"}
        row["first_speedup"] = row["plain_first_s"] / row["served_first_s"]
        row["steady_speedup"] = row["plain_steady_s"] / row["served_steady_s"]
        rows.append(row)
        print(f"{case:<28} first call {row['plain_first_s']:.3f} s plain, {row['served_first_s']:.3f} s served "
              f"({row['first_speedup']:.2f}x); steady {row['plain_steady_s']:.3f} / {row['served_steady_s']:.3f} s "
              f"({row['steady_speedup']:.2f}x); text side served {1e3 * row['served_text_first_s']:.1f} / "
              f"{1e3 * row['served_text_steady_s']:.1f} ms; set-up {row['plain_set_up_s']:.3f} / "
              f"{row['served_set_up_s']:.3f} s; same output: {row['same_output']}", flush=True)
    save_results(args.out, args.repeats, rows)


if __name__ == "__main__":
    main()
