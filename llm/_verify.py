"""Verified hits: a request recomputes a few of the positions it is served and compares their KV.

Keys describe what runs (weights, settings, hooks, code, ambient torch state); Python lets a
user change what runs in more ways than any description walks. This is the second, independent
defence: before a stored prefix is used, one small forward recomputes the tokens at a few served
positions (the last one and others spread over the range, the first included), each at its own
position and attending to the stored KV before it, and compares the keys and values every layer
computes for them with the stored ones. A change to what runs that moves the KV of a checked
position is seen whatever it was; a hit that disagrees is discarded and computed from scratch.

What it cannot see: a change confined to positions that were not checked, and a change after
the last layer's KV (the final norm, the head, sampling), which leaves stored KV right and runs
on every request anyway.
"""

from __future__ import annotations

import functools
import warnings
from typing import Any, NamedTuple

import numpy as np

from promptstore import KV_TOLERANCE, kv_tolerance
from promptstore.errors import PromptStoreWarning

__all__ = ["VERIFY_POSITIONS", "TOLERANCE", "Verdict", "check_positions", "confirm", "forget_refuted", "refute", "refuted",
           "tolerance", "verifiable", "verify_served", "InForward", "Refuted", "Works"]

# Positions recomputed per hit: the first, the last and two between (a change confined to early
# positions is seen too). Each is one more query token in a forward that reads every weight once.
VERIFY_POSITIONS = 4

# The bounds an unchanged model stays within (the core's, shared with the vLLM connector's check).
TOLERANCE = KV_TOLERANCE


class Verdict(NamedTuple):
    """What a check found: whether the hit stands, the worst error, and the first layer past the bound."""

    ok: bool
    error: float
    layer: int | None
    positions: int


tolerance = kv_tolerance  # the bound for KV computed or stored in any of the given dtypes


def check_positions(n: int, k: int = VERIFY_POSITIONS) -> np.ndarray:
    """``k`` served positions of ``n``: the first, the last, and the others evenly between (fewer if n < k)."""
    return np.unique(np.round(np.linspace(0, n - 1, min(k, n))).astype(np.int64))


# Root keys whose stored KV disagreed with a recompute in this process, until a later check under
# the same key passes (the model put back as it was): meanwhile nothing is stored under them by
# this process, since its live state is not what the key says.
_REFUTED: set[bytes] = set()


def refuted(root: bytes) -> bool:
    """Whether a check in this process found the entries under ``root`` differ from what the model computes."""
    return root in _REFUTED


def refute(root: bytes, verdict: Verdict, what: str) -> None:
    """Remember that ``root`` is not to be served or stored from this process, and warn once."""
    if root in _REFUTED:
        return
    _REFUTED.add(root)
    warnings.warn(
        f"promptstore: {what}: the stored KV of a hit differs from what the model computes now (first in layer "
        f"{verdict.layer}, relative error {verdict.error:.2g} over {verdict.positions} recomputed positions). The "
        "model changed in a way its key does not name (a patched function, a class attribute, an object it calls): "
        "this request and every later one of this live state are computed from scratch, and nothing is stored "
        "under that key from this process", PromptStoreWarning, stacklevel=4)


def confirm(root: bytes) -> None:
    """A check under ``root`` passed: the live state is again what the key says."""
    _REFUTED.discard(root)


def forget_refuted() -> None:
    """Forget every refuted key (tests; a process whose model was put back as it was)."""
    _REFUTED.clear()


def verifiable(model: Any) -> bool:
    """Whether the check can run on this model: every cache layer keeps per-token KV (or none at all).

    A layer with a running state (linear attention, SSM) has no state stored before the checked
    positions, so nothing at a served position can be recomputed, and attention kernels other
    than sdpa and eager take no custom mask: such models are served on their keys alone.
    """
    impl = getattr(model.config, "_attn_implementation", None) or "eager"
    # Other kernels (flash, flex, paged) take no tensor mask: flex aborts the process on one.
    return impl in ("sdpa", "eager") and _layer_plan(model) is not None


