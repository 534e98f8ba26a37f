"""A multi-turn chat where each turn reuses the last: the previous prompt *and* answer come
from the cache, so a turn computes little more than its own new message.

    python examples/chat.py            # a scripted conversation
    python examples/chat.py --interactive
"""

from __future__ import annotations

import argparse
import time

from promptstore import PromptStore
from promptstore.llm import PrefixCache, load_model

SYSTEM = ("You are a helpful assistant for a warehouse team. Keep answers short. "
          "Forklifts park in bay C. Heavy pallets (over 800 kg) go to aisle 4. Fire exits are marked green. ") * 3
SCRIPT = ["Where do forklifts park?", "And heavy pallets?", "How are fire exits marked?"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--interactive", action="store_true")
    args = parser.parse_args()
    model, tokenizer = load_model()
    pc = PrefixCache(model, tokenizer, store=PromptStore(), block_tokens=32)
    messages = [{"role": "system", "content": SYSTEM}]
    turns = iter(lambda: input("you> "), "") if args.interactive else iter(SCRIPT)
    for text in turns:
        messages.append({"role": "user", "content": text})
        t0 = time.perf_counter()
        out = pc.generate(messages, max_new_tokens=48, do_sample=False)
        s = pc.stats["last"]
        answer = tokenizer.decode(out[0, s["queried"]:], skip_special_tokens=True).strip()
        messages.append({"role": "assistant", "content": answer})
        if not args.interactive:
            print(f"you> {text}")
        print(f"bot> {answer}")
        print(f"     [{s['served']} of {s['queried']} prompt tokens from the cache, {s['computed']} computed, "
              f"{s['generated']} generated, {time.perf_counter() - t0:.1f} s]")


if __name__ == "__main__":
    main()
