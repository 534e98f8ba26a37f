"""OmDet-Turbo's language caches, filled from the store.

transformers' ``OmDetTurboForObjectDetection`` keeps two in-process LRU caches (``cache_size``
entries each, 100 by default) of its language backbone's outputs: one per class name, one per task
prompt, keyed by token ids alone. A new process encodes every class and task again, and a
vocabulary larger than ``cache_size`` evicts itself on every call. :func:`serve_omdet` replaces both
caches with ones backed by the store: the same interface and values, keyed by the language
backbone's live identity (weights, settings, hooks, code; ambient torch state) and the token ids,
so an edited backbone is another key, where transformers' own caches would keep serving what the
old one computed.

A forward that runs the backbone anyway (some names missing) re-encodes one name the store served
in that forward and compares (:mod:`._verify`); on a mismatch every name that forward took from the
store is encoded again in place, with a warning, and nothing more is served or stored under that
backbone's key in this process.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any

import numpy as np

from promptstore import PromptStore
from promptstore._live import Generators
from promptstore.errors import InvalidInputError, UnsupportedModelError

from ._classes import TEXT_KIND, Recipes, describe_ahead
from ._pipelines import _padding_inert
from ._verify import Drew, Refuted, check_feature, warn_refuted
from ._zeroshot import _STORED, _storable

__all__ = ["serve_omdet"]


def serve_omdet(model: Any, store: PromptStore | None = None) -> Any:
    """Back ``model``'s class and task caches with ``store``; returns ``model`` (called as before).

    Args:
        model: transformers' ``OmDetTurboForObjectDetection``, in eval mode.
        store: default ``PromptStore()``.

    Raises:
        InvalidInputError: not an OmDet-Turbo detector.
        UnsupportedModelError: a model in training mode.
    """
    if type(model).__name__ != "OmDetTurboForObjectDetection":
        raise InvalidInputError(f"expected transformers' OmDetTurboForObjectDetection, got {type(model).__name__}")
    if model.training:
        raise UnsupportedModelError("OmDet-Turbo in training mode: call .eval()")
    side = _Backbone(model, store if store is not None else PromptStore())
    capacity = int(model.config.cache_size)
    # transformers keys its caches by a row's unmasked ids; the backbone sees the whole padded row (no mask
    # reaches its text model): only padding after the row's own tokens leaves their features unchanged.
    model._get_cache_key_at_index = _cache_key
    model.language_cache_class = _StoredCache(side, "class", capacity)
    model.language_cache_prompt = _StoredCache(side, "task", capacity)
    # One hook, of the store served now (serve_omdet again: another store replaces the first).
    for hook_id, hook in list(model._forward_pre_hooks.items()):
        if isinstance(getattr(hook, "__self__", None), _Backbone):
            del model._forward_pre_hooks[hook_id]
    model.register_forward_pre_hook(side.new_call)
    describe_ahead(side.fingerprint)
    side.new_call(model, ())  # the key itself is taken again by the first forward
    return model


class _Backbone:
    """The language backbone's key, taken once per forward of the detector."""

    def __init__(self, model: Any, store: PromptStore) -> None:
        self.model, self.store = model, store
        self._fingerprint: str | None = None
        self.refuted: set[str] = set()
        self.encoded = 0  # rows the backbone computed for a check

    def new_call(self, module: Any, args: Any) -> None:
        self._fingerprint = None
        for cache in (self.model.language_cache_class, self.model.language_cache_prompt):
            if isinstance(cache, _StoredCache):
                cache.served_now.clear()
                cache.generators = None

    def __deepcopy__(self, memo: dict[int, Any]) -> _Backbone:
        """A copy of the model serves itself: described as the copy, over the same store (a store is shared,
        as between processes; its files and connections are not copied)."""
        import copy

        new = _Backbone.__new__(_Backbone)
        memo[id(self)] = new
        new.model, new.store = copy.deepcopy(self.model, memo), self.store
        new._fingerprint, new.refuted, new.encoded = None, set(self.refuted), 0  # refuted keys stay refuted
        return new

    def fingerprint(self) -> str:
        if self._fingerprint is None:
            from promptstore._live import ambient_identity, module_identity

            backbone = self.model.language_backbone
            device = next(backbone.parameters()).device.type
            live = module_identity(backbone, what="OmDet-Turbo's language backbone")
            self._fingerprint = f"omdet-language:{type(self.model).__qualname__}:device={device}:{live}:{ambient_identity()}"
        return self._fingerprint

    def encode(self, which: str, ids: tuple[int, ...]) -> Any:
        """One name (class) or prompt (task) through the backbone now, as the detector's caches hold it."""
        import torch

        backbone = self.model.language_backbone
        device = next(backbone.parameters()).device
        row = torch.tensor([ids], device=device)
        self.encoded += 1
        with torch.no_grad():
            if which == "class":
                return backbone(row, encode_type="class")[0]
            emb, mask = backbone(row, mask=torch.ones_like(row), encode_type="task")
            return emb[:, [0], :], mask[0][None]


