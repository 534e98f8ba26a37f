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

import time
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from promptstore import PromptStore
from promptstore._live import forward_intercepted
from promptstore.errors import InvalidInputError, UnsupportedModelError

from ._counts import Counts
from ._engine import KIND, Engine, dtype_name, model_lock
from ._inputs import check_generation, check_lengths, refuse_padding
from ._request import Request

__all__ = ["PrefixCache", "KIND", "model_lock"]


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
        #: The model, its store and the operations on blocks, shared with ChunkCache (see _engine.py).
        self.engine = Engine(model, tokenizer, store if store is not None else PromptStore(), block_tokens,
                             dtype_name(kv_dtype), verify, reuse)
        self._total = Counts()
        self._last = Counts()

    @property
    def model(self) -> Any:
        """The model served."""
        return self.engine.model

    @property
    def tokenizer(self) -> Any:
        """Its tokenizer (None: token-id prompts only)."""
        return self.engine.tokenizer

    @property
    def store(self) -> PromptStore:
        """Where blocks live."""
        return self.engine.store

    @property
    def block_tokens(self) -> int:
        """Tokens per stored block."""
        return self.engine.block_tokens

    @property
    def kv_dtype(self) -> str | None:
        """The stored KV dtype's name (None: the model's own)."""
        return self.engine.kv_dtype

    @property
    def verify(self) -> bool:
        """Whether hits are checked (see the class)."""
        return self.engine.verify

    @property
    def reuse(self) -> str:
        """``"auto"`` or ``"always"`` (see the class)."""
        return self.engine.reuse

    @property
    def fingerprint(self) -> str:
        """What the keys are bound to: model, tokenizer, KV dtype and layout, block size."""
        return "|".join(self.engine.fingerprints(self.engine.refresh()))

    # -- inputs ---------------------------------------------------------------------------
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
            return self.engine.token_ids(ids)
        return self.engine.token_ids(prompt)

    # -- requests -----------------------------------------------------------------------
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
        with self.engine.lock:  # one request at a time (see the class)
            ids = self.engine.token_ids(input_ids)
            req = self.engine.request()
            if self.engine.stepwise():
                raise UnsupportedModelError(f"{type(self.model).__name__} continues a restored state one token per forward "
                                            "only (a longer forward starts its scan from zero), so a cache from lookup "
                                            "would be continued wrong: use prefill or generate, which step it")
            return req.lookup(ids)

    def prefill(self, input_ids: Any) -> tuple[Any, Any]:
        """Run only the tokens after the longest stored prefix, and store the new blocks and the tail.

        Returns:
            ``(cache, logits)``: the cache holding all of ``input_ids`` and the next-token
            scores after the last token (a 1-D tensor over the vocabulary).
        """
        with self.engine.lock:  # one request at a time (see the class)
            ids = self.engine.token_ids(input_ids)
            return self.prefill_request(self.engine.request(), ids)

    def prefill_request(self, req: Request, ids: np.ndarray) -> tuple[Any, Any]:
        """``prefill`` of checked token ids as ``req``, a request the caller made and holds the model's lock for
        (ChunkCache's exact path: its request already checked the model)."""
        with self.engine.lock:
            self._last = req.counts
            req.counts.queried, req.counts.requests = len(ids), 1
            cache, n_cached = req.lookup(ids, in_forward=True)
            ran = req.checked_run(ids, lambda: req.run(ids, n_cached, len(ids), cache, last_apart=True))
            if ran is None:  # the hit was refuted: from scratch
                cache, n_cached = None, 0
                ran = req.run(ids, 0, len(ids), None, last_apart=True)
            cache, logits, seconds = ran
            req.measured(n_cached, len(ids), seconds)
            req.counts.served, req.counts.computed = n_cached, len(ids) - n_cached
            req.store_blocks(ids, cache, len(ids), n_cached // self.block_tokens, seconds / max(len(ids) - n_cached, 1))
            self._end(req)
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
        with self.engine.lock:  # one request at a time (see the class)
            import torch

            ids = self._prompt_ids(prompt)
            refuse_padding(generate_kwargs.pop("attention_mask", None))
            # Resolved as model.generate resolves them (its generation_config, a passed one, kwargs),
            # then checked, before any lookup or forward.
            check_generation(self.model, generate_kwargs)
            check_lengths(generate_kwargs, len(ids))
            intercepted = forward_intercepted(self.model)  # before the call too: a hook may remove itself
            req = self._begin(len(ids))
            cache, n_cached = req.lookup(ids, in_forward=True)
            stop = len(ids) - 1
            first_block, ran_from = n_cached // self.block_tokens, n_cached
            if stop > n_cached and self.engine.states():
                # Running states exist only where a forward ends: a miss runs in pieces that end
                # where states are stored (see Request.run), so the prompt is run here, up to its last token.
                cache, _, seconds = req.run(ids, n_cached, stop, cache)
                req.store_blocks(ids, cache, stop, first_block, seconds / (stop - n_cached))
                first_block, ran_from = stop // self.block_tokens, stop
            full = torch.as_tensor(ids, device=self.model.device)[None]
            user_processors = list(generate_kwargs.get("logits_processor") or [])

            made: list[Any] = []  # a DynamicCache made here: nobody else holds it (see store_blocks' later)

            def run(cache: Any) -> tuple[Any, Any, _FirstScores, float]:
                if cache is None:
                    cache = self.engine.miss_cache(len(ids))
                if cache is None:
                    from transformers import DynamicCache

                    cache = DynamicCache(config=self.model.config)
                    made.append(cache)
                generate_kwargs[self.engine.cache_arg] = cache
                # Otherwise model.generate runs every uncached token in its own first forward (it slices
                # the prompt past what the cache holds), so a hit costs one pass over the weights, not two;
                # the hit's check rides in that forward too. The first scores it makes mark the end of that
                # forward: its rate prices the blocks.
                from transformers import LogitsProcessorList

                first = _FirstScores()
                generate_kwargs["logits_processor"] = LogitsProcessorList([*user_processors, first])
                t0 = time.perf_counter()
                return self.model.generate(full, attention_mask=torch.ones_like(full), **generate_kwargs), cache, first, t0

            ran = req.checked_run(ids, lambda: run(cache))
            if ran is None:  # the hit was refuted: from scratch
                n_cached, first_block, ran_from = 0, 0, 0
                ran = run(None)
            out, cache, first, t0 = ran
            req.counts.served, req.counts.computed = n_cached, len(ids) - n_cached
            if first.at is not None:
                self.engine.prefill_tps = (len(ids) - ran_from) / max(first.at - t0, 1e-9)
                req.measured(ran_from, len(ids), first.at - t0)
            sequences = out if isinstance(out, torch.Tensor) else out.sequences
            seq = sequences[0].detach().cpu().numpy()
            req.counts.generated = len(seq) - len(ids)
            # The cache now holds every token but the last generated one; price blocks of the
            # prompt and of the generated tokens at the measured prefill rate (what recomputing them would cost).
            tps = self.engine.prefill_tps or 1000.0
            # Unless every layer is a running state (Mamba2): then no KV tells how many tokens
            # model.generate ran through the cache, so what it left is not stored (measured: Mamba2's
            # left state differs from one of len(seq) - 1 tokens); the prompt's state serves the next turn.
            if self.engine.layout()[0]:
                # Copied for the store after returning where the cache is this call's alone: made here, not
                # handed back in the output (return_dict_in_generate gives the caller past_key_values), and
                # seen by no hook or forward wrapper, before or after the call (one is handed the cache, and
                # may keep it and write into it later).
                alone = (any(c is cache for c in made) and getattr(out, "past_key_values", None) is None
                         and not intercepted and not forward_intercepted(self.model))
                req.store_blocks(seq, cache, len(seq) - 1, first_block, 1.0 / tps, later=alone)
            self._end(req)
            return out

    def _begin(self, n_queried: int) -> Request:
        req = self.engine.request(n_queried)
        self._last = req.counts
        return req

    def _end(self, req: Request) -> None:
        self._total.add(req.counts)

    # -- statistics -------------------------------------------------------------------------
    @property
    def stats(self) -> dict[str, dict[str, int]]:
        """Tokens queried, served from cache, computed (and generated), for the last request and in total."""
        return {"last": self._last.as_dict(), "total": self._total.as_dict()}
