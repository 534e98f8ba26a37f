"""What storing a completion's state costs LlamaCppCache, with and without llama-cpp-python's save_state().

    python bench/llamacpp_store_cost.py [REQUESTS]   (default 6)

SmolLM2-135M-Instruct's GGUF, 2 threads, one process: completions (8 new tokens) of prompts of 1,700 random
words that share nothing, so every cached one is a miss that stores its state. Rotating among: no cache; the
cache as shipped (it stores from the context and spares llama-cpp-python's save_state()); the cache made to
let llama-cpp-python call save_state() and hand it over, as before. Prints the medians of each path's
completions and of the parts: save_state(), what the completion waits for of the cache's storing
(LlamaCppCache._store: reading the state) and what runs after it returns (LlamaCppCache._write: the
store's writes and the index; waited for between requests, outside the timings). The completions of this
machine spread by 15% or more; the parts are what to read.
"""
import time, statistics, tempfile, numpy as np, llama_cpp, sys
from promptstore import PromptStore
from promptstore.llm import LlamaCppCache
import promptstore.llm._llamacpp as L
from promptstore.llm._model import _gguf_path
p = str(_gguf_path("smollm2-135m-instruct"))
mk = lambda: llama_cpp.Llama(p, n_ctx=4096, n_threads=2, verbose=False, seed=0)
plain = mk(); cached = mk()
store = PromptStore(tempfile.mkdtemp())
cache = LlamaCppCache(cached, store); cached.set_cache(cache)
rng = np.random.default_rng(0)
words = "alpha beta gamma delta river stone cloud paper window garden engine silver orange valley".split()
def prompt(i):
    return " ".join(rng.choice(words, 1700)) + f" question {i}?"
fast = L._COMPLETION_CODE
res = {"plain": [], "new": [], "old": []}
parts = {"store": []}
orig_store = LlamaCppCache._store
def timed_store(self, value):
    t0 = time.perf_counter(); orig_store(self, value); parts["store"].append(time.perf_counter() - t0)
LlamaCppCache._store = timed_store
orig_write = LlamaCppCache._write
def timed_write(self, *args):
    t0 = time.perf_counter(); orig_write(self, *args); parts.setdefault("write (after return)", []).append(time.perf_counter() - t0)
LlamaCppCache._write = timed_write
orig_save = llama_cpp.Llama.save_state
def timed_save(self):
    t0 = time.perf_counter(); r = orig_save(self); parts.setdefault("save_state", []).append(time.perf_counter() - t0); return r
llama_cpp.Llama.save_state = timed_save
for i in range(int(sys.argv[1]) if len(sys.argv) > 1 else 6):
    for mode in ["plain", "new", "old"][i % 3:] + ["plain", "new", "old"][:i % 3]:
        text = prompt(i * 3 + ["plain", "new", "old"].index(mode))
        llm = plain if mode == "plain" else cached
        L._COMPLETION_CODE = fast if mode == "new" else None
        llm.reset()
        t0 = time.perf_counter(); llm.create_completion(text, max_tokens=8, temperature=0); res[mode].append(time.perf_counter() - t0)
        cache.flush()
print("completion medians (s):", {k: round(statistics.median(v), 3) for k, v in res.items()})
print("part medians (s):", {k: round(statistics.median(v), 4) for k, v in parts.items()}, "counts:", {k: len(v) for k, v in parts.items()})
print({k: [round(x, 2) for x in v] for k, v in res.items()})
