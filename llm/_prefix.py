"""PrefixCache: exact prefix KV reuse for transformers causal LMs through the store.

Token ids are cut into blocks of ``block_tokens``; block ``i`` is stored under the chained
key ``k_i = H(k_{i-1}, tokens of block i)``, so a key names the whole prefix up to the end
of its block and any prompt that starts with the same tokens finds it. An entry holds the
block's keys and values for every layer, ``k`` and ``v`` of shape
``(layers, kv_heads, block_tokens, width)`` (keys and values may differ in width). Sliding-window
layers store every token's KV too: which of them attention sees is the layer's business.

Reuse is token-granular. The partial block after a request's last full block is stored too,
with its token ids, under a key made from that last full block's key and the tail's first
token. A later prompt finds it with one index lookup after walking its full blocks, and
reuses as many of its tokens as the two prompts share: the KV of token *i* depends only on
tokens up to *i*. So "prefill the document, then document + question" computes only the
question.
"""

from __future__ import annotations

import inspect
import os
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, cast

import numpy as np

from promptstore import Entry, PromptStore, chain_keys
from promptstore._live import autocast_active
from promptstore.errors import InvalidInputError, PromptStoreWarning, UnsupportedModelError

from ._admission import Layout, States, checked_layout, vocab_size
from ._buffers import (
    CAPACITY_STEP,
    RESERVE_TOKENS,
    KVBuffers,
    copy_block,
    held_tokens,
    host_view,
    kv_layers,
    make_cache,
    warm_allocator,
)
from ._counts import Counts
from ._decide import Rates
from ._fingerprint import ambient_fingerprint, cache_code_fingerprint, model_fingerprint, model_structure, tokenizer_fingerprint
from ._inputs import check_generation, check_lengths, refuse_padding
from ._states import STATE_KIND, read_states, restore_states, states_fit
from ._verify import InForward, Refuted, Verdict, confirm, refute, refuted, tolerance, verify_served, works_on

__all__ = ["PrefixCache", "KIND"]

KIND = "llm.kv"
_STORED_DTYPES = ("F64", "F32", "F16", "BF16")  # what stored KV may be: anything else under a key is a miss
TAIL_KIND = "llm.kv.tail"  # the key space of partial blocks (stored with kind llm.kv)
# Linear-attention/SSM models: a miss stores every layer's running state about this often (a
# whole number of blocks), and at each request's end. Chosen in bench/state_every.py: the least
# worst regret over two workloads (RAG documents, a shared system prompt) and two state models.
STATE_EVERY_TOKENS = 256
_KV_DTYPES = {None: None, "float32": "F32", "float16": "F16", "bfloat16": "BF16"}


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


def _dtype_name(dtype: Any) -> str | None:
    if dtype is None:
        return None
    name = str(dtype).replace("torch.", "")
    if name not in _KV_DTYPES:
        raise InvalidInputError(f"kv_dtype must be None, float32, float16 or bfloat16, got {dtype!r}")
    return name


class _FirstScores:
    """A logits processor that changes nothing and notes when model.generate's first scores came."""

    def __init__(self) -> None:
        self.at: float | None = None

    def __call__(self, input_ids: Any, scores: Any) -> Any:
        if self.at is None:
            self.at = time.perf_counter()
        return scores


