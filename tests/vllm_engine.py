"""One vLLM engine, or one OpenAI client of a served one, in a process of its own (tests/test_vllm.py runs it
with the vLLM venv's Python).

    python tests/vllm_engine.py '{"model": DIR, "connector": {...} | null, "dtype": "float32", "prompts": [...]}'

(optional: ``processes``: vLLM's own process layout, an engine core and a worker process, rather than all in
this one; ``connector_class``: [class, module] in place of PromptStoreConnector; ``hf_overrides``, ``load_format``,
``tensor_parallel_size``, ``num_gpu_blocks_override``, ``enable_prefix_caching``, ``max_num_batched_tokens``:
passed to ``LLM``)
    python tests/vllm_engine.py --client URL '{"model": DIR, "prompts": [...]}'

Each prompt is ``{"text": ...}``, ``{"batch": [texts]}`` (asked together, one answer each) or
``{"chat": [user turns]}`` (a conversation: each answer is appended before the next turn), with optional ``cache_salt``, ``lora`` (an adapter folder; the engine is started
with LoRA on when any prompt names one), ``wait`` (a file to wait for before it), ``touch`` (a file to
create once it is answered and the store folder ``settle`` names stopped changing) and ``kill`` (a pid
to kill before it). Prints one JSON line: per answer the greedy text, the first tokens' logprobs and how
many prompt tokens vLLM did not compute (``cached``: its own prefix cache plus the connector's blocks).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time
from pathlib import Path

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
MAX_TOKENS = 12


def settle(folder: str, quiet_s: float = 2.0, limit_s: float = 120.0) -> None:
    """Wait until the store folder's entries stop changing: the worker writes blocks from a thread of its own."""
    def state() -> tuple[int, int]:
        files = list(Path(folder).rglob("*.safetensors"))
        return len(files), sum(f.stat().st_size for f in files if f.exists())

    last, since, start = state(), time.monotonic(), time.monotonic()
    while time.monotonic() - since < quiet_s and time.monotonic() - start < limit_s:
        time.sleep(0.2)
        now = state()
        if now != last:
            last, since = now, time.monotonic()


def before(prompt: dict) -> None:
    if "kill" in prompt:
        os.kill(prompt["kill"], signal.SIGKILL)
    if "wait" in prompt:
        start = time.monotonic()
        while not Path(prompt["wait"]).exists():
            if time.monotonic() - start > 600:
                raise TimeoutError(prompt["wait"])
            time.sleep(0.2)


def after(prompt: dict, spec: dict) -> None:
    if "touch" in prompt:
        if spec.get("settle"):
            settle(spec["settle"])
        Path(prompt["touch"]).touch()


def answer(out) -> dict:
    first = out.outputs[0]
    return {"text": first.text, "logprobs": [next(iter(d.values())).logprob for d in first.logprobs[:3]],
            "cached": out.num_cached_tokens or 0, "prompt_tokens": len(out.prompt_token_ids)}


