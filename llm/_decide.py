"""Reuse or recompute: whether running a prompt over its stored prefix beats running it all.

A hit runs the uncached tokens over the served ones (attention with an explicit mask, plus the
hit's check), where a full prefill's causal kernel skips the masked half, so serving a small
share of a long prompt can cost more than computing it all. The work of a forward over
positions ``[a, b)`` is counted in multiply-adds: per token ``2·P`` for the weights (``P`` the
parameters outside the embeddings), plus for attention ``4·L·d`` per key attended (``L``
layers, ``d`` the query width): from no cache each position attends to those before it, over a
served prefix every new position is computed against all ``b`` keys. A stored prefix is used when

    ρ · work(served, total) < work(0, total)

where ``ρ`` is the measured seconds per unit of work of forwards over a served prefix divided
by that of full prefills (what the count above leaves out: the check's positions, kernels' speeds), on this architecture, dtype, device and CPU. Forwards of at
least ``MIN_MEASURED_TOKENS`` tokens are measured (shorter ones are dominated by fixed costs, and
they are the ones that serve large shares, where the answer never depends on ``ρ``). Until both
kinds are measured, ``ρ`` is ``DEFAULT_RHO``. Measurements are kept in the store (kind
``llm.rates``), so a fresh process starts with them.

A model that continues a state one token per forward only (Mamba: see probe_model) is served
when ``(total - served)`` such forwards, at their measured seconds each (``DEFAULT_STEP_TOKENS``
tokens of a full prefill until measured), take less than one full prefill of ``total`` tokens.
"""

from __future__ import annotations

import platform
import statistics
import threading
from typing import Any

import numpy as np

from promptstore import PromptStore

__all__ = ["DEFAULT_RESTORE_S_PER_BYTE", "DEFAULT_RHO", "DEFAULT_STEP_TOKENS", "GUARD_PROBE_EVERY", "GuardCost",
           "MIN_MEASURED_TOKENS", "RATES_KIND", "Rates", "RestoreRates", "Work"]

RATES_KIND = "llm.rates"
# Measured on this machine (SmolLM2, 2k tokens: bench/never_slower.py): a forward over stored KV runs
# 5-13% slower per unit of work, as counted above, than a full prefill; the slow end until measured.
DEFAULT_RHO = 1.10
MIN_MEASURED_TOKENS = 128
# A one-token forward of a state model costs about this many tokens of a full prefill until measured
# (weights read once per token instead of once per chunk).
DEFAULT_STEP_TOKENS = 16
_KEEP = 9  # samples kept per kind: the median of the last nine


