"""hostkv-redis: a Redis/Valkey provider for hostkv-providers.

Installing this distribution registers the ``redis``, ``rediss``, ``redis+cluster`` and
``rediss+cluster`` URL schemes in the ``hostkv_providers.providers`` entry-point group, so
``hostkv_providers.open("redis://host:6379/0?budget=64GiB&namespace=llama3")`` finds it.
"""

from __future__ import annotations

from ._errors import NotReplicatedError, ReservationLostError, ServerOutOfMemoryError, ServerUnavailableError
from ._provider import (
    DEFAULT_BUDGET,
    RedisClusterProvider,
    RedisProvider,
    RedissClusterProvider,
    RedissProvider,
)
from ._scripts import TRAILER_NBYTES
from ._sharded import DEFAULT_GROUP, DEFAULT_SHARDS, RedisShardedProvider, shard_tags

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_BUDGET",
    "DEFAULT_GROUP",
    "DEFAULT_SHARDS",
    "TRAILER_NBYTES",
    "NotReplicatedError",
    "RedisClusterProvider",
    "RedisProvider",
    "RedisShardedProvider",
    "RedissClusterProvider",
    "RedissProvider",
    "ReservationLostError",
    "ServerOutOfMemoryError",
    "ServerUnavailableError",
    "__version__",
    "shard_tags",
]
