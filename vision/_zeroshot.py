"""open_clip zero-shot classifiers (classes x templates) from the store.

``open_clip.build_zero_shot_classifier`` encodes every class under every template (ImageNet:
1,000 x 80 = 80,000 prompts, about an hour on a CPU) in every process. Here:

  ``vision.text``     each rendered prompt's normalised text feature (``Recipes.text``), keyed by
                      the tower's fingerprint and the prompt's text: a new class or a new template
                      encodes only its own prompts. Kept in the dtype ``encode_text`` returns (half,
                      bfloat16, float32, float64), so the class arithmetic is open_clip's, in that dtype;
  ``vision.zsclass``  each class's averaged, normalised weight vector, keyed by the tower and the
                      class's ordered prompts;
  ``vision.zsset``    the whole classifier, keyed by the tower and every class's ordered prompts,
                      so a classifier seen before comes back in one read.

The tower's fingerprint covers the text side's every weight and buffer (hashed on every call,
as the rest of promptstore does), the model class and open_clip version, the tokenizer's
vocabulary and context, and the device type.
"""

from __future__ import annotations

import time
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm import tqdm

from promptstore import PromptStore
from promptstore._live import Generators
from promptstore.errors import InvalidInputError, PromptStoreWarning, UnsupportedModelError

from ._classes import TEXT_KIND, Recipes, check_names, vocabulary_payload
from ._verify import Refuted, check_draws, check_feature, warn_refuted

__all__ = ["zero_shot_classifier", "CLASS_KIND", "CLASSIFIER_KIND"]

CLASS_KIND, CLASSIFIER_KIND = "vision.zsclass", "vision.zsset"


