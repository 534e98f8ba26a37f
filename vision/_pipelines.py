"""transformers' zero-shot vision pipelines with their text side from the store.

    from promptstore.vision import pipeline
    classify = pipeline("zero-shot-image-classification", model=folder_or_hub_id)
    classify(image, candidate_labels=["a forklift", "a pallet"])

:func:`pipeline` is ``transformers.pipeline(task, model, **kwargs)``: the same object (an instance
of transformers' own pipeline class), the same arguments and outputs. Only its forward changes:
the text tower's pooled output for each candidate label comes from the store, keyed by the tower's
live identity and the label's token ids as the pipeline tokenised them; the tower runs only for the
labels the store lacks. The rest of the model (projection, normalisation, logit scale and bias,
the detection heads) runs as in the plain call, in the model's own code, so the scores are the
model's. A forward that runs the tower anyway re-encodes one stored label in its batch and compares
(:mod:`._verify`); a mismatch computes the call without the store and warns.

- ``zero-shot-image-classification``: CLIP, MetaCLIP 2, SigLIP and SigLIP 2 (their forward takes
  the text tower's pooled output as it is).
- ``zero-shot-object-detection``: OWL-ViT and OWLv2. transformers' pipeline runs the detector once
  per label, image tower included; here the image tower runs once per image and each label reuses
  its feature map (the heads are computed per label as before).
- A detection call runs a forward per label, yet it is named once, at its first label, as one
  forward over all its labels would be (the classification pipeline's): an edit to the model made
  during a call, which only a hook or another thread can make, is seen from the next call.
- ``zero-shot-object-detection``: Grounding DINO. Its feature enhancer fuses text with the image, so
  only the text backbone's output (every token's hidden state) is stored, keyed by the label's
  token ids and token types, the special tokens that shape its attention masks and ``max_text_len``;
  the whole detector runs on it as in the plain call. One label per forward: a missing label runs
  the backbone for itself only, so there is no stored label to check beside it, and hits are
  served on their keys.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
import time
import warnings
import weakref
from contextlib import contextmanager
from typing import Any

import numpy as np

from promptstore import PromptStore
from promptstore._live import Generators
from promptstore.errors import InvalidInputError, PromptStoreWarning, UnsupportedModelError

from ._classes import TEXT_KIND, Recipes, describe_ahead
from ._verify import Drew, Refuted, check_draws, check_feature, warn_refuted
from ._zeroshot import _storable

__all__ = ["pipeline", "CLASSIFIER_FAMILIES", "DETECTOR_FAMILIES"]

# model_type -> the attribute path of the text tower whose pooled output the model's forward uses as is.
CLASSIFIER_FAMILIES = {"clip": "text_model", "metaclip_2": "text_model", "siglip": "text_model",
                       "siglip2": "text_model"}
DETECTOR_FAMILIES = {"owlvit": "owlvit.text_model", "owlv2": "owlv2.text_model",
                     "grounding-dino": "model.text_backbone"}
_TASKS = {"zero-shot-image-classification": CLASSIFIER_FAMILIES, "zero-shot-object-detection": DETECTOR_FAMILIES}
_CALL = "promptstore_call"  # the key preprocess adds to each label's inputs
_GD_MASKS = "generate_masks_with_special_tokens_and_transfer_map"  # Grounding DINO's text masks and positions


def pipeline(task: str, model: Any = None, *, store: PromptStore | None = None, **kwargs: Any) -> Any:
    """``transformers.pipeline(task, model, **kwargs)`` whose text tower is served from ``store``.

    Args:
        task: ``"zero-shot-image-classification"`` or ``"zero-shot-object-detection"``.
        model: what ``transformers.pipeline`` takes (a hub id, a folder, or a model object).
        store: default ``PromptStore()``.
        **kwargs: passed to ``transformers.pipeline`` (``image_processor``, ``tokenizer``,
            ``device``, ``dtype``...).

    Returns:
        transformers' own pipeline object for ``task``; called as that pipeline is called, it
        returns what that pipeline returns.

    Raises:
        InvalidInputError: another task.
        UnsupportedModelError: a model family whose text side is not served (see
            ``CLASSIFIER_FAMILIES`` and ``DETECTOR_FAMILIES``).
    """
    if task not in _TASKS:
        raise InvalidInputError(f"promptstore.vision.pipeline serves {sorted(_TASKS)}, not {task!r}")
    from transformers import pipeline as transformers_pipeline

    # ignore[call-overload]: transformers' overloads take Literal task names only; task is one of _TASKS (checked above)
    pipe = transformers_pipeline(task, model=model, **kwargs)  # type: ignore[call-overload]
    family = getattr(pipe.model.config, "model_type", "")
    if family not in _TASKS[task]:
        raise UnsupportedModelError(f"{task}: the text side of {family!r} models is not served from the store "
                                    f"(served: {sorted(_TASKS[task])})")
    if getattr(pipe.model, "training", False):
        raise UnsupportedModelError(f"{task}: the model is in training mode (call .eval())")
    base = type(pipe)
    served = _Classifier if task == "zero-shot-image-classification" else _Detector
    # A subclass of transformers' own class: isinstance, its preprocess and postprocess are unchanged.
    methods = {k: v for k, v in vars(served).items() if not k.startswith("__")}
    pipe.__class__ = type(base.__name__, (base,), {**methods, "__module__": base.__module__})
    pipe._promptstore = _TextSide(pipe.model, _TASKS[task][family], store if store is not None else PromptStore())
    describe_ahead(pipe._promptstore.fingerprint)
    return pipe


def _side(pipe: Any, families: dict[str, str]) -> _TextSide | None:
    """The pipeline's text side for the model it holds now (a user may hand it another: ``pipe.model = ...``),
    or None where that model's text side is not served (the call then runs as transformers' own)."""
    side: _TextSide = pipe._promptstore
    model = pipe.model
    if model is side.model:
        return side
    family = getattr(getattr(model, "config", None), "model_type", "")
    if family not in families:
        return None
    pipe._promptstore = side = _TextSide(model, families[family], side.store)
    return side


def _stand_in_unseen(model: Any, path: str) -> bool:
    """Whether only the model's own code sees what its text tower returns during a forward: no global module
    hook, and no user's hook or patched forward on a module that holds the tower. The stand-in returns what
    the store holds (the pooled rows, or the token states), not every field of the tower's output: a hook
    there may read another, or call the tower itself."""
    import torch

    if _hooks((), global_too=True):
        return False
    holders, owner = [model], model
    for part in path.split(".")[:-1]:
        owner = getattr(owner, part)
        holders.append(owner)
    for m in holders:
        if (_users_hook(_hooks([m])) or type(m).__call__ is not torch.nn.Module.__call__ or "forward" in vars(m)
                or not _transformers_code(getattr(type(m), "forward", None))):
            return False
    return True


def _attr(obj: Any, path: str) -> Any:
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


class _TextSide:
    """One model's text tower: its pooled output per token-id row, from the store or computed now."""

    def __init__(self, model: Any, path: str, store: PromptStore) -> None:
        self.model, self.path, self.store = model, path, store
        self.encoded = 0  # rows the tower computed (probes included)
        self.served = 0  # rows served from the store
        self._call: tuple[Any, str] | None = None  # (the call's token, its fingerprint) while its forwards may share it

    @property
    def tower(self) -> Any:
        return _attr(self.model, self.path)

    def fingerprint(self) -> str:
        from promptstore._live import ambient_identity, module_identity

        tower = self.tower
        device = next(tower.parameters()).device.type
        live = module_identity(tower, what=f"{self.model.config.model_type}'s text tower")
        # Grounding DINO derives the backbone's attention masks and positions from the ids with these.
        owner_path = self.path.rpartition(".")[0]
        owner = _attr(self.model, owner_path) if owner_path else self.model
        extra = ""
        if hasattr(owner, "special_tokens"):
            from promptstore._live import functions_identity

            # ... by this function of its module, as the module binds it now (the forward looks it up there).
            masks = vars(sys.modules[type(owner).__module__]).get(_GD_MASKS)
            extra = (f":special={getattr(owner, 'special_tokens', None)!r}:max_text_len={self.model.config.max_text_len}"
                     f":masks={functions_identity(masks) if masks is not None else None}")
        return f"hf-text:{type(self.model).__qualname__}.{self.path}:device={device}:{live}{extra}:{ambient_identity()}"

    def call_fingerprint(self, call: Any) -> str:
        """The fingerprint for one forward of a pipeline call that runs a forward per label.

        ``call`` is an object all of one call's forwards hold and nothing else does. The call is
        named once, at its first forward, as one forward over all its labels would be (the
        classification pipeline's): the image tower also runs once per call. An edit to the model
        made during a call (only a hook or another thread can make one) is seen from the next call,
        and what the tower computes after it is not stored under the earlier name.
        """
        memo = self._call
        if memo is not None and memo[0] is call:
            return memo[1]
        fp = self.fingerprint()
        self._call = (call, fp)
        return fp

    def still(self, fingerprint: str) -> bool:
        """Whether the tower is still what ``fingerprint``, taken earlier in the call, names: what it computed
        is stored under that name only then."""
        return self.fingerprint() == fingerprint

    def end_call(self) -> None:
        """The call's last forward is done: its name is not reused."""
        self._call = None

    def pooled(self, input_ids: Any, attention_mask: Any | None, fingerprint: str | None = None) -> Any:
        """The tower's pooled output for every row of ``input_ids``, as ``tower(...).pooler_output`` gives it.

        A row's key is its token ids (cut to its attention mask when there is one; else the whole
        padded row, which the tower attends to), under the tower's fingerprint (``fingerprint``, or
        named now).

        Raises:
            Drew: the tower drew random numbers on a miss (the generators put back, nothing stored): the caller
                runs transformers' own forward, as if nothing were served.
        """
        import torch

        recipes = Recipes(self.store, fingerprint if fingerprint is not None else self.fingerprint())
        dtype = next(self.tower.parameters()).dtype
        family = self.model.config.model_type
        eos = getattr(getattr(self.tower, "config", None), "eos_token_id", None)
        # CLIP's text transformer pools the largest id where its config's eos id is the legacy 2.
        pooling = "argmax" if family == "clip" and eos == 2 else _EOS_POOLED.get(family)
        names = _row_names(input_ids, attention_mask, pooling, eos)
        found: dict[str, Any] = {}
        for name in dict.fromkeys(names):
            row = _read(self.store.get(recipes.text(name), kind=TEXT_KIND), dtype)
            if row is not None:
                found[name] = row
        firsts = {name: i for i, name in reversed(list(enumerate(names)))}
        missing = [name for name in firsts if name not in found]
        probe = next(iter(found), None) if missing else None
        if missing:
            rows = [firsts[n] for n in ([probe] if probe is not None else []) + missing]
            before = Generators()
            t0 = time.perf_counter()
            fresh = self._encode(input_ids[rows], None if attention_mask is None else attention_mask[rows])
            each = (time.perf_counter() - t0) / len(rows)
            # A tower that drew: Drew, the generators put back, for the caller to run transformers' own forward.
            check_draws(before, f"{family}'s text tower")
            self.encoded += len(rows)
            if probe is not None:
                try:
                    check_feature(probe, found[probe].float().numpy(), fresh[0].float().cpu().numpy(), str(dtype))
                except Refuted as exc:
                    warn_refuted("pipeline", exc)
                    self.encoded += input_ids.shape[0]
                    return self._encode(input_ids, attention_mask)
                fresh = fresh[1:]
            keep = fingerprint is None or self.still(fingerprint)
            for name, value in zip(missing, fresh, strict=True):
                value = value.detach().cpu()
                if keep:
                    self.store.put(recipes.text(name), {"text": _storable(value)}, kind=TEXT_KIND, cost_s=each,
                                   meta={"encoder": recipes.efp})
                found[name] = value
        self.served += sum(1 for n in names if n not in missing)
        device = input_ids.device
        return torch.stack([found[n] for n in names]).to(device=device, dtype=dtype)

    def grounded(self, model_inputs: Any, fingerprint: str) -> Any:
        """Grounding DINO's forward on one label, its text backbone's hidden states from the store
        (keyed under ``fingerprint``, the backbone's)."""
        import torch

        ids = model_inputs["input_ids"]
        types = model_inputs.get("token_type_ids")
        if ids.shape[0] != 1:
            with torch.no_grad():
                return self.model(**model_inputs)
        recipes = Recipes(self.store, fingerprint)
        name = _row_name(ids[0], None) + ("" if types is None else "|types:" + ",".join(map(str, types[0].tolist())))
        dtype = next(self.tower.parameters()).dtype
        entry = self.store.get(recipes.text(name), kind=TEXT_KIND)
        hidden = _read(entry, dtype, ndim=2)
        if hidden is not None:
            self.served += 1
            with torch.no_grad(), self.serving(hidden=hidden[None].to(ids.device), ids=ids, types=types):
                return self.model(**model_inputs)
        seen: list[Any] = []
        handle = self.tower.register_forward_hook(lambda module, args, out: seen.append(out.last_hidden_state))
        before = Generators()
        t0 = time.perf_counter()
        try:
            with torch.no_grad():
                outputs = self.model(**model_inputs)
        finally:
            handle.remove()
        self.encoded += 1
        if before.moved():
            # The forward drew random numbers (a user's hook; where is not known): this call is the plain one,
            # and what its backbone returned is one draw, not stored.
            warn_refuted("pipeline", Drew(f"{self.model.config.model_type}'s forward"))
            return outputs
        if len(seen) == 1 and seen[0].shape[0] == 1 and self.still(fingerprint):
            self.store.put(recipes.text(name), {"text": _storable(seen[0][0].detach().cpu())}, kind=TEXT_KIND,
                           cost_s=time.perf_counter() - t0, meta={"encoder": recipes.efp})
        return outputs

    def _encode(self, input_ids: Any, attention_mask: Any | None) -> Any:
        import torch

        kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
        with torch.no_grad():
            return self.tower(input_ids=input_ids, return_dict=True, **kwargs).pooler_output

    @contextmanager
    def serving(self, pooled: Any = None, hidden: Any = None, *, ids: Any, mask: Any = None, types: Any = None) -> Any:
        """The model's text tower replaced, for one forward, by one that returns ``pooled`` (its
        pooled output) or ``hidden`` (every token's hidden state), computed from ``ids`` (and ``mask``,
        ``types``): called with other inputs (a user's hook changed them), the tower itself runs."""
        owner_path, _, name = self.path.rpartition(".")
        owner = _attr(self.model, owner_path) if owner_path else self.model
        with _swapped(self.model, owner, name,
                      lambda original: _Served(pooled, hidden, original, (ids, mask, types))):
            yield


