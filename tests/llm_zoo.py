"""Tiny random models of every causal-LM architecture the installed transformers registers.

``build(model_type)`` shrinks the architecture's default config (hidden size, layers, heads,
vocabulary, experts, MLA ranks, rotary dims, per-layer lists...) and returns a model made
from a fixed seed, so a second process builds the very same weights. Shrinking is tried
from the most to the least aggressive; an architecture none of them builds offline is
reported with the reason.
"""

from __future__ import annotations

import contextlib
import copy
import io
import logging
import warnings
from typing import Any

import torch

MAX_PARAMS = 30_000_000
LAYERS = 2
VOCAB = 512

# attribute -> tiny value, applied where a config has the attribute (directly or through attribute_map).
_DIMS = {
    "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
    "num_experts": 4, "num_local_experts": 4, "n_routed_experts": 4, "num_experts_per_tok": 2, "moe_topk": 2,
    "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32, "n_group": 1, "topk_group": 1,
    "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    "qk_head_dim": 24, "rotary_dim": 8, "rotary_emb_base": None, "d_ff": 128, "ffn_dim": 128, "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128, "decoder_attention_heads": 4, "encoder_attention_heads": 4, "d_kv": 16,
    "num_decoder_layers": LAYERS, "decoder_layers": LAYERS, "encoder_layers": LAYERS, "n_inner": 128,
    "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16,
    "state_size": 8, "expand": 2, "mamba_d_state": 8, "mamba_n_heads": 4, "mamba_d_head": 16, "mamba_head_dim": 16,
    "ssm_state_size": 8, "time_step_rank": 8, "conv_kernel": 4, "attention_hidden_size": 64,
    # Windows shorter than the prompts (61 tokens, then 16 generated): block boundaries fall inside
    # and outside them, and generation runs past them.
    "sliding_window": 12, "attention_chunk_size": 12, "sliding_window_size": 12,
}
# Families whose shrunk default config does not build, or keeps no attention layer once cut to
# two layers: one attention layer beside the state layers, and SSM head counts that divide the
# tiny widths (heads x head size = expand x hidden).
_OVERRIDES: dict[str, dict[str, Any]] = {
    "bamba": {"attn_layer_indices": [1], "mamba_n_heads": 8, "mamba_d_head": 16},
    "recurrent_gemma": {"block_types": ["recurrent", "attention"]},
    "falcon_h1": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128},
    "mamba2": {"num_heads": 8, "head_dim": 16, "n_groups": 1},
    # Shrunk to one layer (a Mamba one) by default: two, the second attention (Zamba2's "hybrid"
    # layers add its shared attention block).
    "granitemoehybrid": {"num_hidden_layers": 2, "layer_types": ["linear_attention", "full_attention"],
                         "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 8, "shared_intermediate_size": 32},
    "zamba2": {"num_hidden_layers": 2, "layers_block_type": ["linear_attention", "hybrid"], "hybrid_layer_ids": [1],
               "mamba_headdim": 16, "n_mamba_heads": 8, "mamba_d_state": 8, "attention_hidden_size": 128,
               "attention_head_dim": 32, "kv_channels": 16, "num_query_groups": 4},
}
_SPECIAL_IDS = ("pad_token_id", "bos_token_id", "eos_token_id", "decoder_start_token_id", "sep_token_id",
                "cls_token_id", "mask_token_id", "unk_token_id")


def _quiet() -> contextlib.AbstractContextManager[Any]:
    stack = contextlib.ExitStack()
    stack.enter_context(warnings.catch_warnings())
    warnings.simplefilter("ignore")
    stack.enter_context(contextlib.redirect_stdout(io.StringIO()))
    stack.enter_context(contextlib.redirect_stderr(io.StringIO()))
    return stack