def _layer_plan(model: Any) -> tuple[tuple[str, ...], int | None] | None:
    """Per cache layer ``"full"``, ``"sliding"`` or ``"none"`` (a layer without a cache), and the window; None if any keeps a state."""
    from transformers import DynamicCache

    try:
        layers: list[Any] = DynamicCache(config=model.config).layers  # told apart by class name below
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot read: no plan
        return None
    kinds, window = [], None
    for layer in layers:
        name = type(layer).__name__
        if name == "DynamicLayer":
            kinds.append("full")
        elif name == "DynamicSlidingWindowLayer":
            kinds.append("sliding")
            window = int(layer.sliding_window) if window is None else min(window, int(layer.sliding_window))
        elif name == "DummyLayer":
            kinds.append("none")
        else:
            return None
    return tuple(kinds), window


def verify_served(model: Any, cache_arg: str, buffers: tuple[Any, Any], n: int, ids: np.ndarray, bound: float,
                  positions: np.ndarray | None = None) -> Verdict | None:
    """Recompute the tokens at ``positions`` of the served ``ids[:n]`` over the buffers' KV and compare.

    One forward: the checked tokens at their own positions, each attending to the stored KV
    before it and to itself (other checked positions see each other's fresh KV, which the check
    has just compared). The buffers are left exactly as they were.

    Args:
        model: the causal LM.
        cache_arg: the name of its forward's cache argument.
        buffers: (keys, values) of shape (layers that keep KV, 1, kv heads, capacity, width) holding ``n`` tokens.
        n: how many tokens the buffers hold (the served prefix).
        ids: the prompt's token ids (at least ``n``).
        bound: the largest relative error that stands.
        positions: the positions to check (default: ``check_positions(n)``).

    Returns:
        The verdict, or None where the check cannot run (see ``verifiable``).
    """
    import torch
    from transformers import DynamicCache

    plan = _layer_plan(model)
    if plan is None or not verifiable(model):
        return None
    kinds, window = plan
    at_np = check_positions(n) if positions is None else positions
    device = buffers[0].device
    at = torch.as_tensor(at_np, device=device)
    found: list[tuple[int, Any, Any, Any, Any]] = []  # per layer as it ran: (index, stored k, v, fresh k, v)
    cache = DynamicCache(config=model.config)
    layer_cls, kv_index = _check_layer_class(), iter(range(buffers[0].shape[0]))
    cache.layers = [layer if kind == "none" else layer_cls(buffers[0][i], buffers[1][i], n, at, found, i)
                    for layer, kind in zip(cache.layers, kinds, strict=True)
                    for i in [-1 if kind == "none" else next(kv_index)]]
    dtype = buffers[0].dtype
    columns = torch.arange(n, device=device)[None, :]
    allowed = {"full": columns <= at[:, None]}
    if window is not None:
        allowed["sliding"] = allowed["full"] & (columns > at[:, None] - window)
    additive = {kind: torch.zeros(m.shape, dtype=dtype, device=device).masked_fill(~m, torch.finfo(dtype).min)[None, None]
                for kind, m in allowed.items()}
    used = set(kinds) - {"none"}
    # Models with both kinds of layer take one mask per kind (transformers' causal_mask_mapping).
    mask: Any = additive[used.pop()] if len(used) == 1 else \
        {"full_attention": additive["full"], "sliding_attention": additive["sliding"]}
    params = {"logits_to_keep": 1} if "logits_to_keep" in _forward_params(model) else {}
    try:
        with torch.no_grad():
            model(torch.as_tensor(ids[at_np], device=device)[None], position_ids=at[None], attention_mask=mask,
                  use_cache=True, **{cache_arg: cache}, **params)
    finally:
        # Put the stored KV back wherever the pass wrote its own (only the checked positions).
        for i, old_k, old_v, _, _ in found:
            buffers[0][i][:, :, at] = old_k
            buffers[1][i][:, :, at] = old_v
    return _verdict(found, buffers[0].shape[0], len(at_np), bound)