# Towers whose pooled output is one real token's state under a causal mask (CLIP's end-of-text token, found
# as the row's largest id or its first eos id): with padding after the row's own tokens, and no pad that
# those rules could pick instead, the padding changes nothing, and a row is named by its own ids (the same
# label then hits whatever the longest label of the call). Elsewhere (SigLIP pools the last position, a pad;
# left padding shifts every position) a row is named by the whole padded row and its mask.
_EOS_POOLED = {"clip": "eos", "metaclip_2": "eos", "owlvit": "argmax", "owlv2": "argmax"}  # how each pools


def _row_names(input_ids: Any, attention_mask: Any | None, pooling: str | None = None,
               eos: int | None = None) -> list[str]:
    """Each row's name in the store: what the tower's pooled output for it depends on (see ``_EOS_POOLED``)."""
    rows = input_ids.tolist()
    if attention_mask is None:
        return ["ids:" + ",".join(map(str, row)) + f"|padded:{len(row)}" for row in rows]
    names = []
    for row, kept in zip(rows, attention_mask.tolist(), strict=True):
        own = sum(1 for m in kept if m)
        if pooling is not None and _padding_inert(row, kept, own, pooling, eos):
            names.append("ids:" + ",".join(map(str, row[:own])))
        else:
            names.append("ids:" + ",".join(map(str, row)) + "|mask:" + "".join("1" if m else "0" for m in kept))
    return names