def _shrink(cfg: Any, level: int, seen: set[int]) -> None:
    if id(cfg) in seen:
        return
    seen.add(id(cfg))
    from transformers import PretrainedConfig

    for name in list(vars(cfg)):
        value = getattr(cfg, name, None)
        if isinstance(value, PretrainedConfig):
            _shrink(value, level, seen)
    old_layers = getattr(cfg, "num_hidden_layers", None)
    dims = dict(_DIMS)
    if level >= 1:  # milder: keep the architecture's own head geometry
        for k in ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "qk_head_dim", "rotary_dim",
                  "q_lora_rank", "kv_lora_rank", "d_kv"):
            dims.pop(k)
    for k, v in dims.items():
        if v is None or not hasattr(cfg, k) or getattr(cfg, k) is None:
            continue
        with contextlib.suppress(Exception):
            setattr(cfg, k, v)
    rope, nope = getattr(cfg, "qk_rope_head_dim", None), getattr(cfg, "qk_nope_head_dim", None)
    if isinstance(rope, int) and isinstance(nope, int):  # MLA: derived head sizes follow the ranks
        for k, v in (("head_dim", rope), ("qk_head_dim", rope + nope)):
            if hasattr(cfg, k):
                with contextlib.suppress(Exception):
                    setattr(cfg, k, v)
    if getattr(cfg, "kv_lora_rank", None) and hasattr(cfg, "num_key_value_heads"):
        with contextlib.suppress(Exception):  # MLA: one latent KV per query head
            cfg.num_key_value_heads = cfg.num_attention_heads
    if isinstance(old_layers, int) and old_layers > LAYERS:
        _keep_layers(cfg, old_layers)
    if hasattr(cfg, "vocab_size") and isinstance(cfg.vocab_size, int) and cfg.vocab_size > VOCAB:
        with contextlib.suppress(Exception):
            cfg.vocab_size = VOCAB
        for k in _SPECIAL_IDS:
            v = getattr(cfg, k, None)
            if isinstance(v, int) and v >= VOCAB:
                with contextlib.suppress(Exception):
                    setattr(cfg, k, VOCAB - 1 - _SPECIAL_IDS.index(k))
            elif isinstance(v, list):
                with contextlib.suppress(Exception):
                    setattr(cfg, k, [x if x < VOCAB else VOCAB - 1 for x in v])


def _keep_layers(cfg: Any, old: int) -> None:
    """Cut to a few layers, keeping one layer of every kind a hybrid model mixes."""
    lists = {n: v for n, v in vars(cfg).items()
             if isinstance(v, (list, tuple)) and len(v) == old and n != "architectures"}
    keep = list(range(LAYERS))
    # The attention kinds decide what a layer caches: read them before other per-layer labels (MLP kinds).
    named = sorted(lists, key=lambda n: (n not in ("layer_types", "layers_block_type"), n))
    kinds = next((lists[n] for n in named if all(isinstance(x, str) for x in lists[n])), None)
    if kinds is not None:  # first layer of each kind, then the next ones
        firsts = [kinds.index(k) for k in dict.fromkeys(kinds)]
        keep = sorted(set(firsts) | set(range(max(0, LAYERS - len(firsts)))))
    for k, v in (("attn_layer_period", 2), ("attn_layer_offset", 1), ("expert_layer_period", 2),
                 ("expert_layer_offset", 1), ("attn_layer_indices", [1]), ("hybrid_layer_ids", [1]),
                 ("full_attn_idxs", [1]), ("attn_layer_idx", [1])):
        if getattr(cfg, k, None) is not None:
            with contextlib.suppress(Exception):
                setattr(cfg, k, v)
    pattern = getattr(cfg, "hybrid_override_pattern", None)
    if isinstance(pattern, str) and len(pattern) == old:
        keep = sorted(set(keep) | {pattern.index(c) for c in dict.fromkeys(pattern)})
        with contextlib.suppress(Exception):
            cfg.hybrid_override_pattern = "".join(pattern[i] for i in keep)
    with contextlib.suppress(Exception):
        cfg.num_hidden_layers = len(keep)
    for name, value in lists.items():  # every per-layer list follows the same layers
        with contextlib.suppress(Exception):
            setattr(cfg, name, type(value)(value[i] for i in keep))