def _verdict(found: list[tuple[int, Any, Any, Any, Any]], layers: int, positions: int, bound: float) -> Verdict:
    """The worst relative error over layers (K or V), and the first layer past ``bound``."""
    worst, first = 0.0, None
    for i, old_k, old_v, new_k, new_v in sorted(found, key=lambda f: f[0]):
        error = max(_relative(old_k, new_k), _relative(old_v, new_v))
        if first is None and not error <= bound:  # NaN is past any bound
            first = i
        worst = max(worst, error) if error == error else float("inf")
    if sorted(f[0] for f in found) != list(range(layers)):
        # Some layer never wrote its KV: the model did not run the pass as a cached forward.
        return Verdict(False, float("inf"), len(found), positions)
    return Verdict(first is None, worst, first, positions)


def _relative(stored: Any, fresh: Any) -> float:
    import torch

    a, b = stored.to(torch.float64), fresh.to(torch.float64)
    scale = float(torch.linalg.vector_norm(a))
    diff = float(torch.linalg.vector_norm(b - a))
    return diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))


def _forward_params(model: Any) -> Any:
    import inspect

    return inspect.signature(model.forward).parameters


@functools.lru_cache(maxsize=1)
def _check_layer_class() -> Any:
    """A cache layer over a prefix's buffers that records, then writes, the fresh KV of the checked positions."""
    from transformers.cache_utils import DynamicLayer

    class _CheckLayer(DynamicLayer):
        def __init__(self, kbuf: Any, vbuf: Any, n: int, at: Any, found: list[Any], index: int) -> None:
            # transformers leaves DynamicLayer.__init__ unannotated, and untyped_calls_exclude misses calls through super()
            super().__init__()  # type: ignore[no-untyped-call]
            self.lazy_initialization(kbuf, vbuf)
            self._kbuf, self._vbuf, self._n, self._at, self._found, self._index = kbuf, vbuf, n, at, found, index
            self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            self._found.append((self._index, self._kbuf[:, :, self._at].clone(), self._vbuf[:, :, self._at].clone(),
                                key_states.detach().clone(), value_states.detach().clone()))
            self._kbuf[:, :, self._at] = key_states.to(self._kbuf.dtype)
            self._vbuf[:, :, self._at] = value_states.to(self._vbuf.dtype)
            return self.keys, self.values

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return int(self._n)

    return _CheckLayer


VERIFY_CHECK_KIND = "llm.check"  # the admission verdicts' kind: whether the check runs right on a structure (works_on)


class Works(NamedTuple):
    """Where the check reproduces an unchanged model's own KV: in a forward of its own, in the request's forward."""

    alone: bool
    in_forward: bool


def works_on(model: Any, store: Any, signature: Any, layout: Any, cache_arg: str) -> Works:
    """Whether the check reproduces an unchanged model's own KV on this architecture, from the store when known.

    The check runs the model in a way a plain prefill does not (a custom mask, scattered
    positions; in the request's forward, its tokens' KV at other cache columns than their
    positions); an architecture that ignores those (positions from the mask, ALiBi biases from
    cache columns, remote code) would fail every check. One prefill of a short probe and one
    check of each kind over it, once per live structure (``signature``, as the layout's
    verdict), decide; a model the check cannot run on is served on its keys alone.
    """
    import torch
    import transformers

    if not verifiable(model) or not layout[0]:
        return Works(False, False)
    from ._admission import CHECKS

    key = store.key(VERIFY_CHECK_KIND, b"verify-check", fingerprints=[repr(signature), CHECKS,
                                                                       f"transformers={transformers.__version__}",
                                                                       f"torch={torch.__version__}"])
    entry = store.get(key, kind=VERIFY_CHECK_KIND)
    if entry is not None and {entry.meta.get("works"), entry.meta.get("in_forward")} <= {"0", "1"}:
        return Works(entry.meta["works"] == "1", entry.meta["in_forward"] == "1")
    from promptstore._live import Generators

    from ._admission import refuse_draws

    before = Generators()
    works = _self_test(model, layout, cache_arg)
    # Its prefill is longer than the layout's probe: a forward that draws only on longer inputs draws here.
    refuse_draws(before, type(model).__name__)
    store.put(key, {"works": np.array([int(works.alone), int(works.in_forward)], np.int8)}, kind=VERIFY_CHECK_KIND,
              meta={"works": str(int(works.alone)), "in_forward": str(int(works.in_forward))})
    return works


