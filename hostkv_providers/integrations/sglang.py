"""SGLang: any hostkv store as HiCache's L3 storage (``--hicache-storage-backend dynamic``).

::

    python -m sglang.launch_server --model-path meta-llama/Llama-3.1-8B-Instruct \\
      --enable-hierarchical-cache --hicache-storage-backend dynamic \\
      --hicache-storage-backend-extra-config '{"backend_name": "hostkv",
        "module_path": "hostkv_providers.integrations.sglang", "class_name": "HostKVStorage",
        "url": "mmap:///nvme/hostkv?budget=256GiB", "interface_v1": 1}'

SGLang's ``StorageBackendFactory`` builds :class:`HostKVStorage` with its ``HiCacheStorageConfig``
(one instance per TP rank), registers the host memory pool, and its cache controller calls the
storage from its prefetch and backup threads.  Keys: SGLang's page hashes (SHA-256 chained over
the prompt, seeded by the request namespace) mapped under a salt of the model, the TP rank and
size (MLA KV is replicated: one shared salt; TP-sharded state beside it, such as Mamba, keeps
the rank), pipeline and context-parallel shards, the page size, the host pool's KV geometry and
dtype, and the ``namespace``/``model_revision`` of the extra config.  Parents come from SGLang's
chain: ``extra_info.prefix_keys`` precede a batch's keys, so a page's parent is the page before
it.  See ``docs/engines/sglang.md``.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolName,
    PoolTransfer,
    PoolTransferResult,
)

from hostkv_providers._capabilities import SupportsIterate
from hostkv_providers._errors import InvalidArgumentError
from hostkv_providers._keys import Key, Salt
from hostkv_providers._layout import DTYPE_ITEMSIZE, KVLayout
from hostkv_providers._provider import Provider
from hostkv_providers.integrations._common import (
    AdapterStats,
    EngineKeyer,
    engine_salt,
    open_store,
    read_pages,
    store_pages,
)

__all__ = ["HostKVStorage", "salt_from_storage_config"]

logger = logging.getLogger(__name__)


def _dtype_name(dtype: object) -> str:
    name = str(dtype).replace("torch.", "")
    return name if name in DTYPE_ITEMSIZE else "uint8"


def salt_from_storage_config(
    config: HiCacheStorageConfig,
    *,
    layout: KVLayout | None = None,
    host_layout: str = "",
    rank_sharded: bool = False,
) -> Salt:
    """The salt of one SGLang HiCache storage configuration (one TP rank).

    ``layout`` is the host pool's KV geometry (known once SGLang registers its host pool);
    before that, the extra config's ``kv_dtype``/``page_size``/``num_layers``/``head_num``/
    ``head_dim`` describe it.  ``rank_sharded``: the salt of state that is split over the TP
    ranks even where the MLA KV is replicated (Mamba/KDA state): it keeps the real TP rank and
    size.  Without MLA it is the KV's salt.
    """
    extra_cfg = dict(config.extra_config or {})
    if layout is None:
        layout = KVLayout(
            num_layers=int(extra_cfg.get("num_layers", 1)),
            num_kv_heads=int(extra_cfg.get("head_num", 1)) * (1 if config.is_mla_model else int(config.tp_size)),
            head_dim=int(extra_cfg.get("head_dim", 1)),
            page_tokens=int(extra_cfg.get("page_size", config.logical_page_size or 1)),
            dtype=_dtype_name(extra_cfg.get("kv_dtype", "bfloat16")),
            kinds=("kv",) if config.is_mla_model else ("k", "v"),
        )
    # MLA KV is replicated over TP ranks: every rank reads the one copy (SGLang lets only the
    # DCP writers store it); MHA shards heads, so each rank has its own salt.
    shared = config.is_mla_model and not rank_sharded
    tp_world = 1 if shared else int(config.tp_size)
    tp_rank = 0 if shared else int(config.tp_rank)
    extra: dict[str, object] = {
        "sglang.pp": f"{config.pp_rank}/{config.pp_size}",
        "sglang.attn_cp": f"{config.attn_cp_rank}/{config.attn_cp_size}",
        "sglang.dcp": f"{config.dcp_rank}/{config.dcp_size}",
        "sglang.mla": bool(config.is_mla_model),
        "sglang.host_layout": host_layout or ("page_first" if config.is_page_first_layout else "layer_first"),
        "sglang.split_heads": bool(config.should_split_heads),
    }
    if config.is_mla_model:
        extra["sglang.tp_size"] = config.tp_size
    return engine_salt(
        engine="sglang",
        model_id=config.model_name or str(extra_cfg.get("model_name", "")),
        layout=layout,
        model_revision=str(extra_cfg.get("model_revision", "")),
        quantization=str(extra_cfg.get("quantization", "none")),
        namespace=str(extra_cfg.get("namespace", "")),
        tp_rank=tp_rank,
        tp_world_size=tp_world,
        extra=extra,
    )


def _rank_sharded_pool(name: object, pool: Any) -> bool:
    """Whether a v2 pool's pages differ per TP rank even where the MLA KV is replicated.

    SGLang's ``HybridCacheController.should_backup`` backs these up on every TP rank: the
    Mamba/KDA state (TP-sharded; HiCacheFile keys it per rank), and a draft model's KV when its
    host pool is MHA (its heads are split over the ranks; Mooncake keys it per rank).  The class
    is matched by name: importing SGLang's host pool modules here would pull in its model
    configs.
    """
    if name == PoolName.MAMBA:
        return True
    if name in (PoolName.DRAFT, PoolName.DRAFT_SWA):
        return any(c.__name__ == "MHATokenToKVPoolHost" for c in type(pool).__mro__)
    return False


class _PoolKeys(NamedTuple):
    pool: Any
    keyer: EngineKeyer
    salt: Salt
    rank_sharded: bool


def _as_bytes(t: torch.Tensor) -> np.ndarray:
    if t.device.type != "cpu":
        raise InvalidArgumentError(f"HostKVStorage moves host pages; got a tensor on {t.device}")
    return t.contiguous().view(torch.uint8).reshape(-1).numpy()


class HostKVStorage(HiCacheStorage):
    """SGLang HiCache L3 storage over any hostkv provider.

    Extra config keys (besides ``backend_name``/``module_path``/``class_name``): ``url``
    (required), ``namespace``, ``model_revision``, ``quantization``, ``interface_v1`` (1: the
    controller uses the zero-copy ``batch_get_v1``/``batch_set_v1`` against the registered host
    pool).  All calls are synchronous, as HiCache expects: the controller calls them from its own
    prefetch and backup threads, concurrently; the provider is thread-safe.
    """

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        url = extra.get("url")
        if not url:
            raise InvalidArgumentError("HostKVStorage needs 'url' in the HiCache storage extra config",
                                       hint='"url": "mmap:///nvme/hostkv?budget=256GiB"')
        self.storage_config = storage_config
        self._owns_provider = not isinstance(url, Provider)
        self.provider = open_store(url)
        self._lock = threading.Lock()
        self.salt = salt_from_storage_config(storage_config)
        # TP-sharded v2 state (Mamba ...) of an MLA model: keyed per rank (== self.salt without MLA).
        self.rank_salt = salt_from_storage_config(storage_config, rank_sharded=True)
        self._keyer = EngineKeyer(self.salt, "sglang")
        self.stats = AdapterStats()
        # MLA replicas: only SGLang's designated writer stores (the others would write the
        # same bytes under the same keys).
        self._writer = bool(storage_config.is_storage_writer)

    # -- host pool registration: the salt takes the pool's real geometry -------------------
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        pool = mem_pool_host
        cfg = self.storage_config
        heads = int(getattr(pool, "head_num", 1) or 1)
        layout = KVLayout(
            num_layers=int(getattr(pool, "layer_num", 1) or 1),
            num_kv_heads=heads * (1 if cfg.is_mla_model else int(cfg.tp_size)),
            head_dim=int(getattr(pool, "head_dim", getattr(pool, "kv_cache_dim", 1)) or 1),
            page_tokens=int(pool.page_size),
            dtype=_dtype_name(getattr(pool, "dtype", "uint8")),
            kinds=("kv",) if cfg.is_mla_model else ("k", "v"),
        )
        host_layout = str(getattr(pool, "layout", ""))
        salt = salt_from_storage_config(cfg, layout=layout, host_layout=host_layout)
        rank_salt = salt_from_storage_config(cfg, layout=layout, host_layout=host_layout, rank_sharded=True)
        with self._lock:
            self.salt = salt
            self.rank_salt = rank_salt
            self._keyer = EngineKeyer(salt, "sglang")

    # -- keys --------------------------------------------------------------------------------
    def _chain(self, keys: Sequence[str], extra_info: HiCacheStorageExtraInfo | None) -> list[tuple[Key, Key | None]]:
        keyer = self._keyer
        ours = keyer.keys(list(keys))
        prefix = extra_info.prefix_keys if extra_info is not None else None
        parent: Key | None = keyer.key(prefix[-1]) if prefix else None
        out: list[tuple[Key, Key | None]] = []
        for k in ours:
            out.append((k, parent))
            parent = k
        return out

    # -- the generic interface (tensors in, tensors out) -----------------------------------
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        got = self.batch_get([key], [target_location])
        return got[0] if isinstance(got, list) else None

    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        if target_locations is None or len(target_locations) != len(keys):
            raise InvalidArgumentError("HostKVStorage.batch_get needs one target tensor per key")
        targets = list(target_locations)
        if any(t is not None and not isinstance(t, torch.Tensor) for t in targets):
            raise InvalidArgumentError("HostKVStorage.batch_get: each target must be a torch.Tensor (or None)")
        ours = self._keyer.keys(keys)
        result: list[torch.Tensor | None] = [None] * len(keys)
        # The base class makes the target optional ("None if the key does not exist"): a key
        # without a target is answered by presence alone; a present one has nowhere to go.
        untargeted = [i for i, t in enumerate(targets) if t is None]
        if untargeted and any(self.provider.present([ours[i] for i in untargeted])):
            raise InvalidArgumentError("HostKVStorage.batch_get needs a target tensor for a stored page",
                                       hint="pass target_location (a host tensor of the page's size)")
        todo = [i for i, t in enumerate(targets) if t is not None]
        if not todo:
            return result
        outs = [_as_bytes(targets[i]) if targets[i].is_contiguous() else None for i in todo]
        bufs = [o if o is not None else np.empty(targets[i].numel() * targets[i].element_size(), np.uint8)
                for o, i in zip(outs, todo, strict=True)]
        hits = read_pages(self.provider, [ours[i] for i in todo], bufs, stats=self.stats)
        for hit, i, o, b in zip(hits, todo, outs, bufs, strict=True):
            if not hit:
                continue
            t = targets[i]
            if o is None:  # a non-contiguous target: copy the bytes in
                t.copy_(torch.from_numpy(b).view(t.dtype).reshape(t.shape))
            result[i] = t
        return result

    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        if values is None or len(values) != len(keys):
            raise InvalidArgumentError("HostKVStorage.batch_set needs one value tensor per key")
        if not self._writer:
            return True
        # No prefix info on this path (the controller's generic page set): the batch is one
        # piece of a chain, linked page to page; its first page is stored as a root.
        pairs = self._chain(keys, None)
        items = [(k, p, _as_bytes(v)) for (k, p), v in zip(pairs, values, strict=True)]
        return all(store_pages(self.provider, items, salt_tag=self.salt.tag, stats=self.stats))

    def exists(self, key: str) -> bool:
        return self.provider.present([self._keyer.key(key)])[0]

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self.provider.longest_prefix(self._keyer.keys(keys))

    # -- the zero-copy interface (pages of the registered host pool) -----------------------
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        if not self._writer:
            return [True] * len(keys)
        pool = self.mem_pool_host
        page = int(pool.page_size)
        pairs = self._chain(keys, extra_info)
        items = [(k, p, _as_bytes(pool.get_data_page(int(host_indices[i * page]), flat=True)))
                 for i, (k, p) in enumerate(pairs)]
        return store_pages(self.provider, items, salt_tag=self.salt.tag, stats=self.stats)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        pool = self.mem_pool_host
        page = int(pool.page_size)
        pages = [pool.get_dummy_flat_data_page() for _ in keys]
        hits = read_pages(self.provider, self._keyer.keys(keys), [_as_bytes(p) for p in pages], stats=self.stats)
        for i, (hit, data) in enumerate(zip(hits, pages, strict=True)):
            if hit:  # a miss never touches the host pool: no torn or foreign page lands there
                pool.set_from_flat_data_page(int(host_indices[i * page]), data)
        return hits

    # -- v2: the host pools beside the KV (mamba/SWA state, draft KV, indexer ...) ----------
    # SGLang 0.5.23's HybridCacheController registers each extra host pool of its
    # HostPoolGroup with ``register_mem_host_pool_v2(pool, name)`` and moves its pages with
    # PoolTransfers (keys = the KV page hashes they belong to, host_indices in that pool).
    # Every host pool class there has the same flat-page API, so one generic path serves them:
    # a pool's pages live under their own keys (the pool's name and byte geometry are hashed
    # into the key), stored as roots (no chain: a trailing-window state page has no parent page).
    # A TP-sharded pool of an MLA model (Mamba ...) is keyed under the rank's own salt: every
    # rank writes and reads its own shard, where the replicated MLA KV has one shared copy.
    def _pool_keyer(self, name: object) -> _PoolKeys | None:
        pools = getattr(self, "registered_pools", None) or {}
        pool = pools.get(name)
        if pool is None:
            return None
        page_nbytes = int(pool.get_dummy_flat_data_page().view(torch.uint8).numel())
        tag = f"sglang.pool:{name}:{type(pool).__name__}:{page_nbytes}:{getattr(pool, 'layout', '')}"
        sharded = _rank_sharded_pool(name, pool)
        salt = self.rank_salt if sharded else self.salt
        return _PoolKeys(pool, EngineKeyer(salt, tag), salt, sharded)

    def batch_exists_v2(self, keys: list[str], pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None) -> PoolTransferResult:
        # The restorable prefix lengths are a set, not a prefix: a trailing-window state (Mamba,
        # SWA) exists only at the lengths where a checkpoint was backed up, so 2 and 5 may be
        # restorable and 3 not.  Each pool's set is intersected, as HiCacheFile.batch_exists_v2
        # does, and returned as ``restorable_prefix_pages`` (the controller reduces the sets over
        # the TP ranks; without it, it would take every length up to ``kv_hit_pages``).
        kv_pages = self.batch_exists(keys, extra_info)
        hits: dict[Any, int] = {PoolName.KV: kv_pages} if kv_pages else {}
        restorable = set(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            found = self._pool_keyer(transfer.name)
            if found is None:  # a pool we were never given: absent, never guessed
                restorable = set()
                break
            present = self.provider.present(found.keyer.keys(list(keys[:kv_pages])))
            if transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                # Only the last ``trailing`` pages of the prefix must exist.
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                pool_restorable = {n for n in range(1, kv_pages + 1) if all(present[max(0, n - trailing):n])}
                boundary = max(pool_restorable, default=0)
            else:  # ALL_PAGES (and BLOCK_GROUPS, reported as its leading run)
                boundary = next((i for i, hit in enumerate(present) if not hit), kv_pages)
                pool_restorable = set(range(1, boundary + 1))
            if boundary:
                hits[transfer.name] = boundary
            restorable &= pool_restorable
        pages = sorted(restorable)
        return PoolTransferResult(pages[-1] if pages else 0, hits, pages)

    def _pool_pages(self, transfer: PoolTransfer, pool: Any) -> list[int]:
        keys = transfer.keys or []
        idx = transfer.host_indices
        if idx is None or not keys:
            return []
        step = len(idx) // len(keys)
        if step < 1:
            raise InvalidArgumentError(f"v2 transfer {transfer.name}: {len(idx)} host indices for {len(keys)} keys")
        return [int(idx[i * step]) for i in range(len(keys))]

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            found = self._pool_keyer(transfer.name)
            if found is None:
                out[transfer.name] = [False] * len(keys)
                continue
            # A replicated pool has one copy, the writer's; a TP-sharded one (SGLang sends it on
            # every rank) is each rank's own.
            if not self._writer and not found.rank_sharded:
                out[transfer.name] = [True] * len(keys)
                continue
            pool = found.pool
            pages = self._pool_pages(transfer, pool)
            items = [(k, None, _as_bytes(pool.get_data_page(p, flat=True)))
                     for k, p in zip(found.keyer.keys(keys), pages, strict=True)]
            out[transfer.name] = store_pages(self.provider, items, salt_tag=found.salt.tag, stats=self.stats)
        return out

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[Any, list[bool]]:
        out: dict[Any, list[bool]] = {}
        for transfer in transfers:
            keys = list(transfer.keys or [])
            found = self._pool_keyer(transfer.name)
            if found is None:
                out[transfer.name] = [False] * len(keys)
                continue
            pool = found.pool
            pages = self._pool_pages(transfer, pool)
            bufs = [pool.get_dummy_flat_data_page() for _ in keys]
            hits = read_pages(self.provider, found.keyer.keys(keys), [_as_bytes(b) for b in bufs], stats=self.stats)
            for hit, page, buf in zip(hits, pages, bufs, strict=True):
                if hit:  # a miss never touches the host pool
                    pool.set_from_flat_data_page(page, buf)
            out[transfer.name] = hits
        return out

    # -- lifecycle ---------------------------------------------------------------------------
    def clear(self) -> None:
        """Remove this configuration's pages (other salts' pages in a shared store stay)."""
        if not isinstance(self.provider, SupportsIterate):
            logger.warning("hostkv: %s cannot list its entries; clear() removes nothing", type(self.provider).__name__)
            return
        tags = {self.salt.tag, self.rank_salt.tag}
        mine = [e.key for e in self.provider.iter_entries() if e.salt_tag in tags]
        if mine:
            self.provider.evict(mine)

    def get_stats(self) -> None:
        return None

    def close(self) -> None:
        if self._owns_provider and not self.provider.closed:
            self.provider.close()
