"""vLLM: any hostkv store as a secondary tier of the ``OffloadingConnector``'s tiering spec.

vLLM's ``TieringOffloadingSpec`` keeps a CPU primary tier (rows of vLLM's own host buffer) and
loads secondary tiers by module path::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
      "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec",
        "cpu_bytes_to_use": 8589934592,
        "secondary_tiers": [{"type": "HostKVTier",
          "module_path": "hostkv_providers.integrations.vllm",
          "url": "mmap:///nvme/hostkv?budget=256GiB"}]}}'

The tiering manager (scheduler process) calls :class:`HostKVTier` with real ``TransferJob``\\ s:
``submit_store`` cascades rows of the primary tier into the store, ``submit_load`` promotes
stored rows back into primary rows, ``get_finished_jobs`` reports both.  The copies run on the
adapter's I/O threads; every method the manager calls only hashes keys and enqueues.

Keys: vLLM's offload key (the chained block hash of the chunk's last block plus the KV group
index) mapped under a :class:`~hostkv_providers.Salt` built from the ``OffloadingConfig``: model
name, KV dtype, the KV groups (tokens per block, layer names), blocks per chunk, the row bytes,
the KV cache layout and either the worker KV bytes per block and the parallel configuration or,
where vLLM certifies the row bytes as parallelism-agnostic, the row's KV bytes (the same under
any TP size), plus ``namespace``/``model_revision``/``quantization`` from the tier config.
Parents come from vLLM's chain: the scheduler records each key's end-token position in the
``ReqContext``, so a chunk's parent is the key of the same request and group one chunk earlier.
See ``docs/engines/vllm.md``.
"""

from __future__ import annotations

import collections
import hashlib
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import numpy.typing as npt
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    get_offload_group_idx,
)
from vllm.v1.kv_offload.tiering.base import JobResult, SecondaryTierManager, TransferJob

from hostkv_providers._errors import HostKVError, InvalidArgumentError
from hostkv_providers._keys import Key, Salt
from hostkv_providers._layout import DTYPE_ITEMSIZE, KVLayout
from hostkv_providers._provider import Provider
from hostkv_providers.integrations._common import (
    AdapterStats,
    EngineKeyer,
    IOPool,
    engine_salt,
    open_store,
    read_pages,
    store_pages,
)

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.config import OffloadingConfig
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

__all__ = ["HostKVTier", "salt_from_offloading_config"]

logger = logging.getLogger(__name__)

#: Seconds between two warnings of failed lookups (a store outage fails every lookup).
_LOG_EVERY_S = 30.0
#: After a failed lookup, lookups answer MISS without asking the store for this long: each
#: try against a store that is down costs the scheduler's thread the client's connection
#: retries (~0.3 s against a loopback Redis refusing connections), per chunk it asks about.
_LOOKUP_BACKOFF_S = 2.0

_FP8 = {"fp8": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2",
        "fp8_inc": "float8_e4m3fn", "fp8_ds_mla": "float8_e4m3fn", "half": "float16",
        "float": "float32", "bf16": "bfloat16", "fp16": "float16", "auto": "bfloat16"}


def _kv_dtype(name: str) -> tuple[str, str]:
    """Our dtype name for vLLM's and the quantization it implies (``"none"`` or vLLM's name)."""
    low = str(name).lower().replace("torch.", "")
    if low in DTYPE_ITEMSIZE:
        return low, "none"
    mapped = _FP8.get(low)
    if mapped is not None:
        return mapped, (low if low.startswith("fp8") else "none")
    return "uint8", low