def engine(spec: dict) -> list[dict]:
    kwargs: dict = {}
    if not spec.get("processes") and "tensor_parallel_size" not in spec:
        # The engine's core and its worker in this process (vLLM starts each in a process of its own by
        # default, about 13 s more per engine here): the connector's scheduler and worker sides are still two
        # objects that talk only through vLLM's metadata; tests that need the processes ask for them.
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
        kwargs["distributed_executor_backend"] = "uni"
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.lora.request import LoRARequest

    if spec.get("connector") is not None:
        name, module = spec.get("connector_class", ("PromptStoreConnector", "promptstore.vllm"))
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector=name, kv_connector_module_path=module, kv_role="kv_both",
            kv_connector_extra_config=spec["connector"])
    adapters = sorted({p["lora"] for p in spec["prompts"] if p.get("lora")})
    if adapters:
        kwargs.update(enable_lora=True, max_lora_rank=8, max_loras=len(adapters))
    for name in ("load_format", "tensor_parallel_size", "num_gpu_blocks_override", "hf_overrides",
                 "enable_prefix_caching", "max_num_batched_tokens"):
        if name in spec:
            kwargs[name] = spec[name]
    if any("image" in p for p in spec["prompts"]):
        kwargs["limit_mm_per_prompt"] = {"image": 2}
    llm = LLM(spec["model"], dtype=spec.get("dtype", "float32"), enforce_eager=True, max_model_len=4096, seed=0,
              **kwargs)
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, logprobs=1)
    results = []
    for prompt in spec["prompts"]:  # one at a time: each request sees what the ones before it stored
        before(prompt)
        lora = LoRARequest(Path(prompt["lora"]).name, adapters.index(prompt["lora"]) + 1, prompt["lora"]) \
            if prompt.get("lora") else None
        salt = {"cache_salt": prompt["cache_salt"]} if "cache_salt" in prompt else {}
        if "batch" in prompt:  # several prompts in one call: vLLM runs them together
            outs = llm.generate([{"prompt": text} for text in prompt["batch"]], params, use_tqdm=False)
            results.extend(answer(out) for out in outs)
        elif "chat" in prompt:
            messages: list[dict] = []
            for turn in prompt["chat"]:
                messages.append({"role": "user", "content": turn})
                # chat() takes no per-request salt: conversations are asked without one
                out = llm.chat([messages], params, use_tqdm=False, lora_request=lora)[0]
                results.append(answer(out))
                messages.append({"role": "assistant", "content": out.outputs[0].text})
        else:
            images = {"multi_modal_data": {"image": [image(seed) for seed in prompt["image"]]}} \
                if "image" in prompt else {}
            out = llm.generate([{"prompt": prompt["text"], **salt, **images}], params, use_tqdm=False,
                               lora_request=lora)[0]
            results.append(answer(out))
        after(prompt, spec)
    return results


def image(seed: int):
    """A 64x64 picture of noise, the same for the same seed."""
    import numpy as np
    from PIL import Image

    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (64, 64, 3), dtype=np.uint8))


def tiny_idefics3(folder: str, tokenizer_dir: str) -> None:
    """A small Idefics3 (its SigLIP-style vision tower, a Llama text model) with random weights (transformers'
    own initialisation, seeded), SmolLM2's tokenizer with Idefics3's image tokens, and its processor.
    ``<image>`` in a prompt becomes a picture's tokens where it stands."""
    import torch
    from transformers import (AutoTokenizer, Idefics3Config, Idefics3ForConditionalGeneration, Idefics3ImageProcessor,
                              Idefics3Processor, Idefics3VisionConfig, LlamaConfig)

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": ["<fake_token_around_image>", "<image>",
                                                                "<end_of_utterance>", "<global-img>"]})
    images = Idefics3ImageProcessor(size={"longest_edge": 56}, max_image_size={"longest_edge": 56},
                                    do_image_splitting=False)
    Idefics3Processor(image_processor=images, tokenizer=tokenizer, image_seq_len=4).save_pretrained(folder)
    vocab = (len(tokenizer) + 63) // 64 * 64
    text = LlamaConfig(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096,
                       bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                       tie_word_embeddings=True)
    vision = Idefics3VisionConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                                  image_size=56, patch_size=14)
    config = Idefics3Config(vision_config=vision, text_config=text, scale_factor=2,
                            image_token_id=tokenizer.convert_tokens_to_ids("<image>"))
    config.tie_word_embeddings = True
    torch.manual_seed(0)
    Idefics3ForConditionalGeneration(config).save_pretrained(folder)


def client(url: str, spec: dict) -> list[dict]:
    """The same prompts through a served vLLM's OpenAI API (the ``openai`` package)."""
    from openai import OpenAI

    api = OpenAI(base_url=url, api_key="unused")
    results = []
    for prompt in spec["prompts"]:
        out = api.completions.create(model=spec["model"], prompt=prompt["text"], max_tokens=MAX_TOKENS,
                                     temperature=0, logprobs=1)
        choice, details = out.choices[0], out.usage.prompt_tokens_details
        results.append({"text": choice.text, "logprobs": list(choice.logprobs.token_logprobs[:3]),
                        "cached": (details.cached_tokens if details else 0) or 0,
                        "prompt_tokens": out.usage.prompt_tokens})
    return results


if __name__ == "__main__":
    if sys.argv[1] == "--tiny-idefics3":
        tiny_idefics3(sys.argv[2], sys.argv[3])
        sys.exit(0)
    if sys.argv[1] == "--client":
        found = client(sys.argv[2], json.loads(sys.argv[3]))
    else:
        found = engine(json.loads(sys.argv[1]))
    print("RESULTS " + json.dumps(found), flush=True)
