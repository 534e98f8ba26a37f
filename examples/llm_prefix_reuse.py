"""The seed example, done with promptstore: a long system prompt prefilled once, then each
question runs only its own tokens, with the same next-token scores as a full recompute.

    python examples/llm_prefix_reuse.py

Run it twice: the second run (a fresh process) finds the system prompt's KV on disk.
"""

from __future__ import annotations

import torch

from promptstore import PromptStore
from promptstore.llm import PrefixCache, load_model

SYSTEM = (
    "You are the assistant of a logistics warehouse. Answer in one short sentence. "
    "Forklifts park in bay C and are charged overnight. Pallets heavier than 800 kg go to aisle 4, ground racks only. "
    "Hazardous goods are kept in the fenced area near door 9; their safety data sheets are in the red binder. "
    "Trucks are unloaded at docks 1 to 6 between 6 am and 2 pm; outgoing orders leave from docks 7 to 12. "
) * 4


def main() -> None:
    model, tokenizer = load_model("smollm2-135m-instruct")
    store = PromptStore()  # $PROMPTSTORE_DIR, else the user cache folder
    pc = PrefixCache(model, tokenizer, store=store)
    for question in ["Where do forklifts park?", "Where do heavy pallets go?"]:
        messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}]
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)["input_ids"]
        _, scores = pc.prefill(ids)  # the full prompt's ids: prefix and question are never tokenized apart
        with torch.no_grad():
            full = model(torch.tensor([ids]), logits_to_keep=1).logits[0, -1]
        s = pc.stats["last"]
        same = torch.allclose(scores, full, atol=1e-4)
        print(f"Computed {s['computed']} of {s['queried']} tokens, same next-token scores: {same}")
        answer = pc.generate(messages, max_new_tokens=30, do_sample=False)[0, len(ids):]
        print("  ", question, "->", tokenizer.decode(answer, skip_special_tokens=True).strip())


if __name__ == "__main__":
    main()
