"""Admission: whether a model's prefix KV can be stored and served exactly, decided before anything is stored.

The checks that need no forward (``check_structure``) run on every PrefixCache; the verdict of
the probe forwards (``probe_model``) is kept in the store per architecture (``checked_layout``).
"""

from __future__ import annotations

import inspect
import json
import time
from collections.abc import Mapping
from typing import Any

import numpy as np

from promptstore import PromptStore
from promptstore._live import Generators
from promptstore.errors import UnsupportedModelError

from ._buffers import kv_layers
from ._states import state_signature

__all__ = ["CHECK_KIND", "Layout", "States", "check_structure", "checked_layout", "probe_model", "vocab_size"]

CHECK_KIND = "llm.check"  # a model architecture's verdict of probe_model, so a fresh process skips its forwards


Layout = tuple[int, int, int, int, Any]  # (layers, kv heads, key width, value width, dtype)


States = dict[str, tuple[tuple[int, ...], str]]  # state tensor name -> (shape, dtype): see _states.py


def checked_layout(model: Any, store: PromptStore, signature: Any, output_cache: Any) -> tuple[Layout, States, bool]:
    """probe_model's verdict, from the store when this model structure passed it before.

    The verdict depends on what the model computes with apart from its weights' values: its
    live structure (class, config, settings, hooks, live code, attention implementation;
    ``signature`` holds it with the dtypes, device and ambient torch state), never on the
    weights. So any live change of those (a sliding window set on the config, a hook, patched
    code) is checked again before the next request. The forward-free checks run every time.
    The four forwards cost ~0.6 s on SmolLM2, which would otherwise land on the first request
    of every fresh process.
    """
    import torch
    import transformers

    check_structure(model)  # the checks without a forward run every time
    key = store.key(CHECK_KIND, fingerprints=[repr(signature), CHECKS,
                                              f"transformers={transformers.__version__}",
                                              f"torch={torch.__version__}"])
    entry = store.get(key, kind=CHECK_KIND)
    dtype = getattr(torch, entry.meta.get("dtype", ""), None) if entry is not None else None
    # A verdict of an earlier format (one width for keys and values, no states) is probed again.
    if (entry is not None and isinstance(dtype, torch.dtype) and "states" in entry.meta
            and entry.tensors.get("layout", np.empty(0)).shape == (4,)):
        layers, heads, k_dim, v_dim = (int(x) for x in entry.tensors["layout"])
        try:
            states = {n: (tuple(shape), str(dt)) for n, (shape, dt) in json.loads(entry.meta["states"]).items()}
        except (ValueError, TypeError):
            states = None
        if states is not None:
            return (layers, heads, k_dim, v_dim, dtype), states, entry.meta.get("stepwise") == "1"
    t0 = time.perf_counter()
    (layers, heads, k_dim, v_dim, dtype), states, stepwise = probe_model(model, output_cache)
    store.put(key, {"layout": np.array([layers, heads, k_dim, v_dim], np.int64)}, kind=CHECK_KIND,
              cost_s=time.perf_counter() - t0,
              meta={"dtype": str(dtype).replace("torch.", ""), "states": json.dumps(states),
                    "stepwise": "1" if stepwise else "0"})
    return (layers, heads, k_dim, v_dim, dtype), states, stepwise


def _rope_types(model: Any) -> set[str]:
    """Every RoPE type the model's rotary modules and config name (a per-layer-type dict counts each)."""
    found: set[str] = set()

    def add(value: Any) -> None:
        if isinstance(value, str):
            found.add(value)
        elif isinstance(value, Mapping):
            for key in ("rope_type", "type"):
                if isinstance(value.get(key), str):
                    found.add(value[key])
            for v in value.values():
                if isinstance(v, Mapping):
                    add(v)

    for module in model.modules():
        add(getattr(module, "rope_type", None))
    config = model.config
    for cfg in {id(config): config, id(_text_config(config)): _text_config(config)}.values():
        for attr in ("rope_parameters", "rope_scaling"):
            add(getattr(cfg, attr, None))
    return found