def _padding_inert(row: list[int], kept: list[Any], own: int, pooling: str, eos: Any) -> bool:
    """Whether an eos-pooled tower's output for ``row`` is that of its first ``own`` tokens alone: the mask
    keeps exactly those, and the pooling rule cannot land on a pad. ``argmax``: the row's first largest id
    (OWL; CLIP configs whose eos id is the legacy 2); ``eos``: the first ``eos`` id."""
    if own == 0 or not all(kept[:own]):
        return False  # padding before or between the row's own tokens
    pads, real = row[own:], row[:own]
    if not pads:
        return True
    if pooling == "argmax":
        return max(pads) <= max(real)
    return isinstance(eos, int) and eos in real


def _row_name(ids: Any, mask: Any | None) -> str:
    row = ids if mask is None else ids[mask.bool()]
    tail = f"|padded:{int(ids.shape[0])}" if mask is None else ""
    return "ids:" + ",".join(str(int(t)) for t in row.tolist()) + tail


def _read(entry: Any, dtype: Any, ndim: int = 1) -> Any:
    """A stored row (pooled: 1-D; every token's hidden state: 2-D) as a CPU tensor of ``dtype``, or None (a miss)."""
    import torch

    from ._zeroshot import _STORED

    if entry is None or "text" not in entry.tensors or entry.tensors["text"].ndim != ndim:
        return None
    if entry.dtypes.get("text") != _STORED.get(str(dtype).removeprefix("torch.")):
        return None
    arr = np.array(entry.tensors["text"])
    return torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if dtype == torch.bfloat16 else torch.from_numpy(arr)


