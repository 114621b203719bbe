"""Errors specific to the Redis provider, each rooted in the core hierarchy."""

from __future__ import annotations

from hostkv_providers.errors import NoSpaceError, ReservationError, StorageIOError

__all__ = ["NotReplicatedError", "ReservationLostError", "ServerOutOfMemoryError", "ServerUnavailableError"]


class ServerUnavailableError(StorageIOError):
    """The Redis server could not be reached (refused, reset, timed out) after the retries.

    Stored pages on the server are unaffected; calls succeed again once it is reachable.  A server
    that came back *empty* (restarted without persistence) is re-initialised on the next call.
    """

    default_hint = "check that redis-server is running and reachable; calls recover once it is back"


class ServerOutOfMemoryError(NoSpaceError):
    """The server refused a write with OOM (its ``maxmemory`` is below this store's budget)."""

    default_hint = "raise the server's maxmemory above the store budget plus ~10% overhead, or lower budget="


class ReservationLostError(ReservationError):
    """The reservation expired or vanished (server restart, or no renewal within reservation_ttl).

    Nothing was published; save the page again.
    """

    default_hint = "save the page again; raise reservation_ttl if writers stall longer than it"


class NotReplicatedError(StorageIOError):
    """``wait_replicas`` replicas did not confirm a seal within ``wait_timeout`` (``WAIT``).

    The page may be stored on the master (and read back later), but it is *not acknowledged*:
    a failover could lose it.  Save it again, or check the replicas' health.
    """

    default_hint = "check that the master's replicas are connected (INFO replication); save the page again"
