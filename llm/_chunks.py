"""ChunkCache: reuse a passage's KV wherever it appears in a prompt (RAG passages in any order).

A prompt is given as segments: an anchor (a system line), passages, and a question.

- The leading exact prefix comes from :class:`PrefixCache` blocks, and the anchor's blocks are
  stored there (exact: they are computed in their real context).
- Each passage's KV is computed once, right after the anchor, and stored under its own key
  (model fingerprint, anchor tokens, passage tokens). Its position in a new prompt differs, so
  its cached RoPE keys are rotated to the new positions: exact arithmetic, since RoPE applies
  a rotation per position. Values carry no position.
- What a moved passage's KV lacks is the other passages it did not see. A fraction
  ``recompute`` of the moved tokens is computed again in the new context, together with the
  question, in one forward pass: the selected tokens attend to the whole prompt (stored KV for
  the others) and their fresh KV replaces the stored one at every layer. ``select`` says which
  tokens:

  - ``"recent"``: the moved tokens nearest the question (the question's queries lean most on the
    context just before it). The default for a model whose queries ``"query"`` cannot read.
  - ``"blend"`` (CacheBlend): the largest deviation of layer 1's values between the stored KV
    and this prompt, which costs one layer over the whole prompt to find.
  - ``"first"`` (EPIC): the first tokens of each moved passage.
  - ``"query"`` (the default; question-aware, after ProphetKV and InfoFlow KV): the question is run
    once over the stitched (rotated) KV, and each moved token is ranked by the attention its
    queries give it, at the question's final positions, summed over every layer. It costs that
    one extra pass over the question; on both measured prompt sets it beat the other selections
    at equal TTFT on KL and top-1 (BENCHMARKS.md, "Passages anywhere").
- ``recompute=1.0`` recomputes every moved token: a full prefill, up to float rounding.
- ``max_kl``: a per-request quality guard. Each request estimates how far its next-token
  distribution still is from a full prefill's from the KL divergence between two budgets
  (the stale KV's against the repaired one, then each budget against half of it), times
  ``GUARD_SAFETY``, and doubles the recomputed fraction until the estimate is within the bound;
  a doubling past half of the moved tokens, or an estimate too far over the bound to come within
  it by then (``GUARD_FALL``), is an exact prefill instead. ``stats["last"]`` reports the estimate and the fraction used.
  Where trying the budgets has lately ended in the exact prefill more than it paid, a request goes
  straight to the exact prefill (``GuardCost``, learned per setting and kept in the store, so a
  restarted process does not learn it again).

Such KV is approximate, so nothing ChunkCache computes after the anchor is ever stored in
PrefixCache's exact key space.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from typing import Any

import numpy as np

from promptstore import PromptStore
from promptstore.errors import InvalidInputError, UnsupportedModelError

from ._buffers import CAPACITY_STEP, RESERVE_TOKENS, copy_block, host_view, kv_layers, make_cache
from ._counts import Counts
from ._decide import GuardCost
from ._engine import Engine
from ._inputs import check_generation, check_lengths
from ._prefix import PrefixCache
from ._request import Request
from ._verify import refuted

__all__ = ["ChunkCache", "CHUNK_KIND", "SELECTIONS", "DEFAULT_RECOMPUTE", "DEFAULT_SELECT"]

CHUNK_KIND = "llm.chunk"
MOVES_KIND = "llm.chunk.moves"  # a live structure's pass of the move check, so a fresh process skips its forwards
SELECTIONS = ("recent", "blend", "first", "query")
# Chosen from measured quality and speed (BENCHMARKS.md, "Passages anywhere"; bench/chunk_quality.py).
DEFAULT_RECOMPUTE = 0.10
DEFAULT_SELECT = "query"  # "recent" for a model whose queries "query" cannot read (see _query_parts)
# The step between two budgets understates the distance left to a full prefill: the later
# doublings keep moving the distribution. bench/guard_probe.py recorded every budget on 40 prompts
# of each set: with the step alone the true KL exceeded the bound in 10-43% of requests; 6x is
# the smallest factor that keeps it to 5% or less on both sets at bounds 0.02-0.05 (0-2.5%).
GUARD_SAFETY = 6.0
# A doubled budget above half the moved tokens costs most of an exact prefill (through the slower
# scatter pass) and the 6x step rarely accepts it: the guard goes exact instead. On the recorded
# budgets of both sets this cut the guard's work at bound 0.02 from 2.48 to 1.70 (chat) and 1.47
# to 1.24 (plain) times the moved tokens, worst case 2.5 to 1.7, with no more violations.
GUARD_EXACT_ABOVE = 0.5
# The most the estimate is taken to fall per doubling (the probe's 90th percentile at 10-40%: 2.2-4):
# an estimate over the bound by more than GUARD_FALL ** (the doublings left before exact) cannot get
# within it, so the request goes exact at once. On the recorded budgets at bounds 0.02-0.05 this cut
# the chat set's work from 1.59-1.70 to 1.10-1.11 x the moved tokens; plain: 0.47 / 1.04 / 1.24 to
# 0.51 / 1.09 / 1.18; violations 0-2.5% on both.
GUARD_FALL = 4.0
_SHIFT = 37  # how far the model check moves a probe passage
SERVED, STORED, COMPUTED = 0, 1, 2


class _Stop(Exception):
    """Raised by the recording cache layer once it has what it needs: the rest of the forward is skipped."""


class _Stats(Counts):
    FIELDS = ("queried", "served", "recomputed", "computed", "requests")
    recomputed: int  # moved tokens recomputed (set in __init__ by name, as Counts' fields)

    def __init__(self) -> None:
        super().__init__()
        self.estimate: float | None = None  # the guard's KL estimate (nats), when it ran
        self.fraction: float | None = None  # the share of moved tokens the request recomputed

    def as_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(super().as_dict())
        if self.fraction is not None:
            out["fraction"] = self.fraction
        if self.estimate is not None:
            out["estimate"] = self.estimate
        return out


class ChunkCache:
    """Serve prompts made of an anchor, cached passages in any order, and a question.

    Args:
        model: a transformers causal LM with rotary positions (Llama, Qwen2, Mistral, Phi-3,
            SmolLM...), ``attn_implementation`` ``"sdpa"`` or ``"eager"``.
        tokenizer: its tokenizer; needed when segments are text.
        store: where blocks and passages live (default: ``PromptStore()``).
        recompute: fraction (0 to 1) of the moved passage tokens whose KV is computed again in
            the new prompt. The first passage sits where it was cached (right after the anchor)
            and is exact without recompute. ``1.0`` equals a full prefill.
        select: ``"recent"``, ``"blend"``, ``"first"`` or ``"query"``; see the module docstring.
            The default (None) is ``"query"``, the best measured on both of bench/chunk_quality.py's
            prompt sets (README.md), or ``"recent"`` for a model whose queries it cannot read.
        block_tokens: block size of the leading exact prefix (see :class:`PrefixCache`).
        max_kl: the quality guard's bound (nats; None: off): recompute more, up to an exact
            prefill, until the request's estimated KL from a full prefill is within it.

    Raises:
        InvalidInputError: ``recompute`` outside [0, 1], an unknown ``select``, ``max_kl`` negative or not finite.
        UnsupportedModelError: a model PrefixCache refuses, one without rotary positions
            (learned absolute positions, ALiBi), one whose keys do not move with a rotation
            (another RoPE layout, length-dependent RoPE), sliding-window layers, or an attention
            kernel that takes no custom mask. Raised before anything is looked up or stored.
    """

    def __init__(self, model: Any, tokenizer: Any = None, store: PromptStore | None = None, *,
                 recompute: float = DEFAULT_RECOMPUTE, select: str | None = None, block_tokens: int = 64,
                 max_kl: float | None = None) -> None:
        if isinstance(recompute, bool) or not isinstance(recompute, (int, float)) or not 0.0 <= recompute <= 1.0:
            raise InvalidInputError(f"recompute must be a number from 0 to 1, got {recompute!r}")
        if select is None:
            try:
                _query_parts(model)
                select = DEFAULT_SELECT
            except UnsupportedModelError:
                select = "recent"
        if select not in SELECTIONS:
            raise InvalidInputError(f"select must be one of {SELECTIONS}, got {select!r}")
        if max_kl is not None and (isinstance(max_kl, bool) or not isinstance(max_kl, (int, float))
                                   or not 0.0 <= max_kl < float("inf")):
            raise InvalidInputError(f"max_kl must be a finite number >= 0 (nats) or None, got {max_kl!r}")
        if select == "query":
            _query_parts(model)  # refuse, before any work, a model whose queries cannot be read
        self.prefix = PrefixCache(model, tokenizer, store, block_tokens)
        self.engine = self.prefix.engine  # its keys, block reads and writes, forwards (see _engine.py)
        self.model, self.tokenizer, self.store = model, tokenizer, self.prefix.store
        self.recompute, self.select = float(recompute), select
        self.max_kl = None if max_kl is None else float(max_kl)
        self._checked: Any = None  # the live model signature the move check last passed for
        self._inv_freq: Any = None  # the rotary frequencies that check read
        self._check_model()
        self._last, self._total = _Stats(), _Stats()
        self._guard_cost: GuardCost | None = None

    def _guard(self) -> GuardCost:
        """The guard's own cost (see GuardCost): where trying keeps ending in the exact prefill, a request goes
        straight to it, never slower than a plain prefill by more than a probe now and then."""
        if self._guard_cost is None:
            self._guard_cost = GuardCost(self.store, self.engine.rates(),
                                         f"max_kl={self.max_kl!r}|recompute={self.recompute!r}|select={self.select}")
        return self._guard_cost

    def _check_model(self) -> None:
        """The checks of a model whose passages can move, again whenever its live identity moved.

        PrefixCache re-derives its layout whenever anything but the weights' values changed
        (config, settings, hooks, code); the attention kernel and the rotation check follow it.
        """
        import torch

        signature = self.engine.signature
        # The rotation uses the live frequencies: read on every request (a few hundred bytes),
        # since the signature holds no tensor bytes.
        freqs = _rotary_frequencies(self.model)
        if signature is not None and signature == self._checked and torch.equal(freqs, self._inv_freq):
            return
        impl = getattr(self.model.config, "_attn_implementation", None) or "eager"
        if impl not in ("sdpa", "eager"):
            raise UnsupportedModelError(f"attn_implementation {impl!r} takes no custom attention mask, which recomputing "
                                        "tokens in place needs: load the model with attn_implementation='sdpa'")
        if self.engine.states():
            raise UnsupportedModelError("ChunkCache does not serve models with linear-attention/SSM layers: a "
                                        "passage's running state depends on everything before it, so it cannot move; "
                                        "PrefixCache serves this model exactly")
        if self.engine.sliding():
            # Its recompute pass hands attention a mask of its own over every token's KV, which
            # knows nothing of the window; PrefixCache serves these models exactly.
            raise UnsupportedModelError("ChunkCache does not serve sliding-window layers yet (its recompute mask "
                                        "ignores the window); PrefixCache serves this model exactly")
        self._inv_freq = freqs
        self._checked_moves(signature)
        self._checked = signature

    def _checked_moves(self, signature: Any) -> None:
        """The move check, once per live structure and rotary frequencies in any process sharing the store.

        Whether keys move with a rotation depends on the architecture as it runs (the signature:
        structure, settings, hooks, live code, dtypes, ambient state) and the frequencies it
        rotates with, not on the weights' values. Only a pass is stored: a refused model is
        probed, and refused, again each time.
        """
        import torch
        import transformers

        if signature is None:  # no live structure read yet: nothing to name a verdict by
            _check_moves(self.model, self._inv_freq, self.engine)
            return
        freqs = self._inv_freq.detach().to("cpu", torch.float64).numpy().tobytes()
        key = self.store.key(MOVES_KIND, freqs, fingerprints=[repr(signature), f"shift={_SHIFT}",
                                                              f"transformers={transformers.__version__}",
                                                              f"torch={torch.__version__}"])
        if self.store.get(key, kind=MOVES_KIND) is not None:
            return
        t0 = time.perf_counter()
        _check_moves(self.model, self._inv_freq, self.engine)
        self.store.put(key, {"passed": np.ones(1, np.uint8)}, kind=MOVES_KIND, cost_s=time.perf_counter() - t0)

    # -- inputs ---------------------------------------------------------------------------
    def _segments(self, segments: Sequence[Any]) -> list[np.ndarray]:
        if isinstance(segments, (str, bytes)) or not isinstance(segments, Sequence) or len(segments) < 2:
            raise InvalidInputError("segments must be a list: [anchor, *passages, question] (at least an anchor and a "
                                    "question)")
        out = []
        for i, seg in enumerate(segments):
            if isinstance(seg, str):
                if self.tokenizer is None:
                    raise InvalidInputError("text segments need ChunkCache(model, tokenizer)")
                if not seg:
                    raise InvalidInputError(f"segment {i} is empty")
                # The first segment starts the prompt (special tokens as the tokenizer adds them); the
                # others are tokenized alone, so a passage has the same tokens wherever it is placed.
                ids = self.tokenizer(seg, add_special_tokens=(i == 0))["input_ids"]
                if len(ids) == 0:
                    raise InvalidInputError(f"segment {i} has no tokens")
            else:
                ids = seg
            try:
                out.append(self.engine.token_ids(ids))
            except InvalidInputError as exc:
                raise InvalidInputError(f"segment {i}: {exc}") from None
        return out

    # -- one request ----------------------------------------------------------------------
    def _chunk_key(self, req: Request, anchor: np.ndarray, passage: np.ndarray) -> bytes:
        content = (np.array([len(anchor)], "<i8").tobytes() + anchor.astype("<i4").tobytes()
                   + passage.astype("<i4").tobytes())
        return self.store.key(CHUNK_KIND, content, fingerprints=[req.root.hex()])

    def _build(self, segs: list[np.ndarray], stop: int) -> tuple[Any, Any]:
        """KV for the prompt's first ``stop`` tokens in buffers, then the pass; (cache, last logits or None)."""
        import torch

        engine = self.engine
        ids = np.concatenate(segs)
        anchor, passages = segs[0], segs[1:-1]
        n_anchor = len(anchor)
        req = engine.request()
        self._check_model()
        if self.max_kl is not None and self.recompute < 1.0 and not self._guard().worth_trying() and len(passages) > 1:
            # Trying the guard's budgets has lately ended in the exact prefill: run it at once, before any
            # stored passage is read.
            return self._direct(req, ids, stop)
        need = len(ids) + RESERVE_TOKENS
        buffers = engine.allocate(-(-need // CAPACITY_STEP) * CAPACITY_STEP)
        n_exact = req.lookup_into(ids, buffers)  # leaves the last token, so n_exact <= stop
        if refuted(req.root) or (n_exact and not req.verified(ids, buffers, n_exact)):
            return self._from_scratch(ids, stop)
        # Where each position's KV comes from: SERVED exactly, STORED passage KV, or COMPUTED now.
        source = np.full(len(ids), COMPUTED, np.int8)
        source[:n_exact] = SERVED
        if n_exact < n_anchor:
            # The anchor itself is exact: computed in place and stored as PrefixCache blocks.
            cache = make_cache(buffers, n_exact, self.model.config)
            cache, _, seconds = engine.forward(ids, n_exact, n_anchor, cache)
            req.store_blocks(ids, cache, n_anchor, n_exact // engine.block_tokens, seconds / (n_anchor - n_exact))
        start = max(n_exact, n_anchor)
        exact_to = start  # every position before it holds the KV a plain prefill computes
        placed = np.zeros(len(ids), bool)
        t0 = time.perf_counter()  # the guard's try starts with the passages' reads
        moved = []  # positions of passages cached in another context than this prompt's
        ends = n_anchor + np.cumsum([len(p) for p in passages], dtype=np.int64)
        for i, passage in enumerate(passages):
            lo, hi = int(ends[i]) - len(passage), int(ends[i])
            if lo < start or hi > stop:
                continue  # inside the exact prefix, or straddling it or the end: computed if not served
            placed[lo:hi] = True
            if not self._place(req, anchor, passage, buffers, lo):
                source[lo:hi] = STORED
            if i:  # the first passage sits right after the anchor, where it was cached: exact as it is
                moved.append(np.arange(lo, hi))
            elif lo == start:
                exact_to = hi
        base = np.flatnonzero(~placed[start:stop]) + start  # the question and whatever has no stored KV
        total = sum(len(m) for m in moved)
        partial = 0 < int(round(self.recompute * total)) < total
        stale = hidden = None
        if moved and base.size and ((self.select == "query" and partial) or self.max_kl is not None):
            # The question over the stitched KV as it is: the guard's first point, and the queries
            # the "query" selection ranks moved tokens by.
            with torch.no_grad():
                stale, hidden = self._pass(ids, buffers, base, stop, hidden=self.select == "query")
        ranked = self._query_ranking(hidden, buffers, base, moved, stop) if hidden is not None else None
        if self.select == "blend" and moved and (partial or (self.max_kl is not None and self.recompute < 1.0)):
            # Ranked once, on the KV as stored: the guard's larger budgets take the next tokens of that order.
            candidates = np.concatenate(moved)
            ranked = candidates[np.argsort(-self._deviation(ids, buffers, candidates), kind="stable")]
        fraction = self.recompute
        estimate = None
        if moved and fraction >= 1.0:
            chosen = np.concatenate(moved)
            logits = self._exact(ids, buffers, source, exact_to, stop, chosen)
        else:
            chosen = self._choose(ids, buffers, moved, fraction, ranked)
            logits = self._repair(ids, buffers, np.union1d(chosen, base).astype(np.int64), stop)
        if self.max_kl is not None and stale is not None and logits is not None:
            # A budget that recomputed nothing more than the last is no evidence: it is never accepted.
            estimate = 0.0 if chosen.size >= total else GUARD_SAFETY * _kl(logits, stale) if chosen.size \
                else float("inf")
            # A zero bound accepts only the exact prefill: two budgets can agree to the last bit.
            while (estimate > self.max_kl or self.max_kl == 0.0) and chosen.size < total:
                # Twice the budget (a superset: what was recomputed stays recomputed), up to all of it;
                # no budget yet (inf) is no measure of how far off the request is.
                hopeless = estimate != float("inf") and estimate > self.max_kl * GUARD_FALL ** _doublings_left(fraction)
                fraction = 1.0 if hopeless else _doubled(fraction)
                if fraction >= 1.0:
                    chosen, estimate = np.concatenate(moved), 0.0
                    t_exact = time.perf_counter()
                    logits = self._exact(ids, buffers, source, exact_to, stop, chosen)
                    self._guard().tried(stop, False, t_exact - t0, time.perf_counter() - t_exact)
                    break
                more = np.union1d(chosen, self._choose(ids, buffers, moved, fraction, ranked)).astype(np.int64)
                if more.size == chosen.size:
                    continue
                chosen = more
                previous, logits = logits, self._repair(ids, buffers, np.union1d(chosen, base).astype(np.int64), stop)
                estimate = 0.0 if chosen.size >= total else GUARD_SAFETY * _kl(logits, previous)
        if self.max_kl is not None and moved and self.recompute < 1.0 and fraction < 1.0:
            self._guard().tried(stop, True, time.perf_counter() - t0)
        last = self._last = _Stats()
        last.queried, last.requests = len(ids), 1
        last.recomputed = int(np.count_nonzero(source[chosen] == STORED))
        last.served = int(np.count_nonzero(source != COMPUTED)) - last.recomputed
        last.computed = len(ids) - last.served - last.recomputed
        last.fraction = chosen.size / total if moved else None
        last.estimate = estimate
        cache = make_cache(buffers, stop, self.model.config)
        return cache, logits

    def _exact(self, ids: np.ndarray, buffers: tuple[Any, Any], source: np.ndarray, exact: int, stop: int,
               moved: np.ndarray) -> Any:
        """The exact prefill, as PrefixCache runs it: one plain forward over everything after the first
        ``exact`` positions, whose KV is what a plain prefill computes (the served prefix, the anchor and
        the passage cached right after it), or over the whole prompt where serving those is not expected
        to pay (see _decide.py); never the slower scattered pass. Positions run are marked computed, but
        the ``moved`` passages' (counted as recomputed stored KV); returns the last scores."""
        engine = self.engine
        start = exact if exact and (engine.reuse == "always" or engine.rates().reuse(exact, stop)) else 0
        keep = source[moved] if moved.size else None
        source[start:] = COMPUTED
        if keep is not None:
            source[moved] = keep
        cache = make_cache(buffers, start, self.model.config)
        _, out, _ = engine.forward(ids, start, stop, cache)
        return out[0, -1]

    def _direct(self, req: Request, ids: np.ndarray, stop: int) -> tuple[Any, Any]:
        """The exact prefill as PrefixCache runs a prompt: its stored prefix where serving it pays, checked in the
        forward, the rest computed, the blocks stored. No stored passage is read and none is computed on the side:
        a passage not stored yet is stored by a later request that tries the guard's budgets."""
        t0 = time.perf_counter()
        cache, logits = self.prefix.prefill_request(req, ids[:stop])
        self._guard().went_exact(stop, time.perf_counter() - t0)
        served = self.prefix.stats["last"]["served"]
        last = self._last = _Stats()
        last.queried, last.requests, last.served, last.computed = len(ids), 1, served, len(ids) - served
        last.fraction, last.estimate = 1.0, 0.0
        return cache, logits

    def _from_scratch(self, ids: np.ndarray, stop: int) -> tuple[Any, Any]:
        """The prompt's first ``stop`` tokens in one plain forward, nothing read or stored: a refuted live state."""
        cache, logits, _ = self.engine.forward(ids, 0, stop, None)
        last = self._last = _Stats()
        last.queried, last.requests, last.computed = len(ids), 1, len(ids)
        return cache, logits[0, -1]

    def _repair(self, ids: np.ndarray, buffers: tuple[Any, Any], run: np.ndarray, stop: int) -> Any:
        """Compute the tokens at ``run`` (and their KV) over the stored KV of the rest; the last scores or None."""
        import torch

        if not run.size:
            return None
        if run[0] + run.size == stop:
            # Only the end of the prompt (nothing chosen before it): a plain forward, as PrefixCache runs it.
            cache = make_cache(buffers, int(run[0]), self.model.config)
            _, out, _ = self.engine.forward(ids, int(run[0]), stop, cache)
            return out[0, -1]
        with torch.no_grad():
            return self._pass(ids, buffers, run, stop)[0]

    def _place(self, req: Request, anchor: np.ndarray, passage: np.ndarray, buffers: tuple[Any, Any], lo: int) -> bool:
        """Put a passage's stored KV (computed and stored on a miss) at ``lo``; True if it was computed."""
        import torch

        key = self._chunk_key(req, anchor, passage)
        n, at = len(passage), len(anchor)
        k_buf, v_buf = buffers
        host = k_buf.device.type == "cpu"
        layers, heads, k_dim, v_dim, _ = self.engine.layout()
        want = {"k": (layers, heads, n, k_dim), "v": (layers, heads, n, v_dim)}
        entry = None
        if host:
            into = {side: host_view(full)[:, 0, :, lo : lo + n, :] for side, full in zip(("k", "v"), buffers, strict=True)}
            entry = self.store.get(key, kind=CHUNK_KIND, into=into)
            # Passages are stored in the model's own dtype and layout (the key holds both), so a
            # fitting one is read straight into place; anything else under the key is a miss.
            if entry is not None and not all(entry.tensors.get(s) is dst for s, dst in into.items()):
                entry = None
        else:
            # pragma: no mutate start (a GPU's path: tests/test_chunks.py runs it on the GPU machine)
            entry = self.store.get(key, kind=CHUNK_KIND)
            if entry is not None and all(tuple(entry.tensors[s].shape) == want[s] for s in ("k", "v")):
                for side, full in zip(("k", "v"), buffers, strict=True):
                    stage = torch.empty(want[side], dtype=full.dtype)
                    copy_block(host_view(stage), entry.tensors[side], entry.dtypes[side], full.dtype)
                    full[:, 0, :, lo : lo + n, :].copy_(stage.to(full.device))
            else:
                entry = None
            # pragma: no mutate end
        computed = entry is None
        if computed:
            k, v, seconds = self._compute_chunk(buffers, at, passage)
            self.store.put(key, {"k": self.engine.to_stored(k), "v": self.engine.to_stored(v)}, kind=CHUNK_KIND,
                           cost_s=seconds, meta={"anchor": str(at), "tokens": str(n)})
            with torch.no_grad():
                k_buf[:, 0, :, lo : lo + n, :] = k
                v_buf[:, 0, :, lo : lo + n, :] = v
        if lo != at:
            _rotate(k_buf[:, 0, :, lo : lo + n, :], np.arange(at, at + n), np.arange(lo, lo + n), self._inv_freq)
        return computed

    def _compute_chunk(self, buffers: tuple[Any, Any], at: int, passage: np.ndarray) -> tuple[Any, Any, float]:
        """A passage's KV right after the anchor (whose KV is ``buffers[:at]``): (k, v, seconds)."""
        import torch
        from transformers import DynamicCache

        cache = DynamicCache(config=self.model.config)
        with torch.no_grad():
            for i in range(buffers[0].shape[0]):
                cache.update(buffers[0][i, :, :, :at].clone(), buffers[1][i, :, :, :at].clone(), i)
            t0 = time.perf_counter()
            out = self.model(torch.as_tensor(passage, device=self.model.device)[None], use_cache=True,
                             **{self.engine.cache_arg: cache}, **self.engine.last_only)
            seconds = time.perf_counter() - t0
            kv = kv_layers(self.engine.output_cache(out))
            k = torch.stack([layer_k[0, :, at:, :] for layer_k, _ in kv])
            v = torch.stack([layer_v[0, :, at:, :] for _, layer_v in kv])
        return k, v, seconds

    def _choose(self, ids: np.ndarray, buffers: tuple[Any, Any], moved: list[np.ndarray], fraction: float,
                ranked: np.ndarray | None) -> np.ndarray:
        """The moved tokens to recompute: ``fraction`` of them, picked by ``select`` (``ranked``: the order
        of "query" (most attended first; None without a question to rank by) or "blend" (most deviating
        first; None: ranked here))."""

        if not moved or fraction == 0.0:
            return np.zeros(0, np.int64)
        candidates = np.concatenate(moved)
        count = int(round(fraction * candidates.size))
        if count >= candidates.size:
            return candidates
        if count == 0:
            return np.zeros(0, np.int64)
        if self.select in ("query", "blend") and ranked is not None:
            return np.sort(ranked[:count])
        if self.select in ("recent", "query"):
            # The moved tokens nearest the question: its queries lean on nearby context most.
            return candidates[-count:]
        if self.select == "first":
            # EPIC: the same number of leading tokens from each moved passage.
            per = -(-count // len(moved))
            return np.sort(np.concatenate([p[:per] for p in moved]))[:count] if per else np.zeros(0, np.int64)
        # CacheBlend: recompute layer 1's values of every candidate in the new context (layer 0's KV
        # is already exact: it sees no other token's state) and keep those that moved most.
        deviation = self._deviation(ids, buffers, candidates)
        top = np.argsort(-deviation, kind="stable")[:count]
        return np.sort(candidates[top])

    def _query_ranking(self, hidden: Any, buffers: tuple[Any, Any], at: np.ndarray, moved: list[np.ndarray],
                       n_kv: int) -> np.ndarray:
        """The moved tokens, most attended first by the queries of the tokens at ``at`` (the question),
        whose inputs to each layer are ``hidden``: each layer's attention probabilities over the stitched
        KV, summed over heads, query tokens and layers (each layer weighs the same)."""
        import torch

        layers, queries, scaling = _query_parts(self.model)
        candidates = np.concatenate(moved)
        k_buf = buffers[0]
        device = k_buf.device
        cand = torch.as_tensor(candidates, device=device)
        pos = torch.as_tensor(at, device=device)
        causal = torch.arange(n_kv, device=device)[None, :] <= pos[:, None]  # (queries, keys)
        score = torch.zeros(candidates.size, dtype=torch.float64, device=device)
        with torch.no_grad():
            for i, layer in enumerate(layers):
                q = queries(layer, hidden[i][0]).to(k_buf.dtype)  # (heads, queries, head_dim), not rotated
                _rotate(q[None], np.zeros(len(at), np.int64), at, self._inv_freq)
                keys = k_buf[i, 0, :, :n_kv]
                keys = keys.repeat_interleave(q.shape[0] // keys.shape[0], 0)
                logits = (q.float() @ keys.float().transpose(-1, -2)) * scaling
                probs = torch.softmax(logits.masked_fill(~causal, float("-inf")), -1)
                score += probs[..., cand].sum(dim=(0, 1)).double()
        order = np.argsort(-score.cpu().numpy(), kind="stable")
        return candidates[order]

    def _deviation(self, ids: np.ndarray, buffers: tuple[Any, Any], candidates: np.ndarray) -> np.ndarray:
        """How far each candidate's layer-1 values move when computed in this prompt (squared L2)."""
        import torch

        if buffers[1].shape[0] < 2:
            return np.zeros(candidates.size)  # one layer: its KV (layer 0's) is exact wherever a passage moves
        old = buffers[1][1, 0][:, torch.as_tensor(candidates, device=buffers[1].device)].float()
        with torch.no_grad():
            fresh = self._pass(ids, buffers, candidates, int(candidates[-1]) + 1, record_layer=1)
        out: np.ndarray = ((fresh.float() - old) ** 2).sum(dim=(0, 2)).cpu().numpy()
        return out

    def _pass(self, ids: np.ndarray, buffers: tuple[Any, Any], run: np.ndarray, n_kv: int,
              record_layer: int | None = None, hidden: bool = False) -> Any:
        """One forward of the tokens at positions ``run`` over the buffers' first ``n_kv`` tokens.

        Each layer writes the fresh KV of ``run`` into the buffers before attending, so the tokens
        attend to each other as in a prefill and to stored KV elsewhere. Returns ``(the last token's
        scores, each layer's input hidden states or None)``, or (``record_layer``) that layer's fresh
        values of ``run``, stopping there.
        """
        import torch
        from transformers import DynamicCache

        device = self.model.device
        at = torch.as_tensor(run, device=device)
        recorded: list[Any] = []
        layer_cls = _scatter_layer_class()
        cache = DynamicCache(config=self.model.config)
        cache.layers = [layer_cls(buffers[0][i], buffers[1][i], n_kv, at, recorded if i == record_layer else None)
                        for i in range(buffers[0].shape[0])]
        allowed = torch.arange(n_kv, device=device)[None, :] <= at[:, None]
        if getattr(self.model.config, "_attn_implementation", "eager") == "sdpa":
            mask = allowed[None, None]
        else:
            dtype = buffers[0].dtype
            mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill(~allowed, torch.finfo(dtype).min)[None, None]
        inputs: list[Any] = []
        handles = []
        if hidden:
            # Each decoder layer's input, read by pre-hooks that live only for this pass: transformers'
            # output_hidden_states installs recording hooks for good, which would change the model's
            # live identity (and so every key) after the first such request.
            owner = threading.get_ident()

            def keep(_module: Any, args: Any, kwargs: Any) -> None:
                if threading.get_ident() == owner:  # not a forward another thread runs meanwhile
                    inputs.append(args[0] if args else kwargs["hidden_states"])

            handles = [layer.register_forward_pre_hook(keep, with_kwargs=True) for layer in _query_parts(self.model)[0]]
        try:
            out = self.model(torch.as_tensor(ids[run], device=device)[None], position_ids=at[None], attention_mask=mask,
                             use_cache=True, **{self.engine.cache_arg: cache}, **self.engine.last_only)
        except _Stop:
            return recorded[0][0]
        finally:
            for handle in handles:
                handle.remove()
        return out.logits[0, -1], (inputs if hidden else None)

    # -- public ---------------------------------------------------------------------------
    def prefill(self, segments: Sequence[Any]) -> tuple[Any, Any]:
        """Build the KV of ``[anchor, *passages, question]`` and score the next token.

        Args:
            segments: the anchor (e.g. a system line), the passages, the question: each text
                (with a tokenizer) or token ids. The prompt is their tokens in order.

        Returns:
            ``(cache, logits)``: a transformers ``DynamicCache`` holding the whole prompt and
            the next-token scores after it (1-D over the vocabulary).

        Raises:
            InvalidInputError: fewer than two segments, an empty segment, bad token ids.
        """
        with self.engine.lock:  # one request at a time (see the class)
            segs = self._segments(segments)
            cache, logits = self._build(segs, sum(len(s) for s in segs))
            self._end()
            return cache, logits

    def generate(self, segments: Sequence[Any], **generate_kwargs: Any) -> Any:
        """``model.generate`` on the prompt of ``segments`` (see :meth:`prefill`), reusing stored passages.

        Returns:
            What ``model.generate`` returns: the prompt's ids followed by the new tokens.

        Raises:
            InvalidInputError: bad segments, beams or several sequences, bad lengths.
        """
        with self.engine.lock:  # one request at a time (see the class)
            import torch

            segs = self._segments(segments)
            # Resolved as model.generate resolves them (kwargs, a passed generation_config, the model's own).
            check_generation(self.model, generate_kwargs, "ChunkCache.generate")
            if generate_kwargs.pop("attention_mask", None) is not None:
                raise InvalidInputError("ChunkCache.generate makes its own attention mask: pass none")
            ids = np.concatenate(segs)
            check_lengths(generate_kwargs, len(ids))
            if self.max_kl is None:
                # Everything but the last token: generate runs that one and goes on.
                cache, _ = self._build(segs, len(ids) - 1)
            else:
                # The guard judges the distribution of the first new token, so the whole prompt is built;
                # generate then runs the last token again (one more forward over one token).
                cache, _ = self._build(segs, len(ids))
                cache.crop(-1)
            full = torch.as_tensor(ids, device=self.model.device)[None]
            generate_kwargs[self.engine.cache_arg] = cache
            out = self.model.generate(full, attention_mask=torch.ones_like(full), **generate_kwargs)
            self._end()
            return out

    def _end(self) -> None:
        self._total.add(self._last)

    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """Tokens per request and in total: ``queried``; ``served`` (stored KV used as is); ``recomputed``
        (stored KV of moved passages computed again); ``computed`` (no stored KV: the anchor's and new
        passages' first computation, the question). ``served + recomputed + computed == queried``."""
        return {"last": self._last.as_dict(), "total": self._total.as_dict()}


def _doubled(fraction: float) -> float:
    """The guard's next budget: twice this one (at least 5%), or all of it past GUARD_EXACT_ABOVE."""
    more = min(1.0, max(2.0 * fraction, 0.05))
    return 1.0 if more > GUARD_EXACT_ABOVE else more


def _doublings_left(fraction: float) -> int:
    """How many budgets the guard may still try after ``fraction`` before the exact prefill."""
    left = 0
    while (fraction := _doubled(fraction)) < 1.0:
        left += 1
    return left


def _kl(p_logits: Any, q_logits: Any) -> float:
    """KL(p || q) of two next-token distributions given as scores (nats); inf when not finite (never 0 by NaN)."""
    import torch

    lp, lq = torch.log_softmax(p_logits.double(), -1), torch.log_softmax(q_logits.double(), -1)
    p = lp.exp()
    kl = float(torch.where(p > 0, p * (lp - lq), torch.zeros_like(p)).sum())
    return max(0.0, kl) if np.isfinite(kl) else float("inf")


def _query_parts(model: Any) -> tuple[Any, Any, float]:
    """(decoder layers, layer x inputs -> (heads, tokens, head_dim) queries before RoPE, attention scaling).

    The "query" selection reads the queries the attention computes from each layer's input: the
    input norm, then the query projection (a fused qkv's first part) and its norm where the family
    has one (Qwen3's q_norm).

    Raises:
        UnsupportedModelError: a model whose layers are not laid out so.
    """
    layers = getattr(getattr(model, "model", None), "layers", None)
    first = layers[0] if layers is not None and len(layers) else None
    attn = getattr(first, "self_attn", None)
    heads = getattr(model.config, "num_attention_heads", None)
    head_dim = getattr(attn, "head_dim", None)
    if (attn is None or getattr(first, "input_layernorm", None) is None or heads is None or head_dim is None
            or not (hasattr(attn, "q_proj") or hasattr(attn, "qkv_proj"))):
        raise UnsupportedModelError(f"select='query' reads each layer's queries (input_layernorm, then q_proj or "
                                    f"qkv_proj): {type(model).__name__} is not laid out so; use another select")

    def queries(layer: Any, x: Any) -> Any:
        a = layer.self_attn
        h = layer.input_layernorm(x)
        q = a.q_proj(h) if hasattr(a, "q_proj") else a.qkv_proj(h)[..., : heads * head_dim]
        norm = getattr(a, "q_norm", None)
        weight = getattr(norm, "weight", None)
        whole = weight is not None and weight.numel() == heads * head_dim  # OLMo-2 normalises the whole projection
        if norm is not None and whole:
            q = norm(q)
        q = q.view(x.shape[0], -1, head_dim)
        if norm is not None and not whole:
            q = norm(q)  # per head (Qwen3, Gemma 3)
        q = q.transpose(0, 1)
        layer_norm = getattr(a, "q_layernorm", None)  # Phi's and StableLM's qk_layernorm, on (batch, heads, tokens, dim)
        return layer_norm(q[None])[0] if layer_norm is not None else q

    return layers, queries, float(getattr(attn, "scaling", head_dim ** -0.5))


def _rotary_frequencies(model: Any) -> Any:
    """The model's one set of RoPE inverse frequencies (float32, on the CPU).

    Raises:
        UnsupportedModelError: no rotary module, or several different ones.
    """
    import torch

    found = [m.inv_freq for m in model.modules() if isinstance(getattr(m, "inv_freq", None), torch.Tensor)]
    name = type(model).__name__
    if not found:
        raise UnsupportedModelError(f"{name} has no rotary module with inverse frequencies (learned absolute "
                                    "positions, ALiBi, a precomputed sin/cos table, or no positions): a passage's "
                                    "stored KV cannot be moved to another position")
    freqs = {tuple(f.detach().float().cpu().tolist()) for f in found}
    if len(freqs) != 1:
        raise UnsupportedModelError(f"{name} uses {len(freqs)} different RoPE frequency sets (per-layer RoPE): "
                                    "moving stored keys is not supported")
    return found[0].detach().float().cpu()


def _rotate(k: Any, old: np.ndarray, new: np.ndarray, inv_freq: Any) -> None:
    """Rotate keys stored at positions ``old`` to positions ``new`` in place (transformers' rotate-half RoPE).

    ``k``: (layers, heads, tokens, head_dim). The angle moved is the one transformers uses at
    each position (float32 products) taken apart in float64, so the result matches keys
    computed at ``new`` up to rounding of the multiply.
    """
    import torch

    half = inv_freq.numel()
    f = inv_freq.float()
    angle = ((torch.as_tensor(new, dtype=torch.float32)[:, None] * f).double()
             - (torch.as_tensor(old, dtype=torch.float32)[:, None] * f).double())
    cos, sin = torch.cos(angle).to(k.device), torch.sin(angle).to(k.device)
    with torch.no_grad():
        x1, x2 = k[..., :half].double(), k[..., half : 2 * half].double()
        k[..., :half] = (x1 * cos - x2 * sin).to(k.dtype)
        k[..., half : 2 * half] = (x2 * cos + x1 * sin).to(k.dtype)


def _check_moves(model: Any, inv_freq: Any, engine: Engine) -> None:
    """Refuse a model whose KV does not move exactly with a rotation of its keys.

    The same tokens are run at positions 0.. and at 37..: with RoPE in transformers'
    rotate-half layout, every layer's values agree and the first run's keys rotated by 37
    agree with the second's. Anything else (learned positions mixed in, interleaved RoPE,
    positions the model ignores) is refused.

    Raises:
        UnsupportedModelError: with the largest difference found.
    """
    import torch

    name = type(model).__name__
    vocab = int(getattr(model.get_input_embeddings(), "num_embeddings", 0) or 100)
    probe = torch.tensor([[(7 * i + 11) % vocab for i in range(8)]], device=model.device)
    runs = []
    with torch.no_grad():
        for start in (0, _SHIFT):
            out = model(probe, position_ids=torch.arange(start, start + 8, device=model.device)[None], use_cache=True)
            runs.append(kv_layers(engine.output_cache(out)))
    worst = 0.0
    exact = next(model.parameters()).dtype == torch.float32
    for (k0, v0), (k1, v1) in zip(*runs, strict=True):
        k = k0[0].clone().float()
        _rotate(k, np.arange(8), np.arange(_SHIFT, _SHIFT + 8), inv_freq)
        scale = max(1.0, float(k1.abs().max()), float(v1.abs().max()))
        worst = max(worst, float((k - k1[0].float()).abs().max()) / scale, float((v0 - v1).abs().max()) / scale)
    if not worst <= (1e-4 if exact else 3e-2):
        raise UnsupportedModelError(f"{name}'s KV does not move with a rotation of its keys (relative difference "
                                    f"{worst:.2g} after moving 8 tokens by {_SHIFT}): its positions are not "
                                    "transformers-layout RoPE alone")


_SCATTER: Any = None


def _scatter_layer_class() -> Any:
    """A cache layer over full-prompt buffers that writes a pass's KV at given positions."""
    global _SCATTER
    if _SCATTER is not None:
        return _SCATTER
    from transformers.cache_utils import DynamicLayer

    class _ScatterLayer(DynamicLayer):
        def __init__(self, kbuf: Any, vbuf: Any, n: int, at: Any, record: list[Any] | None) -> None:
            super().__init__()  # type: ignore[no-untyped-call]
            self.lazy_initialization(kbuf, vbuf)
            self._kbuf, self._vbuf, self._n, self._at, self._record = kbuf, vbuf, n, at, record
            self.keys, self.values = kbuf[:, :, :n], vbuf[:, :, :n]

        def update(self, key_states: Any, value_states: Any, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            if self._record is not None:
                self._record.append(value_states)
                raise _Stop
            self._kbuf[:, :, self._at] = key_states
            self._vbuf[:, :, self._at] = value_states
            return self.keys, self.values

        def get_seq_length(self, *args: Any, **kwargs: Any) -> int:
            return int(self._n)

    _SCATTER = _ScatterLayer
    return _SCATTER
