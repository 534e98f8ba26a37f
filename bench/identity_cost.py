"""What naming the live model costs per request, side by side in one process.

    python bench/identity_cost.py [--repeats 30] [--out bench/out]

SmolLM2-135M-Instruct (loaded from files, so its weights are named by the file-page proof):
  per request, as PrefixCache runs it   the checks (dropout, autocast), the live structure
                                        (re-checking the reads the last description rests on),
                                        the weights' digest, the tokenizer's live state, ambient state
  of which identity beyond the weights  everything but the weights' digest: what #20 added
  first request of a process            the full description (no reads to re-check yet)
  before #20 (commit 4eb38b8)           its per-request fingerprint: config JSON + class source
                                        digests + weights (tokenizer memoised per object)
YOLOE-11s-seg + MobileCLIP2-B (random weights): a full-hit ``set_classes`` and its detector key.
Medians over ``--repeats``. Writes identity_cost.json. Not a test: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import machine  # noqa: E402

BEFORE = "4eb38b8"


def _median_ms(fn, repeats: int) -> float:
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _old_fingerprint_module() -> types.ModuleType | None:
    """llm/_fingerprint.py as it was before the live identity, from git (None outside a checkout)."""
    root = Path(__file__).resolve().parents[1]
    try:
        source = subprocess.run(["git", "show", f"{BEFORE}:llm/_fingerprint.py"], cwd=root, capture_output=True,
                                text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    module = types.ModuleType("old_fingerprint")
    exec(compile(source, "old_fingerprint.py", "exec"), module.__dict__)  # noqa: S102 - our own history
    return module


def llm(repeats: int) -> dict[str, float]:
    import tempfile

    from promptstore import PromptStore
    from promptstore._live import _MEMO, module_structure
    from promptstore.llm import PrefixCache, load_model

    model, tokenizer = load_model()
    with PromptStore(tempfile.mkdtemp(prefix="ps-idcost-")) as store:
        pc = PrefixCache(model, tokenizer, store=store)

        def request() -> None:  # what every prefill/generate does before its lookup
            pc.engine.request().root

        out = {"per_request_ms": _median_ms(request, repeats)}
        structure = pc.engine.refresh()
        from promptstore import digest_tensors

        out["weights_digest_ms"] = _median_ms(lambda: digest_tensors("live", structure[1]), repeats)
        from promptstore.llm._fingerprint import ambient_fingerprint, cache_code_fingerprint, tokenizer_fingerprint

        def beyond_weights() -> None:  # the checks, the live structure, the tokenizer, ambient state, cache code
            pc.engine.refresh()
            tokenizer_fingerprint(tokenizer)
            ambient_fingerprint()
            cache_code_fingerprint()

        out["identity_beyond_weights_ms"] = _median_ms(beyond_weights, repeats)

        def first() -> None:
            _MEMO._d.clear()
            module_structure(model)

        out["full_description_ms"] = _median_ms(first, max(3, repeats // 5))
        old = _old_fingerprint_module()
        if old is not None:
            out["before_per_request_ms"] = _median_ms(lambda: (old.architecture(model), old.model_fingerprint(model)),
                                                      repeats)
    return out


def vision(repeats: int) -> dict[str, float]:
    import tempfile

    import torch
    from ultralytics import YOLOE

    from promptstore import PromptStore
    from promptstore.vision import OpenCLIPTextEncoder, set_classes
    from promptstore.vision._classes import detector_fingerprint

    torch.manual_seed(0)
    model = YOLOE("yoloe-11s-seg.yaml")
    names = ["forklift", "pallet", "person", "hard hat", "cardboard box"]
    with PromptStore(tempfile.mkdtemp(prefix="ps-idcost-v-")) as store:
        set_classes(model, names, store=store, encoder=OpenCLIPTextEncoder("MobileCLIP2-B"))
        fresh = OpenCLIPTextEncoder("MobileCLIP2-B")  # as in a fresh process: a full hit never builds it
        return {"set_classes_full_hit_ms": _median_ms(lambda: set_classes(model, names, store=store, encoder=fresh),
                                                      repeats),
                "detector_key_ms": _median_ms(lambda: detector_fingerprint(model), repeats),
                "encoder_key_ms": _median_ms(lambda: fresh.fingerprint, repeats)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=30)
    parser.add_argument("--out", type=Path, default=Path("bench/out"))
    args = parser.parse_args()
    result = {"machine": machine(), "llm": llm(args.repeats), "vision": vision(args.repeats)}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "identity_cost.json").write_text(json.dumps(result, indent=2))
    for side in ("llm", "vision"):
        for name, value in result[side].items():
            print(f"{side:7s} {name:30s} {value:8.2f}")


if __name__ == "__main__":
    main()
