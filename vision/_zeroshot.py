"""open_clip zero-shot classifiers (classes x templates) from the store.

``open_clip.build_zero_shot_classifier`` encodes every class under every template (ImageNet:
1,000 x 80 = 80,000 prompts, about an hour on a CPU) in every process. Here:

  ``vision.text``     each rendered prompt's normalised text feature (``Recipes.text``), keyed by
                      the tower's fingerprint and the prompt's text: a new class or a new template
                      encodes only its own prompts;
  ``vision.zsclass``  each class's averaged, normalised weight vector, keyed by the tower and the
                      class's ordered prompts;
  ``vision.zsset``    the whole classifier, keyed by the tower and every class's ordered prompts,
                      so a classifier seen before comes back in one read.

The tower's fingerprint covers the text side's every weight and buffer (hashed on every call,
as the rest of promptstore does), the model class and open_clip version, the tokenizer's
vocabulary and context, and the device type.
"""

from __future__ import annotations

import json
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from promptstore import PromptStore, digest_tensors
from promptstore.errors import InvalidInputError, UnsupportedModelError

from ._classes import TEXT_KIND, Recipes, check_names, vocabulary_payload

__all__ = ["zero_shot_classifier", "CLASS_KIND", "CLASSIFIER_KIND"]

CLASS_KIND, CLASSIFIER_KIND = "vision.zsclass", "vision.zsset"


_VOCAB_FPS: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()


def _tokenizer_fingerprint(tokenizer: Any) -> str:
    """What turns a prompt into token ids: the vocabulary, merges, context and specials.

    The vocabulary's digest (0.2 s for open_clip's BPE) is remembered per tokenizer object:
    open_clip builds it once and never changes it. The context length is read every call.
    """
    kind = f"{type(tokenizer).__module__}.{type(tokenizer).__qualname__}:context={getattr(tokenizer, 'context_length', None)}"
    try:
        vocab = _VOCAB_FPS.get(tokenizer)
    except TypeError:  # not weak-referenceable
        vocab = None
    if vocab is None:
        vocab = _vocabulary_digest(tokenizer)
        try:
            _VOCAB_FPS[tokenizer] = vocab
        except TypeError:
            pass
    return f"{kind}:{vocab}"


def _clean_name(tokenizer: Any) -> str:
    """The text cleaner's name (a function's repr holds its address, which differs per process)."""
    fn = getattr(tokenizer, "clean_fn", None)
    return f"{getattr(fn, '__module__', '')}.{getattr(fn, '__qualname__', type(fn).__name__)}"


def _vocabulary_digest(tokenizer: Any) -> str:
    import xxhash

    if hasattr(tokenizer, "encoder") and hasattr(tokenizer, "bpe_ranks"):  # open_clip's SimpleTokenizer
        state = json.dumps([sorted(tokenizer.encoder.items()), sorted((" ".join(k), v) for k, v in tokenizer.bpe_ranks.items()),
                            getattr(tokenizer, "all_special_ids", None), _clean_name(tokenizer)])
    elif hasattr(tokenizer, "backend_tokenizer"):  # a transformers tokenizer (OWL-ViT's CLIP tokenizer)
        state = tokenizer.backend_tokenizer.to_str()
    elif hasattr(getattr(tokenizer, "tokenizer", None), "backend_tokenizer"):  # open_clip's HFTokenizer
        state = tokenizer.tokenizer.backend_tokenizer.to_str() + _clean_name(tokenizer)
    else:
        raise UnsupportedModelError(f"cannot fingerprint the tokenizer {type(tokenizer).__name__}: pass open_clip's "
                                    "get_tokenizer(...) result")
    return xxhash.xxh3_128_hexdigest(state.encode())