def _vocab(model: Any) -> int:
    emb = model.get_input_embeddings()
    return int(getattr(emb, "num_embeddings", None) or model.config.get_text_config().vocab_size)


def build(model_type: str, seed: int = 0) -> tuple[Any, str]:
    """(model in eval mode, "") or (None, why it cannot be built offline as a tiny model)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    logging.getLogger("transformers").setLevel(logging.ERROR)
    reasons = []
    for level in (0, 1, 2):
        try:
            with _quiet():
                cfg = AutoConfig.for_model(model_type)
                if level < 2:
                    _shrink(cfg, level, set())
                    for k, v in _OVERRIDES.get(model_type, {}).items():
                        setattr(cfg, k, v)
                if hasattr(cfg, "is_decoder"):
                    cfg.is_decoder = True  # BERT-style models are causal LMs only as decoders
                with torch.device("meta"):
                    meta = AutoModelForCausalLM.from_config(copy.deepcopy(cfg))
                n = sum(p.numel() for p in meta.parameters())
                if n > MAX_PARAMS:
                    reasons.append(f"{n / 1e6:.0f}M parameters after shrinking")
                    continue
                torch.manual_seed(seed)
                model = AutoModelForCausalLM.from_config(cfg).eval()
                vocab = _vocab(model)
                with torch.no_grad():
                    model(torch.arange(1, 6)[None] % vocab)  # builds and runs a forward
            return model, ""
        except Exception as exc:  # noqa: BLE001 - any failure is a reason to report
            reasons.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:160] if str(exc) else ''}")
    return None, "; ".join(dict.fromkeys(reasons))


def vocab_of(model: Any) -> int:
    """Token ids below this are valid inputs."""
    return _vocab(model)


BLOCK = 8
ATOL = 1e-4
GREEDY = 16


def plain_scores(model: Any, ids: list[int]) -> Any:
    """The model's own next-token scores after ``ids`` (no cache): what a cached call must equal."""
    with torch.no_grad():
        return model(torch.as_tensor([ids])).logits[0, -1]


def greedy_tokens(model: Any, ids: list[int], n: int) -> list[int]:
    """``ids`` and ``n`` greedy tokens from the model's own ``generate`` (no store)."""
    with torch.no_grad(), _quiet():
        out = model.generate(torch.as_tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                             max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0)
    return out[0].tolist()


def prompts(vocab: int, seed: int = 0) -> list[list[int]]:
    """A short request then a long one sharing it, block-boundary lengths, an unaligned divergence."""
    import numpy as np

    rng = np.random.default_rng(seed)
    base = rng.integers(1, vocab, 61).tolist()
    other = rng.integers(1, vocab, 8).tolist()
    return [base[:5], base, base[: 2 * BLOCK], base[: 2 * BLOCK + 1], base[: 3 * BLOCK - 1],
            base[:29] + other, base[:3] + other]