def _self_test(model: Any, layout: Any, cache_arg: str) -> Works:
    import torch

    from ._admission import vocab_size
    from ._buffers import KVBuffers, make_cache

    plan = _layer_plan(model)
    if plan is None:
        return Works(False, False)
    window = plan[1]
    vocab = vocab_size(model)
    n = max(24, (window or 0) + 12)
    ids = (np.arange(n + 1, dtype=np.int64) * 7 + 3) % vocab
    buffers = KVBuffers().allocate(layout, model.device, n + 16)
    bound = tolerance(_dtype_tag(layout[4]))
    try:
        cache = make_cache(buffers, 0, model.config)
        with torch.no_grad():
            model(torch.as_tensor(ids[:n], device=model.device)[None], use_cache=True, **{cache_arg: cache})
        verdict = verify_served(model, cache_arg, buffers, n, ids, bound)
        alone = verdict is not None and verdict.ok
    except Exception:  # noqa: BLE001 - a model the check cannot run on is served on its keys alone
        return Works(False, False)
    in_forward = False
    cache = make_cache(buffers, n, model.config)
    if alone and InForward.fits(model, cache):
        params = {"logits_to_keep": 1} if "logits_to_keep" in _forward_params(model) else {}
        try:
            with torch.no_grad(), InForward(model, cache, ids, n, bound, cache_arg) as check:
                model(input_ids=torch.as_tensor(ids[n:], device=model.device)[None], use_cache=True,
                      **{cache_arg: cache}, **params)
            in_forward = check.verdict is not None and check.verdict.ok
        except Exception:  # noqa: BLE001 - Refuted included: then the check runs in a forward of its own
            in_forward = False
    return Works(alone, in_forward)


def _dtype_tag(dtype: Any) -> str:
    return {"torch.float64": "F64", "torch.float32": "F32", "torch.float16": "F16", "torch.bfloat16": "BF16"}.get(
        str(dtype), "BF16")


class Refuted(Exception):
    """Raised out of a request's forward whose checked positions disagree with the stored KV."""

    def __init__(self, verdict: Verdict) -> None:
        super().__init__(f"first in layer {verdict.layer}, relative error {verdict.error:.2g}")
        self.verdict = verdict


