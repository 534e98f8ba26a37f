"""LlamaCppCache: llama-cpp-python's prompt cache (``Llama.set_cache``), backed by the store.

llama-cpp-python asks its cache for the longest stored prefix of every prompt
(``cache[prompt_tokens]``) and stores the context after every completion
(``cache[prompt + completion] = llm.save_state()``). This cache keeps, per stored state:

- the **state**: the sequence's KV as llama.cpp writes it (``llama_state_seq_get_data``, only
  the cells the sequence uses), plus every prompt token's scores when the ``Llama`` keeps them
  (``logits_all=True``: echo and logprobs read them). Not the context's whole ``scores`` array
  that ``save_state`` copies (``n_batch`` x vocabulary floats, 100 MB for SmolLM2), nor its
  output buffer: a restored prefix always evaluates at least one token before sampling;
- its **head**: the state's token ids, small, so that a lookup knows how much a state serves
  before reading it;
- **pointers**, one per full block of the state's tokens, under the chained block keys of
  ``PrefixCache``: block ``i``'s key names the first ``i`` blocks. A lookup walks the prompt's
  blocks (one index lookup each, never a scan of the stored keys) to the deepest one that
  has a pointer, and reads that state, which shares at least those blocks with the prompt.

llama.cpp's state API restores whole sequences (its byte layout is internal and changes between
versions), so a state serves a prompt from its start to where the two part: llama-cpp-python
then trims the rest (``kv_cache_seq_rm``) and evaluates the prompt's remaining tokens. A new
state that extends a stored one (the next turn of a chat) replaces it.

A lookup restores the state into the ``Llama``'s context itself, as ``Llama.load_state`` would,
and hands llama-cpp-python a ``LlamaState`` naming those tokens, so that it goes on from them;
it never replaces a context that already holds as much of the prompt. A hit deletes nothing.

Storing reads the context itself too. ``Llama.save_state``, which llama-cpp-python calls for its
cache after every completion, copies the whole context state three times and its ``scores``
array once (0.15-0.27 s at 2,000 tokens of SmolLM2, bench/llamacpp_store_cost.py), none of which this
cache reads. So where llama-cpp-python asks whether it has a cache in order to save
(``if self.cache:`` in ``Llama._create_completion``, once the completion is done), this cache
stores the context's state and answers False, and ``save_state`` is not called. Everywhere else,
and in a llama-cpp-python whose completion this does not recognise, it is true as any cache,
and ``cache[key] = llm.save_state()`` stores the same way.

A completion waits only for its state to be read (6 ms at 2,000 tokens of SmolLM2, into a buffer
reused from state to state). Writing it, its head and its pointers runs on the store's writer
thread after the completion returns (``PromptStore.later``); :meth:`LlamaCppCache.flush`,
``store.flush()``, ``store.close()`` and a normal interpreter exit wait for that.
"""

from __future__ import annotations

import ctypes
import os
import platform
import statistics
import sys
import time
import warnings
from collections.abc import Sequence
from concurrent.futures import Future
from typing import Any

import numpy as np

from promptstore import PromptStore, chain_keys, file_digest
from promptstore.errors import InvalidInputError, PromptStoreWarning, UnsupportedModelError

from ._decide import RestoreRates

try:
    import llama_cpp
    from llama_cpp.llama_cache import BaseLlamaCache
except ImportError as exc:  # pragma: no cover - the extra is missing
    raise ImportError('LlamaCppCache needs llama-cpp-python: pip install "promptstore[llamacpp]"') from exc

__all__ = ["LlamaCppCache", "KIND"]

_COMPLETION_CODE = getattr(getattr(llama_cpp.Llama, "_create_completion", None), "__code__", None)