def _text_config(config: Any) -> Any:
    get: Any = getattr(config, "get_text_config", None)
    try:
        return get(decoder=True) if get is not None else config
    except TypeError:
        return get()


def vocab_size(model: Any) -> int:
    emb = model.get_input_embeddings()
    n = getattr(emb, "num_embeddings", None)
    return int(n if n is not None else _text_config(model.config).vocab_size)


def _check_cache(name: str, text: Any, cache: Any) -> None:
    """Refuse a cache that is not one plain DynamicLayer of full per-token KV per decoder layer."""
    from transformers import DynamicCache
    from transformers.cache_utils import (
        DummyLayer,
        DynamicLayer,
        DynamicSlidingWindowLayer,
        LinearAttentionAndFullAttentionLayer,
        LinearAttentionAndSlidingWindowAttentionLayer,
        LinearAttentionLayer,
    )

    if cache is None:
        raise UnsupportedModelError(f"{name} returns no KV cache (use_cache=True gave none)")
    if type(cache) is not DynamicCache:
        raise UnsupportedModelError(f"{name} keeps its state in a {type(cache).__name__}, not a plain DynamicCache "
                                    "(hybrid, recurrent or encoder-decoder state cannot be stored as KV blocks)")
    # Sliding-window layers are served: every token's KV is stored, and a restored layer hands
    # attention what transformers' own layer would (see reserved_layer_classes in _buffers.py).
    # Linear-attention/SSM layers are served beside attention layers: their running state is
    # stored where a prefix can end (_states.py); layers without a cache of their own need none.
    kv_kinds = (DynamicLayer, DynamicSlidingWindowLayer, LinearAttentionAndFullAttentionLayer,
                LinearAttentionAndSlidingWindowAttentionLayer)
    kinds = sorted({type(layer).__name__ for layer in cache.layers
                    if type(layer) not in (*kv_kinds, LinearAttentionLayer, DummyLayer)})
    if kinds:
        why = []
        if any("Linear" in k or "Mamba" in k for k in kinds):
            why.append("linear-attention/SSM layers of a kind not supported")
        if any("Indexed" in k for k in kinds):
            why.append("indexed (sparse) attention keeps indexer state beside the KV")
        raise UnsupportedModelError(f"{name}'s cache has {', '.join(kinds)} layers: "
                                    f"{'; '.join(why) or 'not plain per-token KV'}")
    if not any(type(layer) in (*kv_kinds, LinearAttentionLayer) for layer in cache.layers):
        raise UnsupportedModelError(f"{name} keeps neither KV nor a running state in any layer")
    n_layers = getattr(text, "num_hidden_layers", None)
    if isinstance(n_layers, int) and n_layers != len(cache.layers):
        raise UnsupportedModelError(f"{name} fills {len(cache.layers)} cache layers for {n_layers} decoder layers "
                                    "(shared or skipped KV): not supported")
    layers = kv_layers(cache)
    if not layers:
        return  # a running state in every layer (Mamba2): no KV to check
    if any(k is None or v is None for k, v in layers):
        raise UnsupportedModelError(f"{name} leaves some cache layers empty: not supported")
    # A sliding layer holds the last tokens only: shapes are compared without the token axis.
    shapes = {(_no_tokens(k.shape), _no_tokens(v.shape), k.dtype) for k, v in layers}
    if len(shapes) != 1:
        described = sorted(f"{k[1]} heads of width {k[3]}/{v[3]}" if len(k) == 4 else str(k) for k, v, _ in shapes)
        raise UnsupportedModelError(f"{name}'s layers keep KV of different shapes ({', '.join(described)})")
    (kshape, vshape, _), = shapes
    # Keys and values may differ in width (multi-head latent attention as transformers keeps it:
    # DeepSeek-V3, MiniCPM3): blocks carry the two widths apart.
    if len(kshape) != 4 or kshape[:3] != vshape[:3] or kshape[0] != 1:
        raise UnsupportedModelError(f"{name}: unexpected KV shape {kshape} / {vshape} (want [batch, heads, tokens, head_dim])")