class _StoredCache:
    """``OmDetTurboLRUCache``'s interface (has, get, put) over an in-process LRU and the store."""

    def __init__(self, side: _Backbone, which: str, capacity: int) -> None:
        self.side, self.which, self.capacity = side, which, capacity
        self.cache: OrderedDict[tuple[str, Any], Any] = OrderedDict()
        self.served_now: dict[Any, Any] = {}  # what this forward took from the store (or memory): key -> value
        # The random generators at this forward's first miss, before the backbone computes the misses.
        self.generators: Generators | None = None

    def _recipes(self) -> tuple[Recipes, str]:
        fp = self.side.fingerprint()
        return Recipes(self.side.store, f"{fp}:{self.which}"), fp

    def has(self, key: Any) -> bool:
        if isinstance(key, _Unkeyed):
            return False
        recipes, fp = self._recipes()
        if fp in self.side.refuted:
            return False
        if (fp, key) in self.cache:
            return True
        value = self._read(recipes, key)
        if value is None:
            if self.generators is None:
                self.generators = Generators()
            return False
        self._remember(fp, key, value)
        return True

    def get(self, key: Any) -> Any:
        _, fp = self._recipes()
        if (fp, key) not in self.cache:
            return None
        self.cache.move_to_end((fp, key))
        value = self.cache[(fp, key)]
        self.served_now[key] = value
        return value

    def put(self, key: Any, value: Any) -> None:
        if isinstance(key, _Unkeyed):
            return
        recipes, fp = self._recipes()
        if fp in self.side.refuted:
            return
        if self.generators is not None and self.generators.moved():
            # The backbone drew random numbers: what it computed is one draw. Kept in this process, as the
            # detector's own cache keeps it, and not stored (another process draws its own).
            warn_refuted("OmDet-Turbo", Drew("its language backbone"))
            self._remember(fp, key, value)
            return
        if self.served_now and not self._confirmed(fp):
            return
        t0 = time.perf_counter()
        tensors = ({"text": _storable(value)} if self.which == "class" else
                   {"text": _storable(value[0][:, 0, :]), "mask": np.asarray(value[1].detach().cpu().numpy())})
        self.side.store.put(recipes.text(_payload(key)), tensors, kind=TEXT_KIND,
                            cost_s=time.perf_counter() - t0, meta={"encoder": recipes.efp})
        self._remember(fp, key, value)

    def _confirmed(self, fp: str) -> bool:
        """The backbone ran in this forward: one value served in it, encoded again and compared.

        On a mismatch every served value of this forward is recomputed in place (the detector
        stacks them after this call), and the key is refuted for this process.
        """
        key, value = next(iter(self.served_now.items()))
        fresh = self.side.encode(self.which, key)
        n = len(key)  # a task's features are per token: its own tokens (the rest is padding, masked)
        stored = value if self.which == "class" else value[0][:n]
        now = fresh if self.which == "class" else fresh[0]
        try:
            check_feature(str(key), stored.float().cpu().numpy(), now.float().cpu().numpy(), str(stored.dtype))
        except Refuted as exc:
            warn_refuted("OmDet-Turbo", exc)
            self.side.refuted.add(fp)
            for k, v in self.served_now.items():
                again = self.side.encode(self.which, k)
                if self.which == "class":
                    v.copy_(again)
                else:
                    v[0][: len(k)].copy_(again[0])
            self.cache.clear()
            self.served_now.clear()
            return False
        self.served_now.clear()  # one check per forward
        return True

    def _read(self, recipes: Recipes, key: Any) -> Any:
        import torch

        entry = self.side.store.get(recipes.text(_payload(key)), kind=TEXT_KIND)
        backbone = self.side.model.language_backbone
        dtype, device = backbone.text_projection.dtype, backbone.text_projection.device
        if entry is None or entry.dtypes.get("text") != _STORED.get(str(dtype).removeprefix("torch.")):
            return None
        arr = np.array(entry.tensors["text"])
        text = (torch.from_numpy(arr.view(np.int16)).view(torch.bfloat16) if dtype == torch.bfloat16
                else torch.from_numpy(arr)).to(device)
        if self.which == "class":
            return text if text.ndim == 1 else None
        if "mask" not in entry.tensors or text.ndim != 2:
            return None
        return text[:, None, :], torch.from_numpy(np.array(entry.tensors["mask"])).to(device)

    def _remember(self, fp: str, key: Any, value: Any) -> None:
        self.cache[(fp, key)] = value
        self.cache.move_to_end((fp, key))
        while len(self.cache) > self.capacity:
            self.cache.popitem(last=False)


class _Unkeyed(tuple):  # type: ignore[type-arg]
    """A row's unmasked ids where its padding is not after them (left padding): its features depend on the
    padding, which the ids do not name; never served or stored, computed as a fresh model computes it."""


def _cache_key(input_ids: Any, attention_mask: Any, index: int) -> tuple[int, ...]:
    """transformers' ``_get_cache_key_at_index`` (the row's unmasked ids), an :class:`_Unkeyed` where the
    padding is not a suffix of the row, or where the class pooling (the row's largest id) could land on a pad."""
    row, kept = input_ids[index].tolist(), attention_mask[index].tolist()
    key = tuple(t for t, m in zip(row, kept, strict=True) if m)
    return key if _padding_inert(row, kept, len(key), "argmax", None) else _Unkeyed(key)


def _payload(key: Any) -> str:
    return "ids:" + ",".join(str(int(t)) for t in key)