def salt_from_offloading_config(
    config: OffloadingConfig,
    row_nbytes: int,
    *,
    namespace: str = "",
    model_revision: str = "",
    quantization: str | None = None,
) -> Salt:
    """The salt of one vLLM offloading configuration (``row_nbytes``: one primary row's stride).

    A vLLM primary row holds the chunk of *every* worker (the tier runs in the scheduler), so the
    salt records the whole parallel layout (tensor, pipeline, prefill/decode context parallel
    sizes, the world size) and one worker's KV bytes per block instead of one rank.  Where vLLM
    certifies the bytes as the same under any tensor-parallel size (``is_parallelism_agnostic``)
    and the row is made of whole certified blocks (one block per chunk, or vLLM's canonical
    layout), the salt records the row's KV bytes instead, so a TP=2 and a TP=4 engine of one
    model share pages.  See :func:`_parallel_fields`.
    """
    groups = config.groups
    if not groups:
        raise InvalidArgumentError("the vLLM offloading config has no KV groups")
    blocks_per_chunk = int(config.cache.blocks_per_chunk)
    page_tokens = int(groups[0].tokens_per_block) * blocks_per_chunk
    n_layers = sum(len(g.layer_names) for g in groups) or 1
    dtype, implied_quant = _kv_dtype(config.model.dtype)
    # vLLM's row is opaque to the tier; describe it as one byte plane per layer when it divides
    # evenly, so Salt.page_nbytes equals the stored entry size.
    if row_nbytes % (n_layers * page_tokens) == 0:
        layout = KVLayout(num_layers=n_layers, num_kv_heads=1, head_dim=row_nbytes // (n_layers * page_tokens),
                          page_tokens=page_tokens, dtype="uint8", kinds=("kv",))
    else:
        layout = KVLayout(num_layers=1, num_kv_heads=1, head_dim=row_nbytes, page_tokens=1,
                          dtype="uint8", kinds=("kv",))
    layer_digest = hashlib.blake2b(
        "\x00".join(f"{g.group_id}:{g.tokens_per_block}:{g.sliding_window_size_in_chunks}:"
                    + ",".join(g.layer_names) for g in groups).encode(),
        digest_size=16,
    ).hexdigest()
    extra: dict[str, object] = {
        "vllm.kv_dtype": config.model.dtype,
        "vllm.element_dtype": dtype,
        "vllm.tokens_per_block": ",".join(str(g.tokens_per_block) for g in groups),
        "vllm.tokens_per_hash": config.cache.tokens_per_hash,
        "vllm.blocks_per_chunk": blocks_per_chunk,
        "vllm.groups": layer_digest,
        "vllm.num_layers": n_layers,
        "vllm.row_nbytes": row_nbytes,
        "vllm.kv_cache_layout": config.kv_cache_layout or "",
        "vllm.canonical_layout": bool(config.canonical_layout),
        "vllm.replicated_layout": bool(config.replicated_layout),
    }
    extra.update(_parallel_fields(config, blocks_per_chunk))
    return engine_salt(
        engine="vllm",
        model_id=config.model.name,
        layout=layout,
        model_revision=model_revision,
        quantization=quantization if quantization is not None else implied_quant,
        namespace=namespace,
        extra=extra,
    )


def _parallel_fields(config: OffloadingConfig, blocks_per_chunk: int) -> dict[str, object]:
    """The salt's fields for the bytes' dependence on the parallel layout.

    A row is ``worker 0's cell | worker 1's cell | ... | padding`` (vLLM's shared offload region),
    each cell holding that worker's share of the chunk.  vLLM's ``is_parallelism_agnostic``
    certifies that *one block's* data concatenated across workers in rank order is the same
    bytes under any TP size.  So is a row of one block, and a canonical-layout row (every worker
    writes its bytes into one topology-free page per chunk).  A direct-layout row of several
    blocks is not: each cell holds its worker's slice of every block of the chunk, so the bytes
    interleave differently per TP size -- those rows keep the TP and world sizes.
    """
    p = config.parallel
    if not p.is_parallelism_agnostic:
        # Kept exactly as it was before certified rows could share (a test pins two tags): the
        # keys such engines stored stay valid.
        return {
            "vllm.worker_kv_bytes_per_block": config.worker_kv_bytes_per_block,
            "vllm.tp_size": p.tp_size, "vllm.pp_size": p.pp_size, "vllm.pcp_size": p.pcp_size,
            "vllm.dcp_size": p.dcp_size, "vllm.world_size": p.world_size, "vllm.rank": p.rank,
        }
    # One worker's bytes halve when TP doubles; the row's KV bytes (every worker's share, one
    # copy where vLLM replicates a latent) do not.  They also pin the payload inside the row, so
    # two rows of one stride whose padding starts elsewhere never share a key.  vLLM certifies
    # TP only: pipeline stages (rank order is stage-major) and context parallelism stay in.
    copies = 1 if config.replicated_layout else p.world_size
    fields: dict[str, object] = {
        "vllm.parallelism_agnostic": True,
        "vllm.row_kv_bytes": int(config.worker_kv_bytes_per_block) * copies * blocks_per_chunk,
        "vllm.pp_size": p.pp_size, "vllm.pcp_size": p.pcp_size, "vllm.dcp_size": p.dcp_size,
    }
    if blocks_per_chunk > 1 and not config.canonical_layout:
        fields.update({"vllm.tp_size": p.tp_size, "vllm.world_size": p.world_size})
    return fields