class PrefixCache:
    """Serve the longest stored prefix of a prompt as a transformers ``DynamicCache``.

    Serves transformers causal LMs whose attention layers keep per-token KV of one shape, full
    or sliding-window (Llama, Qwen, Mistral, Gemma 1-3, gpt-oss, SmolLM..., keys and values
    possibly of different widths as in DeepSeek-V3's latent attention), possibly beside
    linear-attention/SSM layers whose running state is stored where prefixes end (Qwen3-Next,
    Jamba, Nemotron-H: see _states.py), and refuses the others before anything is stored
    (see ``check_structure`` and ``probe_model`` in _admission.py). Keys cover the model's
    fingerprint (config, every weight, attention implementation), the tokenizer, the KV
    dtype and the block size, so a cached block is only ever used by the computation that
    produced it.

    Args:
        model: a transformers causal LM (``model.eval()``; any device).
        tokenizer: its tokenizer; needed for text and chat-message prompts.
        store: where blocks live (default: ``PromptStore()``, the default disk folder).
        block_tokens: tokens per stored block. The partial block at the end of a request is
            stored as well, so reuse is token-granular whatever the block size.
        kv_dtype: ``None`` stores the model's own KV dtype (exact). ``torch.float16`` or
            ``torch.bfloat16`` halve the bytes of fp32 KV at a small, measured score error.
        verify: recompute a few served positions of every hit and compare their KV (see
            _verify.py); a hit that disagrees is computed from scratch. ``False`` serves on
            the keys alone.
        reuse: ``"auto"``: ``prefill`` and ``generate`` use a stored prefix only where running
            the rest over it is expected to be faster than running the whole prompt, from this
            model's measured rates (see _decide.py: a small share of a long prompt is
            recomputed; ``stats`` counts it as ``declined``). ``"always"``: any stored prefix.

    Requests on one model run one at a time: calls from several threads, through this cache or
    any other PrefixCache or ChunkCache on the same model, wait for each other (a lock per model),
    each answered as if alone. A forward already uses every core on a CPU; for parallel serving,
    use an engine (the vLLM connector). The model's own calls in other threads (a plain
    ``model.generate`` beside a cached one) are not held up, and not changed.

    Raises:
        InvalidInputError: bad block size or kv_dtype.
    """

    def __init__(self, model: Any, tokenizer: Any = None, store: PromptStore | None = None, block_tokens: int = 64,
                 kv_dtype: Any = None, verify: bool = True, reuse: str = "auto") -> None:
        if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens <= 0:
            raise InvalidInputError(f"block_tokens must be a positive int, got {block_tokens!r}")
        if not isinstance(verify, bool):
            raise InvalidInputError(f"verify must be True or False, got {verify!r}")
        if reuse not in ("auto", "always"):
            raise InvalidInputError(f"reuse must be 'auto' or 'always', got {reuse!r}")
        self.reuse = reuse
        self.model = model
        self.verify = verify
        self.tokenizer = tokenizer
        self.store = store if store is not None else PromptStore()
        self.block_tokens = block_tokens
        self.kv_dtype = _dtype_name(kv_dtype)
        params = inspect.signature(model.forward).parameters
        # transformers 5.24 renamed `past_key_values` to `cache`; use whichever this version takes.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        # Only the last position's scores are returned: computing the others costs a vocabulary-wide
        # projection per prompt token.
        self._last_only = {"logits_to_keep": 1} if "logits_to_keep" in params else {}
        self._layout: tuple[Any, tuple[Layout, States, bool]] | None = None
        self._checkable = False  # whether served positions can be recomputed on this live structure (_verify.py)
        self._check: InForward | None = None  # this request's check, carried by its next forward
        self._in_forward = False  # whether the check can ride in the request's forward (else a forward of its own)
        self._structure: tuple[str, list[tuple[str, Any]]] | None = None  # this request's live model structure
        self._buffers = KVBuffers()  # host KV buffers reused across requests, pinned slots for copies to a GPU
        warm_allocator()
        self._total = Counts()
        self._last = Counts()
        self._prefill_tps: float | None = None  # measured prefill tokens/s, to price generated blocks
        self._rates: Rates | None = None  # this setting's measured forward rates: reuse or recompute
        self._root: bytes | None = None  # this request's root key (the weights as they are now)
        self._parted = 0  # this request's longest stored KV prefix (see _lookup)
        # Requests share the per-request fields above, the host buffers and the model's hooks: one request
        # on this model runs at a time, through this cache or any other, and the others wait.
        self._serving = model_lock(model)
        self._refresh_layout()  # refuse an unsupported model before anything is looked up or stored

    # -- identity -------------------------------------------------------------------------
    @property
    def fingerprint(self) -> str:
        """What the keys are bound to: model, tokenizer, KV dtype and layout, block size."""
        self._refresh_layout()
        return "|".join(self._fingerprints())

    def _fingerprints(self) -> list[str]:
        layers, heads, k_dim, v_dim, dtype = self._get_layout()
        stored = self.kv_dtype or str(dtype).replace("torch.", "")
        width = k_dim if k_dim == v_dim else f"{k_dim}/{v_dim}"  # keys and values of one width: as before
        # Read on every request (microseconds when unchanged): a tokenizer edited in place
        # (add_tokens, another chat template) is another key at once.
        states = self._states()
        return [model_fingerprint(self.model, self._structure), tokenizer_fingerprint(self.tokenizer),
                ambient_fingerprint(), cache_code_fingerprint(),
                f"kv:{stored}:dynamic[{layers},{heads},T,{width}]", f"block:{self.block_tokens}",
                *([f"states:{sorted(states.items())}"] if states else [])]

    def _root_key(self) -> bytes:
        # Hashes every weight (tens of ms): callers take it once per request.
        return self.store.key(KIND, b"", fingerprints=self._fingerprints())

    def _get_layout(self) -> Layout:
        if self._layout is None:
            self._refresh_layout()
        assert self._layout is not None
        return self._layout[1][0]

    def _states(self) -> States:
        """The model's linear-attention/SSM state tensors (empty: every layer keeps KV)."""
        if self._layout is None:
            self._refresh_layout()
        assert self._layout is not None
        return self._layout[1][1]

    def _stepwise(self) -> bool:
        """Whether the model continues a running state one token at a time only (Mamba: see probe_model)."""
        if self._layout is None:
            self._refresh_layout()
        assert self._layout is not None
        return self._layout[1][2]

    def _refresh_layout(self) -> None:
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
        self._structure = model_structure(self.model)
        if any(getattr(t, "is_meta", False) for _, t in self._structure[1]):
            raise UnsupportedModelError(f"{type(self.model).__name__} has tensors on the meta device (no values): load "
                                        "its weights before serving it")
        # Dtypes read from the tensors themselves: .half() keeps every Parameter object.
        # The cache classes' code too: a model with running states is run in pieces on a miss, which
        # is exact only while the code that passed the pieces check is what runs.
        signature = (tuple(sorted({str(t.dtype) for _, t in self._structure[1]})), str(self.model.device),
                     self._structure[0], ambient_fingerprint(), cache_code_fingerprint())
        if self._layout is None or self._layout[0] != signature:
            self._layout = (signature, checked_layout(self.model, self.store, signature, self._output_cache))
            self._rates = None  # another dtype, device or structure: its own measured rates
            works = works_on(self.model, self.store, signature, self._layout[1][0], self._cache_arg)
            self._checkable = not self._layout[1][1] and works.alone
            self._in_forward = self._checkable and works.in_forward

    def _new_request(self) -> None:
        """What a request starts from: the weights as they are now (root key) and the current layout."""
        self._root = None
        self._refresh_layout()

    def _request_root(self) -> bytes:
        if self._root is None:
            self._root = self._root_key()
        return self._root

    def _output_cache(self, out: Any) -> Any:
        cache = getattr(out, "cache", None)
        return cache if cache is not None else getattr(out, "past_key_values", None)

    # -- inputs ---------------------------------------------------------------------------
    def _ids(self, input_ids: Any) -> np.ndarray:
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

    def _prompt_ids(self, prompt: Any) -> np.ndarray:
        if isinstance(prompt, str) or (isinstance(prompt, Sequence) and prompt and isinstance(prompt[0], Mapping)):
            if self.tokenizer is None:
                raise InvalidInputError("text and chat-message prompts need PrefixCache(model, tokenizer)")
            if isinstance(prompt, str):
                ids = self.tokenizer(prompt)["input_ids"]
            else:
                ids = self.tokenizer.apply_chat_template(list(prompt), add_generation_prompt=True, tokenize=True)
                if isinstance(ids, Mapping) or hasattr(ids, "input_ids"):
                    ids = ids["input_ids"]
            return self._ids(ids)
        return self._ids(prompt)

    # -- lookup ---------------------------------------------------------------------------
    def _block_keys(self, ids: np.ndarray, n_blocks: int) -> list[bytes]:
        return chain_keys(self._request_root(), ids[: n_blocks * self.block_tokens], self.block_tokens)

    def _fits(self, entry: Entry) -> bool:
        layers, heads, k_dim, v_dim, _ = self._get_layout()
        want = (layers, heads, self.block_tokens)
        try:
            return (tuple(entry.tensors["k"].shape) == (*want, k_dim) and tuple(entry.tensors["v"].shape) == (*want, v_dim)
                    and entry.dtypes["k"] == entry.dtypes["v"] and entry.dtypes["k"] in _STORED_DTYPES)
        except KeyError:
            return False

    def lookup(self, input_ids: Any) -> tuple[Any, int]:
        """Load the longest stored prefix of ``input_ids``, leaving at least the last token.

        Args:
            input_ids: token ids (list, numpy array, or a tensor of shape (n,) or (1, n)).

        Returns:
            ``(cache, n_cached)``: a transformers ``DynamicCache`` holding the first
            ``n_cached`` tokens (on the model's device), or ``(None, 0)`` on a miss.

        Raises:
            InvalidInputError: empty ids, ids outside the vocabulary, a batch of several.
            UnsupportedModelError: a model served one token per forward (Mamba): only ``prefill``
                and ``generate`` continue its state correctly.
        """
        with self._serving:  # one request at a time (see the class)
            ids = self._ids(input_ids)
            self._new_request()
            if self._stepwise():
                raise UnsupportedModelError(f"{type(self.model).__name__} continues a restored state one token per forward "
                                            "only (a longer forward starts its scan from zero), so a cache from lookup "
                                            "would be continued wrong: use prefill or generate, which step it")
            return self._lookup(ids)

    def _lookup(self, ids: np.ndarray, in_forward: bool = False) -> tuple[Any, int]:
        """The longest stored prefix of ``ids`` as a cache, checked (see _verify.py).

        ``in_forward``: the caller runs a forward over the returned cache next and carries the
        check in it (``self._check``), where the cache allows; otherwise the check runs here, in
        a forward of its own.
        """
        self._parted = 0
        self._check = None
        usable = len(ids) - 1
        n_blocks = -(-usable // self.block_tokens)
        if n_blocks == 0:
            return None, 0
        # Room for the rest of the prompt and some generated tokens: they are written in place
        # instead of concatenated (see _ReservedLayer in _buffers.py). Allocated before the keys,
        # whose root fingerprints the model, so that new pages fault in meanwhile.
        # Rounded up, so that the next request of about this length can reuse them.
        need = max(len(ids) + RESERVE_TOKENS, n_blocks * self.block_tokens)
        buffers = self._allocate(-(-need // CAPACITY_STEP) * CAPACITY_STEP)
        n_cached = self._lookup_into(ids, buffers)
        if n_cached and in_forward and self.reuse == "auto" and not self._states() and \
                not self._rates_here().reuse(n_cached, len(ids)):
            self._last.declined = n_cached  # recomputing it all is expected to be faster
            return None, 0
        if n_cached and in_forward and self._checks() and self._in_forward and not self._states():
            cache = make_cache(buffers, n_cached, self.model.config)
            if InForward.fits(self.model, cache):
                self._check = InForward(self.model, cache, ids, n_cached, self._bound(), self._cache_arg)
                self._parted = n_cached
                return cache, n_cached
        if n_cached and not self._verified(ids, buffers, n_cached):
            return None, 0
        self._parted = n_cached  # where this prompt parts from every stored one (KV), before any state point
        state = None
        if self._states() and n_cached:
            n_cached, state = self._state_point(ids, n_cached)
            if n_cached and in_forward and self._stepwise() and self.reuse == "auto" and \
                    not self._rates_here().reuse_stepwise(n_cached, len(ids)):
                self._last.declined = n_cached  # its tokens one at a time would take longer than all in one pass
                return None, 0
        if n_cached == 0:
            return None, 0
        cache = make_cache(buffers, n_cached, self.model.config)
        if state is not None:
            restore_states(cache, state, self.model.device, n_cached)
            if not self._holds(cache, n_cached):
                return None, 0
        return cache, n_cached

    def _rates_here(self) -> Rates:
        if self._rates is None:
            self._rates = Rates(self.store, self.model, self._get_layout()[4], self.model.device)
        return self._rates

    def _measured(self, served: int, total: int, seconds: float) -> None:
        """Record a forward's time for the reuse decision (not for models with running states: see _run)."""
        if self.reuse == "auto" and not self._states():
            self._rates_here().record(served, total, seconds)

    def _holds(self, cache: Any, n: int) -> bool:
        """Whether a restored cache says it holds the ``n`` tokens served: the model takes the next
        positions and masks from that count, so a cache that counts otherwise (a layer whose
        bookkeeping the restore does not know) would continue from the wrong place. Such a request
        runs from scratch, with a warning."""
        try:
            held = int(cache.get_seq_length())
        except (ValueError, TypeError):
            return True  # a cache of running states only, with no count to compare (older transformers)
        if held == n:
            return True
        warnings.warn(f"promptstore: {type(self.model).__name__}'s cache counts {held} tokens after restoring {n}; "
                      "recomputed from scratch", PromptStoreWarning, stacklevel=4)
        return False

    def _verified(self, ids: np.ndarray, buffers: tuple[Any, Any], n: int) -> bool:
        """Whether the ``n`` tokens read into ``buffers`` are what the model computes now (see _verify.py).

        True where nothing can be checked (verification off, a model with running states, an
        architecture the check does not run on). False refutes the request's root key: this
        request runs from scratch, and nothing is stored under the key until a check passes again.
        """
        if not self._checks():
            return not refuted(self._request_root())
        return self._judged(verify_served(self.model, self._cache_arg, buffers, n, ids, self._bound()))

    def _checks(self) -> bool:
        return self.verify and self._checkable

    def _bound(self) -> float:
        dtype = str(self._get_layout()[4]).replace("torch.", "")
        return tolerance(*{d for d in (_KV_DTYPES.get(dtype, "BF16"), _KV_DTYPES[self.kv_dtype]) if d is not None})

    def _judged(self, verdict: Verdict | None) -> bool:
        """Count a check's verdict, confirm or refute the request's root key by it; whether the hit stands."""
        self._last.verified += 1
        if verdict is None or verdict.ok:
            confirm(self._request_root())
            return True
        refute(self._request_root(), verdict, type(self.model).__name__)
        self._last.refuted += 1
        return False

    def _checked_run(self, ids: np.ndarray, run: Any) -> Any:
        """``run()``: the request's forward(s) over the cache ``_lookup`` returned, carrying its check if one is due.

        A check that fails aborts that forward (before any token is chosen from it): the hit is
        refuted and ``run`` is called again with no cache (``self._check`` cleared), from scratch.
        """
        check = self._check
        if check is None:
            return run()
        try:
            with check:
                out = run()
        except Refuted as exc:
            self._check = None
            self._judged(exc.verdict)
            self._parted = 0
            return None
        self._check = None
        self._judged(check.verdict)
        return out

    def _lookup_into(self, ids: np.ndarray, buffers: tuple[Any, Any]) -> int:
        """Read the longest stored prefix of ``ids`` (leaving the last token) into ``buffers``; its length."""
        usable = len(ids) - 1
        n_blocks = -(-usable // self.block_tokens)
        if n_blocks == 0:
            return 0
        keys = self._block_keys(ids, n_blocks)
        blocks = self._read_blocks(keys, buffers, usable)
        n_cached = min(blocks * self.block_tokens, usable)
        if n_cached < usable:
            # Token-granular: the stored partial block after the last full one, if it starts
            # like this prompt, serves every token the two share (one index lookup).
            tail = self.store.get(self._tail_key(keys[blocks - 1] if blocks else None, int(ids[n_cached])), kind=KIND)
            shared = self._shared(tail, ids[n_cached:usable]) if tail is not None else 0
            if shared and tail is not None and "full" in tail.meta:
                # A pointer to a full block that this prompt leaves part-way: read that block.
                key = chain_keys(keys[blocks - 1] if blocks else self._request_root(), tail.tensors["tokens"],
                                 self.block_tokens)[0]
                shared = shared if self._read_blocks([key], buffers, usable, first=blocks) == 1 else 0
            elif shared and tail is not None:
                self._copy_tail(buffers, tail, n_cached, shared)
            n_cached += shared
        return n_cached

    # -- running states (linear-attention/SSM layers) --------------------------------------
    def _state_every(self) -> int:
        """Tokens between the states a miss stores (a whole number of blocks, about STATE_EVERY_TOKENS)."""
        return max(1, round(STATE_EVERY_TOKENS / self.block_tokens)) * self.block_tokens

    def _state_key(self, ids: np.ndarray, n: int, keys: list[bytes] | None = None) -> bytes:
        """Where the state after the first ``n`` tokens lives: under the last full block, with the tokens after it."""
        b = n // self.block_tokens
        keys = keys if keys is not None and len(keys) >= b else self._block_keys(ids, b)
        parent = keys[b - 1] if b else self._request_root()
        return self.store.key(STATE_KIND, ids[b * self.block_tokens : n].astype("<i4").tobytes(),
                              fingerprints=[parent.hex()])

    def _state_point(self, ids: np.ndarray, n_kv: int) -> tuple[int, Any]:
        """The longest prefix of at most ``n_kv`` tokens whose every layer's state is stored: (tokens, entry).

        Tried, longest first: every length from ``n_kv`` back to the block boundary before it and
        one token more (where earlier requests ended: a document prefilled alone, then questions
        after it; a block-aligned prompt's generate), then
        the states a miss stored every ``_state_every()`` tokens. (0, None) if none is stored.
        """
        every = self._state_every()
        keys = self._block_keys(ids, n_kv // self.block_tokens)
        signature = self._states()
        boundary = n_kv // self.block_tokens * self.block_tokens
        # boundary - 1 too: where a block-aligned prompt's generate stored the state before its last token.
        for n in dict.fromkeys([*range(n_kv, boundary - 2, -1), *range(boundary // every * every, 0, -every)]):
            if n <= 0:
                continue
            entry = self.store.get(self._state_key(ids, n, keys), kind=STATE_KIND)
            if entry is not None and states_fit(entry, signature):
                return n, entry
        return 0, None

    def _store_state(self, ids: np.ndarray, n: int, cache: Any, seconds_per_token: float) -> None:
        """Store the state of every state layer after the first ``n`` tokens (what ``cache`` holds now)."""
        key = self._state_key(ids, n)
        if key in self.store:
            return
        b = n // self.block_tokens
        parent = self._block_keys(ids, b)[-1] if b else None
        # Recomputing a state means running its whole prefix: that is what it saves.
        self.store.put(key, read_states(cache), kind=STATE_KIND, cost_s=seconds_per_token * n, parent=parent,
                       meta={"tokens": str(n)}, background=True)

    def _tail_key(self, parent: bytes | None, first_token: int) -> bytes:
        """Where the partial block after ``parent`` (None: the chain's root) starting with ``first_token`` lives."""
        return self.store.key(TAIL_KIND, np.array([first_token], "<i4").tobytes(),
                              fingerprints=[(parent if parent is not None else self._request_root()).hex()])

    def _shared(self, tail: Entry, ids: np.ndarray) -> int:
        """How many leading tokens of ``ids`` the stored tail holds KV for (0 if it does not fit)."""
        layers, heads, k_dim, v_dim, _ = self._get_layout()
        tokens = tail.tensors.get("tokens")
        r = tokens.shape[0] if tokens is not None and tokens.ndim == 1 else -1
        if "full" in tail.meta:  # a pointer to a full block: its tokens only
            if r != self.block_tokens:
                return 0
        else:
            k, v = tail.tensors.get("k"), tail.tensors.get("v")
            if (not 0 < r < self.block_tokens or k is None or v is None or k.shape != (layers, heads, r, k_dim)
                    or v.shape != (layers, heads, r, v_dim)
                    or tail.dtypes["k"] != tail.dtypes["v"] or tail.dtypes["k"] not in _STORED_DTYPES):
                return 0
        if tokens is None:
            return 0
        n = min(r, len(ids))
        differ = np.flatnonzero(tokens[:n].astype(np.int64) != ids[:n])
        return int(differ[0]) if differ.size else n

    def _copy_tail(self, buffers: tuple[Any, Any], tail: Entry, lo: int, n: int) -> None:
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

    def _read_blocks(self, keys: list[bytes], buffers: tuple[Any, Any], usable: int, first: int = 0) -> int:
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
            for slot in self._buffers.staging_slots(self._get_layout(), self.block_tokens, 2 * workers):
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
                if entry is None or not self._fits(entry):
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

    def _allocate(self, capacity: int) -> tuple[Any, Any]:
        return self._buffers.allocate(self._get_layout(), self.model.device, capacity)

    # -- storing --------------------------------------------------------------------------
    def _store_blocks(self, ids: np.ndarray, cache: Any, n_in_cache: int, first_block: int,
                      seconds_per_token: float) -> None:
        if refuted(self._request_root()):
            return  # this live state is not what its key says: nothing is stored under it
        n = min(n_in_cache, len(ids))
        last_block = n // self.block_tokens
        if last_block <= first_block and n == last_block * self.block_tokens and not self._states():
            return
        # A cache of running states only (Mamba2) holds no per-token KV to count: its state is
        # that of the tokens this request ran through it.
        held = cache.get_seq_length() if kv_layers(cache) else n_in_cache
        if held != n_in_cache:
            # The cache does not hold exactly these tokens (MPT's generate re-feeds the whole
            # sequence into a given cache at every step): storing slices of it would key wrong
            # KV under right tokens. Found by tests/llm_zoo.py.
            warnings.warn(f"promptstore: {type(self.model).__name__} left {held} positions in the KV cache for "
                          f"{n_in_cache} tokens; nothing stored from it", PromptStoreWarning, stacklevel=3)
            return
        if kv_layers(cache) and held_tokens(cache) != {n_in_cache}:
            # A layer keeps fewer tokens than the sequence (a sliding window in transformers' own
            # layer): its slices would not be these tokens' KV.
            warnings.warn(f"promptstore: {type(self.model).__name__}'s cache layers hold {sorted(held_tokens(cache))} "
                          f"tokens for {n_in_cache}; nothing stored from it", PromptStoreWarning, stacklevel=3)
            return
        if not (last_block <= first_block and n == last_block * self.block_tokens):
            self._store_kv(ids, cache, n, first_block, seconds_per_token)
        if self._states() and n == n_in_cache:
            self._store_state(ids, n, cache, seconds_per_token)  # after its blocks: its parent is one

    def _store_kv(self, ids: np.ndarray, cache: Any, n: int, first_block: int, seconds_per_token: float) -> None:
        """The full blocks from ``first_block`` and the partial one after them, of the first ``n`` tokens."""
        import torch

        last_block = n // self.block_tokens
        keys = self._block_keys(ids, last_block)
        kv = kv_layers(cache)
        for b in range(first_block, last_block):
            if keys[b] in self.store:
                continue
            lo, hi = b * self.block_tokens, (b + 1) * self.block_tokens
            with torch.no_grad():
                k = self._stack(kv, 0, lo, hi)
                v = self._stack(kv, 1, lo, hi)
            parent = keys[b - 1] if b else None
            if self.store.put(keys[b], {"k": self._to_stored(k), "v": self._to_stored(v)}, kind=KIND,
                              cost_s=seconds_per_token * self.block_tokens, parent=parent,
                              meta={"block": str(b), "tokens": str(self.block_tokens)}, background=True):
                # A later prompt that leaves this block part-way (a new question after the same
                # document) finds it from the block before, like a tail, and reuses what it shares.
                # It holds the block's token ids only: the block's key follows from them.
                # A child of the block it names, so it goes when the block goes.
                self.store.put(self._tail_key(parent, int(ids[lo])), {"tokens": ids[lo:hi].astype(np.int32)},
                               kind=KIND, cost_s=seconds_per_token * self.block_tokens, parent=keys[b],
                               meta={"full": str(b)}, background=True)
        lo = last_block * self.block_tokens
        if n > lo:
            self._store_tail(ids[lo:n], kv, lo, keys[last_block - 1] if last_block else None, seconds_per_token)

    def _store_tail(self, tokens: np.ndarray, kv: list[tuple[Any, Any]], lo: int, parent: bytes | None,
                    seconds_per_token: float) -> None:
        """Store the partial block after the last full one (tokens and their KV), unless one stored covers it."""
        import torch

        key = self._tail_key(parent, int(tokens[0]))
        old = self.store.peek(key)
        if old is not None and len(tokens) <= self._shared(old, tokens.astype(np.int64)):
            return  # the stored tail already starts with all of these tokens
        hi = lo + len(tokens)
        with torch.no_grad():
            k = self._stack(kv, 0, lo, hi)
            v = self._stack(kv, 1, lo, hi)
        self.store.put(key, {"tokens": tokens.astype(np.int32), "k": self._to_stored(k), "v": self._to_stored(v)},
                       kind=KIND, cost_s=seconds_per_token * len(tokens), parent=parent,
                       meta={"tail": str(len(tokens)), "tokens": str(self.block_tokens)}, background=True)

    def _stack(self, kv: list[tuple[Any, Any]], side: int, lo: int, hi: int) -> Any:
        """Keys (side 0) or values (1) of tokens ``lo:hi`` for every KV layer: (layers, heads, tokens, width)."""
        import torch

        if not kv:  # running states only (Mamba2): a block holds no KV, it marks its place in the chain
            return torch.empty((0, 0, hi - lo, 0), dtype=self._get_layout()[4])
        return torch.stack([layer[side][0, :, lo:hi, :] for layer in kv])

    def _to_stored(self, t: Any) -> Any:
        import torch

        target = getattr(torch, self.kv_dtype) if self.kv_dtype else t.dtype
        t = t.to(device="cpu", dtype=target).contiguous()
        if target == torch.bfloat16:
            return (t.view(torch.int16).numpy().view(np.uint16), "BF16")
        return t.numpy()

    # -- running the model ------------------------------------------------------------------
    def _forward(self, ids: np.ndarray, start: int, stop: int, cache: Any) -> tuple[Any, Any, float]:
        import torch

        chunk = torch.as_tensor(ids[start:stop], device=self.model.device)[None]
        if cache is None:
            cache = self._miss_cache(len(ids))
        kwargs = {self._cache_arg: cache} if cache is not None else {}
        t0 = time.perf_counter()
        with torch.no_grad():
            out = self.model(chunk, use_cache=True, **kwargs, **self._last_only)
        seconds = time.perf_counter() - t0
        if stop > start:
            self._prefill_tps = (stop - start) / max(seconds, 1e-9)
        return self._output_cache(out), out.logits, seconds

    def _run(self, ids: np.ndarray, start: int, stop: int, cache: Any, last_apart: bool = False) -> tuple[Any, Any, float]:
        """``_forward`` over ``ids[start:stop]``; for a model with running states, in pieces that end where states are stored.

        A state exists only where a forward ends, so a miss is run up to each multiple of
        ``_state_every()`` tokens, storing the state there: a later prompt that shares only
        part of this one resumes from the last such point. ``last_apart`` runs the last token
        on its own too, so that the same prompt asked again (which leaves its last token to
        compute) finds the state before it.
        """
        if not self._states():
            return self._forward(ids, start, stop, cache)
        if self._stepwise():
            return self._run_stepwise(ids, start, stop, cache, last_apart)
        every = self._state_every()
        seconds, logits = 0.0, None
        # Where the prompt parts from the stored ones too: a hit that resumed before it (the last
        # stored state) stores one there, so the next prompt that parts there (another question
        # after the same document or system prompt) resumes there exactly.
        parted = [self._parted] if start < self._parted < stop else []
        ends = [*range((start // every + 1) * every, stop, every), *parted, *([stop - 1] if last_apart else []), stop]
        first = start
        for end in sorted(e for e in set(ends) if e > start):
            cache, logits, took = self._forward(ids, start, end, cache)
            seconds += took
            if end < stop:
                # The blocks up to here first: a persistent tier takes an entry only after its parent.
                # Priced at this run's mean rate so far: a one-token piece costs more per token.
                self._store_blocks(ids, cache, end, start // self.block_tokens, seconds / max(end - first, 1))
            start = end
        return cache, logits, seconds

    def _run_stepwise(self, ids: np.ndarray, start: int, stop: int, cache: Any, last_apart: bool) -> tuple[Any, Any, float]:
        """``_run`` for a model that continues a state one token at a time only (see probe_model).

        From no state (a miss), the prompt runs in one forward: exact, but no state is stored
        inside it (a later piece could not continue it in one forward either). Over a restored
        state, one forward per token. States are stored where ``_run`` stores them: where the
        prompt parts from the stored ones, and before its last token when ``last_apart``.
        """
        fresh = cache is None and start == 0
        # From no state, nothing but the state before the last token: ending the one pass where the prompt
        # parts from a stored one would leave the rest to run one token at a time.
        stops = {e for e in (0 if fresh else self._parted, stop - 1 if last_apart else 0) if start < e < stop}
        seconds, logits, first = 0.0, None, start
        if fresh:
            end = min(stops, default=stop)
            cache, logits, seconds = self._forward(ids, 0, end, None)
            if self.reuse == "auto":
                self._rates_here().record(0, end, seconds)
            if end < stop:
                self._store_blocks(ids, cache, end, 0, seconds / end)
            start = end
        stepping = 0.0  # the steps' forwards only, not the storing between them
        for pos in range(start, stop):
            cache, logits, took = self._forward(ids, pos, pos + 1, cache)
            seconds += took
            stepping += took
            if pos + 1 in stops:
                self._store_blocks(ids, cache, pos + 1, first // self.block_tokens, seconds / max(pos + 1 - first, 1))
        if stop > start and self.reuse == "auto":
            self._rates_here().record_steps(stop - start, stepping)
        return cache, logits, seconds

    def _miss_cache(self, n_tokens: int) -> Any:
        """The cache a request without a stored prefix runs into: None (the model's own) unless it has sliding layers.

        transformers' sliding-window layer keeps the last window of tokens only; blocks need
        every token's KV, so those models run into our buffers, whose sliding layers keep them all.
        """
        if not self._sliding():
            return None
        capacity = -(-(n_tokens + RESERVE_TOKENS) // CAPACITY_STEP) * CAPACITY_STEP
        return make_cache(self._allocate(capacity), 0, self.model.config)

    def _sliding(self) -> bool:
        from transformers import DynamicCache

        layers = getattr(DynamicCache(config=self.model.config), "layers", None) or []
        return any(type(layer).__name__ == "DynamicSlidingWindowLayer" for layer in layers)

    def _begin(self, n_queried: int) -> None:
        self._new_request()
        self._last = Counts()
        self._last.queried = n_queried
        self._last.requests = 1

    def _end(self) -> None:
        self._total.add(self._last)

    def prefill(self, input_ids: Any) -> tuple[Any, Any]:
        """Run only the tokens after the longest stored prefix, and store the new blocks and the tail.

        Returns:
            ``(cache, logits)``: the cache holding all of ``input_ids`` and the next-token
            scores after the last token (a 1-D tensor over the vocabulary).
        """
        with self._serving:  # one request at a time (see the class)
            ids = self._ids(input_ids)
            self._begin(len(ids))
            cache, n_cached = self._lookup(ids, in_forward=True)
            ran = self._checked_run(ids, lambda: self._run(ids, n_cached, len(ids), cache, last_apart=True))
            if ran is None:  # the hit was refuted: from scratch
                cache, n_cached = None, 0
                ran = self._run(ids, 0, len(ids), None, last_apart=True)
            cache, logits, seconds = ran
            self._measured(n_cached, len(ids), seconds)
            self._last.served, self._last.computed = n_cached, len(ids) - n_cached
            self._store_blocks(ids, cache, len(ids), n_cached // self.block_tokens, seconds / max(len(ids) - n_cached, 1))
            self._end()
            return cache, logits[0, -1]

    def generate(self, prompt: Any, **generate_kwargs: Any) -> Any:
        """``model.generate`` on the full prompt, computing only what the store lacks.

        Args:
            prompt: token ids, a text string, or chat messages (``[{"role", "content"}]``,
                rendered with the tokenizer's chat template and a generation prompt).
            **generate_kwargs: passed to ``model.generate`` (``max_new_tokens``, ``do_sample``...).

        Returns:
            What ``model.generate`` returns: the prompt's ids followed by the new tokens.
            Full blocks of the prompt and of the generated tokens are stored, so the next
            turn of a conversation finds both.

        Raises:
            InvalidInputError: a bad prompt, a padded batch, or generation settings PrefixCache
                cannot serve (beams, several sequences, another cache implementation,
                assisted or contrastive decoding), from kwargs, a passed ``generation_config``
                or the model's own.
            UnsupportedModelError: the model as it is now cannot be served (see the class).
        """
        with self._serving:  # one request at a time (see the class)
            import torch

            ids = self._prompt_ids(prompt)
            refuse_padding(generate_kwargs.pop("attention_mask", None))
            # Resolved as model.generate resolves them (its generation_config, a passed one, kwargs),
            # then checked, before any lookup or forward.
            check_generation(self.model, generate_kwargs)
            check_lengths(generate_kwargs, len(ids))
            self._begin(len(ids))
            cache, n_cached = self._lookup(ids, in_forward=True)
            stop = len(ids) - 1
            first_block, ran_from = n_cached // self.block_tokens, n_cached
            if stop > n_cached and self._states():
                # Running states exist only where a forward ends: a miss runs in pieces that end
                # where states are stored (see _run), so the prompt is run here, up to its last token.
                cache, _, seconds = self._run(ids, n_cached, stop, cache)
                self._store_blocks(ids, cache, stop, first_block, seconds / (stop - n_cached))
                first_block, ran_from = stop // self.block_tokens, stop
            full = torch.as_tensor(ids, device=self.model.device)[None]
            user_processors = list(generate_kwargs.get("logits_processor") or [])

            def run(cache: Any) -> tuple[Any, Any, _FirstScores, float]:
                if cache is None:
                    cache = self._miss_cache(len(ids))
                if cache is None:
                    from transformers import DynamicCache

                    cache = DynamicCache(config=self.model.config)
                generate_kwargs[self._cache_arg] = cache
                # Otherwise model.generate runs every uncached token in its own first forward (it slices
                # the prompt past what the cache holds), so a hit costs one pass over the weights, not two;
                # the hit's check rides in that forward too. The first scores it makes mark the end of that
                # forward: its rate prices the blocks.
                from transformers import LogitsProcessorList

                first = _FirstScores()
                generate_kwargs["logits_processor"] = LogitsProcessorList([*user_processors, first])
                t0 = time.perf_counter()
                return self.model.generate(full, attention_mask=torch.ones_like(full), **generate_kwargs), cache, first, t0

            ran = self._checked_run(ids, lambda: run(cache))
            if ran is None:  # the hit was refuted: from scratch
                n_cached, first_block, ran_from = 0, 0, 0
                ran = run(None)
            out, cache, first, t0 = ran
            self._last.served, self._last.computed = n_cached, len(ids) - n_cached
            if first.at is not None:
                self._prefill_tps = (len(ids) - ran_from) / max(first.at - t0, 1e-9)
                self._measured(ran_from, len(ids), first.at - t0)
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            seq = sequences[0].detach().cpu().numpy()
            self._last.generated = len(seq) - len(ids)
            # The cache now holds every token but the last generated one; price blocks of the
            # prompt and of the generated tokens at the measured prefill rate (what recomputing them would cost).
            tps = self._prefill_tps or 1000.0
            # Unless every layer is a running state (Mamba2): then no KV tells how many tokens
            # model.generate ran through the cache, so what it left is not stored (measured: Mamba2's
            # left state differs from one of len(seq) - 1 tokens); the prompt's state serves the next turn.
            if self._get_layout()[0]:
                self._store_blocks(seq, cache, len(seq) - 1, first_block, 1.0 / tps)
            self._end()
            return out

    # -- statistics -------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """Tokens queried, served from cache, computed (and generated), for the last request and in total."""
        return {"last": self._last.as_dict(), "total": self._total.as_dict()}
