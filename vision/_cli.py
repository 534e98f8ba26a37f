"""``promptstore warm-classes``: encode a vocabulary into the store ahead of time."""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from pathlib import Path
from typing import Any

from promptstore.cli import open_store
from promptstore.errors import InvalidInputError, UnsupportedModelError

from ._classes import TEXT_KIND, Recipes, check_names, encode_and_store, set_classes
from ._encoders import OpenCLIPTextEncoder, TextEncoder, UltralyticsTextEncoder
from ._verify import Drew


def read_names(spec: str) -> list[str]:
    """Class names from a .txt file (one per line), an ultralytics dataset .yaml, or ``coco`` / ``lvis``."""
    path = Path(spec)
    if spec in ("coco", "lvis", "coco8") and not path.exists():
        import ultralytics

        path = Path(ultralytics.__file__).parent / "cfg" / "datasets" / f"{spec}.yaml"
    if not path.is_file():
        raise InvalidInputError(f"names file {spec} not found")
    if path.suffix in (".yaml", ".yml"):
        import yaml

        names = yaml.safe_load(path.read_text()).get("names")
        names = list(names.values()) if isinstance(names, dict) else names
    else:
        names = [line.strip() for line in path.read_text().splitlines() if line.strip()]
    return check_names(names)


def parse_encoder(spec: str, seed: int) -> TextEncoder:
    """``open_clip:MODEL[:WEIGHTS]`` or ``ultralytics:mobileclip:blt[:WEIGHTS]``."""
    kind, _, rest = spec.partition(":")
    if kind == "open_clip" and rest:
        name, _, weights = rest.partition(":")
        return OpenCLIPTextEncoder(name, pretrained=weights or None, seed=seed)
    if kind == "ultralytics" and rest.count(":") >= 1:
        base, size, *file = rest.split(":", 2)
        return UltralyticsTextEncoder(f"{base}:{size}", weights=file[0] if file else None)
    raise InvalidInputError(f"encoder is open_clip:MODEL[:WEIGHTS] or ultralytics:mobileclip:blt[:WEIGHTS], got {spec!r}")


def read_templates(spec: str) -> list[Any]:
    """``openai`` (80) or ``simple`` (7): open_clip's ImageNet templates; else a .txt file of format strings."""
    import open_clip

    if spec == "openai":
        return list(open_clip.OPENAI_IMAGENET_TEMPLATES)
    if spec == "simple":
        return list(open_clip.SIMPLE_IMAGENET_TEMPLATES)
    path = Path(spec)
    if not path.is_file():
        raise InvalidInputError(f"templates are openai, simple or a .txt file of format strings; {spec} not found")
    return [line.strip() for line in path.read_text().splitlines() if line.strip()]


def _zero_shot(args: argparse.Namespace) -> tuple[Any, str, int]:
    """Warm an open_clip zero-shot classifier: every (class, template) prompt and every class's weights."""
    import open_clip
    import torch

    from ._zeroshot import zero_shot_classifier

    kind, _, rest = args.encoder.partition(":")
    name, _, weights = rest.partition(":")
    if kind != "open_clip" or not name:
        raise InvalidInputError(f"--templates needs --encoder open_clip:MODEL[:WEIGHTS], got {args.encoder!r}")
    if args.names == "imagenet":
        names = list(open_clip.IMAGENET_CLASSNAMES)  # with open_clip's own repeats ("missile", "sunglasses")
    else:
        names = read_names(args.names)
    templates = read_templates(args.templates)
    if not weights:
        warnings.warn(f"{args.encoder} has random weights (no checkpoint given): the classifier has the right shape and "
                      "cost but no meaning", stacklevel=2)
    torch.manual_seed(args.seed)
    model = open_clip.create_model(name, pretrained=weights or None).eval()
    t0 = time.perf_counter()
    with open_store(args, create=True) as store:
        # --batch prompts per forward pass, in whole classes (open_clip batches classes x templates)
        w = zero_shot_classifier(model, open_clip.get_tokenizer(name), names, templates,
                                 max(1, args.batch // len(templates)), use_tqdm=sys.stderr.isatty(), store=store)
        encoded = store.stats()["kinds"].get(TEXT_KIND, {}).get("misses", 0)  # each prompt not found was encoded
    seconds = time.perf_counter() - t0
    data = {"classes": len(names), "templates": len(templates), "prompts": len(names) * len(templates),
            "encoded": encoded, "seconds": seconds, "shape": list(w.shape)}
    return data, (f"{len(names)} classes x {len(templates)} templates: {encoded} prompts encoded, classifier "
                  f"{tuple(w.shape)} in the store ({seconds:.1f} s)"), 0


def _configure(p: argparse.ArgumentParser) -> None:
    p.add_argument("names", help="a .txt file (one name per line), an ultralytics dataset .yaml, coco / lvis, or "
                                 "imagenet (open_clip's class names; with --templates)")
    p.add_argument("--templates", help="build an open_clip zero-shot classifier: openai, simple, or a .txt file of "
                                       "format strings ({} is the class name)")
    p.add_argument("--encoder", required=True, help="open_clip:MobileCLIP2-B[:WEIGHTS] or ultralytics:mobileclip:blt[:WEIGHTS]")
    p.add_argument("--detector", help="a YOLOE .yaml or .pt: also store its detector-ready embeddings")
    p.add_argument("--seed", type=int, default=0, help="seed of a random-init open_clip encoder")
    p.add_argument("--batch", type=int, default=64, help="texts per encoder pass (with --templates: whole classes, "
                                                         "at least one, of that many prompts)")


def _run(args: argparse.Namespace) -> tuple[Any, str, int]:
    if args.templates:
        return _zero_shot(args)
    names = read_names(args.names)
    encoder = parse_encoder(args.encoder, args.seed)
    if getattr(encoder, "random_weights", False):
        warnings.warn(f"{args.encoder} has random weights (no checkpoint given): its embeddings have the right shape and "
                      "cost but no meaning; use open_clip:MODEL:WEIGHTS with a tag or a checkpoint path", stacklevel=2)
    encoder.batch = args.batch  # type: ignore[attr-defined]
    t0 = time.perf_counter()
    with open_store(args, create=True) as store:
        if args.detector:
            from ultralytics import YOLOE

            report = set_classes(YOLOE(args.detector), names, store=store, encoder=encoder)
            encoded, hits = report.misses, report.hits + report.text_hits
        else:
            recipes = Recipes(store, encoder.fingerprint)
            keys = [recipes.text(n) for n in names]
            todo = [n for n, k in zip(names, keys, strict=True) if k not in store]
            if todo:
                try:
                    encode_and_store(encoder, todo, recipes)  # each finished chunk is stored: Ctrl-C keeps it
                except Drew as exc:
                    raise UnsupportedModelError(f"{args.encoder}: {exc}: its features cannot be stored") from None
            encoded, hits = len(todo), len(names) - len(todo)
    seconds = time.perf_counter() - t0
    data = {"names": len(names), "encoded": encoded, "already_stored": hits, "seconds": seconds,
            "encoder": encoder.fingerprint}
    return data, f"{len(names)} names: {encoded} encoded, {hits} already in the store ({seconds:.1f} s)", 0


# Declared in pyproject.toml under [project.entry-points."promptstore.commands"].
COMMAND = ("encode a vocabulary's class names into the store", _configure, _run)