def tower_fingerprint(model: Any, tokenizer: Any) -> str:
    """Names what ``model.encode_text(tokenizer(texts), normalize=True)`` computes, as it runs now.

    The text side's live identity (:mod:`promptstore._live`: every tensor, setting, hook and
    the code ``encode_text`` reaches; the image tower ``visual`` never sees text and is left
    out), the tokenizer's live options and tables (open_clip's SimpleTokenizer and
    HFTokenizer, or any tokenizer whose state can be named), the ambient torch state
    (autocast), the model class and the device type.

    Raises:
        InvalidInputError: not an open_clip model.
        UnsupportedModelError: dropout active in training mode, a tokenizer whose output is random
            (a reduction mask), or state that cannot be named.
    """
    from promptstore._live import ambient_identity, module_identity, tokenizer_identity

    if not hasattr(model, "encode_text"):
        raise InvalidInputError(f"expected an open_clip model with encode_text, got {type(model).__name__}")
    if getattr(tokenizer, "reduction_fn", None) is not None:
        # open_clip's reduction masks (simple, random, shuffle, syntax) pick the kept tokens of a
        # text longer than the context at random: no stored feature may stand for its output.
        raise UnsupportedModelError("zero_shot_classifier: a tokenizer with a reduction mask (reduction_mask=...) "
                                    "tokenizes long texts at random; use one without")
    live = module_identity(model, entries=("encode_text",), skip="visual", what="the open_clip text tower")
    device = next(model.parameters()).device.type
    return (f"open_clip-text:{type(model).__qualname__}:device={device}:{live}:{tokenizer_identity(tokenizer)}:"
            f"{ambient_identity()}")


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
                         templates: Sequence[str | Callable[[str], str]], num_classes_per_batch: int | None = 10,
                         device: Any = "cpu", use_tqdm: bool = False, *, store: PromptStore | None = None) -> Any:
    """open_clip's ``build_zero_shot_classifier``, computing only the prompts the store lacks.

    A drop-in: open_clip's arguments in open_clip's order, and its result (values, dtype,
    device). The arithmetic is open_clip's, in the model's own dtype: each prompt's
    ``encode_text(..., normalize=True)`` feature (stored in that dtype), then per class the
    mean over templates and its normalisation, on ``device``.

    Args:
        model: an open_clip model (``create_model``/``create_model_and_transforms``), in eval mode,
            in any float dtype (``.half()``, ``.to(torch.bfloat16)``, ``.double()``).
        tokenizer: ``open_clip.get_tokenizer(name)``.
        classnames: distinct, visible class names (``check_names``), e.g. ``open_clip.IMAGENET_CLASSNAMES``.
        templates: format strings or callables, e.g. ``open_clip.OPENAI_IMAGENET_TEMPLATES``.
        num_classes_per_batch: classes per forward pass (that many times ``len(templates)``
            prompts; None or 0: all at once), as open_clip. Each finished batch is stored at
            once, so an interrupted build resumes where it stopped.
        device: where the tokens go (the model's device, as open_clip needs) and the result is.
        use_tqdm: a progress bar over the prompts to encode.
        store: default ``PromptStore()``.

    Returns:
        A ``(dim, classes)`` tensor in the dtype ``encode_text`` returns, on ``device``: what
        ``build_zero_shot_classifier(model, tokenizer, classnames, templates, ...)`` returns,
        within 1e-6 in float32 (rounding of the model's dtype in others). A full hit never
        runs the text tower.

    Raises:
        InvalidInputError: bad names, templates, batch size or device, before any work.
        UnsupportedModelError: a tokenizer that cannot be fingerprinted, a dtype that cannot be stored.
    """
    import torch

    if isinstance(classnames, str) or not isinstance(classnames, Sequence):
        raise InvalidInputError("classnames must be a list of strings")
    names = list(classnames)
    # Repeats are allowed: open_clip's own ImageNet list names two classes "missile" and two
    # "sunglasses". Each name is still checked like any class name.
    check_names(list(dict.fromkeys(names)))
    prompts = _render(names, templates)
    if num_classes_per_batch is not None and (not isinstance(num_classes_per_batch, int)
                                              or isinstance(num_classes_per_batch, bool) or num_classes_per_batch < 0):
        raise InvalidInputError(f"num_classes_per_batch must be a positive int or None, got {num_classes_per_batch!r}")
    per_forward = (num_classes_per_batch or len(names)) * len(templates)
    try:
        device = torch.device(device)
    except (RuntimeError, TypeError, ValueError) as exc:
        raise InvalidInputError(f"device must name a torch device, got {device!r}: {exc}") from None
    store = store if store is not None else PromptStore()
    recipes = Recipes(store, tower_fingerprint(model, tokenizer))
    dtype, dim = _feature_dtype(model), _dim(model)
    whole_key = store.key(CLASSIFIER_KIND, vocabulary_payload([p for row in prompts for p in row]
                                                              + [str(len(row)) for row in prompts]),
                          fingerprints=[recipes.efp])
    whole = _tensor(store.get(whole_key, kind=CLASSIFIER_KIND), "w", (len(names), dim), dtype)
    if whole is not None:
        return whole.T.contiguous().to(device)
    class_keys = [store.key(CLASS_KIND, vocabulary_payload(row), fingerprints=[recipes.efp]) for row in prompts]
    weights = torch.empty((len(names), dim), dtype=dtype)
    todo = []
    for i, key in enumerate(class_keys):
        w = _tensor(store.get(key, kind=CLASS_KIND), "w", (dim,), dtype)
        if w is None:
            todo.append(i)
        else:
            weights[i] = w
    if todo:
        try:
            served = [i for i in range(len(names)) if i not in set(todo)]
            feats = _features(model, tokenizer, recipes, sorted({p for i in todo for p in prompts[i]}), per_forward,
                              use_tqdm, device, dtype, dim, probes=[prompts[i][0] for i in served[:1]])
        except Refuted as exc:
            from open_clip import build_zero_shot_classifier

            warn_refuted("zero_shot_classifier", exc)
            return build_zero_shot_classifier(model, tokenizer, names, list(templates), num_classes_per_batch,
                                              device, use_tqdm)
        except _NotAsKeyed as exc:
            # Nothing of this call is stored, and none of the store's entries is mixed in:
            # open_clip's own build, in whatever the tower does now.
            from open_clip import build_zero_shot_classifier

            warnings.warn(f"the text tower gives {exc} features, not the {dtype} {dim}-d its weights say (autocast?): "
                          "built with open_clip, nothing stored", PromptStoreWarning, stacklevel=2)
            return build_zero_shot_classifier(model, tokenizer, names, list(templates), num_classes_per_batch,
                                              device, use_tqdm)
        # open_clip's own arithmetic, in the model's dtype on its device: (classes, templates, dim)
        # -> mean over templates -> divide by the norm.
        rows = torch.stack([torch.stack([feats[p] for p in prompts[i]]) for i in todo]).to(device)
        mean = rows.mean(dim=1)
        mean = (mean / mean.norm(dim=1, keepdim=True)).cpu()
        for j, i in enumerate(todo):
            weights[i] = mean[j]
            store.put(class_keys[i], {"w": _storable(mean[j])}, kind=CLASS_KIND,
                      meta={"name": names[i], "templates": str(len(prompts[i]))})
    store.put(whole_key, {"w": _storable(weights)}, kind=CLASSIFIER_KIND, meta={"classes": str(len(names))})
    return weights.T.contiguous().to(device)


