"""One prepared GPU check of promptstore.llm: exactness and TTFT on an accelerator.

    python bench/gpu_check.py [--smoke]     # --smoke: tiny sizes, runs on a CPU in seconds

Random-weight models of two real shapes (SmolLM2-135M's, in fp32; a Llama-3.2-1B-like one,
in bf16), since no model hub is reachable from the GPU machine. For each: next-token scores
and 32 greedy tokens with the cache against a full recompute, then TTFT of a full prefill,
a memory-tier hit and a disk-tier hit (memory tier off, files from the page cache) for long
shared prefixes plus a 14-token question. Prints one table.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from promptstore import PromptStore
from promptstore.errors import UnsupportedModelError
from promptstore.llm import PrefixCache

SHAPES = {
    "smollm2-135m-shape fp32": (dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True,
                                     rope_theta=100000.0), torch.float32),
    "llama-1b-shape bf16": (dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                                 num_attention_heads=32, num_key_value_heads=8, tie_word_embeddings=True,
                                 rope_theta=500000.0), torch.bfloat16),
    "llama-8b-shape bf16": (dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                                 num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0), torch.bfloat16),
}


def sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2000, 8000])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), help="a subset of: " + ", ".join(SHAPES))
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    import transformers

    print(f"device {torch.cuda.get_device_name() if device.type == 'cuda' else 'cpu'}, torch {torch.__version__}, "
          f"transformers {transformers.__version__}")
    rows = []
    for name, (shape, dtype) in SHAPES.items():
        if name not in args.shapes:
            continue
        if args.smoke:
            shape = dict(shape, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                         num_key_value_heads=2, vocab_size=1000)
        torch.manual_seed(0)
        with torch.device(device):
            model = LlamaForCausalLM(LlamaConfig(max_position_embeddings=16384, **shape)).to(dtype).eval()
        vocab = shape["vocab_size"]
        folder = tempfile.mkdtemp(prefix="ps-gpu-")
        try:
            pc = PrefixCache(model, store=PromptStore(folder, memory_bytes="16GiB", disk_bytes="64GiB"), block_tokens=64)
        except UnsupportedModelError as e:  # a refusal is a result too: report it and go on to the next shape
            print(f"{name}: refused: {e}", flush=True)
            continue
        pc.fingerprint  # noqa: B018
        gen = torch.Generator().manual_seed(1)
        # exactness
        prefix = torch.randint(0, vocab, (1000,), generator=gen).tolist()
        question = torch.randint(0, vocab, (14,), generator=gen).tolist()
        ids = prefix + question
        pc.prefill(prefix)
        _, logits = pc.prefill(ids)
        with torch.no_grad():
            ref = model(torch.tensor([ids], device=device), logits_to_keep=1).logits[0, -1]
            greedy = model.generate(torch.tensor([ids], device=device), max_new_tokens=32, do_sample=False,
                                    attention_mask=torch.ones(1, len(ids), dtype=torch.long, device=device))
        diff = (logits.float() - ref.float()).abs().max().item()
        served = pc.stats["last"]["served"]
        same = pc.generate(ids, max_new_tokens=32, do_sample=False)[0].tolist() == greedy[0].tolist()
        # The same split done by transformers alone (its own cache, no promptstore): the
        # numerical noise of computing a prompt in two pieces instead of one.
        with torch.no_grad():
            own = model(torch.tensor([ids[:served]], device=device), use_cache=True)
            own_cache = own.cache if getattr(own, "cache", None) is not None else own.past_key_values
            arg = pc.engine.cache_arg
            split = model(torch.tensor([ids[served:]], device=device), use_cache=True, logits_to_keep=1,
                          **{arg: own_cache}).logits[0, -1]
        noise = (split.float() - ref.float()).abs().max().item()
        print(f"{name}: served {served} of {len(ids)}; max |score diff| {diff:.2e} (transformers' own cache, same "
              f"split: {noise:.2e}; identical to it: {torch.equal(split, logits)}); 32 greedy tokens identical: {same}",
              flush=True)
        from promptstore.llm._fingerprint import model_fingerprint

        fp = timed(lambda: model_fingerprint(model), 3)
        print(f"  weights fingerprint on the device (every request): {fp * 1e3:.1f} ms", flush=True)
        layers, heads, k_dim, v_dim, kv_dtype = pc.engine.layout()
        per_token = layers * heads * (k_dim + v_dim) * torch.empty(0, dtype=kv_dtype).element_size()
        for length in [256, 512] if args.smoke else args.lengths:
            doc = torch.randint(0, vocab, (length - 23,), generator=gen).tolist()
            pc.prefill(doc + torch.randint(0, vocab, (30,), generator=gen).tolist())  # warm: document + a question
            questions = [doc + torch.randint(0, vocab, (14,), generator=gen).tolist() for _ in range(args.repeats)]
            qi = iter(questions * 6)
            with torch.no_grad():
                full = timed(lambda: model(torch.tensor([next(qi)], device=device), logits_to_keep=1), args.repeats)
            mem = timed(lambda: pc.prefill(next(qi)), args.repeats)
            mem_load = timed(lambda: pc.lookup(next(qi)), args.repeats)
            disk_pc = PrefixCache(model, store=PromptStore(folder, memory_bytes=0), block_tokens=64)
            disk_pc.prefill(next(qi))  # its staging slots are pinned once per PrefixCache
            disk = timed(lambda: disk_pc.prefill(next(qi)), args.repeats)
            disk_load = timed(lambda: disk_pc.lookup(next(qi)), args.repeats)
            served = disk_pc.stats["last"]["served"]
            gbs_mem, gbs_disk = served * per_token / mem_load / 1e9, served * per_token / disk_load / 1e9
            rows.append((name, length, full, mem, disk, gbs_mem, gbs_disk, fp))
            print(f"  {length:>5} tokens: full {full * 1e3:8.1f} ms  memory hit {mem * 1e3:8.1f} ms  "
                  f"disk hit {disk * 1e3:8.1f} ms  (full/memory {full / mem:5.1f}x, full/disk {full / disk:5.1f}x); "
                  f"KV to the GPU {gbs_mem:.1f} GB/s from memory, {gbs_disk:.1f} GB/s from files "
                  f"({served * per_token / 1e9:.2f} GB, lookup incl. fingerprint)", flush=True)
        model = pc = None  # free the GPU memory before the next shape
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\n| model | prompt tokens | full prefill | memory hit | disk hit | full/memory | full/disk "
          "| KV to GPU GB/s (memory / files) | weights fingerprint |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, length, full, mem, disk, gm, gd, fp in rows:
        print(f"| {name} | {length} | {full * 1e3:.1f} ms | {mem * 1e3:.1f} ms | {disk * 1e3:.1f} ms | "
              f"{full / mem:.1f}x | {full / disk:.1f}x | {gm:.1f} / {gd:.1f} | {fp * 1e3:.1f} ms |")


if __name__ == "__main__":
    main()
