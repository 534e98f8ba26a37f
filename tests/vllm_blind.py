"""A PromptStoreConnector whose keys do not name the model's configuration as the engine runs it
(tests/test_vllm.py): a change only the hit's own check can then catch."""

from __future__ import annotations

from typing import Any

from promptstore.vllm import PromptStoreConnector


class BlindConnector(PromptStoreConnector):
    def _engine_fingerprints(self, config: Any) -> list[str]:
        return [f for f in super()._engine_fingerprints(config) if not f.startswith("config:")]