# torch dtype -> how the store keeps it (safetensors name); bfloat16 travels as its raw bits.
_STORED = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def _feature_dtype(model: Any) -> Any:
    """The dtype ``encode_text`` returns: its last step's, the text projection (else the text tower's).

    Read off the weights, so a full hit knows it without running the tower; entries of another
    dtype (an older release kept float32 for every model) are misses.

    Raises:
        UnsupportedModelError: a dtype the store cannot keep.
    """
    import torch

    dtype = None
    for owner in (model, getattr(model, "text", None)):
        for attr in ("text_projection", "proj"):
            proj = getattr(owner, attr, None) if owner is not None else None
            if isinstance(proj, torch.Tensor):
                dtype = proj.dtype
            elif isinstance(proj, torch.nn.Module):
                dtype = next((t.dtype for t in reversed(list(proj.parameters())) if t.is_floating_point()), None)
            if dtype is not None:
                break
        if dtype is not None:
            break
    if dtype is None:
        dtype = next((t.dtype for n, t in model.named_parameters() if not n.startswith("visual.") and t.is_floating_point()),
                     torch.float32)
    if str(dtype).removeprefix("torch.") not in _STORED:
        raise UnsupportedModelError(f"zero_shot_classifier keeps text features in {sorted(_STORED)}, not {dtype}")
    return dtype


def _storable(t: Any) -> Any:
    """A CPU tensor as the store takes it, dtype kept (bfloat16 as its raw bits)."""
    import torch

    t = t.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(np.uint16), "BF16"
    return t.numpy()


def _tensor(entry: Any, name: str, shape: tuple[int, ...], dtype: Any) -> Any:
    """An entry's tensor as a torch tensor of ``dtype`` and ``shape``, or None (a miss)."""
    import torch

    if entry is None or name not in entry.tensors or entry.tensors[name].shape != shape:
        return None
    if entry.dtypes.get(name) != _STORED[str(dtype).removeprefix("torch.")]:
        return None
    arr = np.array(entry.tensors[name])  # a private, writable copy of the cache's read-only view
    return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if dtype == torch.bfloat16 else torch.from_numpy(arr)


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


def _features(model: Any, tokenizer: Any, recipes: Recipes, texts: list[str], batch: int, use_tqdm: bool,
              device: Any, dtype: Any, dim: int, probes: Sequence[str] = ()) -> dict[str, Any]:
    """Each prompt's normalised feature (a CPU tensor of ``dtype``): from the store, or encoded
    in batches stored as they finish. ``probes``: stored prompts to check if none of ``texts`` is.

    Raises:
        Refuted: a stored feature differs from what the tower computes now; :class:`Drew`: the tower drew
            random numbers (the generators are put back as they stood before it first ran).
    """
    import torch

    store = recipes.store
    out: dict[str, Any] = {}
    missing = []
    for t in texts:
        feat = _tensor(store.get(recipes.text(t), kind=TEXT_KIND), "text", (dim,), dtype)
        if feat is None:
            missing.append(t)
        else:
            out[t] = feat
    # The tower runs anyway: one stored prompt (of these, else of a class served whole) is encoded
    # again in the first batch and compared before anything is stored (see _verify.py).
    probe = next(((t, out[t]) for t in texts if t in out), None)
    for t in probes if probe is None and missing else ():
        feat = _tensor(store.get(recipes.text(t), kind=TEXT_KIND), "text", (dim,), dtype)
        if feat is not None:
            probe = (t, feat)
            break
    bar = tqdm(total=len(missing), desc="promptstore: encoding prompts", unit="prompt", leave=False,
               disable=not use_tqdm)
    before = Generators()
    with torch.no_grad():
        for lo in range(0, len(missing), batch):
            part = missing[lo : lo + batch]
            checked = probe is not None and lo == 0
            t0 = time.perf_counter()
            feats = model.encode_text(tokenizer([probe[0], *part] if checked and probe is not None else part).to(device),
                                      normalize=True).cpu()
            each = (time.perf_counter() - t0) / (len(part) + checked)
            try:
                check_draws(before, "the open_clip text tower")
            except Refuted:
                bar.close()
                raise
            if feats.dtype != dtype or feats.shape[1:] != (dim,):
                bar.close()
                raise _NotAsKeyed(f"{feats.dtype} {tuple(feats.shape[1:])}")
            if checked:
                assert probe is not None
                try:
                    check_feature(probe[0], probe[1].float().numpy(), feats[0].float().numpy(), str(dtype))
                except Refuted:
                    bar.close()
                    raise
                feats = feats[1:]
            for text, f in zip(part, feats, strict=True):
                store.put(recipes.text(text), {"text": _storable(f)}, kind=TEXT_KIND, cost_s=each,
                          meta={"name": text, "encoder": recipes.efp})
                out[text] = f
            bar.update(len(part))
    bar.close()
    return out


class _NotAsKeyed(Exception):
    """The tower's features are not what the weights say (another dtype: autocast; another width)."""
