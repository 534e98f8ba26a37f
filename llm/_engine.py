"""The engine under PrefixCache and ChunkCache: one model on one store, and what every request through it shares.

An :class:`Engine` holds what outlives a request: the model's checked layout (re-derived whenever
its live identity moves), its measured forward rates, the host KV buffers, and the operations
on stored blocks that need no request (reading blocks into buffers, shaping KV to store, running
a forward). What one request knows (its root key, where it parts from the stored prompts, its
check, its counts) lives in a :class:`~._request.Request`, made by :meth:`Engine.request`.

Requests on one model run one at a time (:func:`model_lock`): a request attaches hooks to the
model for one forward and reads its live identity, and two at once would see each other's.
"""

from __future__ import annotations

import inspect
import os
import queue
import threading
import time
import weakref
from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from promptstore import Entry, PromptStore
from promptstore._live import autocast_active
from promptstore.errors import InvalidInputError, UnsupportedModelError

from ._admission import Layout, States, checked_layout, vocab_size
from ._buffers import CAPACITY_STEP, RESERVE_TOKENS, KVBuffers, copy_block, host_view, make_cache, warm_allocator
from ._decide import Rates
from ._fingerprint import ambient_fingerprint, cache_code_fingerprint, model_fingerprint, model_structure, tokenizer_fingerprint
from ._inputs import refuse_padding
from ._verify import tolerance, works_on

if TYPE_CHECKING:
    from ._request import Request

__all__ = ["Engine", "KIND", "STATE_EVERY_TOKENS", "Structure", "TAIL_KIND", "model_lock"]

KIND = "llm.kv"
STORED_DTYPES = ("F64", "F32", "F16", "BF16")  # what stored KV may be: anything else under a key is a miss
TAIL_KIND = "llm.kv.tail"  # the key space of partial blocks (stored with kind llm.kv)
# Linear-attention/SSM models: a miss stores every layer's running state about this often (a
# whole number of blocks), and at each request's end. Chosen in bench/state_every.py: the least
# worst regret over two workloads (RAG documents, a shared system prompt) and two state models.
STATE_EVERY_TOKENS = 256
KV_DTYPES = {None: None, "float32": "F32", "float16": "F16", "bfloat16": "BF16"}
Structure = tuple[str, list[tuple[str, Any]]]  # what model_structure returns: the model's live identity but its bytes


_MODEL_LOCKS: weakref.WeakKeyDictionary[Any, threading.RLock] = weakref.WeakKeyDictionary()
_MODEL_LOCKS_GUARD = threading.Lock()


def model_lock(model: Any) -> threading.RLock:
    """The lock every request through a cache on ``model`` holds, whichever cache it goes through.

    A request attaches hooks to the model for one forward (the hit's check, ChunkCache's query
    reads) and reads its live identity: two requests on one model at once would see each other's.
    """
    with _MODEL_LOCKS_GUARD:
        lock = _MODEL_LOCKS.get(model)
        if lock is None:
            lock = _MODEL_LOCKS[model] = threading.RLock()
        return lock


def dtype_name(dtype: Any) -> str | None:
    """``kv_dtype`` as a name (``"float16"``...), or None; anything else is refused."""
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    if name not in KV_DTYPES:
        raise InvalidInputError(f"kv_dtype must be None, float32, float16 or bfloat16, got {dtype!r}")
    return name