@functools.cache
def _served_module() -> Any:
    """The stand-in's class, built once (torch is imported lazily)."""
    import torch
    from transformers.modeling_outputs import BaseModelOutputWithPooling

    class Served(torch.nn.Module):
        """A text tower's stand-in for one forward: the pooled rows it was given, for exactly that batch."""

        def __init__(self, pooled: Any, hidden: Any, original: Any, inputs: tuple[Any, Any, Any]) -> None:
            super().__init__()
            self.pooled, self.hidden, self.original = pooled, hidden, original
            self.inputs = inputs  # (input_ids, attention_mask, token_type_ids) the rows were made from
            self.thread = threading.get_ident()
            self.answered = False  # the model's forward calls the tower once: a later call is someone else's
            self.training = original.training  # as read by a hook (not train(): that would set the tower's own parts)

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:  # what a user's hook reads of the tower during the forward (its config, norms)
                return getattr(self._modules["original"], name)

        def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # the model saved meanwhile: the tower's own keys
            return self.get_submodule("original").state_dict(*args, **kwargs)

        def forward(self, input_ids: Any = None, *args: Any, **kwargs: Any) -> Any:
            if self.answered or threading.get_ident() != self.thread or not self._as_made(input_ids, args, kwargs):
                # The model called elsewhere meanwhile, with inputs a hook changed, or the tower called again: itself.
                return self.original(input_ids, *args, **kwargs)
            self.answered = True
            rows = (self.pooled if self.pooled is not None else self.hidden).shape[0]
            if input_ids is None or input_ids.shape[0] != rows:
                raise RuntimeError("promptstore: the served text tower was called with another batch")
            return BaseModelOutputWithPooling(last_hidden_state=self.hidden, pooler_output=self.pooled)

        def _as_made(self, input_ids: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
            """Whether the tower is asked for what the served rows were made from: the same ids, and the same
            attention mask and token types where those named the rows; no position ids of the caller's."""
            ids, mask, types = self.inputs
            if input_ids is None or input_ids.shape != ids.shape or not torch.equal(input_ids, ids.to(input_ids.device)):
                return False
            if self.pooled is not None:  # a pooling tower, called with keywords (CLIP, SigLIP, OWL)
                got = kwargs.get("attention_mask")
                if kwargs.get("position_ids") is not None or (got is None) != (mask is None) or (
                        got is not None and (got.shape != mask.shape or not torch.equal(got, mask.to(got.device)))):
                    return False
            elif types is not None:  # Grounding DINO's text backbone: (ids, masks, token types, positions)
                got = args[1] if len(args) > 1 else kwargs.get("token_type_ids")
                if got is None or got.shape != types.shape or not torch.equal(got, types.to(got.device)):
                    return False
            return True

    return Served


def _Served(pooled: Any, hidden: Any, original: Any, inputs: tuple[Any, Any, Any]) -> Any:  # noqa: N802 - the module class is built on first use (torch lazily)
    return _served_module()(pooled, hidden, original, inputs)


_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_LOCKS_GUARD = threading.Lock()


@contextmanager
def _swapped(model: Any, owner: Any, name: str, make: Any) -> Any:
    """``owner.<name>`` replaced by ``make(original)`` for one forward of ``model``.

    Forwards that replace a part of the same model run one at a time: a second thread's swap would
    otherwise keep the first's stand-in as the original and put it back for good. The stand-ins
    answer only their own thread; the model called from another thread meanwhile runs its own part.
    """
    with _LOCKS_GUARD:
        lock = _LOCKS.get(model)
        if lock is None:
            lock = _LOCKS[model] = threading.RLock()
    with lock:
        original = getattr(owner, name)
        setattr(owner, name, make(original))
        try:
            yield
        finally:
            setattr(owner, name, original)


@functools.cache
def _backbone_once_module() -> Any:
    """The image backbone's stand-in class, built once (torch is imported lazily)."""
    import torch

    def copied(value: Any) -> Any:
        if isinstance(value, torch.Tensor):
            return value.clone()
        if isinstance(value, (list, tuple)):
            return type(value)(copied(v) for v in value)
        return value

    class BackboneOnce(torch.nn.Module):
        """Grounding DINO's backbone for one label of a call: its output for these pixels and mask, computed at
        the call's first label and copied (a later step writing into what it got cannot reach the others)."""

        def __init__(self, backbone: Any, holder: Any, call: Any) -> None:
            super().__init__()
            self.backbone, self.holder, self.call = backbone, holder, call
            self.thread = threading.get_ident()

        def __getattr__(self, name: str) -> Any:
            try:
                return super().__getattr__(name)
            except AttributeError:  # what the model reads of its backbone besides the call (position_embedding)
                return getattr(self._modules["backbone"], name)

        def state_dict(self, *args: Any, **kwargs: Any) -> Any:  # the model saved meanwhile: the backbone's own keys
            return self.get_submodule("backbone").state_dict(*args, **kwargs)

        def forward(self, pixel_values: Any, pixel_mask: Any) -> Any:
            if threading.get_ident() != self.thread:  # the model called elsewhere meanwhile
                return self.backbone(pixel_values, pixel_mask)
            memo = self.holder._image_memo
            if (memo is not None and memo[0] is self.call and memo[1].shape == pixel_values.shape
                    and memo[2].shape == pixel_mask.shape and torch.equal(memo[1], pixel_values)
                    and torch.equal(memo[2], pixel_mask)):
                return copied(memo[3])
            out = self.backbone(pixel_values, pixel_mask)
            self.holder._image_memo = (self.call, pixel_values, pixel_mask, copied(out))
            return out

    return BackboneOnce


def _BackboneOnce(backbone: Any, holder: Any, call: Any) -> Any:  # noqa: N802 - as _Served
    return _backbone_once_module()(backbone, holder, call)


def _owl_forward_is_stock(model: Any, base: Any, tower: Any) -> bool:
    """Whether an OWL detector's forward is transformers' own, with no hook or patch of anyone's on what the
    served path calls around (the detector's and its base model's forward, ``image_text_embedder``) or runs
    fewer times (the image side: once per call, not once per label), and no global module hook."""
    import torch

    if _hooks((), global_too=True):
        return False
    for m, methods in ((model, ("forward", "image_text_embedder", "image_embedder")), (base, ("forward",))):
        if type(m).__call__ is not torch.nn.Module.__call__:
            return False
        for name in methods:
            if name in vars(m) or not _transformers_code(getattr(type(m), name, None)):
                return False
    inside = {id(m) for m in tower.modules()}  # the text tower's own hooks are part of its live identity
    return not _users_hook(_hooks(m for m in model.modules() if id(m) not in inside))


def _hooks(modules: Any, global_too: bool = False) -> list[Any]:
    """The forward hooks and pre-hooks of ``modules`` (and, with ``global_too``, the global module hooks)."""
    from torch.nn.modules import module as torch_modules

    hooks = ([*torch_modules._global_forward_hooks.values(), *torch_modules._global_forward_pre_hooks.values()]
             if global_too else [])
    for m in modules:
        hooks += [*m._forward_hooks.values(), *m._forward_pre_hooks.values()]
    return hooks


def _users_hook(hooks: list[Any]) -> bool:
    """Whether any of ``hooks`` is someone's other than transformers' own."""
    return any(not (getattr(h, "__module__", None) or "").startswith("transformers.") for h in hooks)


def _transformers_code(fn: Any) -> bool:
    """Whether ``fn`` is a plain function of transformers' own source files, as is everything it wraps (a
    wrapper made with ``functools.wraps`` or wrapt elsewhere takes the wrapped function's ``__module__``)."""
    import types

    import transformers

    root = os.path.dirname(transformers.__file__) + os.sep
    while fn is not None:
        if type(fn) is not types.FunctionType or not fn.__code__.co_filename.startswith(root):
            return False
        fn = getattr(fn, "__wrapped__", None)
    return True


class _Classifier:
    """``ZeroShotImageClassificationPipeline._forward`` with the text tower's rows from the store."""

    _promptstore: _TextSide

    def _forward(self, model_inputs: Any) -> Any:
        from collections import UserDict

        candidate_labels = model_inputs.pop("candidate_labels")
        text_inputs = model_inputs.pop("text_inputs")
        text_inputs = text_inputs[0] if isinstance(text_inputs[0], UserDict) else text_inputs[0][0]
        side = _side(self, CLASSIFIER_FAMILIES)
        if side is None or not _stand_in_unseen(self.model, side.path):  # type: ignore[attr-defined]
            outputs = self.model(**text_inputs, **model_inputs)  # type: ignore[attr-defined]  # transformers' own call
            return {"candidate_labels": candidate_labels, "logits": outputs.logits_per_image}
        try:
            pooled = side.pooled(text_inputs["input_ids"], text_inputs.get("attention_mask"))
        except Drew as exc:
            warn_refuted("pipeline", exc)
            outputs = self.model(**text_inputs, **model_inputs)  # type: ignore[attr-defined]  # as if served never
            return {"candidate_labels": candidate_labels, "logits": outputs.logits_per_image}
        with side.serving(pooled, ids=text_inputs["input_ids"], mask=text_inputs.get("attention_mask")):
            outputs = self.model(**text_inputs, **model_inputs)  # type: ignore[attr-defined]
        return {"candidate_labels": candidate_labels, "logits": outputs.logits_per_image}


class _Detector:
    """``ZeroShotObjectDetectionPipeline._forward`` with the text side from the store, named once per
    call (:meth:`_TextSide.call_fingerprint`); for OWL the image tower runs once per call, every label
    of the image reusing its feature map."""

    _promptstore: _TextSide
    _image_memo: tuple[Any, ...] | None = None  # (the call's token, pixel values[, pixel mask], the image side's output)

    def preprocess(self, *args: Any, **kwargs: Any) -> Any:
        """transformers' preprocess, each label's inputs marked with its call (an object the device moves and
        the batch collation pass through: one call's labels hold the same one, no other call does)."""
        call = object()
        for model_inputs in super(type(self), self).preprocess(*args, **kwargs):  # type: ignore[misc]
            yield {**model_inputs, _CALL: call}

    def _forward(self, model_inputs: Any) -> Any:
        call = model_inputs.pop(_CALL, None)
        side = _side(self, DETECTOR_FAMILIES)
        if side is None or not _stand_in_unseen(self.model, side.path):  # type: ignore[attr-defined]
            return super(type(self), self)._forward(model_inputs)  # type: ignore[misc]  # transformers' own, unnamed
        target_size = model_inputs.pop("target_size")
        candidate_label = model_inputs.pop("candidate_label")
        is_last = model_inputs.pop("is_last")
        if call is None or isinstance(call, list):  # inputs not from preprocess, or a batch of several labels
            call = object()
        fingerprint = side.call_fingerprint(call)
        try:
            if side.path == DETECTOR_FAMILIES["grounding-dino"]:
                with self._backbone_once(call):
                    outputs = side.grounded(model_inputs, fingerprint)
                return {"target_size": target_size, "candidate_label": candidate_label, "is_last": is_last, **outputs}
            try:
                output = self._owl(model_inputs, call, fingerprint)
            except Drew as exc:
                warn_refuted("pipeline", exc)
                return super(type(self), self)._forward(  # type: ignore[misc]  # transformers' own
                    {**model_inputs, "target_size": target_size, "candidate_label": candidate_label, "is_last": is_last})
        except BaseException:
            self._image_memo = None  # the call is cut short: its image side is not kept
            raise
        finally:
            if is_last:
                side.end_call()
                self._image_memo = None
        return {"target_size": target_size, "candidate_label": candidate_label, "is_last": is_last, **output}

    @contextmanager
    def _backbone_once(self, call: Any) -> Any:
        """Grounding DINO's image backbone (Swin and its position embeddings: no text enters them) run once
        per ``call``: the call's later labels get copies of its output for the same pixels and mask, as
        transformers' pipeline computes it again for each (1.2 of a 7.5 s forward at 800 x 1066)."""
        owner = self.model.model  # type: ignore[attr-defined]
        # transformers' own hooks (capturing a layer's output inside the backbone's forward) are replayed with it.
        if _users_hook(_hooks(owner.backbone.modules(), global_too=True)):
            # A user's hook sees every label's run, as in transformers' pipeline.
            yield
            return
        with _swapped(self.model, owner, "backbone",  # type: ignore[attr-defined]
                      lambda original: _BackboneOnce(original, self, call)):
            yield

    def _owl(self, model_inputs: Any, call: Any, fingerprint: str) -> dict[str, Any]:
        """OWL's detection for one label; the image tower runs once per ``call``."""
        import torch

        model = self.model  # type: ignore[attr-defined]
        side = self._promptstore
        input_ids, mask = model_inputs["input_ids"], model_inputs.get("attention_mask")
        pixel_values = model_inputs["pixel_values"]
        pooled = side.pooled(input_ids, mask, fingerprint)
        base = _attr(model, side.path.rpartition(".")[0])
        if not _owl_forward_is_stock(model, base, side.tower):
            # The user's hook or patch is on what the path below goes around: the detector's own forward runs
            # (its image tower for every label, as in transformers' pipeline), only the text tower served.
            with torch.no_grad(), side.serving(pooled, ids=input_ids, mask=mask):
                return dict(model(**model_inputs))
        with torch.no_grad():
            query = base.text_projection(pooled)
            # The detector's own normalisation (OwlViTModel / Owlv2Model.forward).
            query = query / torch.linalg.norm(query, ord=2, dim=-1, keepdim=True)
            memo = self._image_memo
            if memo is not None and memo[0] is call and memo[1].shape == pixel_values.shape and torch.equal(memo[1], pixel_values):
                feature_map, vision_outputs = memo[2]
            else:
                feature_map, vision_outputs = model.image_embedder(pixel_values=pixel_values)[:2]
                self._image_memo = (call, pixel_values, (feature_map, vision_outputs))
            batch, h, w, dim = feature_map.shape
            image_feats = feature_map.reshape(batch, h * w, dim)
            queries = query.reshape(batch, -1, query.shape[-1])
            query_mask = input_ids.reshape(batch, -1, input_ids.shape[-1])[..., 0] > 0
            logits, class_embeds = model.class_predictor(image_feats, queries, query_mask)
            boxes = model.box_predictor(image_feats, feature_map, False)
            extra = {}
            if hasattr(model, "objectness_predictor"):
                extra["objectness_logits"] = model.objectness_predictor(image_feats)
        return {"logits": logits, "pred_boxes": boxes, "text_embeds": queries, "image_embeds": feature_map,
                "class_embeds": class_embeds, "vision_model_output": vision_outputs, **extra}