def tower_fingerprint(model: Any, tokenizer: Any) -> str:
    """Names what ``model.encode_text(tokenizer(texts), normalize=True)`` computes.

    The image tower (``visual.*``) does not enter text features and is left out.
    """
    import open_clip

    if not hasattr(model, "encode_text"):
        raise InvalidInputError(f"expected an open_clip model with encode_text, got {type(model).__name__}")
    named = [(n, t) for n, t in list(model.named_parameters(remove_duplicate=False))
             + list(model.named_buffers(remove_duplicate=False)) if not n.startswith("visual.")]
    device = next((t.device.type for _, t in named), "cpu")
    label = (f"open_clip-text:{type(model).__qualname__}:open_clip={open_clip.__version__}:device={device}:"
             f"{module_settings(model, skip='visual')}")
    return f"{label}:{digest_tensors(label, sorted(named, key=lambda kv: kv[0]))}:{_tokenizer_fingerprint(tokenizer)}"


def module_settings(module: Any, skip: str = "") -> str:
    """Every plain setting (numbers, strings, flags) of a module and its submodules, outside ``skip``.

    Weights are not all that decides an output: open_clip's ``text_pool_type``, an attention
    module's head count, dropout in training mode. A digest of them is part of a fingerprint.
    """
    import xxhash

    plain = (bool, int, float, str, type(None))
    rows = []
    for name, sub in module.named_modules():
        if skip and (name == skip or name.startswith(skip + ".")):
            continue
        settings = {k: v for k, v in vars(sub).items() if not k.startswith("_") and isinstance(v, plain)}
        rows.append(f"{name}:{type(sub).__qualname__}:{sorted(settings.items())!r}")
    return xxhash.xxh3_128_hexdigest("\n".join(rows).encode())


def _render(classnames: list[str], templates: Sequence[str | Callable[[str], str]]) -> list[list[str]]:
    if isinstance(templates, str) or not isinstance(templates, Sequence) or len(templates) == 0:
        raise InvalidInputError("templates must be a non-empty list of format strings or callables")
    if not (all(isinstance(t, str) for t in templates) or all(callable(t) for t in templates)):
        raise InvalidInputError("templates must be all format strings or all callables (as open_clip takes them)")
    out = []
    for c in classnames:
        try:
            row = [t.format(c) if isinstance(t, str) else t(c) for t in templates]
        except (IndexError, KeyError, ValueError, TypeError) as exc:
            raise InvalidInputError(f"a template failed on class {c!r}: {exc}") from None
        if not all(isinstance(p, str) and p for p in row):
            raise InvalidInputError(f"templates must render non-empty strings (class {c!r})")
        out.append(row)
    return out