class Work:
    """Multiply-adds of a forward over positions ``[a, b)`` of one model."""

    def __init__(self, model: Any) -> None:
        config: Any = getattr(model, "config", None)
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = _size(getattr(text, "num_attention_heads", 0))
        hidden = _size(getattr(text, "hidden_size", 0))
        head_dim = _size(getattr(text, "head_dim", 0)) or (hidden // heads if heads else 0)
        self.layers = _size(getattr(text, "num_hidden_layers", 0))
        self.width = heads * head_dim
        embeddings: set[int] = set()
        for getter in ("get_input_embeddings", "get_output_embeddings"):
            try:
                module = getattr(model, getter)()
            except (AttributeError, NotImplementedError):
                module = None
            if module is not None:
                embeddings.update(id(p) for p in module.parameters())
        self.params: int = sum(p.numel() for p in model.parameters() if id(p) not in embeddings)

    def __call__(self, a: int, b: int) -> float:
        """Work of computing positions ``a`` to ``b - 1``.

        From no cache (``a == 0``) the causal kernel skips the masked half: each position attends to
        those before it. Over a served prefix attention runs with an explicit mask, and the kernel
        computes every query against all ``b`` keys, masked or not.
        """
        if b <= a:
            return 0.0
        n = b - a
        attended = (b - 1) * b / 2 if a == 0 else float(b) * n
        return 2.0 * self.params * n + 4.0 * self.layers * self.width * attended


def _size(value: Any) -> int:
    """A config size as one int: the largest of a per-layer list (OpenELM's heads), 0 where it is not a size."""
    if isinstance(value, (list, tuple)):
        value = max((v for v in value if isinstance(v, int)), default=0)
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else 0


class _Measured:
    """Samples of a few kinds of rate for one setting, the last ``_KEEP`` of each, kept in the store."""

    _lock = threading.Lock()

    def __init__(self, store: PromptStore, setting: str, kinds: tuple[str, ...]) -> None:
        self.store, self.setting = store, setting
        self.key = store.key(RATES_KIND, setting)
        self.samples: dict[str, list[float]] = {kind: [] for kind in kinds}
        entry = store.get(self.key, kind=RATES_KIND)
        if entry is not None:
            for kind in self.samples:
                arr = entry.tensors.get(kind)
                if arr is not None and arr.ndim == 1 and arr.dtype == np.float64:
                    self.samples[kind] = [float(x) for x in arr[-_KEEP:] if np.isfinite(x) and x > 0]

    def _add(self, kind: str, value: float, **more: float) -> None:
        """Keep ``value`` as a sample of ``kind`` (and each of ``more`` as one of its kind), in one write."""
        with self._lock:
            for k, v in {kind: value, **more}.items():
                samples = self.samples[k]
                samples.append(v)
                del samples[:-_KEEP]
            tensors = {k: np.asarray(v, dtype=np.float64) for k, v in self.samples.items() if v}
        self.store.put(self.key, tensors, kind=RATES_KIND, background=True)


class Rates(_Measured):
    """Seconds per unit of work of full prefills and of forwards over a served prefix, for one setting."""

    def __init__(self, store: PromptStore, model: Any, dtype: Any, device: Any) -> None:
        # Not the thread count: a library may change it inside a process (so a fresh one would find nothing),
        # and ρ and a step's cost are ratios of two rates measured under the same threads.
        setting = "|".join([type(model).__name__, str(dtype), str(getattr(device, "type", device)),
                            platform.machine(), platform.processor()])
        super().__init__(store, setting, ("full", "tail", "step"))
        self.work = Work(model)

    def rho(self) -> float:
        """Seconds per unit of work over a served prefix / over a full prefill (``DEFAULT_RHO`` until measured)."""
        full, tail = self.samples["full"], self.samples["tail"]
        if not full or not tail:
            return DEFAULT_RHO
        return statistics.median(tail) / statistics.median(full)

    def reuse(self, served: int, total: int) -> bool:
        """Whether running ``total`` tokens over ``served`` stored ones is expected to be faster than all of them."""
        if served <= 0:
            return False
        return self.rho() * self.work(served, total) < self.work(0, total)

    def reuse_stepwise(self, served: int, total: int) -> bool:
        """For a model that continues a state one token per forward (Mamba): whether ``total - served`` such
        forwards are expected to be faster than one forward over all ``total`` tokens."""
        full, step = self.samples["full"], self.samples["step"]
        per_token = statistics.median(full) * self.work(0, 1) if full else None
        if per_token is None:
            return total - served <= 1  # nothing measured yet: only where no step is needed beyond generate's own
        step_s = statistics.median(step) if step else DEFAULT_STEP_TOKENS * per_token
        return served > 0 and (total - served) * step_s < statistics.median(full) * self.work(0, total)

    def record_steps(self, steps: int, seconds: float) -> None:
        """``steps`` one-token forwards over a state took ``seconds``."""
        if steps > 0 and seconds > 0:
            self._add("step", seconds / steps)

    def record(self, served: int, total: int, seconds: float) -> None:
        """A forward that computed positions ``served`` to ``total`` in ``seconds`` (``served`` 0: a full prefill)."""
        if total - served < MIN_MEASURED_TOKENS or not seconds > 0:
            return
        self._add("tail" if served else "full", seconds / self.work(served, total))


# Reading a stored llama.cpp state and handing it to llama.cpp, until measured: about 1 GB/s.
DEFAULT_RESTORE_S_PER_BYTE = 1e-9


class RestoreRates(_Measured):
    """For llama.cpp contexts (LlamaCppCache): seconds per prompt token of a prefill and per byte of restoring
    a stored state, for one setting (the model file, the context settings, the CPU). A state is restored when
    reading all of it is expected to cost less than evaluating the tokens it saves."""

    def __init__(self, store: PromptStore, setting: str) -> None:
        super().__init__(store, "llama.cpp|" + setting, ("prefill", "restore"))

    def reuse(self, state_bytes: int, saved_tokens: int) -> bool:
        """Whether restoring a state of ``state_bytes`` bytes is expected to beat evaluating ``saved_tokens``
        tokens. Without a measured prefill rate it serves (what llama-cpp-python's own caches do)."""
        if saved_tokens <= 0:
            return False
        if not self.samples["prefill"]:
            return True
        restore = statistics.median(self.samples["restore"]) if self.samples["restore"] else DEFAULT_RESTORE_S_PER_BYTE
        return state_bytes * restore < saved_tokens * statistics.median(self.samples["prefill"])

    def record_prefill(self, tokens: int, seconds: float) -> None:
        """llama.cpp evaluated ``tokens`` prompt tokens in ``seconds``."""
        if tokens >= MIN_MEASURED_TOKENS // 2 and seconds > 0:
            self._add("prefill", seconds / tokens)

    def record_restore(self, nbytes: int, seconds: float) -> None:
        """A state of ``nbytes`` bytes was read and restored in ``seconds``."""
        if nbytes > 0 and seconds > 0:
            self._add("restore", seconds / nbytes)


# Where trying the guard's budgets has lately not paid, every GUARD_PROBE_EVERY-th request tries anyway (the
# prompts may have changed).
GUARD_PROBE_EVERY = 8
_ACCEPTED, _FAILED = 1.0, 2.0  # a try's outcome as a sample (samples are positive)


class GuardCost(_Measured):
    """Whether trying ChunkCache's guard budgets is expected to beat going straight to the exact prefill.

    A try costs what it ran before it was accepted, or that plus the exact prefill when it was not;
    going straight costs the exact prefill. With ``p`` the share of the last tries accepted, trying
    pays while ``p * (exact - accepted) > (1 - p) * failed``, each cost the median of its last
    samples in seconds per unit of a full prefill's work (:class:`Work`), so prompts of other
    lengths compare. Until three tries are known it tries; while it does not, every
    ``GUARD_PROBE_EVERY``-th request of this object tries anyway. Kept in the store (kind
    ``llm.rates``) per model class, dtype, device, CPU and guard setting: a restarted process starts
    with what the last one learned instead of paying three tries to learn it again.
    """

    def __init__(self, store: PromptStore, rates: Rates, setting: str) -> None:
        super().__init__(store, f"chunk-guard|{rates.setting}|{setting}", ("outcome", "accepted", "failed", "exact"))
        self.work = rates.work
        self._since_try = 0

    def worth_trying(self) -> bool:
        outcomes, exact = self.samples["outcome"], self.samples["exact"]
        if len(outcomes) < 3 or not exact:
            return True
        accepted, failed = self.samples["accepted"], self.samples["failed"]
        p = outcomes.count(_ACCEPTED) / len(outcomes)
        gain = p * (statistics.median(exact) - statistics.median(accepted)) if accepted else 0.0
        loss = (1 - p) * statistics.median(failed) if failed else 0.0
        if gain > loss or self._since_try + 1 >= GUARD_PROBE_EVERY:
            self._since_try = 0
            return True
        self._since_try += 1
        return False

    def tried(self, tokens: int, accepted: bool, seconds: float, exact_s: float | None = None) -> None:
        """A try on a prompt of ``tokens`` was accepted after ``seconds``, or failed after ``seconds`` and then ran
        the exact prefill in ``exact_s``."""
        work = self.work(0, tokens)
        if not work > 0 or not seconds > 0:
            return
        if accepted:
            self._add("outcome", _ACCEPTED, accepted=seconds / work)
        elif exact_s is not None and exact_s > 0:
            self._add("outcome", _FAILED, failed=seconds / work, exact=exact_s / work)

    def went_exact(self, tokens: int, seconds: float) -> None:
        """A request of ``tokens`` went straight to the exact prefill, which took ``seconds``."""
        work = self.work(0, tokens)
        if work > 0 and seconds > 0:
            self._add("exact", seconds / work)