class Engine:
    """One model, its tokenizer and one store, served in blocks of ``block_tokens`` (see PrefixCache).

    Settings are PrefixCache's (validated there). Refuses a model it cannot serve exactly with
    :class:`~promptstore.errors.UnsupportedModelError` when built, before anything is stored.
    """

    def __init__(self, model: Any, tokenizer: Any, store: PromptStore, block_tokens: int, kv_dtype: str | None,
                 verify: bool, reuse: str) -> None:
        self.model, self.tokenizer, self.store = model, tokenizer, store
        self.block_tokens, self.kv_dtype, self.verify, self.reuse = block_tokens, kv_dtype, verify, reuse
        params = inspect.signature(model.forward).parameters
        # transformers 5.24 renamed `past_key_values` to `cache`; use whichever this version takes.
        self.cache_arg = "cache" if "cache" in params else "past_key_values"
        # Only the last position's scores are returned: computing the others costs a vocabulary-wide
        # projection per prompt token.
        self.last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._layout: tuple[Any, tuple[Layout, States, bool]] | None = None
        self.checkable = False  # whether served positions can be recomputed on this live structure (_verify.py)
        self.check_in_forward = False  # whether that check can ride in the request's forward (else one of its own)
        self._buffers = KVBuffers()  # host KV buffers reused across requests, pinned slots for copies to a GPU
        warm_allocator()
        self.prefill_tps: float | None = None  # the last measured prefill rate (tokens/s), to price generated blocks
        self._rates: Rates | None = None  # this setting's measured forward rates: reuse or recompute
        # Requests share the buffers and the model's hooks: one request on this model at a time,
        # through this engine or any other.
        self.lock = model_lock(model)
        # The copy of the last request's blocks, made after it returned (settle).
        self.pending: Future[None] | None = None
        self.refresh()  # refuse an unsupported model before anything is looked up or stored

    def request(self, n_queried: int = 0) -> Request:
        """A new request over the model as it is now (its layout checked again; its root key taken when first needed)."""
        from ._request import Request

        self.settle()
        return Request(self, self.refresh(), n_queried)

    def settle(self) -> None:
        """Return once the blocks the last request left to copy after it returned are in the store."""
        if self.pending is not None:
            # In a forked child this returns at once (PromptStore.later): the parent's writer runs the copy.
            self.pending.result()  # forgotten only once done: an interrupted wait leaves it to be waited for again
            self.pending = None

    def copying(self, job: Future[None]) -> None:
        """Note the copy of a request's blocks that runs after it returned: the next request waits for it."""
        self.pending = job

    @property
    def signature(self) -> Any:
        """What the current layout was derived for (dtypes, device, structure, ambient state, code)."""
        return self._layout[0] if self._layout is not None else None

    def fingerprints(self, structure: Structure) -> list[str]:
        """What a request's keys are bound to, for the live ``structure`` that ``refresh`` returned."""
        layers, heads, k_dim, v_dim, dtype = self.layout()
        stored = self.kv_dtype or str(dtype).replace("torch.", "")
        width = k_dim if k_dim == v_dim else f"{k_dim}/{v_dim}"  # keys and values of one width: as before
        # Read on every request (microseconds when unchanged): a tokenizer edited in place
        # (add_tokens, another chat template) is another key at once.
        states = self.states()
        return [model_fingerprint(self.model, structure), tokenizer_fingerprint(self.tokenizer),
                ambient_fingerprint(), cache_code_fingerprint(),
                f"kv:{stored}:dynamic[{layers},{heads},T,{width}]", f"block:{self.block_tokens}",
                *([f"states:{sorted(states.items())}"] if states else [])]

    def root_key(self, structure: Structure) -> bytes:
        """The key every block of a request chains from. Hashes every weight (tens of ms): once per request."""
        return self.store.key(KIND, b"", fingerprints=self.fingerprints(structure))

    def _checked(self) -> tuple[Layout, States, bool]:
        if self._layout is None:
            self.refresh()
        assert self._layout is not None
        return self._layout[1]

    def layout(self) -> Layout:
        return self._checked()[0]

    def states(self) -> States:
        """The model's linear-attention/SSM state tensors (empty: every layer keeps KV)."""
        return self._checked()[1]

    def stepwise(self) -> bool:
        """Whether the model continues a running state one token at a time only (Mamba: see probe_model)."""
        return self._checked()[2]

    def refresh(self) -> Structure:
        """Check the model as it is now, and re-derive the layout whenever its live identity moved.

        Once per request. Refuses, before anything is looked up or stored: active dropout or
        batch norm in training mode (random outputs must never be frozen into a cache) and
        autocast (its KV mixes dtypes). The layout is derived again, through the model check,
        whenever anything but the weights' values changed: dtype or device (``.half()``,
        ``.to()``), config (a sliding window set live), settings, hooks, code, ambient state.
        """
        import torch

        cast = autocast_active(torch, self.model.device.type)
        if cast is not None:
            raise UnsupportedModelError(f"PrefixCache under torch.autocast ({cast}): its KV mixes dtypes (autocast "
                                        "keys, full-precision values), so no stored block could be served; call it "
                                        "outside autocast, or convert the model (model.to(dtype))")
        peft = getattr(self.model, "peft_config", None)
        if isinstance(peft, Mapping) and any(getattr(c, "is_prompt_learning", False) for c in peft.values()):
            # Virtual tokens are prepended inside the model's forward: stored KV would sit at other
            # positions than its token ids say, and a recompute never runs them the same way.
            raise UnsupportedModelError(f"{type(self.model).__name__} carries a peft prompt-learning adapter (prompt, "
                                        "prefix or p-tuning: virtual tokens the token ids do not show); merge or "
                                        "remove it, or call the model without PrefixCache")
        structure = model_structure(self.model)
        if any(getattr(t, "is_meta", False) for _, t in structure[1]):
            raise UnsupportedModelError(f"{type(self.model).__name__} has tensors on the meta device (no values): load "
                                        "its weights before serving it")
        # Dtypes read from the tensors themselves: .half() keeps every Parameter object.
        # The cache classes' code too: a model with running states is run in pieces on a miss, which
        # is exact only while the code that passed the pieces check is what runs.
        signature = (tuple(sorted({str(t.dtype) for _, t in structure[1]})), str(self.model.device),
                     structure[0], ambient_fingerprint(), cache_code_fingerprint())
        if self._layout is None or self._layout[0] != signature:
            layout = checked_layout(self.model, self.store, signature, self.output_cache)
            works = works_on(self.model, self.store, signature, layout[0], self.cache_arg)
            # Named only once both checks passed: a model refused by either is refused again next request.
            self._layout = (signature, layout)
            self._rates = None  # another dtype, device or structure: its own measured rates
            self.checkable = not layout[1] and works.alone
            self.check_in_forward = self.checkable and works.in_forward
        return structure

    def output_cache(self, out: Any) -> Any:
        cache = getattr(out, "cache", None)
        return cache if cache is not None else getattr(out, "past_key_values", None)

    def token_ids(self, input_ids: Any) -> np.ndarray:
        ids = input_ids
        if isinstance(ids, Mapping) and "input_ids" in ids:
            # What tokenizers and apply_chat_template(..., return_tensors="pt") return (a BatchEncoding).
            refuse_padding(ids.get("attention_mask"))
            ids = ids["input_ids"]
        if hasattr(ids, "detach"):
            ids = ids.detach().cpu().numpy()
        ids = np.asarray(ids)
        if ids.ndim == 2:
            if ids.shape[0] != 1:
                raise InvalidInputError(
                    f"a batch of {ids.shape[0]} sequences: PrefixCache serves one sequence at a time "
                    "(call it once per sequence)"
                )
            ids = ids[0]
        if ids.ndim != 1 or ids.size == 0:
            raise InvalidInputError("input_ids must be a non-empty 1-D sequence of token ids (or a batch of one)")
        if not np.issubdtype(ids.dtype, np.integer):
            raise InvalidInputError(f"token ids must be integers, got {ids.dtype}")
        vocab = vocab_size(self.model)
        if int(ids.min()) < 0 or int(ids.max()) >= vocab:
            raise InvalidInputError(f"token ids must lie in [0, {vocab}) for this model, got {int(ids.min())}..{int(ids.max())}")
        out: np.ndarray = ids.astype(np.int64)
        return out

    def fits(self, entry: Entry) -> bool:
        layers, heads, k_dim, v_dim, _ = self.layout()
        want = (layers, heads, self.block_tokens)
        try:
            return (tuple(entry.tensors["k"].shape) == (*want, k_dim) and tuple(entry.tensors["v"].shape) == (*want, v_dim)
                    and entry.dtypes["k"] == entry.dtypes["v"] and entry.dtypes["k"] in STORED_DTYPES)
        except KeyError:
            return False

    def rates(self) -> Rates:
        if self._rates is None:
            self._rates = Rates(self.store, self.model, self.layout()[4], self.model.device)
        return self._rates

    def checks(self) -> bool:
        return self.verify and self.checkable

    def bound(self) -> float:
        dtype = str(self.layout()[4]).replace("torch.", "")
        computed = {**KV_DTYPES, "float64": "F64"}.get(dtype, "BF16")  # a float64 model stores F64 KV: its own bound
        return tolerance(*{d for d in (computed, KV_DTYPES[self.kv_dtype]) if d is not None})

    def state_every(self) -> int:
        """Tokens between the states a miss stores (a whole number of blocks, about STATE_EVERY_TOKENS)."""
        return max(1, round(STATE_EVERY_TOKENS / self.block_tokens)) * self.block_tokens

    def shared(self, tail: Entry, ids: np.ndarray) -> int:
        """How many leading tokens of ``ids`` the stored tail holds KV for (0 if it does not fit)."""
        layers, heads, k_dim, v_dim, _ = self.layout()
        tokens = tail.tensors.get("tokens")
        r = tokens.shape[0] if tokens is not None and tokens.ndim == 1 else -1
        if "full" in tail.meta:  # a pointer to a full block: its tokens only
            if r != self.block_tokens:
                return 0
        else:
            k, v = tail.tensors.get("k"), tail.tensors.get("v")
            if (not 0 < r < self.block_tokens or k is None or v is None or k.shape != (layers, heads, r, k_dim)
                    or v.shape != (layers, heads, r, v_dim)
                    or tail.dtypes["k"] != tail.dtypes["v"] or tail.dtypes["k"] not in STORED_DTYPES):
                return 0
        if tokens is None:
            return 0
        n = min(r, len(ids))
        differ = np.flatnonzero(tokens[:n].astype(np.int64) != ids[:n])
        return int(differ[0]) if differ.size else n

    def copy_tail(self, buffers: tuple[Any, Any], tail: Entry, lo: int, n: int) -> None:
        import torch

        for side, full in zip(("k", "v"), buffers, strict=True):
            src = tail.tensors[side][:, :, :n, :]
            if full.device.type == "cuda":
                # pragma: no mutate start (a GPU's path: tests/test_llm.py runs it on the GPU machine)
                host = torch.empty((full.shape[0], full.shape[2], n, full.shape[4]), dtype=full.dtype)
                copy_block(host_view(host), src, tail.dtypes[side], full.dtype)
                full[:, 0, :, lo : lo + n, :].copy_(host.to(full.device))
                # pragma: no mutate end
            else:
                copy_block(host_view(full)[:, 0, :, lo : lo + n, :], src, tail.dtypes[side], full.dtype)

    def read_blocks(self, keys: list[bytes], buffers: tuple[Any, Any], usable: int, first: int = 0) -> int:
        """Read the stored blocks of ``keys`` into their places in ``buffers``, up to the first miss.

        Each block is read from the store in one copy, its checksum verified on the way (see
        ``PromptStore.get(into=)``): on the CPU straight into its slice of the final per-layer
        buffers; for a GPU into a pinned staging slot, from which an asynchronous copy moves it
        to the device while the next blocks are read. Several blocks are read at a time (file
        reads, hashing and copies release the GIL). Returns how many blocks in a row were found.
        """
        import torch

        host = buffers[0].device.type == "cpu"
        bt = self.block_tokens
        workers = 2 if host else max(2, min(8, os.cpu_count() or 1))
        free: queue.SimpleQueue[Any] = queue.SimpleQueue()
        copies: list[Any] = []
        if not host:
            # pragma: no mutate start (a GPU's path)
            for slot in self._buffers.staging_slots(self.layout(), self.block_tokens, 2 * workers):
                free.put((slot, None))
            # pragma: no mutate end
        local = threading.local()

        def fetch(i: int) -> bool:
            b = first + i
            lo, hi = b * bt, min((b + 1) * bt, usable)
            slot = event = None
            if host:
                into = {side: host_view(full)[:, 0, :, lo : lo + bt, :]
                        for side, full in zip(("k", "v"), buffers, strict=True)}
            else:
                # pragma: no mutate start (a GPU's path, as below)
                slot, event = free.get()
                if event is not None:
                    event.synchronize()  # the copy that read this slot has finished
                event = None
                into = {"k": host_view(slot[0]), "v": host_view(slot[1])}
                # pragma: no mutate end
            try:
                entry = self.store.get(keys[i], kind=KIND, into=into)
                if entry is None or not self.fits(entry):
                    return False  # a block that does not fit this model is a miss, never a crash
                for side, dst in into.items():
                    if entry.tensors[side] is not dst:  # stored in another dtype: converted on the way
                        copy_block(dst, entry.tensors[side], entry.dtypes[side], buffers[0].dtype)
                if not host:
                    # pragma: no mutate start (a GPU's path: tests/test_llm.py runs it on the GPU machine)
                    stream = getattr(local, "stream", None)
                    if stream is None:
                        stream = local.stream = torch.cuda.Stream(device=buffers[0].device)
                    with torch.cuda.stream(stream):
                        for full, stage in zip(buffers, cast(Any, slot), strict=True):
                            full[:, 0, :, lo:hi, :].copy_(stage[:, :, : hi - lo, :], non_blocking=True)
                        event = torch.cuda.Event()
                        event.record(stream)
                    copies.append(event)
                    # pragma: no mutate end
                return True
            finally:
                if slot is not None:
                    free.put((slot, event))

        if len(keys) == 1:
            found = int(fetch(0))
        else:
            # Blocks past a miss may still be read; every read ends before the caller uses the buffers.
            with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="promptstore-kv") as pool:
                futures = [pool.submit(fetch, i) for i in range(len(keys))]
                found = 0
                while found < len(futures) and futures[found].result():
                    found += 1
                for future in futures[found:]:
                    future.cancel()
        if copies:
            # pragma: no mutate start (a GPU's path)
            current = torch.cuda.current_stream(buffers[0].device)
            for event in copies:
                current.wait_event(event)  # the forward runs after every block has landed
            # pragma: no mutate end
        return found

    def allocate(self, capacity: int) -> tuple[Any, Any]:
        return self._buffers.allocate(self.layout(), self.model.device, capacity)

    def stack(self, kv: list[tuple[Any, Any]], side: int, lo: int, hi: int) -> Any:
        """Keys (side 0) or values (1) of tokens ``lo:hi`` for every KV layer: (layers, heads, tokens, width)."""
        import torch

        if not kv:  # running states only (Mamba2): a block holds no KV, it marks its place in the chain
            return torch.empty((0, 0, hi - lo, 0), dtype=self.layout()[4])
        return torch.stack([layer[side][0, :, lo:hi, :] for layer in kv])

    def to_stored(self, t: Any) -> Any:
        import torch

        target = getattr(torch, self.kv_dtype) if self.kv_dtype else t.dtype
        t = t.to(device="cpu", dtype=target).contiguous()
        if target == torch.bfloat16:
            return (t.view(torch.int16).numpy().view(np.uint16), "BF16")
        return t.numpy()

    def forward(self, ids: np.ndarray, start: int, stop: int, cache: Any) -> tuple[Any, Any, float]:
        import torch

        chunk = torch.as_tensor(ids[start:stop], device=self.model.device)[None]
        if cache is None:
            cache = self.miss_cache(len(ids))
        kwargs = {self.cache_arg: cache} if cache is not None else {}
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model(chunk, use_cache=True, **kwargs, **self.last_only)
        seconds = time.perf_counter() - t0
        if stop > start:
            self.prefill_tps = (stop - start) / max(seconds, 1e-9)
        return self.output_cache(out), out.logits, seconds

    def miss_cache(self, n_tokens: int) -> Any:
        """The cache a request without a stored prefix runs into: None (the model's own) unless it has sliding layers.

        transformers' sliding-window layer keeps the last window of tokens only; blocks need
        every token's KV, so those models run into our buffers, whose sliding layers keep them all.
        """
        if not self.sliding():
            return None
        capacity = -(-(n_tokens + RESERVE_TOKENS) // CAPACITY_STEP) * CAPACITY_STEP
        return make_cache(self.allocate(capacity), 0, self.model.config)

    def sliding(self) -> bool:
        from transformers import DynamicCache

        layers = getattr(DynamicCache(config=self.model.config), "layers", None) or []
        return any(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in layers)
