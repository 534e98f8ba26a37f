"""One vLLM engine in a process of its own (run with the vLLM venv's Python by tests/test_vllm.py).

    python tests/vllm_engine.py '{"model": DIR, "connector": {...} | null, "dtype": "float32", "prompts": [...]}'

Each prompt is ``{"text": ..., "cache_salt": ... (optional)}``. Prints one JSON line: per prompt
the greedy text, the first tokens' logprobs and how many prompt tokens vLLM did not compute
(``num_cached_tokens``: its own prefix cache plus the connector's blocks).
"""

from __future__ import annotations

import json
import os
import sys

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def main() -> None:
    spec = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kwargs = {}
    if spec.get("connector") is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="PromptStoreConnector", kv_connector_module_path="promptstore.vllm", kv_role="kv_both",
            kv_connector_extra_config=spec["connector"])
    llm = LLM(spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True, max_model_len=4096, seed=0,
              **kwargs)
    params = SamplingParams(max_tokens=spec.get("max_tokens", 12), temperature=0, logprobs=1)
    results = []
    for prompt in spec["prompts"]:  # one at a time: each request sees what the ones before it stored
        request = {"prompt": prompt["text"], **({"cache_salt": prompt["cache_salt"]} if "cache_salt" in prompt else {})}
        out = llm.generate([request], params, use_tqdm=False)[0]
        first = out.outputs[0]
        results.append({"text": first.text, "logprobs": [next(iter(d.values())).logprob for d in first.logprobs[:3]],
                        "cached": out.num_cached_tokens or 0, "prompt_tokens": len(out.prompt_token_ids)})
    print("RESULTS " + json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
