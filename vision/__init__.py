"""promptstore.vision: what open-vocabulary vision models compute from text, from the store.

- ``set_classes``: YOLOE / YOLO-World class prompts (text features and detector-ready
  embeddings); ``export_npz`` / ``import_npz`` move prompt sets to and from ultralytics' NPZ
  format; ``visual_pe``: YOLOE visual prompts.
- ``zero_shot_classifier``: open_clip's ``build_zero_shot_classifier``, same arguments and result.
- ``owl_detect``: OWLv2 / OWL-ViT detection with each text query's embedding from the store.
- ``pipeline``: transformers' ``zero-shot-image-classification`` (CLIP, MetaCLIP 2, SigLIP,
  SigLIP 2) and ``zero-shot-object-detection`` (OWL-ViT, OWLv2) pipelines, their text tower
  served from the store.
- ``serve_omdet``: OmDet-Turbo's class and task caches backed by the store.
- ``serve_sam3``: SAM 3's concept prompts (``SAM3SemanticModel.set_classes``, which the image and
  video semantic predictors call) from the store.

No text encoder runs for a text the store has seen, and none is even loaded when every text
hits. Keys name the towers, heads and tokenizers as they run now (``promptstore._live``).

>>> from ultralytics import YOLOE                                           # doctest: +SKIP
>>> from promptstore.vision import set_classes, OpenCLIPTextEncoder         # doctest: +SKIP
>>> model = YOLOE("yoloe-11s-seg.pt")                                       # doctest: +SKIP
>>> report = set_classes(model, ["pallet", "forklift"])                     # doctest: +SKIP

Needs the ``vision`` extra: ``pip install "promptstore[vision]"``.
"""

from ._classes import ClassesReport, export_npz, import_npz, set_classes
from ._encoders import OpenCLIPTextEncoder, TextEncoder, UltralyticsTextEncoder
from ._omdet import serve_omdet
from ._owl import owl_detect
from ._pipelines import pipeline
from ._sam3 import serve_sam3
from ._visual import VisualReport, visual_pe
from ._zeroshot import zero_shot_classifier

__all__ = [
    "set_classes",
    "ClassesReport",
    "OpenCLIPTextEncoder",
    "UltralyticsTextEncoder",
    "TextEncoder",
    "export_npz",
    "import_npz",
    "visual_pe",
    "VisualReport",
    "zero_shot_classifier",
    "owl_detect",
    "pipeline",
    "serve_omdet",
    "serve_sam3",
]
