"""promptstore.vision: YOLOE class prompts from the store.

No text encoder runs for a class name the store has seen, and none is even loaded when
every name hits. Prompt sets move to and from ultralytics' own NPZ format.

>>> from ultralytics import YOLOE                                           # doctest: +SKIP
>>> from promptstore.vision import set_classes, OpenCLIPTextEncoder         # doctest: +SKIP
>>> model = YOLOE("yoloe-11s-seg.pt")                                       # doctest: +SKIP
>>> report = set_classes(model, ["pallet", "forklift"])                     # doctest: +SKIP

Needs the ``vision`` extra: ``pip install "promptstore[vision]"``.
"""

from ._classes import ClassesReport, export_npz, import_npz, set_classes
from ._encoders import OpenCLIPTextEncoder, TextEncoder, UltralyticsTextEncoder
from ._owl import owl_detect
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
]