class InForward:
    """The check carried by the request's own next forward: the checked tokens ride after its tokens.

    ``with InForward(model, cache, ids, n, bound) as check: model.generate(...)`` (or any call that
    runs the model once over the cache first): that forward's input gets the tokens at the checked
    positions appended, with their own positions and a mask under which each attends to the stored
    KV before it and to itself, and the request's tokens to what they attend to anyway. Its scores
    are those of the request's last token; the appended tokens' KV is compared with the stored KV,
    then dropped from the cache. A disagreement raises :class:`Refuted` out of the forward, before
    a token is chosen from it. One pass over the weights serves both: the check adds a few query
    rows, not a forward. Needs a cache whose every layer is one of the in-place KV layers of
    _buffers.py over full attention (``InForward.fits``).
    """

    def __init__(self, model: Any, cache: Any, ids: np.ndarray, n: int, bound: float, cache_arg: str) -> None:
        self.model, self.cache, self.ids, self.n, self.bound, self.cache_arg = model, cache, ids, n, bound, cache_arg
        self.at = check_positions(n)
        self.verdict: Verdict | None = None
        self._handles: list[Any] = []
        self._u = 0

    @staticmethod
    def fits(model: Any, cache: Any) -> bool:
        """Whether the check can ride in a forward over ``cache``: full attention only, in-place layers only."""
        from ._buffers import reserved_layer_classes

        plan = _layer_plan(model)
        classes = reserved_layer_classes() or {}
        full = classes.get("DynamicLayer")
        return (plan is not None and verifiable(model) and set(plan[0]) == {"full"} and full is not None
                and all(type(layer) is full for layer in getattr(cache, "layers", [None])))

    def __enter__(self) -> InForward:
        self._handles = [self.model.register_forward_pre_hook(self._before, with_kwargs=True),
                         self.model.register_forward_hook(self._after, with_kwargs=True)]
        return self

    def __exit__(self, *exc: Any) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    def _before(self, module: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        import torch

        if self.verdict is not None or self._u or kwargs.get(self.cache_arg) is not self.cache:
            return None  # only the request's first forward over this cache carries the check
        ids = kwargs.get("input_ids", args[0] if args else None)
        # ignore[union-attr] here and below: the `is not self.cache` test above makes mypy narrow the Any cache to Any | None
        if ids is None or self.cache.get_seq_length() != self.n:  # type: ignore[union-attr]
            return None
        device = ids.device
        k, u = len(self.at), int(ids.shape[1])
        self._u = u
        at = torch.as_tensor(self.at, device=device)
        own = torch.arange(self.n, self.n + u, device=device)
        columns = torch.arange(self.n + u + k, device=device)[None, :]
        rows_own = columns <= own[:, None]  # causal over the stored KV and the request's tokens
        rows_check = (columns < at[:, None]) | (columns == (self.n + u + torch.arange(k, device=device))[:, None])
        allowed = torch.cat([rows_own, rows_check])
        dtype = self.cache.layers[0]._kbuf.dtype  # type: ignore[union-attr]  # see the get_seq_length line
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)
        kwargs = dict(kwargs)
        kwargs["input_ids"] = torch.cat([ids, torch.as_tensor(self.ids[self.at], device=device)[None]], dim=1)
        kwargs["position_ids"] = torch.cat([own, at])[None]
        kwargs["attention_mask"] = mask[None, None]
        kwargs["cache_position"] = torch.arange(self.n, self.n + u + k, device=device)
        if "logits_to_keep" in kwargs or "logits_to_keep" in _forward_params(self.model):
            kwargs["logits_to_keep"] = k + 1
        return (), kwargs

    def _after(self, module: Any, args: Any, kwargs: dict[str, Any], output: Any) -> Any:
        if self.verdict is not None or not self._u or kwargs.get(self.cache_arg) is not self.cache:
            return None  # another forward of the model (another thread's own call) while the check waits
        import torch

        k, u, n = len(self.at), self._u, self.n
        at = torch.as_tensor(self.at)
        found = []
        cache: Any = self.cache
        for i, layer in enumerate(cache.layers):
            fresh_k, fresh_v = layer._kbuf[:, :, n + u : n + u + k], layer._vbuf[:, :, n + u : n + u + k]
            found.append((i, layer._kbuf[:, :, at], layer._vbuf[:, :, at], fresh_k, fresh_v))
            layer.keys, layer.values = layer._kbuf[:, :, : n + u], layer._vbuf[:, :, : n + u]
            layer._n = n + u
        self.verdict = _verdict(found, len(cache.layers), len(self.at), self.bound)
        logits = getattr(output, "logits", None)
        if logits is not None and logits.shape[1] >= k + 1:
            output.logits = logits[:, -(k + 1) : -k]
        if not self.verdict.ok:
            raise Refuted(self.verdict)
        return output
