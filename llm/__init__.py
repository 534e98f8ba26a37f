"""promptstore.llm: exact prefix KV reuse for transformers causal LMs.

The adapter lands with its own issue; until then this package only marks the place.
"""