class HostKVTier(SecondaryTierManager):
    """A vLLM secondary tier over any hostkv provider (``url``).

    Tier config keys (besides ``type``/``module_path``): ``url`` (required), ``namespace``,
    ``model_revision``, ``quantization``, ``io_threads`` (2 load threads; stores run in one
    ordered lane, parent before child), ``max_pending_jobs`` (64 store jobs: past it a store is
    reported failed at once -- vLLM's drop-on-pressure semantics; loads always queue),
    ``batch_pages`` (256: pages per provider call), ``locality`` (``"LOCAL"``/``"REMOTE"``, as for
    vLLM's own tiers: a request's ``kv_load_tiers`` filter selects tiers by it).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(
        self,
        offloading_spec: OffloadingSpec,
        primary_kv_view: memoryview,
        tier_type: str,
        url: str | Provider = "",
        namespace: str = "",
        model_revision: str = "",
        quantization: str | None = None,
        io_threads: int = 2,
        max_pending_jobs: int = 64,
        batch_pages: int = 256,
        locality: str | None = None,
        backpressure_detector: BackpressureDetector | None = None,
    ) -> None:
        super().__init__(
            offloading_spec=offloading_spec,
            primary_kv_view=primary_kv_view,
            tier_type=tier_type,
            backpressure_detector=backpressure_detector,
        )
        if not url:
            raise InvalidArgumentError("HostKVTier needs 'url' in its tier config",
                                       hint='"url": "mmap:///nvme/hostkv?budget=256GiB"')
        if batch_pages < 1:
            raise InvalidArgumentError("batch_pages must be >= 1")
        # The tiering manager skips a tier whose locality a request's load filter excludes
        # (``load_tier_filter.allows(tier.medium, tier.locality)``); None matches every filter.
        try:
            self.locality = Locality(locality) if locality is not None else None
        except ValueError:
            raise InvalidArgumentError(
                f"locality must be one of {[m.value for m in Locality]}, got {locality!r}",
                hint='"locality": "REMOTE" for a store on the network (redis://)') from None
        rows = np.asarray(primary_kv_view)
        if rows.ndim != 2:
            raise InvalidArgumentError(f"primary_kv_view must be 2-D (chunks, row bytes), got {rows.shape}")
        # Row c of vLLM's primary tier, as bytes: the source of a store, the target of a load.
        self._rows: npt.NDArray[np.uint8] = rows.view(np.uint8)
        self._row_nbytes = int(self._rows.shape[1])
        cfg = offloading_spec.config
        self.salt = salt_from_offloading_config(cfg, self._row_nbytes, namespace=namespace,
                                                model_revision=model_revision, quantization=quantization)
        self._keyer = EngineKeyer(self.salt, "vllm")
        self._owns_provider = not isinstance(url, Provider)
        self.provider = open_store(url)
        self._batch = batch_pages
        # Tokens between consecutive chunks of one KV group: a chunk's parent sits that many
        # tokens earlier in the same request.  Keyed by vLLM's KV-cache group id (the group index
        # of an offload key), which need not be the group's place in ``cfg.groups``: vLLM offloads
        # only the prefix-cacheable groups.
        self._chunk_tokens: dict[int, int] = {
            int(g.group_id): int(g.tokens_per_block) * int(cfg.cache.blocks_per_chunk) for g in cfg.groups}
        self._positions: dict[str, dict[tuple[int, int], Key]] = {}
        self._pos_lock = threading.Lock()
        # Stores run in one ordered lane: a job's parents, cascaded by an earlier job of the same
        # request, are sealed before it runs (parent before child), so the store keeps vLLM's
        # chain as its tree.  Loads run on ``io_threads`` threads of their own.
        self._io = IOPool("vllm-store", threads=1, max_pending=max_pending_jobs)
        self._load_io = IOPool("vllm-load", threads=io_threads, max_pending=1 << 30)
        self._finished: collections.deque[JobResult] = collections.deque()
        # Keys of store jobs queued or running in the store lane: a lookup of one is RETRY (the
        # chunk is being transferred; the scheduler asks again next step), never a MISS that
        # would make vLLM recompute a chunk about to be readable.
        self._inflight: collections.Counter[Key] = collections.Counter()
        self._inflight_lock = threading.Lock()
        self.stats = AdapterStats()
        self._lookup_errors = 0
        self._lookup_error_logged = -_LOG_EVERY_S
        self._lookup_backoff_s = _LOOKUP_BACKOFF_S
        self._lookup_quiet_until = 0.0  # monotonic time before which lookups do not ask the store

    # -- keys and parents ------------------------------------------------------------------
    def _note(self, req_context: ReqContext, okeys: Iterable[OffloadKey]) -> list[tuple[Key, Key | None]]:
        """Our key and parent for each offload key (in ``okeys``' order), recording positions.

        Every position is recorded before any parent is looked up: vLLM's keys come in no
        particular order (a store job's keys are a ``set``), and a parent listed after its child
        is still its parent.
        """
        noted: list[tuple[Key, int, int | None]] = []
        out: list[tuple[Key, Key | None]] = []
        with self._pos_lock:
            seen = self._positions.setdefault(req_context.req_id, {})
            for okey in okeys:
                key = self._keyer.key(okey)
                group = get_offload_group_idx(okey)
                pos = req_context.get_offload_key_position(okey)
                if pos is not None:
                    seen[(group, pos)] = key
                noted.append((key, group, pos))
            for key, group, pos in noted:
                parent: Key | None = None
                step = self._chunk_tokens.get(group, 0)
                if pos is not None and step and pos > step:
                    parent = seen.get((group, pos - step))
                out.append((key, parent))
        return out

    @staticmethod
    def _chain_order(req_context: ReqContext, okeys: Sequence[OffloadKey]) -> npt.NDArray[np.intp]:
        """Indices of ``okeys`` with every parent before its children (by group, then position).

        The provider refuses a child whose parent is a *later* item of the same call (and every
        item below it), so a job is stored root first whatever order vLLM listed it in.  Keys
        without a recorded position have no parent here and are no one's parent: they go first.
        """
        def rank(i: int) -> tuple[int, int]:
            pos = req_context.get_offload_key_position(okeys[i])
            return get_offload_group_idx(okeys[i]), -1 if pos is None else int(pos)
        return np.asarray(sorted(range(len(okeys)), key=rank), dtype=np.intp)

    # -- the SecondaryTierManager interface ------------------------------------------------
    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        (ours, _), = self._note(req_context, (key,))
        if time.monotonic() < self._lookup_quiet_until:
            return LookupResult.MISS  # the store failed a moment ago: not asked again yet
        try:
            found = self.provider.present([ours])[0]
        except HostKVError as exc:
            self._lookup_quiet_until = time.monotonic() + self._lookup_backoff_s
            # An unreachable store (a Redis server restarting, a network partition) must not
            # raise into vLLM's scheduler, which does not catch it (EngineCore would die).  MISS,
            # as vLLM's own AsyncLookupManager answers when its probe fails: vLLM recomputes the
            # chunk.  RETRY would stall the request for as long as the outage lasts.
            self._lookup_failed(exc)
            return LookupResult.MISS
        if found:
            return LookupResult.HIT
        with self._inflight_lock:
            busy = ours in self._inflight
        return LookupResult.RETRY if busy else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = np.asarray(job_metadata.chunk_ids, dtype=np.int64)
        if len(keys) != len(chunk_ids):
            raise InvalidArgumentError(f"store job {job_metadata.job_id}: {len(keys)} keys, {len(chunk_ids)} chunk ids")
        # vLLM's connector completes a store with the job's keys as a set: put them root first.
        order = self._chain_order(job_metadata.req_context, keys)
        keys, chunk_ids = [keys[i] for i in order], chunk_ids[order]
        pairs = self._note(job_metadata.req_context, keys)
        self._mark_inflight(pairs, +1)
        if self._io.try_submit(self._run_store, job_metadata.job_id, pairs, chunk_ids) is None:
            self._mark_inflight(pairs, -1)
            # Backpressure: never block the scheduler; vLLM releases the rows and counts a failure.
            self.stats.add(store_failures=len(keys))
            self._finished.append(JobResult(job_id=job_metadata.job_id, success=False))

    def submit_load(self, job_metadata: TransferJob) -> None:
        keys = list(job_metadata.keys)
        chunk_ids = np.asarray(job_metadata.chunk_ids, dtype=np.int64)
        if len(keys) != len(chunk_ids):
            raise InvalidArgumentError(f"load job {job_metadata.job_id}: {len(keys)} keys, {len(chunk_ids)} chunk ids")
        ours = [k for k, _ in self._note(job_metadata.req_context, keys)]
        # A load always runs (the request waits on it); it queues behind the stores.
        self._load_io.submit(self._run_load, job_metadata.job_id, keys, ours, chunk_ids)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        out: list[JobResult] = []
        pop = self._finished.popleft
        while self._finished:
            out.append(pop())
        return out

    def has_pending_work(self) -> bool:
        return self._io.pending > 0 or self._load_io.pending > 0 or bool(self._finished)

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def on_request_finished(self, req_context: ReqContext) -> None:
        with self._pos_lock:
            self._positions.pop(req_context.req_id, None)

    def drain_jobs(self) -> None:
        self._io.drain()
        self._load_io.drain()

    def shutdown(self) -> None:
        self._io.close()
        self._load_io.close()
        # Drop our export of vLLM's primary buffer so its region can be unmapped.
        self._rows = np.empty((0, self._row_nbytes), dtype=np.uint8)
        if self._owns_provider and not self.provider.closed:
            self.provider.close()

    def config_info(self) -> dict[str, str]:
        return {"hostkv_salt_tag": self.salt.tag}

    @classmethod
    def config_info_keys(cls, tier_config: dict[str, Any]) -> tuple[str, ...]:
        return ("hostkv_salt_tag",)

    def _lookup_failed(self, exc: HostKVError) -> None:
        """Log a failed lookup, at most once per ``_LOG_EVERY_S`` (the scheduler asks per chunk)."""
        now = time.monotonic()
        self._lookup_errors += 1
        if now - self._lookup_error_logged >= _LOG_EVERY_S:
            self._lookup_error_logged = now
            n, self._lookup_errors = self._lookup_errors, 0
            logger.warning("hostkv lookup failed (%d time(s) since the last such warning), answering "
                           "MISS: %s: %s", n, type(exc).__name__, exc)

    def _mark_inflight(self, pairs: Sequence[tuple[Key, Key | None]], delta: int) -> None:
        with self._inflight_lock:
            for k, _ in pairs:
                n = self._inflight[k] + delta
                if n > 0:
                    self._inflight[k] = n
                else:
                    del self._inflight[k]

    # -- the I/O threads -------------------------------------------------------------------
    def _run_store(self, job_id: int, pairs: Sequence[tuple[Key, Key | None]],
                   chunk_ids: npt.NDArray[np.int64]) -> None:
        t0 = time.monotonic()
        ok = True
        done = 0  # pairs whose outcome store_pages counted
        try:
            rows = self._rows
            for start in range(0, len(pairs), self._batch):
                part = pairs[start:start + self._batch]
                ids = chunk_ids[start:start + self._batch]
                items = [(k, p, rows[int(c)]) for (k, p), c in zip(part, ids, strict=True)]
                ok = all(store_pages(self.provider, items, salt_tag=self.salt.tag, stats=self.stats)) and ok
                done = start + len(part)
        except Exception:
            logger.exception("hostkv store job %d failed", job_id)
            self.stats.add(store_failures=len(pairs) - done)  # (a whole call failed: none of its pages counted)
            ok = False
        finally:
            # Sealed (a lookup now sees it) or failed (a lookup now misses) before vLLM hears.
            self._mark_inflight(pairs, -1)
        self._finished.append(JobResult(job_id=job_id, success=ok, transfer_time=time.monotonic() - t0,
                                        transfer_bytes=len(pairs) * self._row_nbytes if ok else None))

    def _run_load(self, job_id: int, okeys: Sequence[OffloadKey], ours: Sequence[Key],
                  chunk_ids: npt.NDArray[np.int64]) -> None:
        t0 = time.monotonic()
        hits: list[bool] = []
        try:
            rows = self._rows
            for start in range(0, len(ours), self._batch):
                outs = [rows[int(c)] for c in chunk_ids[start:start + self._batch]]
                hits.extend(read_pages(self.provider, ours[start:start + self._batch], outs, stats=self.stats))
        except Exception:
            logger.exception("hostkv load job %d failed", job_id)
            hits.extend([False] * (len(ours) - len(hits)))
        n_ok = sum(hits)
        if n_ok == len(ours):
            result = JobResult(job_id=job_id, success=True, transfer_time=time.monotonic() - t0,
                               transfer_bytes=n_ok * self._row_nbytes)
        else:
            # A miss (evicted, or dropped for a failed checksum) fails only its own key: vLLM
            # marks the other rows loaded and recomputes the rest; a failed row is never used.
            result = JobResult(job_id=job_id, success=False,
                               successful_keys=[k for k, h in zip(okeys, hits, strict=True) if h],
                               transfer_time=time.monotonic() - t0, transfer_bytes=n_ok * self._row_nbytes)
        self._finished.append(result)
