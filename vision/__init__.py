"""promptstore.vision: YOLOE / YOLOWorld class-prompt embeddings from the store.

The adapter lands with its own issue; until then this package only marks the place.
"""