def check_architecture(model: Any, store: Any) -> str:
    """``"served"`` after proving cache-on equals cache-off; ``"refused: why"`` with nothing stored.

    Raises:
        AssertionError: a hit that differs from a recompute, or a refusal after storing.
    """
    from promptstore.errors import UnsupportedModelError
    from promptstore.llm import PrefixCache

    from transparency import assert_same, assert_transparent

    try:
        with _quiet():
            # Every stored prefix is served (the zoo's prompts are short): whether a hit pays is tests/test_decide.py's.
            pc = PrefixCache(model, None, store=store, block_tokens=BLOCK, reuse="always")
    except UnsupportedModelError as exc:
        assert not store.ls(), "refused after storing entries"
        return f"refused: {exc}"
    vocab = vocab_of(model)
    for ids in prompts(vocab):
        with _quiet():
            assert_transparent(lambda ids=ids: pc.prefill(ids)[1], lambda ids=ids: plain_scores(model, ids), atol=ATOL,
                               what=f"scores after {len(ids)} tokens")
    assert pc.stats["total"]["served"] > 0, "nothing was ever served from the store"
    long = prompts(vocab)[1]
    with _quiet():
        out = pc.generate(long, max_new_tokens=GREEDY, min_new_tokens=GREEDY, do_sample=False, pad_token_id=0)
    assert_same(out[0].tolist(), greedy_tokens(model, long, GREEDY), 0, "greedy tokens")
    cont = out[0].tolist() + [1, 2, 3]  # the next turn continues generated text
    with _quiet():
        _, logits = pc.prefill(cont)
    # Generated blocks are reused, unless the model's generate left a cache that does not match
    # its tokens (then nothing is stored from it, with a warning).
    assert pc.stats["last"]["served"] >= len(long) // BLOCK * BLOCK
    assert_same(logits, plain_scores(model, cont), ATOL, "scores after a continuation of generated text")
    return "served"


def all_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _group(verdict: str) -> str:
    """The reason of a refusal without the class name or figures, for a grouped table."""
    reason = verdict.split(": ", 1)[1]
    head, _, rest = reason.partition(" ")
    reason = rest if head.endswith("'s") or "For" in head or head[:1].isupper() else reason
    if reason.startswith("cache has "):
        reason = reason.split(": ", 1)[1]
    import re

    return re.split(r" \((?:\d|max|use_cache|hybrid)", reason)[0].split(": RuntimeError")[0]


def markdown(rows: list[tuple[str, str]]) -> str:
    """served / refused (grouped by reason) / not buildable, as Markdown tables."""
    import collections

    served = [t for t, v in rows if v == "served"]
    refused: dict[str, list[str]] = collections.defaultdict(list)
    for t, v in rows:
        if v.startswith("refused"):
            refused[_group(v)].append(t)
    lines = [f"**Served exactly: {len(served)}** - " + ", ".join(f"`{t}`" for t in served), "",
             f"**Refused with `UnsupportedModelError`: {sum(map(len, refused.values()))}**", "",
             "| reason | architectures |", "|---|---|"]
    lines += [f"| {r} | {', '.join(f'`{t}`' for t in ts)} |" for r, ts in sorted(refused.items(), key=lambda kv: -len(kv[1]))]
    broken = [(t, v.split(": ", 1)[1]) for t, v in rows if v.startswith("not buildable")]
    lines += ["", f"**Not buildable offline as a tiny model: {len(broken)}** (the reason transformers gave)", "",
              "| architecture | reason |", "|---|---|"]
    lines += [f"| `{t}` | {why.split(';')[0].replace('|', '/')[:140]} |" for t, why in broken]
    return "\n".join(lines)


if __name__ == "__main__":  # python tests/llm_zoo.py [model_type ...]: print the table
    import sys
    import tempfile
    import time

    from promptstore import PromptStore

    as_markdown = "--markdown" in sys.argv
    rows = []
    for mt in [a for a in sys.argv[1:] if not a.startswith("--")] or all_types():
        t0 = time.perf_counter()
        model, why = build(mt)
        if model is None:
            verdict = f"not buildable: {why}"
        else:
            with tempfile.TemporaryDirectory() as d, PromptStore(d, memory_bytes="64MiB") as store:
                try:
                    verdict = check_architecture(model, store)
                except AssertionError as exc:
                    verdict = f"WRONG: {exc}"
                except Exception as exc:  # noqa: BLE001
                    verdict = f"CRASH: {type(exc).__name__}: {str(exc)[:200]}"
        rows.append((mt, verdict))
        print(f"{mt}\t{type(model).__name__ if model is not None else '-'}\t{time.perf_counter() - t0:.1f}s\t{verdict}",
              flush=True, file=sys.stderr if as_markdown else sys.stdout)
    if as_markdown:
        print(markdown(rows))
