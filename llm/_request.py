"""One request through an :class:`~._engine.Engine`: its keys, what it reads, what it runs and stores.

A request is made by :meth:`Engine.request` at the start of a call and dropped at its end. It
holds what belongs to that call alone: the root key (the model's identity as it is now, taken
once), where the prompt parts from the stored ones, the check riding in its next forward, and its
counts. Blocks are keyed as the module docstring of _prefix.py says.
"""

from __future__ import annotations

import warnings
from typing import Any

import numpy as np

from promptstore import chain_keys
from promptstore.errors import PromptStoreWarning

from ._buffers import CAPACITY_STEP, RESERVE_TOKENS, held_tokens, kv_layers, make_cache
from ._counts import Counts
from ._engine import KIND, TAIL_KIND, Engine, Structure
from ._states import STATE_KIND, read_states, restore_states, states_fit
from ._verify import InForward, Refuted, Verdict, confirm, refute, refuted, verify_served

__all__ = ["Request"]


class Request:
    """One call's state over ``engine`` (see the module docstring); made by :meth:`Engine.request`."""

    def __init__(self, engine: Engine, structure: Structure, n_queried: int = 0) -> None:
        self.engine = engine
        self.structure = structure  # the model's live identity when the request began
        self._root: bytes | None = None
        self.parted = 0  # the longest stored KV prefix of this request's prompt (see lookup)
        self.check: InForward | None = None  # this request's check, carried by its next forward
        self.counts = Counts()
        self.counts.queried = n_queried
        self.counts.requests = 1

    @property
    def root(self) -> bytes:
        """The key every block of this request chains from: the weights as they were when it was first needed."""
        if self._root is None:
            self._root = self.engine.root_key(self.structure)
        return self._root

    def block_keys(self, ids: np.ndarray, n_blocks: int) -> list[bytes]:
        return chain_keys(self.root, ids[: n_blocks * self.engine.block_tokens], self.engine.block_tokens)

    def lookup(self, ids: np.ndarray, in_forward: bool = False) -> tuple[Any, int]:
        """The longest stored prefix of ``ids`` as a cache, checked (see _verify.py).

        ``in_forward``: the caller runs a forward over the returned cache next and carries the
        check in it (``self.check``), where the cache allows; otherwise the check runs here, in
        a forward of its own.
        """
        self.parted = 0
        self.check = None
        usable = len(ids) - 1
        n_blocks = -(-usable // self.engine.block_tokens)
        if n_blocks == 0:
            return None, 0
        # Room for the rest of the prompt and some generated tokens: they are written in place
        # instead of concatenated (see _ReservedLayer in _buffers.py). Allocated before the keys,
        # whose root fingerprints the model, so that new pages fault in meanwhile.
        # Rounded up, so that the next request of about this length can reuse them.
        need = max(len(ids) + RESERVE_TOKENS, n_blocks * self.engine.block_tokens)
        buffers = self.engine.allocate(-(-need // CAPACITY_STEP) * CAPACITY_STEP)
        n_cached = self.lookup_into(ids, buffers)
        if n_cached and in_forward and self.engine.reuse == "auto" and not self.engine.states() and \
                not self.engine.rates().reuse(n_cached, len(ids)):
            self.counts.declined = n_cached  # recomputing it all is expected to be faster
            return None, 0
        if n_cached and in_forward and self.engine.checks() and self.engine.check_in_forward and not self.engine.states():
            cache = make_cache(buffers, n_cached, self.engine.model.config)
            if InForward.fits(self.engine.model, cache):
                self.check = InForward(self.engine.model, cache, ids, n_cached, self.engine.bound(), self.engine.cache_arg)
                self.parted = n_cached
                return cache, n_cached
        if n_cached and not self.verified(ids, buffers, n_cached):
            return None, 0
        self.parted = n_cached  # where this prompt parts from every stored one (KV), before any state point
        state = None
        if self.engine.states() and n_cached:
            n_cached, state = self.state_point(ids, n_cached)
            if n_cached and in_forward and self.engine.stepwise() and self.engine.reuse == "auto" and \
                    not self.engine.rates().reuse_stepwise(n_cached, len(ids)):
                self.counts.declined = n_cached  # its tokens one at a time would take longer than all in one pass
                return None, 0
        if n_cached == 0:
            return None, 0
        cache = make_cache(buffers, n_cached, self.engine.model.config)
        if state is not None:
            restore_states(cache, state, self.engine.model.device, n_cached)
            if not self.holds(cache, n_cached):
                return None, 0
        return cache, n_cached

    def measured(self, served: int, total: int, seconds: float) -> None:
        """Record a forward's time for the reuse decision (not for models with running states: see run)."""
        if self.engine.reuse == "auto" and not self.engine.states():
            self.engine.rates().record(served, total, seconds)

    def holds(self, cache: Any, n: int) -> bool:
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
        warnings.warn(f"promptstore: {type(self.engine.model).__name__}'s cache counts {held} tokens after restoring {n}; "
                      "recomputed from scratch", PromptStoreWarning, stacklevel=4)
        return False

    def verified(self, ids: np.ndarray, buffers: tuple[Any, Any], n: int) -> bool:
        """Whether the ``n`` tokens read into ``buffers`` are what the model computes now (see _verify.py).

        True where nothing can be checked (verification off, a model with running states, an
        architecture the check does not run on). False refutes the request's root key: this
        request runs from scratch, and nothing is stored under the key until a check passes again.
        """
        if not self.engine.checks():
            return not refuted(self.root)
        return self.judged(verify_served(self.engine.model, self.engine.cache_arg, buffers, n, ids, self.engine.bound()))

    def judged(self, verdict: Verdict | None) -> bool:
        """Count a check's verdict, confirm or refute the request's root key by it; whether the hit stands."""
        self.counts.verified += 1
        if verdict is None or verdict.ok:
            confirm(self.root)
            return True
        refute(self.root, verdict, type(self.engine.model).__name__)
        self.counts.refuted += 1
        return False

    def checked_run(self, ids: np.ndarray, run: Any) -> Any:
        """``run()``: the request's forward(s) over the cache ``lookup`` returned, carrying its check if one is due.

        A check that fails aborts that forward (before any token is chosen from it): the hit is
        refuted and ``run`` is called again with no cache (``self.check`` cleared), from scratch.
        """
        check = self.check
        if check is None:
            return run()
        try:
            with check:
                out = run()
        except Refuted as exc:
            self.check = None
            self.judged(exc.verdict)
            self.parted = 0
            return None
        self.check = None
        self.judged(check.verdict)
        return out

    def lookup_into(self, ids: np.ndarray, buffers: tuple[Any, Any]) -> int:
        """Read the longest stored prefix of ``ids`` (leaving the last token) into ``buffers``; its length."""
        usable = len(ids) - 1
        n_blocks = -(-usable // self.engine.block_tokens)
        if n_blocks == 0:
            return 0
        keys = self.block_keys(ids, n_blocks)
        blocks = self.engine.read_blocks(keys, buffers, usable)
        n_cached = min(blocks * self.engine.block_tokens, usable)
        if n_cached < usable:
            # Token-granular: the stored partial block after the last full one, if it starts
            # like this prompt, serves every token the two share (one index lookup).
            tail = self.engine.store.get(self.tail_key(keys[blocks - 1] if blocks else None, int(ids[n_cached])), kind=KIND)
            shared = self.engine.shared(tail, ids[n_cached:usable]) if tail is not None else 0
            if shared and tail is not None and "full" in tail.meta:
                # A pointer to a full block that this prompt leaves part-way: read that block.
                key = chain_keys(keys[blocks - 1] if blocks else self.root, tail.tensors["tokens"],
                                 self.engine.block_tokens)[0]
                shared = shared if self.engine.read_blocks([key], buffers, usable, first=blocks) == 1 else 0
            elif shared and tail is not None:
                self.engine.copy_tail(buffers, tail, n_cached, shared)
            n_cached += shared
        return n_cached

    def state_key(self, ids: np.ndarray, n: int, keys: list[bytes] | None = None) -> bytes:
        """Where the state after the first ``n`` tokens lives: under the last full block, with the tokens after it."""
        b = n // self.engine.block_tokens
        keys = keys if keys is not None and len(keys) >= b else self.block_keys(ids, b)
        parent = keys[b - 1] if b else self.root
        return self.engine.store.key(STATE_KIND, ids[b * self.engine.block_tokens : n].astype("<i4").tobytes(),
                              fingerprints=[parent.hex()])

    def state_point(self, ids: np.ndarray, n_kv: int) -> tuple[int, Any]:
        """The longest prefix of at most ``n_kv`` tokens whose every layer's state is stored: (tokens, entry).

        Tried, longest first: every length from ``n_kv`` back to the block boundary before it and
        one token more (where earlier requests ended: a document prefilled alone, then questions
        after it; a block-aligned prompt's generate), then
        the states a miss stored every ``Engine.state_every()`` tokens. (0, None) if none is stored.
        """
        every = self.engine.state_every()
        keys = self.block_keys(ids, n_kv // self.engine.block_tokens)
        signature = self.engine.states()
        boundary = n_kv // self.engine.block_tokens * self.engine.block_tokens
        # boundary - 1 too: where a block-aligned prompt's generate stored the state before its last token.
        for n in dict.fromkeys([*range(n_kv, boundary - 2, -1), *range(boundary // every * every, 0, -every)]):
            if n <= 0:
                continue
            entry = self.engine.store.get(self.state_key(ids, n, keys), kind=STATE_KIND)
            if entry is not None and states_fit(entry, signature):
                return n, entry
        return 0, None

    def store_state(self, ids: np.ndarray, n: int, cache: Any, seconds_per_token: float) -> None:
        """Store the state of every state layer after the first ``n`` tokens (what ``cache`` holds now)."""
        key = self.state_key(ids, n)
        if key in self.engine.store:
            return
        b = n // self.engine.block_tokens
        parent = self.block_keys(ids, b)[-1] if b else None
        # Recomputing a state means running its whole prefix: that is what it saves.
        self.engine.store.put(key, read_states(cache), kind=STATE_KIND, cost_s=seconds_per_token * n, parent=parent,
                       meta={"tokens": str(n)}, background=True)

    def tail_key(self, parent: bytes | None, first_token: int) -> bytes:
        """Where the partial block after ``parent`` (None: the chain's root) starting with ``first_token`` lives."""
        return self.engine.store.key(TAIL_KIND, np.array([first_token], "<i4").tobytes(),
                              fingerprints=[(parent if parent is not None else self.root).hex()])

    def store_blocks(self, ids: np.ndarray, cache: Any, n_in_cache: int, first_block: int,
                      seconds_per_token: float, later: bool = False) -> None:
        """Store the blocks of the first ``n_in_cache`` tokens from ``first_block`` on, as ``cache`` holds them.

        ``later``: ``cache`` is the caller's alone and its tensors are never written again (a
        ``DynamicCache`` this request made, that no forward hook was handed and nobody else holds:
        its layers grow by concatenation, into new tensors): the blocks are then copied out of it on the store's writer thread after
        the call returns (``PromptStore.later``), not before; the engine's next request waits for
        them (``Engine.settle``), so it finds them as before.
        """
        if refuted(self.root):
            return  # this live state is not what its key says: nothing is stored under it
        n = min(n_in_cache, len(ids))
        last_block = n // self.engine.block_tokens
        if last_block <= first_block and n == last_block * self.engine.block_tokens and not self.engine.states():
            return
        # A cache of running states only (Mamba2) holds no per-token KV to count: its state is
        # that of the tokens this request ran through it.
        held = cache.get_seq_length() if kv_layers(cache) else n_in_cache
        if held != n_in_cache:
            # The cache does not hold exactly these tokens (MPT's generate re-feeds the whole
            # sequence into a given cache at every step): storing slices of it would key wrong
            # KV under right tokens. Found by tests/llm_zoo.py.
            warnings.warn(f"promptstore: {type(self.engine.model).__name__} left {held} positions in the KV cache for "
                          f"{n_in_cache} tokens; nothing stored from it", PromptStoreWarning, stacklevel=3)
            return
        if kv_layers(cache) and held_tokens(cache) != {n_in_cache}:
            # A layer keeps fewer tokens than the sequence (a sliding window in transformers' own
            # layer): its slices would not be these tokens' KV.
            warnings.warn(f"promptstore: {type(self.engine.model).__name__}'s cache layers hold {sorted(held_tokens(cache))} "
                          f"tokens for {n_in_cache}; nothing stored from it", PromptStoreWarning, stacklevel=3)
            return
        if not (last_block <= first_block and n == last_block * self.engine.block_tokens):
            kv = kv_layers(cache)  # the layers' tensors as they are now (a deferred copy reads these)
            if later and not self.engine.states():
                ids = ids.copy()  # the caller's output may share these ids' memory, and is theirs to change
                keys = self.block_keys(ids, n // self.engine.block_tokens)  # the root, hashed here and not on the writer
                self.engine.copying(self.engine.store.later(
                    lambda: self.store_kv(ids, kv, n, first_block, seconds_per_token, keys),
                    nbytes=sum(k.nbytes + v.nbytes for k, v in kv)))
            else:
                self.store_kv(ids, kv, n, first_block, seconds_per_token)
        if self.engine.states() and n == n_in_cache:
            self.store_state(ids, n, cache, seconds_per_token)  # after its blocks: its parent is one

    def store_kv(self, ids: np.ndarray, kv: list[tuple[Any, Any]], n: int, first_block: int, seconds_per_token: float,
                 keys: list[bytes] | None = None) -> None:
        """The full blocks from ``first_block`` and the partial one after them, of the first ``n`` tokens of ``kv``
        (``kv_layers`` of a cache); ``keys``: their block keys, if already made."""
        import torch

        last_block = n // self.engine.block_tokens
        keys = keys if keys is not None else self.block_keys(ids, last_block)
        for b in range(first_block, last_block):
            if keys[b] in self.engine.store:
                continue
            lo, hi = b * self.engine.block_tokens, (b + 1) * self.engine.block_tokens
            with torch.no_grad():
                k = self.engine.stack(kv, 0, lo, hi)
                v = self.engine.stack(kv, 1, lo, hi)
            parent = keys[b - 1] if b else None
            if self.engine.store.put(keys[b], {"k": self.engine.to_stored(k), "v": self.engine.to_stored(v)}, kind=KIND,
                              cost_s=seconds_per_token * self.engine.block_tokens, parent=parent,
                              meta={"block": str(b), "tokens": str(self.engine.block_tokens)}, background=True):
                # A later prompt that leaves this block part-way (a new question after the same
                # document) finds it from the block before, like a tail, and reuses what it shares.
                # It holds the block's token ids only: the block's key follows from them.
                # A child of the block it names, so it goes when the block goes.
                self.engine.store.put(self.tail_key(parent, int(ids[lo])), {"tokens": ids[lo:hi].astype(np.int32)},
                               kind=KIND, cost_s=seconds_per_token * self.engine.block_tokens, parent=keys[b],
                               meta={"full": str(b)}, background=True)
        lo = last_block * self.engine.block_tokens
        if n > lo:
            self.store_tail(ids[lo:n], kv, lo, keys[last_block - 1] if last_block else None, seconds_per_token)

    def store_tail(self, tokens: np.ndarray, kv: list[tuple[Any, Any]], lo: int, parent: bytes | None,
                    seconds_per_token: float) -> None:
        """Store the partial block after the last full one (tokens and their KV), unless one stored covers it."""
        import torch

        key = self.tail_key(parent, int(tokens[0]))
        old = self.engine.store.peek(key)
        if old is not None and len(tokens) <= self.engine.shared(old, tokens.astype(np.int64)):
            return  # the stored tail already starts with all of these tokens
        hi = lo + len(tokens)
        with torch.no_grad():
            k = self.engine.stack(kv, 0, lo, hi)
            v = self.engine.stack(kv, 1, lo, hi)
        self.engine.store.put(key, {"tokens": tokens.astype(np.int32), "k": self.engine.to_stored(k), "v": self.engine.to_stored(v)},
                       kind=KIND, cost_s=seconds_per_token * len(tokens), parent=parent,
                       meta={"tail": str(len(tokens)), "tokens": str(self.engine.block_tokens)}, background=True)

    def run(self, ids: np.ndarray, start: int, stop: int, cache: Any, last_apart: bool = False) -> tuple[Any, Any, float]:
        """``Engine.forward`` over ``ids[start:stop]``; for a model with running states, in pieces that end where states are stored.

        A state exists only where a forward ends, so a miss is run up to each multiple of
        ``Engine.state_every()`` tokens, storing the state there: a later prompt that shares only
        part of this one resumes from the last such point. ``last_apart`` runs the last token
        on its own too, so that the same prompt asked again (which leaves its last token to
        compute) finds the state before it.
        """
        if not self.engine.states():
            return self.engine.forward(ids, start, stop, cache)
        if self.engine.stepwise():
            return self.run_stepwise(ids, start, stop, cache, last_apart)
        every = self.engine.state_every()
        seconds, logits = 0.0, None
        # Where the prompt parts from the stored ones too: a hit that resumed before it (the last
        # stored state) stores one there, so the next prompt that parts there (another question
        # after the same document or system prompt) resumes there exactly.
        parted = [self.parted] if start < self.parted < stop else []
        ends = [*range((start // every + 1) * every, stop, every), *parted, *([stop - 1] if last_apart else []), stop]
        first = start
        for end in sorted(e for e in set(ends) if e > start):
            cache, logits, took = self.engine.forward(ids, start, end, cache)
            seconds += took
            if end < stop:
                # The blocks up to here first: a persistent tier takes an entry only after its parent.
                # Priced at this run's mean rate so far: a one-token piece costs more per token.
                self.store_blocks(ids, cache, end, start // self.engine.block_tokens, seconds / max(end - first, 1))
            start = end
        return cache, logits, seconds

    def run_stepwise(self, ids: np.ndarray, start: int, stop: int, cache: Any, last_apart: bool) -> tuple[Any, Any, float]:
        """``run`` for a model that continues a state one token at a time only (see probe_model).

        From no state (a miss), the prompt runs in one forward: exact, but no state is stored
        inside it (a later piece could not continue it in one forward either). Over a restored
        state, one forward per token. States are stored where ``run`` stores them: where the
        prompt parts from the stored ones, and before its last token when ``last_apart``.
        """
        fresh = cache is None and start == 0
        # From no state, nothing but the state before the last token: ending the one pass where the prompt
        # parts from a stored one would leave the rest to run one token at a time.
        stops = {e for e in (0 if fresh else self.parted, stop - 1 if last_apart else 0) if start < e < stop}
        seconds, logits, first = 0.0, None, start
        if fresh:
            end = min(stops, default=stop)
            cache, logits, seconds = self.engine.forward(ids, 0, end, None)
            if self.engine.reuse == "auto":
                self.engine.rates().record(0, end, seconds)
            if end < stop:
                self.store_blocks(ids, cache, end, 0, seconds / end)
            start = end
        stepping = 0.0  # the steps' forwards only, not the storing between them
        for pos in range(start, stop):
            cache, logits, took = self.engine.forward(ids, pos, pos + 1, cache)
            seconds += took
            stepping += took
            if pos + 1 in stops:
                self.store_blocks(ids, cache, pos + 1, first // self.engine.block_tokens, seconds / max(pos + 1 - first, 1))
        if stop > start and self.engine.reuse == "auto":
            self.engine.rates().record_steps(stop - start, stepping)
        return cache, logits, seconds