KIND = "llm.llamacpp"  # a state: the sequence's KV (and scores)
HEAD_KIND = "llm.llamacpp.head"  # a state's token ids
INDEX_KIND = "llm.llamacpp.index"  # block key -> the head of a state holding that block
# Context settings that cannot change a token's KV or scores: sizes and threads, callbacks that only
# abort or observe timing, where llama-cpp-python keeps its samplers. Every other field is in the key,
# so a field a later llama.cpp adds is in the key until it is known to be harmless.
_CONTEXT_IGNORED = frozenset({"n_ctx", "n_threads", "n_threads_batch", "abort_callback", "abort_callback_data",
                              "no_perf", "defrag_thold", "samplers", "n_samplers", "cb_eval_user_data"})
_MODEL_IGNORED = frozenset({"progress_callback", "progress_callback_user_data", "use_mmap", "use_mlock",
                            "use_direct_io", "check_tensors", "kv_overrides", "tensor_split"})


def _plain(value: Any) -> str:
    """A ctypes field as text: numbers as they are, pointers as whether they are set."""
    if isinstance(value, (bool, int, float, bytes, str)):
        return repr(value)
    return f"set:{bool(value)}"


def _settings(struct: Any, ignored: frozenset[str]) -> str:
    return ",".join(f"{name}={_plain(getattr(struct, name))}" for name, *_ in struct._fields_ if name not in ignored)


def _shared(a: np.ndarray, b: np.ndarray) -> int:
    """How many leading tokens ``a`` and ``b`` share."""
    n = min(len(a), len(b))
    parted = np.flatnonzero(a[:n] != b[:n])
    return int(parted[0]) if parted.size else n


def _file_identity(path: str) -> tuple[int, int, int, int]:
    st = os.stat(path)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