def _shortest_window(model: Any) -> int | None:
    """The shortest sliding window among the cache layers transformers builds for this model (None: none)."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicSlidingWindowLayer

    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # noqa: BLE001 - a config DynamicCache cannot read has no window it could keep
        return None
    windows = [int(layer.sliding_window) for layer in layers if isinstance(layer, DynamicSlidingWindowLayer)]
    return min(windows) if windows else None


def _no_tokens(shape: Any) -> tuple[int, ...]:
    return (*shape[:2], -1, *shape[3:]) if len(shape) == 4 else tuple(shape)


def check_structure(model: Any) -> None:
    """The checks that need no forward pass (run on every PrefixCache, even when the verdict is stored).

    Raises:
        UnsupportedModelError: an encoder-decoder model, length-dependent RoPE, KV sharing.
    """
    name = type(model).__name__
    if getattr(model.config, "is_encoder_decoder", False):
        raise UnsupportedModelError(f"{name} is an encoder-decoder model: its decoder KV depends on the encoder input")
    moving = sorted(t for t in _rope_types(model) if "dynamic" in t or t == "longrope")
    if moving:
        raise UnsupportedModelError(
            f"{name} uses RoPE whose frequencies depend on the sequence length ({', '.join(moving)}): KV computed "
            "at one length differs from a recompute at another")
    if getattr(_text_config(model.config), "num_kv_shared_layers", 0):
        raise UnsupportedModelError(f"{name} shares KV between layers (num_kv_shared_layers): not supported")



# What a stored verdict passed: the checks of this release. Checks made stricter take a new name, so a verdict
# stored under the old ones (a model that draws random numbers, accepted before they looked) is checked again.
CHECKS = "checks=2"


def refuse_draws(before: Generators, name: str) -> None:
    """Refuse a model that drew random numbers since ``before`` was taken (its forward: a hook adding noise, a
    layer that samples), however little: each call computes another draw, which no stored KV may stand for.
    The generators are put back first.

    Raises:
        UnsupportedModelError: it drew.
    """
    if before.undo():
        raise UnsupportedModelError(f"{name} draws random numbers in its forward (a hook adding noise, a layer that "
                                    "samples): each call computes another draw, which no stored KV may stand for")


def probe_model(model: Any, output_cache: Any) -> tuple[Layout, States, bool]:
    """(layers that keep KV, kv heads, key width, value width, dtype), its state tensors, and whether it continues
    a state one token at a time only, of a model whose prefix KV can be reused exactly (after check_structure).

    Accepted: one forward fills a transformers ``DynamicCache`` whose layers are plain
    ``DynamicLayer`` or ``DynamicSlidingWindowLayer`` of one shape (keys and values per
    token), possibly beside ``LinearAttentionLayer`` (a running state) and ``DummyLayer`` (no
    cache), with RoPE (if any) whose frequencies do not depend on the sequence length, and
    the same tokens run in pieces over the cache (past the sliding window, if any) give the
    same scores as one pass. A model whose every layer is a running state and whose mixer does
    not continue a state over several tokens (Mamba's, Falcon-Mamba's own) is accepted as
    ``stepwise`` when the same tokens fed one at a time after the first piece give the one-pass
    scores: a hit then runs its tokens one at a time. Everything else is refused
    before anything is looked up or stored: a block stored now would be served wrong later.

    Raises:
        UnsupportedModelError: with the reason.
    """
    import torch

    name = type(model).__name__
    text = _text_config(model.config)
    cache_arg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    vocab = vocab_size(model)
    pad = getattr(text, "pad_token_id", None)
    pad = pad if isinstance(pad, int) and 0 <= pad < vocab else 2 % vocab
    tokens = [1 % vocab, pad, 3 % vocab, 4 % vocab, pad, 6 % vocab, 7 % vocab]
    pieces = [(0, 3), (3, 4), (4, 7)]
    window = _shortest_window(model)
    if window is not None:
        # Past the window too: a restored prefix must give the same scores as one pass once
        # the window drops tokens (Moshi's main decoder masks as if it had no window, so its
        # sliding cache makes pieces differ from one pass; found by tests/llm_zoo.py). Costs
        # two forwards over the window once per architecture (the verdict is stored).
        tokens = (tokens * (-(-(window + 4) // len(tokens))))[: window + 4]
        pieces = [(0, 3), (3, 4), (4, window), (window, window + 1), (window + 1, window + 4)]
    probe = torch.tensor([tokens], device=model.device)
    before = Generators()
    try:
        with torch.no_grad():
            out = model(probe, use_cache=True)
            full_logits = out.logits[0].float()
            cache = output_cache(out)
            _check_cache(name, text, cache)
            # The same tokens in pieces, as a cached prefix and then a request's own tokens run
            # them. Some models are not exact here: positions counted from pad tokens in the
            # prompt (RoBERTa family), ALiBi variants (MPT) - found by tests/llm_zoo.py.
            steps, past = [], None
            for lo, hi in pieces:
                kwargs: dict[str, Any] = {cache_arg: past} if past is not None else {}
                piece = model(probe[:, lo:hi], use_cache=True, **kwargs)
                past = output_cache(piece)
                steps.append(piece.logits[0].float())
    except UnsupportedModelError:
        before.undo()
        raise
    except Exception as exc:  # noqa: BLE001 - any failure here means "not a plain causal LM call"
        before.undo()
        raise UnsupportedModelError(f"{name} does not run as a plain causal LM with a KV cache: "
                                    f"{type(exc).__name__}: {exc}") from exc
    drift = float((torch.cat(steps) - full_logits).abs().max())
    # Relative: special tokens drive real models to huge activations, where float32 rounding
    # alone reaches 4e-4 of the largest score (SmolLM2). Systematic drift is of its order.
    bound = 1e-3 * max(1.0, float(full_logits.abs().max()))
    kv = kv_layers(cache)
    stepwise = False
    if not drift <= bound and not kv and window is None:
        # Every layer a running state: maybe its mixer continues a state one token at a time only.
        stepwise_drift = _stepwise_drift(model, probe, pieces[0][1], cache_arg, output_cache, full_logits)
        stepwise = stepwise_drift <= bound
        drift = min(drift, stepwise_drift)
    refuse_draws(before, name)
    if not drift <= bound:
        raise UnsupportedModelError(f"{name} computes different scores when a prompt is run in pieces over its KV "
                                    f"cache than in one pass (max difference {drift:.2g}): reuse would not be exact")
    if not kv:  # every layer a running state: blocks hold no KV, only their place in the chain
        return (0, 0, 0, 0, next(model.parameters()).dtype), state_signature(cache), stepwise
    (kshape, vshape, dtype), = {(_no_tokens(k.shape), _no_tokens(v.shape), k.dtype) for k, v in kv}
    return (len(kv), kshape[1], kshape[3], vshape[3], dtype), state_signature(cache), stepwise


def _stepwise_drift(model: Any, probe: Any, first: int, cache_arg: str, output_cache: Any, full_logits: Any) -> float:
    """How far the scores of ``probe`` run as its first ``first`` tokens, then one token per forward over the
    state, are from one pass (inf where that fails)."""
    import torch

    try:
        with torch.no_grad():
            piece = model(probe[:, :first], use_cache=True)
            steps, past = [piece.logits[0].float()], output_cache(piece)
            for i in range(first, probe.shape[1]):
                piece = model(probe[:, i : i + 1], use_cache=True, **{cache_arg: past})
                past = output_cache(piece)
                steps.append(piece.logits[0].float())
    except Exception:  # noqa: BLE001 - a model that cannot run this way is not served this way
        return float("inf")
    return float((torch.cat(steps) - full_logits).abs().max())