def zero_shot_classifier(model: Any, tokenizer: Any, classnames: Sequence[str],
                         templates: Sequence[str | Callable[[str], str]], store: PromptStore | None = None, *,
                         batch: int = 800, progress: bool | None = None) -> Any:
    """open_clip's ``build_zero_shot_classifier``, computing only the prompts the store lacks.

    Args:
        model: an open_clip model (``create_model``/``create_model_and_transforms``), in eval mode.
        tokenizer: ``open_clip.get_tokenizer(name)``.
        classnames: distinct, visible class names (``check_names``), e.g. ``open_clip.IMAGENET_CLASSNAMES``.
        templates: format strings or callables, e.g. ``open_clip.OPENAI_IMAGENET_TEMPLATES``.
        store: default ``PromptStore()``.
        batch: prompts per forward pass. Each finished batch is stored at once, so an
            interrupted build resumes where it stopped.
        progress: a progress bar over the prompts to encode (None: only on a terminal).

    Returns:
        A ``(dim, classes)`` float tensor on the model's device: the same as
        ``build_zero_shot_classifier(model, tokenizer, classnames, templates)``, within 1e-6.

    Raises:
        InvalidInputError: bad names or templates, before any work.
        UnsupportedModelError: a tokenizer that cannot be fingerprinted.
    """
    import torch

    if isinstance(classnames, str) or not isinstance(classnames, Sequence):
        raise InvalidInputError("classnames must be a list of strings")
    names = list(classnames)
    # Repeats are allowed: open_clip's own ImageNet list names two classes "missile" and two
    # "sunglasses". Each name is still checked like any class name.
    check_names(list(dict.fromkeys(names)))
    prompts = _render(names, templates)
    if not isinstance(batch, int) or isinstance(batch, bool) or batch <= 0:
        raise InvalidInputError(f"batch must be a positive int, got {batch!r}")
    store = store if store is not None else PromptStore()
    recipes = Recipes(store, tower_fingerprint(model, tokenizer))
    device = next(model.parameters()).device
    whole_key = store.key(CLASSIFIER_KIND, vocabulary_payload([p for row in prompts for p in row]
                                                              + [str(len(row)) for row in prompts]),
                          fingerprints=[recipes.efp])
    whole = store.get(whole_key, kind=CLASSIFIER_KIND)
    if whole is not None and whole.tensors.get("w", np.empty(0)).shape == (len(names), _dim(model)):
        return torch.from_numpy(np.ascontiguousarray(whole.tensors["w"].T)).to(device)
    class_keys = [store.key(CLASS_KIND, vocabulary_payload(row), fingerprints=[recipes.efp]) for row in prompts]
    weights = np.empty((len(names), _dim(model)), np.float32)
    todo = []
    for i, key in enumerate(class_keys):
        entry = store.get(key, kind=CLASS_KIND)
        if entry is not None and entry.tensors.get("w", np.empty(0)).shape == (weights.shape[1],):
            weights[i] = entry.tensors["w"]
        else:
            todo.append(i)
    if todo:
        feats = _features(model, tokenizer, recipes, sorted({p for i in todo for p in prompts[i]}), batch, progress)
        for i in todo:
            # open_clip's own arithmetic: mean over templates, then normalise, in torch float32.
            row = torch.from_numpy(np.stack([feats[p] for p in prompts[i]]))
            w = row.mean(dim=0)
            w = (w / w.norm()).numpy()
            weights[i] = w
            store.put(class_keys[i], {"w": w}, kind=CLASS_KIND, meta={"name": names[i], "templates": str(len(prompts[i]))})
    store.put(whole_key, {"w": weights}, kind=CLASSIFIER_KIND, meta={"classes": str(len(names))})
    return torch.from_numpy(np.ascontiguousarray(weights.T)).to(device)


def _dim(model: Any) -> int:
    proj = getattr(model, "text_projection", None)
    if proj is not None and hasattr(proj, "shape"):
        return int(proj.shape[-1])
    text = getattr(model, "text", None)
    out = getattr(text, "output_dim", None) or getattr(model, "embed_dim", None)
    if out is None:
        import torch

        with torch.no_grad():
            out = model.encode_text(torch.zeros(1, 77, dtype=torch.long, device=next(model.parameters()).device)).shape[-1]
    return int(out)


def _features(model: Any, tokenizer: Any, recipes: Recipes, texts: list[str], batch: int,
              progress: bool | None) -> dict[str, np.ndarray]:
    """Each prompt's normalised feature: from the store, or encoded in batches stored as they finish."""
    import torch

    store = recipes.store
    out: dict[str, np.ndarray] = {}
    missing = []
    for t in texts:
        entry = store.get(recipes.text(t), kind=TEXT_KIND)
        if entry is not None and entry.tensors.get("text") is not None and entry.tensors["text"].ndim == 1:
            out[t] = entry.tensors["text"]
        else:
            missing.append(t)
    device = next(model.parameters()).device
    bar = tqdm(total=len(missing), desc="promptstore: encoding prompts", unit="prompt", leave=False,
               disable=(not progress) if progress is not None else None)
    with torch.no_grad():
        for lo in range(0, len(missing), batch):
            part = missing[lo : lo + batch]
            t0 = time.perf_counter()
            feats = model.encode_text(tokenizer(part).to(device), normalize=True).float().cpu().numpy()
            each = (time.perf_counter() - t0) / len(part)
            for text, f in zip(part, feats, strict=True):
                store.put(recipes.text(text), {"text": f}, kind=TEXT_KIND, cost_s=each,
                          meta={"name": text, "encoder": recipes.efp})
                out[text] = f
            bar.update(len(part))
    bar.close()
    return out