class LlamaCppCache(BaseLlamaCache):
    """A prompt cache for a ``llama_cpp.Llama``, shared through a :class:`~promptstore.PromptStore`.

    ``llm.set_cache(LlamaCppCache(llm, store))`` is the whole integration: every
    ``create_completion``, ``create_chat_completion`` and ``__call__`` then starts from the
    longest prefix any process sharing the store has computed with the same model and settings.

    Entries are bound to everything that changes the KV: the GGUF file's digest (read once per
    file version, see :func:`promptstore.file_digest`), the llama.cpp library (its file and
    version, and the CPU features it uses), every context setting but sizes and threads (KV
    types, RoPE and YaRN settings, flash attention, batch sizes, embeddings...), the model
    settings (GPU layers, split, metadata overrides) and LoRA files with their scale. Another
    model or setting finds nothing. Adapters or control vectors applied afterwards through
    llama.cpp's C API are not seen: apply them before building the cache, through ``Llama``'s
    arguments.

    A lookup restores the state into ``llm``'s context (what ``Llama.load_state`` does) when it
    serves more of the prompt than the context holds. A broken entry or tier is a warned miss;
    nothing here raises into a completion, and nothing prints.

    Args:
        llm: the ``llama_cpp.Llama`` whose prompts are cached.
        store: where entries live (default: ``PromptStore()``, the disk folder).
        block_tokens: tokens per block of the index (a state is found from any prompt that
            shares at least one full block with it).
        reuse: ``"auto"`` (default) restores a stored state only where reading all of it is
            expected to cost less than evaluating the tokens it saves, from this setting's
            measured prefill and restore rates (kept in the store: a fresh process starts with
            them); a declined state is counted in ``stats["declined"]``. ``"always"`` restores
            any state that serves more than the context holds.

    Raises:
        InvalidInputError: ``llm`` is not a ``llama_cpp.Llama``, or a bad ``block_tokens`` or ``reuse``.
        UnsupportedModelError: a recurrent or hybrid model (Mamba, RWKV, Jamba...), whose
            state cannot be trimmed to a shorter prefix, or an evaluation callback (``cb_eval``)
            that may change what the model computes.
    """

    def __init__(self, llm: Any, store: PromptStore | None = None, block_tokens: int = 64, reuse: str = "auto") -> None:
        if not isinstance(llm, llama_cpp.Llama):
            raise InvalidInputError(f"LlamaCppCache needs a llama_cpp.Llama, got {type(llm).__name__}")
        if not isinstance(block_tokens, int) or isinstance(block_tokens, bool) or block_tokens <= 0:
            raise InvalidInputError(f"block_tokens must be a positive int, got {block_tokens!r}")
        if reuse not in ("auto", "always"):
            raise InvalidInputError(f'reuse must be "auto" or "always", got {reuse!r}')
        if getattr(llm, "_is_recurrent", False) or getattr(llm, "_is_hybrid", False):
            raise UnsupportedModelError(
                "LlamaCppCache: a recurrent or hybrid model keeps a running state that llama.cpp cannot trim to a "
                "shorter prefix, so a stored state would serve only prompts that extend it exactly; not served")
        if llm.context_params.cb_eval:
            raise UnsupportedModelError("LlamaCppCache: the context has an evaluation callback (cb_eval), which may "
                                        "change what the model computes; not served")
        super().__init__(capacity_bytes=0)
        self.llm = llm
        self.store = store if store is not None else PromptStore()
        self.block_tokens = block_tokens
        self.reuse = reuse
        self._model_file = _file_identity(llm.model_path)
        self._root = self.store.key(KIND, b"", fingerprints=self._fingerprints())
        # Rates are absolute (seconds per token, per byte): the threads are part of their setting.
        params = llm.context_params
        self.rates = RestoreRates(self.store, f"{self._root.hex()}|threads:{params.n_threads}/{params.n_threads_batch}"
                                              f"|{platform.machine()}|{platform.processor()}")
        perf = llama_cpp.llama_perf_context(llm._ctx.ctx)  # llama.cpp's prompt-eval counters when last read
        self._perf = (int(perf.n_p_eval), float(perf.t_p_eval_ms), float(perf.t_load_ms))
        # "queued": states read from the context for writing; "stored": those written (counted by the
        # background writer once the state and its pointers are in the store, so after flush()).
        self.stats: dict[str, int] = {"lookups": 0, "hits": 0, "served": 0, "queued": 0, "stored": 0,
                                      "declined": 0}
        self._job: Future[None] | None = None  # the last state's write (PromptStore.later)
        self._buffers: dict[str, np.ndarray] = {}  # see _staging
        self._writing: np.ndarray | None = None  # the tokens of the state being written

    # -- identity -------------------------------------------------------------------------
    def _fingerprints(self) -> list[str]:
        llm = self.llm
        lib = getattr(getattr(llama_cpp.llama_cpp, "_lib", None), "_name", None)
        loras = [f"lora:{file_digest(llm.lora_path)}:{llm.lora_scale!r}"] if llm.lora_path else []
        return [f"gguf:{file_digest(llm.model_path)}", f"llama_cpp:{llama_cpp.__version__}",
                f"lib:{file_digest(lib) if lib and os.path.exists(lib) else 'unknown'}",
                f"system:{llama_cpp.llama_print_system_info().decode(errors='replace')}",
                f"context:{_settings(llm.context_params, _CONTEXT_IGNORED)}",
                f"model:{_settings(llm.model_params, _MODEL_IGNORED)}",
                f"overrides:{sorted((llm.kv_overrides or {}).items())!r}",
                f"split:{list(llm.tensor_split or [])!r}", *loras]

    def _usable(self) -> bool:
        """Whether the model file is still the one loaded (a replaced GGUF must not key old weights)."""
        if _file_identity(self.llm.model_path) == self._model_file:
            return True
        warnings.warn(f"promptstore: {self.llm.model_path} changed since LlamaCppCache was built; "
                      "the cache is not used until it is built again", PromptStoreWarning, stacklevel=3)
        return False

    def _head_key(self, tokens: np.ndarray) -> bytes:
        return self.store.key(HEAD_KIND, tokens.astype("<i4").tobytes(), fingerprints=[self._root.hex()])

    def _state_key(self, head: bytes) -> bytes:
        return self.store.key(KIND, b"", fingerprints=[head.hex()])

    # -- lookup ---------------------------------------------------------------------------
    def _tokens(self, key: Sequence[int]) -> np.ndarray:
        ids = np.asarray(key, dtype=np.int64)
        if ids.ndim != 1 or (ids.size and (ids.min() < 0 or ids.max() >= self.llm.n_vocab())):
            raise KeyError("not token ids of this model")
        return ids.astype(np.intc)

    def _pointer(self, key: bytes) -> bytes | None:
        entry = self.store.get(key, kind=INDEX_KIND)
        return None if entry is None else entry.tensors["head"].tobytes()

    def _find(self, tokens: np.ndarray) -> tuple[bytes, np.ndarray, int, int | None] | None:
        """The stored state sharing the most tokens with ``tokens``: (head key, its tokens, shared, the
        state's bytes where its head names them)."""
        keys = chain_keys(self._root, tokens, self.block_tokens)
        # Every block of a stored state has a pointer, so the blocks with one form a prefix of the
        # prompt's: a binary search finds its end in log2(blocks) lookups, not one per block.
        lo, hi = 0, len(keys)  # keys[:lo] have pointers (as far as is known), keys[hi:] none
        while lo < hi:
            mid = (lo + hi) // 2
            if self._pointer(keys[mid]) is not None:
                lo = mid + 1
            else:
                hi = mid
        tried: set[bytes] = set()
        for key in reversed(keys[:lo]):  # deepest first; an evicted state falls back to a shallower one
            head_key = self._pointer(key)
            if head_key is None or head_key in tried:
                continue
            tried.add(head_key)
            head = self.store.get(head_key, kind=HEAD_KIND)
            if head is None or self._state_key(head_key) not in self.store:
                continue  # gone, or its state evicted
            stored = head.tensors["tokens"]
            shared = _shared(stored, tokens)
            if shared:
                nbytes = head.tensors.get("state_bytes")
                return head_key, stored, shared, None if nbytes is None else int(nbytes.reshape(-1)[0])
        return None

    def __contains__(self, key: Sequence[int]) -> bool:
        try:
            if not self._usable():
                return False
            tokens = self._tokens(key)
            self._settle(tokens, 0)
            return self._find(tokens) is not None
        except KeyError:
            return False
        except Exception as exc:  # noqa: BLE001 - a cache fault is a miss, never the caller's failure
            self._warn("lookup", exc)
            return False

    def __getitem__(self, key: Sequence[int]) -> llama_cpp.llama.LlamaState:
        """Restore the longest stored prefix of ``key`` into the context; KeyError if none serves more.

        Returns a ``LlamaState`` naming the restored tokens (its KV is already in the context,
        so ``Llama.load_state`` has nothing left to do and llama-cpp-python does not call it).
        """
        self.stats["lookups"] += 1
        try:
            tokens = self._tokens(key)
            restored, shared = self._restore(tokens)
        except KeyError:
            raise
        except Exception as exc:  # noqa: BLE001
            self._warn("lookup", exc)
            raise KeyError("promptstore: lookup failed") from None
        self.stats["hits"] += 1
        # What llama-cpp-python keeps of it: the shared tokens, but for one it evaluates again when the
        # state holds the whole prompt (it needs the last token's scores).
        self.stats["served"] += min(shared, len(tokens) - 1)
        llm = self.llm
        return llama_cpp.llama.LlamaState(input_ids=restored.copy(), scores=np.empty((0, llm.n_vocab()), np.single),
                                          n_tokens=len(restored), llama_state=b"", llama_state_size=0, seed=llm._seed)

    def _restore(self, tokens: np.ndarray) -> tuple[np.ndarray, int]:
        """Restore the stored state sharing the most with ``tokens``: (its tokens, how many it shares)."""
        llm = self.llm
        if not self._usable():
            raise KeyError("model file changed")
        in_context = _shared(llm.input_ids[: llm.n_tokens], tokens)
        self._settle(tokens, in_context)
        found = self._find(tokens)
        if found is None:
            raise KeyError("no stored prefix")
        head_key, stored, shared, nbytes = found
        if shared <= in_context or len(stored) > llm.n_ctx():
            raise KeyError("the context holds as much")  # keep what the context has: nothing to read
        # The whole state is read, however little of it the prompt shares: worth it only where that
        # costs less than evaluating the tokens it saves (llama.cpp evaluates the last one in any case).
        saved = min(shared, len(tokens) - 1) - in_context
        if self.reuse == "auto" and nbytes is not None and not self.rates.reuse(nbytes, saved):
            self.stats["declined"] += 1
            raise KeyError("restoring costs more than it saves")
        start = time.perf_counter()
        entry = self.store.get(self._state_key(head_key), kind=KIND)
        if entry is None or entry.tensors.get("state") is None:
            raise KeyError("state evicted")
        scores = entry.tensors.get("scores")
        if llm._logits_all and (scores is None or scores.shape != (len(stored), llm.n_vocab())):
            raise KeyError("stored without the scores this Llama keeps")
        state = np.ascontiguousarray(entry.tensors["state"], dtype=np.uint8)
        ptr = state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8))
        # From here the context changes: mark it empty first, so that a failed restore leaves
        # llama-cpp-python evaluating the whole prompt, never reusing half a state.
        llm.n_tokens = 0
        llm._requires_eval = True
        if llama_cpp.llama_state_seq_set_data(llm._ctx.ctx, ptr, state.nbytes, 0) != state.nbytes:
            mem = llama_cpp.llama_get_memory(llm._ctx.ctx)
            if mem is not None:
                llama_cpp.llama_memory_clear(mem, True)
            raise KeyError("llama.cpp refused the stored state")
        llm.input_ids[: len(stored)] = stored
        if scores is not None and llm._logits_all:
            llm.scores[: len(stored), :] = scores
        llm.n_tokens = len(stored)
        self.rates.record_restore(state.nbytes + (0 if scores is None else scores.nbytes), time.perf_counter() - start)
        return stored, shared

    def _settle(self, tokens: np.ndarray, held: int) -> None:
        """Wait for the state being written where it would serve ``tokens`` beyond their first
        ``held`` (what the context holds); else go on without it (the next turn of a chat, whose
        context holds that state, or another prompt)."""
        writing = self._writing
        if writing is not None:
            shared = _shared(writing, tokens)
            if shared >= self.block_tokens and shared > held:
                self._written()

    # -- storing --------------------------------------------------------------------------
    def __bool__(self) -> bool:
        """True, but False where llama-cpp-python is about to save the context for this cache, which
        this cache has then stored already (see the module docstring)."""
        frame = sys._getframe(1)
        # The save point: _create_completion's frame once its generation loop has set finish_reason
        # (the lookup, earlier in the same frame, comes before it).
        local = frame.f_locals if frame.f_code is _COMPLETION_CODE else {}
        if "finish_reason" not in local or local.get("self") is not self.llm:  # (another Llama sharing this cache)
            return True
        llm = self.llm
        self._try_store(_Context(llm.n_tokens, llm.input_ids[: llm.n_tokens]))
        return False

    def __setitem__(self, key: Sequence[int], value: llama_cpp.llama.LlamaState) -> None:
        """Store the context's state (``value`` is what ``llm.save_state()`` just returned; with ``logits_all``
        its scores are stored as they are, written after the call returns)."""
        self._try_store(value)

    def _try_store(self, value: Any) -> None:
        """:meth:`_store`, a failure a warned miss."""
        try:
            self._store(value)
        except Exception as exc:  # noqa: BLE001 - a cache fault is a miss, never the caller's failure
            self._warn("store", exc)

    def _store(self, value: Any) -> None:
        """Store the context's state; ``value`` names it (``n_tokens``, ``input_ids``; optionally the
        ``scores`` a ``LlamaState`` holds).

        Only reading the state waits here (the context changes with the next call); the store's
        writes and the index run on a background thread (see :meth:`flush`).
        """
        llm = self.llm
        # The last state's writes first: it is then known whether this one is stored already, and the
        # buffer it was read into is free again. Usually done long since, during this completion.
        self._written()
        self._record_prefill()
        n = int(value.n_tokens)
        # A copy: input_ids is the context's own array, which the next completion overwrites.
        tokens = np.array(value.input_ids[:n], dtype=np.intc)
        if n < self.block_tokens or not self._usable():
            return  # too short to index: no block key would ever find it
        if llm.n_tokens != n or not np.array_equal(llm.input_ids[:n], tokens):
            # Only the live context's own state can be read per sequence.
            warnings.warn("promptstore: LlamaCppCache stores the context's current state; this LlamaState is not "
                          "it, so nothing was stored", PromptStoreWarning, stacklevel=3)
            return
        head_key = self._head_key(tokens)
        if self._state_key(head_key) in self.store:
            return  # stored already (a head whose state was evicted is stored again)
        ctx = llm._ctx.ctx
        size = llama_cpp.llama_state_seq_get_size(ctx, 0)
        state = self._staging("state", size, np.uint8)
        written = llama_cpp.llama_state_seq_get_data(ctx, state.ctypes.data_as(ctypes.POINTER(ctypes.c_uint8)), size, 0)
        if written != size:
            raise RuntimeError(f"llama_state_seq_get_data wrote {written} of {size} bytes")
        tensors = {"state": state}
        if llm._logits_all:
            # A copy, since the context's scores change with the next completion, before the write: the one
            # llama-cpp-python's save_state just made where it is one (copying 400 MB again costs a second).
            scores = getattr(value, "scores", None)
            if not (isinstance(scores, np.ndarray) and scores.shape == (n, llm.n_vocab()) and scores.dtype == np.single
                    and scores.flags.c_contiguous and not np.may_share_memory(scores, llm.scores)):
                copy = self._staging("scores", n * llm.n_vocab(), np.single).reshape(n, llm.n_vocab())
                np.copyto(copy, llm.scores[:n], casting="same_kind")
                scores = copy
            tensors["scores"] = scores
        cost = n / self._prefill_rate()
        self.stats["queued"] += 1
        self._writing = tokens
        # On the store's writer thread, after its queued puts. nbytes 0: the buffers are this cache's,
        # held whether queued or not, and the next state waits for this one before reusing them.
        self._job = self.store.later(lambda: self._write(head_key, tokens, tensors, cost))

    def _staging(self, name: str, size: int, dtype: type) -> np.ndarray:
        """A buffer of ``size`` items to copy a state (or its scores) into, reused from state to state.

        Fresh memory is what made these copies slow: their first writes fault every page in, and,
        where the kernel gives numpy's large arrays huge pages, may wait for it to compact memory
        (9-90 ms for the state of 2,000 tokens of SmolLM2, against 5 ms into a buffer in use; 0.7-1.8 s
        for their 390 MB of scores). The buffers are kept: as large as the largest state stored.
        """
        buffer = self._buffers.get(name)
        if buffer is None or buffer.size < size:
            self._buffers.pop(name, None)  # the old one goes before the new one is made
            buffer = self._buffers[name] = np.empty(size + size // 8, dtype=dtype)  # room for a slightly longer prompt
        return buffer[:size]

    def _write(self, head_key: bytes, tokens: np.ndarray, tensors: dict[str, np.ndarray], cost: float) -> None:
        """Write a state read by :meth:`_store`, its head and its pointers (on the background thread).

        In the order a reader relies on: the head, then the state, then the pointers, deepest first;
        a reader that finds a pointer finds its state, and a process killed halfway leaves misses.
        """
        try:
            n = len(tokens)
            found = self._find(tokens)
            state_bytes = np.array([sum(t.nbytes for t in tensors.values())], dtype=np.int64)
            if not self.store.put(head_key, {"tokens": tokens, "state_bytes": state_bytes}, kind=HEAD_KIND, cost_s=cost):
                return
            if not self.store.put(self._state_key(head_key), tensors, kind=KIND, cost_s=cost, parent=head_key):
                return
            # A new state that extends a stored one serves every prompt the old one did: it replaces it.
            replaced = found[0] if found is not None and found[2] == len(found[1]) < n else None
            # Point every block of the new state at it, deepest first, down to a pointer that names
            # another live state (the blocks above it were pointed at when that state was stored).
            pointer = {"head": np.frombuffer(head_key, dtype=np.uint8)}
            for key in reversed(chain_keys(self._root, tokens, self.block_tokens)):
                named = self._pointer(key)
                if named is not None and named != replaced and self._state_key(named) in self.store:
                    break
                self.store.put(key, pointer, kind=INDEX_KIND, cost_s=cost)
            if replaced is not None:
                self.store.delete(replaced)  # its state goes with it (chained)
            self.stats["stored"] += 1  # only this thread counts it
        except Exception as exc:  # noqa: BLE001 - a cache fault is a miss, never the caller's failure
            try:
                self._warn("store", exc)
            except Exception:  # noqa: BLE001 - warnings made errors must not surface in a later, unrelated call
                pass

    def flush(self) -> None:
        """Return once every state stored so far is in the store (written, indexed, findable by
        any process sharing it).

        A completion returns before its state is written: reading it from the context is all it
        waits for. The writes run on the store's writer thread (``PromptStore.later``), which
        ``store.close()``, ``store.flush()`` and a normal interpreter exit wait for; a killed
        process loses the state it was writing (a miss, never a partial entry).
        """
        self._written()
        self.store.flush()

    def _written(self) -> None:
        if self._job is not None:
            # In a forked child this returns at once (PromptStore.later): the parent's writer runs its job.
            self._job.result()  # forgotten only once done: an interrupted wait (Ctrl-C) leaves it to be waited for again
            self._job = None
        self._writing = None

    def _record_prefill(self) -> None:
        """Record the prompt tokens llama.cpp evaluated since the last call, and how long they took."""
        perf = llama_cpp.llama_perf_context(self.llm._ctx.ctx)
        n, ms, load_ms = int(perf.n_p_eval), float(perf.t_p_eval_ms), float(perf.t_load_ms)
        last_n, last_ms, last_load_ms = self._perf if n >= self._perf[0] else (0, 0.0, load_ms)  # counters reset
        self._perf = (n, ms, load_ms)
        if load_ms != last_load_ms:
            return  # llama.cpp counts a context's first evaluation as loading: its tokens, not its time
        self.rates.record_prefill(n - last_n, (ms - last_ms) / 1000)

    def _prefill_rate(self) -> float:
        """Prompt tokens per second in this setting (what a state saves; the eviction policy's cost)."""
        prefill = self.rates.samples["prefill"]
        # statistics, not numpy: np.median imports numpy.ma on first use (20 ms of a fresh process's first request).
        return 1.0 / statistics.median(prefill) if prefill else 1000.0

    # -- BaseLlamaCache ---------------------------------------------------------------------
    @property
    def cache_size(self) -> int:
        """Bytes of stored states in this store's namespace."""
        self._written()
        return sum(i.size for i in self.store.ls(kind=KIND))

    def _warn(self, what: str, exc: BaseException) -> None:
        warnings.warn(f"promptstore: LlamaCppCache {what} failed ({type(exc).__name__}: {exc}); treated as a miss",
                      PromptStoreWarning, stacklevel=3)


class _Context:
    """What :meth:`LlamaCppCache._store` reads of a ``LlamaState``, for the context as it is (no copy of its state)."""

    scores = None

    def __init__(self, n_tokens: int, input_ids: np.ndarray) -> None:
        self.n_tokens, self.input_ids = n_tokens, input_ids
