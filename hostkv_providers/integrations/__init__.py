"""Engine adapters: any hostkv store URL as the persistent KV tier of vLLM, SGLang or LMCache.

Each engine loads its adapter through its own plug-in point, by module path, without a patch:

* :mod:`hostkv_providers.integrations.vllm` -- ``HostKVTier``, a vLLM ``SecondaryTierManager``
  under the ``TieringOffloadingSpec`` of the ``OffloadingConnector`` (``docs/engines/vllm.md``);
* :mod:`hostkv_providers.integrations.sglang` -- ``HostKVStorage``, an SGLang HiCache L3
  ``HiCacheStorage`` for ``--hicache-storage-backend dynamic`` (``docs/engines/sglang.md``);
* :mod:`hostkv_providers.integrations.lmcache` -- ``HostKVBackend``, an LMCache storage plugin
  (``StoragePluginInterface``), and ``HostKVConnector``, an LMCache ``RemoteConnector`` for
  ``remote_storage_plugins`` (``docs/engines/lmcache.md``).

Importing this package imports no engine; each submodule imports its engine and needs the
matching extra (``pip install hostkv-providers[vllm]`` ...).  The engine-free parts (keys under a
salt, chain writes, the I/O threads) are here.
"""

from __future__ import annotations

from hostkv_providers.integrations._common import (
    ENGINE_KEY_PERSON,
    AdapterStats,
    EngineKeyer,
    IOPool,
    engine_salt,
    open_store,
    read_pages,
    store_pages,
)

__all__ = [
    "ENGINE_KEY_PERSON",
    "AdapterStats",
    "EngineKeyer",
    "IOPool",
    "engine_salt",
    "open_store",
    "read_pages",
    "store_pages",
]
