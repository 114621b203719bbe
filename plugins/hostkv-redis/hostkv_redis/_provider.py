"""``redis://`` — a store on a Redis (or Valkey) server, shared by every engine node that opens it.

The client is thin: page bytes are written with plain ``SET`` and read with plain ``GET``
(pipelined, so a batch is one round trip), and every decision that involves more than one key
runs server-side in a Lua script (:mod:`hostkv_redis._scripts`), atomically.  See
``docs/providers/redis.md`` for the URL options, the key schema and the Redis Cluster trade-off.

Why the bytes do not go through Lua: a script argument is copied into the Lua heap and back into a
Redis object, which costs two extra memcpys of every page.  Instead ``seal`` pipelines a ``SET`` of
a private staging key with the seal script, which ``RENAME``s it into place (O(1), no copy) only
if the reservation is still live; ``put_many`` pipelines the ``SET`` commands of many pages with a
``put`` script that does reserve's and seal's checks for all of them in one call (no per-page
reservation record: the per-page script work on Redis's single thread is what bounds small
pages).  Every page carries a 56-byte trailer (key echo, XXH3-64, nbytes, magic), so one ``GET``
is self-verifying: a read can never pair bytes with the wrong checksum, and a value renamed under
the wrong name is caught by the key echo.
"""

from __future__ import annotations

import ctypes
import hashlib
import itertools
import logging
import os
import re
import struct
import threading
import urllib.parse
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import redis
from hostkv_providers.errors import (
    CapacityError,
    ClosedError,
    HostKVError,
    IncompatibleStoreError,
    InFlightError,
    InvalidArgumentError,
    ReservationError,
    RetainedError,
    StorageIOError,
    StoreNotFoundError,
    UnknownKeyError,
)
from hostkv_providers.providers import (
    CHECKSUM_ALGORITHM,
    FORMAT_VERSION,
    KEY_ALGORITHM,
    ByteSpan,
    Corrupt,
    EntryInfo,
    EvictReport,
    HostRegion,
    Key,
    Lease,
    Options,
    Progress,
    Provider,
    ProviderStats,
    Reservation,
    VerifyReport,
    check_flag,
    check_progress,
    check_span,
    checksum,
    overlapping,
    parse_size,
    writable_buffer,
)
from redis.cluster import RedisCluster

from ._errors import NotReplicatedError, ReservationLostError, ServerOutOfMemoryError
from ._scripts import TRAILER_NBYTES
from ._wire import (
    MAX_BULK,
    Part,
    Piece,
    ReplyTooLong,
    _BufferPool,
    _encode,
    _get_into,
    _Link,
    _redact,
    _send_raw,
    _whole,
)

__all__ = [
    "DEFAULT_BUDGET",
    "RedisClusterProvider",
    "RedisProvider",
    "RedissClusterProvider",
    "RedissProvider",
    "parse_trailer",
]

T = TypeVar("T")
_log = logging.getLogger("hostkv_redis")

DEFAULT_BUDGET = 1 << 30
#: The store-wide counters the scripts keep in the metadata hash (``store_counters``).
_STORE_COUNTERS = ("hits", "misses", "bytes_read", "seals", "bytes_written", "evictions", "evicted_bytes",
                   "checksum_failures", "aborts", "expired_leases", "expired_reservations")
_MAYBE_ORPHAN = "orphan?"  # Corrupt token of a GET miss (see RedisProvider._drop_damaged)
_ORPHAN_CHECK = Corrupt(_MAYBE_ORPHAN)
_TRAILER = struct.Struct("<32sQQ8s")
_MAGIC = b"HKVPAGE1"
_NAMESPACE = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_SALT_TAG_MAX = 128
_ANCHOR_MAX = 64 << 20
_BATCH = 1024  # pages per put script call in put_many
_BATCH_BYTES = 64 << 20  # page bytes staged per put_many pipeline
_GROUP_PAGES = 64  # pages per put script inside one put_many pipeline
_GROUP_BYTES = 4 << 20  # page bytes per put script inside one put_many pipeline
_HASH_AHEAD = 4 << 20  # page bytes checksummed while put_many's probe is on the wire


def _check_share(value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value <= 1:
        raise InvalidArgumentError(f"retain_share must be a number in [0, 1], got {value!r}")
    return float(value)


def _check_options(url: object, *, lease_ttl: object, reservation_ttl: object, timeout: object, retries: object,
                   wait_replicas: object, wait_timeout: object, retain_share: object) -> None:
    """The connection and lease options' checks (typed errors), for :class:`RedisProvider` and
    for the sharded store, which makes them before it builds its cluster client:
    ``RedisCluster.from_url`` and ``Retry`` take the raw values first and fail untyped
    (``RedisClusterException``, ``TypeError``, ``AttributeError``) or not at all."""
    if not isinstance(url, str) or "://" not in url:
        raise InvalidArgumentError(f"url must be a redis:// URL, got {url!r}")
    for what, value in (("lease_ttl", lease_ttl), ("reservation_ttl", reservation_ttl), ("timeout", timeout)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value <= 86400:
            raise InvalidArgumentError(f"{what} must be seconds in (0, 86400], got {value!r}")
    if type(retries) is not int or not 0 <= retries <= 100:
        raise InvalidArgumentError(f"retries must be an int in [0, 100], got {retries!r}")
    if type(wait_replicas) is not int or not 0 <= wait_replicas <= 16:
        raise InvalidArgumentError(f"wait_replicas must be an int in [0, 16], got {wait_replicas!r}")
    if not isinstance(wait_timeout, (int, float)) or isinstance(wait_timeout, bool) or not 0 < wait_timeout <= 3600:
        raise InvalidArgumentError(f"wait_timeout must be seconds in (0, 3600], got {wait_timeout!r}")
    _check_share(retain_share)


def _check_readonly(readonly: object, budget_bytes: int | None, resize: object) -> bool:
    """``readonly`` must be a bool, and a read-only open sets no budget (``budget=``, ``resize=``):
    the rule of every open, checked before anything connects."""
    if type(readonly) is not bool:
        raise InvalidArgumentError(f"readonly must be True or False, got {readonly!r}")
    if readonly and (budget_bytes is not None or resize):
        raise InvalidArgumentError("a read-only open cannot set the budget",
                                   hint="drop budget=/resize= or readonly=")
    return readonly


def _digest(page: memoryview, trailer: bytes) -> str:
    """SHA-1 (hex) of a stored value as a read got it, page and trailer: what the drop script
    compares with the value still stored (``redis.sha1hex``) before it drops a damaged page."""
    h = hashlib.sha1(page, usedforsecurity=False)
    h.update(trailer)
    return h.hexdigest()


def parse_trailer(value: bytes, key: bytes) -> tuple[int, int] | None:
    """``(nbytes, checksum)`` from a stored value's trailer, or ``None`` when it is not a valid
    page of ``key`` (wrong magic, wrong key echo, or a length that disagrees with the value)."""
    if len(value) < TRAILER_NBYTES:
        return None
    echo, digest, nbytes, magic = _TRAILER.unpack_from(value, len(value) - TRAILER_NBYTES)
    if magic != _MAGIC or echo != key or nbytes != len(value) - TRAILER_NBYTES:
        return None
    return nbytes, digest


# --------------------------------------------------------------------------------------------
# Reservations
# --------------------------------------------------------------------------------------------


class _RedisReservation(Reservation):
    """A reservation whose bytes are buffered client-side until ``seal`` ships them in one SET.

    The buffer has room for the 56-byte trailer after the page, so sealing needs no copy.
    """

    __slots__ = ("buf", "data", "hex", "rid")

    def __init__(self, provider: RedisProvider, key: Key, parent: Key | None, nbytes: int, salt_tag: str,
                 rid: str, buf: bytearray | None) -> None:
        super().__init__(provider, key, parent, nbytes, salt_tag)
        self.rid = rid
        self.hex = key.hex()
        self.buf = buf  # pooled, exactly nbytes; None once sealed or aborted (back in the pool)
        self.data: memoryview | None = None if buf is None else memoryview(buf)

    def regions(self) -> Sequence[HostRegion]:
        """The client-side buffer (ordinary memory), for a copy engine that fills it directly."""
        self.check_open(self._provider)
        if self.buf is None:
            raise ReservationError("this reservation has no buffer any more")
        address = ctypes.addressof(ctypes.c_char.from_buffer(self.buf))
        return [HostRegion(0, memoryview(self.buf), address, False)]

    def __del__(self) -> None:
        # Dropped while open (its writer died with an exception, e.g. a seal refused because
        # close() had begun): the provider forgets it (its registry is weak), so queue its
        # server-side abort for the renewal thread or close() (no I/O, no lock: this may run in
        # any thread, inside the garbage collector).  Otherwise its flight would stay on the
        # server until reservation_ttl, seen as in flight by every client.
        try:
            if self._state == "open":
                dropped = getattr(self._provider, "_dropped", None)
                if dropped is not None:
                    dropped.append((self.hex, self.rid))
        except Exception:  # (interpreter shutdown, a half-built object): nothing to queue
            pass


# --------------------------------------------------------------------------------------------
# The provider
# --------------------------------------------------------------------------------------------


class RedisProvider(Provider):
    """A store of KV pages on a Redis/Valkey server, shared by every client that opens it.

    Parameters
    ----------
    url:
        A redis-py URL: ``redis://[user:password@]host:port[/db]`` (``rediss://`` for TLS).  For a
        cluster (``cluster=True``), any node's address.
    budget_bytes:
        The store-wide byte budget (page bytes plus anchor bytes).  ``None`` uses the store's
        recorded budget (or ``DEFAULT_BUDGET`` when the store is created).  A value different
        from the recorded one raises ``IncompatibleStoreError`` unless ``resize=True``.
    namespace:
        The store's name on the server (``[A-Za-z0-9_.-]{1,64}``); it is the Redis Cluster hash
        tag, so one store lives in one slot (one master).  Shard across masters with several
        namespaces.
    cluster:
        Connect to a Redis Cluster.
    lease_ttl, reservation_ttl:
        Seconds after which a lease / an in-flight reservation of a client that stopped renewing
        (crashed, partitioned, frozen) expires server-side.  Live clients renew every third of it
        from a background thread (``keepalive``).
    timeout, retries:
        Socket timeout in seconds; connection retries (with backoff) before a typed
        ``ServerUnavailableError``.
    verify_reads:
        Check the XXH3-64 checksum on every read (default).  The trailer (key echo, length,
        magic) is always checked.
    resize:
        Allow ``budget_bytes`` to change the recorded budget (shrinking evicts LRU leaves, or
        raises ``CapacityError`` when leased/in-flight entries do not allow it).
    keepalive:
        Run the renewal thread.  Off only for tests that simulate a stalled client.
    """

    name: ClassVar[str] = "redis"
    persistent: ClassVar[bool] = True
    multiprocess: ClassVar[bool] = True
    _url_scheme: ClassVar[str] = "redis"
    _cluster_mode: ClassVar[bool] = False
    _reservation_type = _RedisReservation
    _tag_max = _SALT_TAG_MAX

    def __init__(
        self,
        url: str = "redis://127.0.0.1:6379/0",
        *,
        budget_bytes: int | None = None,
        namespace: str = "default",
        cluster: bool = False,
        lease_ttl: float = 30.0,
        reservation_ttl: float = 60.0,
        timeout: float = 5.0,
        retries: int = 3,
        verify_reads: bool = True,
        resize: bool = False,
        keepalive: bool = True,
        wait_replicas: int = 0,
        wait_timeout: float = 2.0,
        readonly: bool = False,
        retain_share: float = 0.5,
        _shared_cluster: RedisCluster | None = None,
    ) -> None:
        super().__init__()
        self._retain_share = _check_share(retain_share)
        self._readonly = _check_readonly(readonly, budget_bytes, resize)
        _check_options(url, lease_ttl=lease_ttl, reservation_ttl=reservation_ttl, timeout=timeout,
                       retries=retries, wait_replicas=wait_replicas, wait_timeout=wait_timeout,
                       retain_share=retain_share)
        if not isinstance(namespace, str) or not _NAMESPACE.match(namespace):
            raise InvalidArgumentError(f"namespace must match [A-Za-z0-9_.-]{{1,64}}, got {namespace!r}")
        if budget_bytes is not None and (type(budget_bytes) is not int or budget_bytes <= 0):
            raise InvalidArgumentError(f"budget must be a positive int, got {budget_bytes!r}")
        self._wait = wait_replicas
        self._wait_ms = max(1, int(wait_timeout * 1000))
        # How long the server remembers an evict call's result for a resend of that call
        # (redis-py resends a command whose reply was lost, and evicting is not idempotent):
        # longer than the call can last, every attempt of _Link.run and of redis-py's Retry
        # timing out (connect and read, plus backoff); at least a minute, at most an hour.
        window = (retries + 2) * (retries + 1) * (2 * float(timeout) + 0.5)
        self._memo_ms = int(1000 * min(3600.0, max(60.0, window)))
        self._namespace = namespace
        self._prefix = f"hkv:{{{namespace}}}:"
        self._meta = self._prefix + "m"
        self._lease_ms = int(lease_ttl * 1000)
        self._flight_ms = int(reservation_ttl * 1000)
        self._verify_reads = verify_reads
        self._url = url
        self._client_id = os.urandom(6).hex()
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._resets = 0  # times this client found its store gone and re-created it (server restart)
        self._live_leases: weakref.WeakValueDictionary[str, Lease] = weakref.WeakValueDictionary()
        self._live_flights: weakref.WeakValueDictionary[str, _RedisReservation] = weakref.WeakValueDictionary()
        self._dropped: list[tuple[str, str]] = []  # (hex, rid) of open reservations dropped unaborted
        self._want_budget = budget_bytes
        self._resize = resize
        self._budget = budget_bytes or DEFAULT_BUDGET
        self._link = _Link(url, cluster, self._meta, float(timeout), retries, _shared_cluster)
        self._keepalive = keepalive and not readonly  # (a read-only client holds nothing to renew)
        self._pool = _BufferPool(256 << 20)
        self._renew_every = min(lease_ttl, reservation_ttl) / 3
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        try:
            self._link.run(lambda c: self._link.load_scripts(c), self._init_store)
            self._link.run(self._init_store, self._init_store)
        except BaseException:
            self._link.close()
            raise

    # -- construction ------------------------------------------------------------------------
    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> Provider:
        opts = Options(cls.name, options)
        budget_raw = opts.text("budget")
        budget = None if budget_raw is None else parse_size(budget_raw)
        namespace = opts.text("namespace", "default") or "default"
        lease_ttl = opts.number("lease_ttl", 30.0)
        reservation_ttl = opts.number("reservation_ttl", 60.0)
        timeout = opts.number("timeout", 5.0)
        retries = opts.integer("retries", 3)
        verify = opts.choice("verify", "read", ("read", "never"))
        resize = opts.boolean("resize", False)
        readonly = opts.boolean("readonly", False)
        retain_share = opts.number("retain_share", 0.5)
        wait_replicas = opts.integer("wait_replicas", 0)
        wait_timeout = opts.number("wait_timeout", 2.0)
        shards, group = 1, 1
        if cls._cluster_mode:
            from ._sharded import DEFAULT_GROUP, DEFAULT_SHARDS

            shards = opts.integer("shards", DEFAULT_SHARDS)
            group = opts.integer("group", DEFAULT_GROUP)
        # TLS: handed to redis-py's SSL connection in the URL it parses (files by path).
        tls: dict[str, str] = {}
        for name in ("ssl_ca_certs", "ssl_ca_path", "ssl_certfile", "ssl_keyfile"):
            value = opts.text(name)
            if value is not None:
                tls[name] = value
        reqs = opts.choice("ssl_cert_reqs", "required", ("required", "optional", "none"))
        if reqs != "required":
            tls["ssl_cert_reqs"] = reqs
        if not opts.boolean("ssl_check_hostname", True):
            tls["ssl_check_hostname"] = "false"
        opts.finish()
        if not location or location.startswith("/"):
            raise InvalidArgumentError(
                f"{cls.name}:// needs a host, got {location!r}",
                hint=f"write {cls.name}://host:6379/0?budget=8GiB&namespace=kv",
            )
        if tls and cls._url_scheme != "rediss":
            raise InvalidArgumentError(f"{', '.join(sorted(tls))}: TLS options on a {cls.name}:// URL",
                                       hint=f"use {cls.name.replace('redis', 'rediss', 1)}:// for TLS")
        query = "?" + urllib.parse.urlencode(tls) if tls else ""
        url = f"{cls._url_scheme}://{location}{query}"
        if shards != 1:
            from ._sharded import RedisShardedProvider

            return RedisShardedProvider(url, budget_bytes=budget, namespace=namespace, shards=shards, group=group,
                                        lease_ttl=lease_ttl, reservation_ttl=reservation_ttl, timeout=timeout,
                                        retries=retries, verify_reads=verify == "read", resize=resize,
                                        readonly=readonly, retain_share=retain_share,
                                        wait_replicas=wait_replicas, wait_timeout=wait_timeout)
        return cls(url, budget_bytes=budget, namespace=namespace,
                   cluster=cls._cluster_mode, lease_ttl=lease_ttl, reservation_ttl=reservation_ttl,
                   timeout=timeout, retries=retries, verify_reads=verify == "read", resize=resize,
                   readonly=readonly, retain_share=retain_share,
                   wait_replicas=wait_replicas, wait_timeout=wait_timeout)

    def _init_store(self, client: redis.Redis) -> None:
        """Create the store's metadata, or check that it matches this build (R4)."""
        if self._readonly:
            self._check_store(client)
            return
        budget = "" if self._want_budget is None else str(self._want_budget)
        out = client.evalsha(self._link.sha("init"), 1, self._meta, str(FORMAT_VERSION), KEY_ALGORITHM,
                             CHECKSUM_ALGORITHM, budget, "1" if self._resize else "0", str(DEFAULT_BUDGET))
        status = out[0].decode()
        if status == "incompatible":
            found = [x.decode() for x in out[1:]]
            raise IncompatibleStoreError(
                f"store {self._namespace!r} has format/key/checksum {found}, this build writes "
                f"{[str(FORMAT_VERSION), KEY_ALGORITHM, CHECKSUM_ALGORITHM]}",
                hint="use another namespace, or evict the old store",
            )
        if status == "budget":
            raise IncompatibleStoreError(
                f"store {self._namespace!r} has budget {out[1].decode()}, not {budget}",
                hint="omit budget= to use the store's budget, or add resize=true to change it",
            )
        if status == "shrink":
            raise CapacityError(
                f"cannot shrink store {self._namespace!r} to {budget}: {out[2].decode()} bytes are leased or in flight"
            )
        if status == "created":
            counts = self._tallies()
            if counts["seals"] + counts["hits"] > 0:
                self._resets += 1
        self._budget = int(out[1])
        # once the budget is applied, re-creating the store after a server restart reuses it
        self._want_budget = self._budget

    def _check_store(self, client: redis.Redis) -> None:
        """The read-only open: the store must exist and match this build; nothing is written
        (no metadata created, no script that writes is run)."""
        fields = ("format", "key_algorithm", "checksum", "budget")
        found = [None if v is None else v.decode() if isinstance(v, bytes) else str(v)
                 for v in client.hmget(self._meta, fields)]
        if found[3] is None:
            raise StoreNotFoundError(f"no store {self._namespace!r} on {_redact(self._url)}",
                                     hint="check the namespace= option (a read-only open never creates a store)")
        if found[:3] != [str(FORMAT_VERSION), KEY_ALGORITHM, CHECKSUM_ALGORITHM]:
            raise IncompatibleStoreError(
                f"store {self._namespace!r} has format/key/checksum {found[:3]}, this build reads "
                f"{[str(FORMAT_VERSION), KEY_ALGORITHM, CHECKSUM_ALGORITHM]}",
                hint="use a build of the store's format")
        self._budget = int(found[3])

    @property
    def readonly(self) -> bool:
        """Opened with ``readonly=true``: every write raises ``InvalidArgumentError``."""
        return self._readonly

    def _writable(self, what: str) -> None:
        if self._readonly:
            raise InvalidArgumentError(f"{what}: this redis store is open read-only (readonly=true)",
                                       hint="open it without readonly=true to modify it")

    # -- plumbing ----------------------------------------------------------------------------
    def _run(self, fn: Callable[[redis.Redis], T]) -> T:
        try:
            return self._link.run(fn, self._init_store)
        except Exception as exc:
            if self._closed and not isinstance(exc, ClosedError):
                # close() from another thread shut the connection under this call (a read: the
                # write-path calls are waited for): that is the answer, not what the socket said
                raise ClosedError(f"{type(self).__name__} was closed during the call") from exc
            raise

    def _eval(self, script: str, *args: Any) -> Any:
        sha = self._link.sha(script)
        return self._run(lambda c: c.evalsha(sha, 1, self._meta, *args))

    def _wait_command(self) -> list[Piece]:
        """``WAIT`` on the pipeline's own connection (it covers that connection's writes only)."""
        return _encode([b"WAIT", b"%d" % self._wait, b"%d" % self._wait_ms])

    def _unreplicated(self, reply: Any) -> NotReplicatedError | None:
        """The error for seals that fewer than ``wait_replicas`` replicas confirmed, or ``None``."""
        if isinstance(reply, int) and reply >= self._wait:
            return None
        return NotReplicatedError(f"{reply!r} of {self._wait} replicas confirmed the write within "
                                  f"{self._wait_ms} ms; the page is not acknowledged")

    def _next_id(self, kind: str) -> str:
        return f"{self._client_id}.{kind}{next(self._ids):x}"

    def _start_keeper(self) -> None:
        if not self._keepalive or self._keeper is not None:
            return
        with self._lock:
            if self._keeper is not None:
                return
            self._keeper = threading.Thread(target=self._keep, name="hostkv-redis-renew", daemon=True)
            self._keeper.start()

    def _keep(self) -> None:
        while not self._stop.wait(self._renew_every):
            try:
                self.renew()
            except HostKVError:
                continue  # unreachable now (or closed); expiry takes over if it lasts

    def renew(self) -> list[str]:
        """Extend this client's live leases and reservations by their TTLs, now.

        The keepalive thread calls this every third of the shorter TTL, so only the leases and
        reservations of a client that stopped (crashed, partitioned, frozen) expire.  Returns the
        ids the server no longer had (already expired, or lost in a server restart).
        """
        self._check_usable()
        self._abort_dropped()
        with self._lock:
            lids = list(self._live_leases.keys())
            flights = [(r.hex, rid) for rid, r in list(self._live_flights.items())]
        if not lids and not flights:
            return []
        args: list[str] = [str(self._lease_ms), str(self._flight_ms), str(len(lids)), *lids]
        for h, rid in flights:
            args += [h, rid]
        return [x.decode() for x in self._eval("renew", *args)]

    def _take_dropped(self) -> list[tuple[str, str]]:
        out = []
        while self._dropped:  # (pop is atomic: __del__ may append meanwhile)
            out.append(self._dropped.pop())
        return out

    def _abort_dropped(self) -> None:
        """Abort on the server the reservations their writers dropped while open (queued by
        ``_RedisReservation.__del__``)."""
        dropped = self._take_dropped()
        if not dropped:
            return
        try:
            self._eval("abort", str(len(dropped)), *(x for pair in dropped for x in pair))
        except HostKVError:
            self._dropped.extend(dropped)  # try again later (or they expire)
            raise

    # -- lookups -----------------------------------------------------------------------------
    # (the public verbs are the front's, in Provider: it validates, checks usability, counts and
    # applies the checksum rule; these are the drivers it calls)
    def _present(self, keys: Sequence[bytes]) -> list[bool]:
        ks = self._keys(keys)
        if not ks:
            return []
        bits = self._eval("present", *[k.hex() for k in ks])
        return [b == 0x31 for b in bits]

    def _longest_prefix(self, keys: Sequence[bytes]) -> int:
        ks = self._keys(keys)
        if not ks:
            return 0
        return int(self._eval("prefix", *[k.hex() for k in ks]))

    def _in_flight(self, k: Key) -> bool:
        if self._readonly:  # the script reaps expired reservations (a write): ask without it
            def go(c: redis.Redis) -> list[Any]:
                pipe = c.pipeline(transaction=False)
                pipe.exists(self._prefix + "f:" + k.hex())
                pipe.zscore(self._prefix + "fz", k.hex())
                pipe.time()
                res: list[Any] = pipe.execute()
                return res

            exists, expiry, (sec, usec) = self._run(go)
            return bool(exists) and expiry is not None and float(expiry) > sec * 1000 + usec // 1000
        return bool(self._eval("in_flight", k.hex()))

    def _entry(self, k: Key) -> EntryInfo | None:
        return self._infos([k])[0]

    def _infos(self, keys: Sequence[Key]) -> list[EntryInfo | None]:
        rows = self._eval("info", *[k.hex() for k in keys])
        out: list[EntryInfo | None] = []
        for k, row in zip(keys, rows, strict=True):
            if not row:
                out.append(None)
                continue
            p, n, g, ck, ct, lu, _gen, rt = row[:8]
            anchors = {row[i].decode(): int(row[i + 1]) for i in range(8, len(row), 2)}
            out.append(EntryInfo(k, Key(bytes.fromhex(p.decode())) if p else None, int(n), g.decode(), int(ck),
                                 int(ct) / 1000, int(lu) / 1000, anchors, retained=rt == b"1"))
        return out

    def iter_entries(self) -> Iterator[EntryInfo]:
        """Every sealed entry (SCAN in batches; entries sealed or evicted meanwhile may or may not
        appear, as with any SCAN)."""
        self._check_usable()  # here, not in the generator: a closed provider raises at the call
        return self._iter_entries()

    def _iter_entries(self) -> Iterator[EntryInfo]:
        for batch in self._scan_entries():
            self._check_usable()
            for info in self._infos(batch):
                if info is not None:
                    yield info

    def _scan_entries(self, count: int = 512) -> Iterator[list[Key]]:
        pattern = self._prefix + "e:*"
        plen = len(self._prefix) + 2
        cursor = 0
        while True:
            def scan(c: redis.Redis, cur: int = cursor) -> tuple[int, list[bytes]]:
                nxt, found = c.scan(cur, match=pattern, count=count)
                return int(nxt), [n if isinstance(n, bytes) else n.encode() for n in found]

            cursor, names = self._run(scan)
            batch = [Key(bytes.fromhex(n[plen:].decode())) for n in names]
            if batch:
                yield batch
            if int(cursor) == 0:
                return

    # -- writes ------------------------------------------------------------------------------
    def _reserve(self, k: Key, p: Key | None, nbytes: int, salt_tag: str) -> Reservation | None:
        self._writable("reserve")
        return self._reserve_remote(k, p, nbytes, salt_tag, "")

    def _reserve_remote(self, k: Key, p: Key | None, nbytes: int, salt_tag: str,
                        remote: str) -> _RedisReservation | None:
        """The reserve driver; ``remote`` is the sharded store's "<shard> <pin>" of a group-first
        page whose parent lives in another shard (empty otherwise)."""
        res = self._reserve_batch([(k, p, nbytes)], salt_tag, remote)[0]
        if isinstance(res, BaseException):
            raise res
        return res

    def _reserve_batch(self, items: Sequence[tuple[Key, Key | None, int]], salt_tag: str,
                       remote: str = "") -> list[_RedisReservation | HostKVError | None]:
        """Reserve many entries in one script call; per item a reservation, ``None`` (already
        stored) or the error for that item; each reservation gets a pooled buffer for ``write``."""
        rids = [self._next_id("r") for _ in items]
        allow = "0"  # a parent must be sealed (the script can also accept this client's in-flight one)
        args: list[Any] = [self._client_id, str(self._flight_ms), allow, str(len(items))]
        for (k, p, n), rid in zip(items, rids, strict=True):
            # '>' parent ' ' shard ' ' pin: the sharded store's group-first page, whose parent is in
            # another shard (``remote`` is "<shard> <pin>", see _scripts._XPIN)
            ph = "" if p is None else (f">{p.hex()} {remote}" if remote else p.hex())
            args += [k.hex(), ph, str(n), str(n), salt_tag, rid]
        statuses = self._eval("reserve", *args)
        out: list[_RedisReservation | HostKVError | None] = []
        for (k, p, n), rid, raw in zip(items, rids, statuses, strict=True):
            st = raw.decode()
            if st == "ok":
                res = _RedisReservation(self, k, p, n, salt_tag, rid, self._pool.take(n))
                with self._lock:
                    self._live_flights[rid] = res
                out.append(res)
            elif st == "dup":
                out.append(None)  # (the front counts the dedup)
            elif st == "busy":
                out.append(InFlightError(f"key {k.hex()[:16]} is being written by another writer", key=k))
            elif st == "noparent":
                assert p is not None
                out.append(UnknownKeyError(f"parent {p.hex()[:16]} is not stored"))
            elif st.startswith("cap"):
                _, budget, used, sealed = st.split()
                out.append(CapacityError(
                    f"{n} bytes do not fit: budget {budget}, used {used}, sealed {sealed} "
                    "(leased/in-flight entries and their ancestors cannot be evicted); nothing was evicted"))
            else:  # pragma: no cover - a script/client version mismatch
                out.append(StorageIOError(f"unexpected reserve status {st!r}"))
        if any(isinstance(r, _RedisReservation) for r in out):
            self._start_keeper()
        return out

    def _write(self, res: _RedisReservation, span: ByteSpan, view: memoryview) -> None:
        data = res.data
        if data is None:  # sealed or aborted by another thread since the front's check
            raise ReservationError(f"the reservation for {res.hex[:16]} is already {res.state}")
        data[span.offset : span.end] = view  # private to its writer until seal: no lock

    def _seal(self, res: _RedisReservation) -> None:
        # (the front claimed it: a racing seal, abort or write of another thread gets
        # ReservationError instead of shipping or freeing the buffer under this one)
        err = self._seal_batch([res])[0]
        if err is not None:
            if res.state == "sealed":  # published, but not confirmed by enough replicas
                self._tally("seals")
            raise err

    def _seal_batch(self, batch: Sequence[_RedisReservation]) -> list[HostKVError | None]:
        """Ship and publish many reservations in one pipeline: a SET of each staging key (page and
        trailer sent as one value, never concatenated), then one seal script that renames them into
        place in order (parents before children)."""
        px = str(self._flight_ms).encode()
        sha = self._link.sha("seal").encode()
        meta = self._meta.encode()

        def commands() -> Iterator[list[Piece]]:
            args: list[Part] = [b"EVALSHA", sha, b"1", meta, str(len(batch)).encode()]
            for res in batch:
                data = res.data
                assert data is not None
                digest = checksum(data)  # overlaps the previous page's transfer
                trailer = _TRAILER.pack(res.key, digest, res.nbytes, _MAGIC)
                yield _encode([b"SET", f"{self._prefix}w:{res.hex}:{res.rid}".encode(), (data, trailer), b"PX", px])
                args += [res.hex.encode(), res.rid.encode(), str(digest).encode()]
            yield _encode(args)
            if self._wait:
                yield self._wait_command()

        extra = 1 if self._wait else 0

        def go(client: redis.Redis) -> list[Any]:
            replies = _send_raw(client, commands, len(batch) + 1 + extra)
            if isinstance(replies[len(batch)], BaseException):
                raise replies[len(batch)]
            return replies

        results = self._run(go)
        statuses = results[len(batch)]
        unreplicated = self._unreplicated(results[-1]) if extra else None
        out: list[HostKVError | None] = []
        for i, (res, raw) in enumerate(zip(batch, statuses, strict=True)):
            st = raw.decode()
            with self._lock:
                self._live_flights.pop(res.rid, None)
            if res.buf is not None:
                self._pool.give(res.buf)
                res.buf = res.data = None
            if st == "ok":
                res._finish("sealed")  # (the front counts the seal)
                out.append(unreplicated)
                continue
            res._finish("aborted")
            if st == "noparent":
                out.append(UnknownKeyError(
                    f"parent {res.parent.hex()[:16] if res.parent else '?'} was dropped before the seal",
                    hint="save the chain again from its first missing page"))
            elif st == "nodata":
                err = results[i]
                if isinstance(err, redis.exceptions.OutOfMemoryError):
                    out.append(ServerOutOfMemoryError(f"redis refused the page: {err}"))
                else:
                    out.append(StorageIOError(f"the page's bytes did not reach the server ({err!r})"))
            else:
                out.append(ReservationLostError(
                    f"the reservation for {res.hex[:16]} expired or was lost (server restart?)"))
        return out

    def _abort(self, reservation: _RedisReservation) -> bool:
        with self._lock:
            if reservation.state != "open":
                return False  # a racing seal or abort finished it
            reservation._finish("aborted")
            self._live_flights.pop(reservation.rid, None)
        if reservation.buf is not None:
            self._pool.give(reservation.buf)
            reservation.buf = reservation.data = None
        try:
            self._eval("abort", "1", reservation.hex, reservation.rid)
        except HostKVError as exc:  # cleanup warns; the reservation expires server-side
            warnings.warn(f"abort of {reservation.hex[:16]} failed ({exc}); it expires after reservation_ttl",
                          stacklevel=4)
        return True

    def put_many(self, items: Sequence[tuple[bytes, bytes | None, object]], *,
                 salt_tag: str = "", _remote: Mapping[Key, str] | None = None) -> list[bool | HostKVError]:
        """Store many pages in two round trips per batch (at most 1,024 pages and 64 MiB).

        ``items`` are ``(key, parent, data)``; a parent may be an earlier item of the same call
        (a chain is stored root first).  Returns per item ``True`` (stored now), ``False``
        (already stored: dedup) or the error for that item (``InFlightError`` when another
        writer holds a reservation for it, ``CapacityError``, ``UnknownKeyError`` when its parent
        is not stored or failed ...); items after a failed parent fail too.  Raises only for
        whole-call failures (bad arguments, server unavailable).

        Per batch: one ``probe`` script says which pages are already stored or in flight (their
        bytes are not sent), then one pipeline carries the other pages' ``SET`` commands to private
        staging keys and the ``put`` script, which publishes them in order with everything
        ``reserve`` and ``seal`` check for a single page.  No reservation is taken: a page of a
        batch is either published whole by that script or not at all.  The staged bytes of one
        batch are on the server, not yet counted against the budget, for the time between their
        ``SET`` and the script (one pipeline); pages the script rejects are deleted by it.
        """
        args = self._put_many_args(items, salt_tag)
        self._check_usable()
        self._writable("put_many")
        with self._write_call():  # close() waits for it (and refuses new ones)
            return self._put_checked(args, salt_tag, _remote or {})

    def _put_checked(self, args: Sequence[tuple[Key, Key | None, memoryview]], salt_tag: str,
                     remote: Mapping[Key, str]) -> list[bool | HostKVError]:
        checked = [(k, p, view.nbytes) for k, p, view in args]
        views = [view for _, _, view in args]
        out: list[bool | HostKVError] = []
        failed: set[Key] = set()  # keys of this call not stored: their children fail unsent
        lo = 0
        while lo < len(checked):
            # A batch bounds how long one script holds the (single-threaded) server and how many
            # staged bytes sit there unaccounted; it always takes at least one page.
            hi, staged = lo + 1, checked[lo][2]
            while hi < len(checked) and hi - lo < _BATCH and staged + checked[hi][2] <= _BATCH_BYTES:
                staged += checked[hi][2]
                hi += 1
            out += self._put_chunk(checked[lo:hi], views[lo:hi], salt_tag, failed, remote)
            lo = hi
        return out

    def _put_chunk(self, checked: Sequence[tuple[Key, Key | None, int]], views: Sequence[memoryview],
                   salt_tag: str, failed: set[Key], remote: Mapping[Key, str]) -> list[bool | HostKVError]:
        hexes = [k.hex() for k, _, _ in checked]
        probe_cmd = _encode([b"EVALSHA", self._link.sha("probe").encode(), b"1", self._meta.encode()])
        probe_cmd[0] = b"*%d\r\n" % (4 + 2 * len(checked))
        for h, (k, p, _) in zip(hexes, checked, strict=True):  # (key, parent) pairs, one step each
            probe_cmd.append(b"$64\r\n%s\r\n$0\r\n\r\n" % h.encode() if p is None or k in remote
                             else b"$64\r\n%s\r\n$64\r\n%s\r\n" % (h.encode(), p.hex().encode()))
        # Checksums the put pipeline needs anyway are computed while the probe is on the wire
        # (up to _HASH_AHEAD bytes; the rest overlap the pages' transfer, in _publish).
        digests: dict[int, int] = {}

        def hash_ahead() -> None:
            hashed = 0
            for i, view in enumerate(views):
                if hashed >= _HASH_AHEAD:
                    return
                if i not in digests:
                    digests[i] = checksum(view)
                hashed += view.nbytes

        def go(client: redis.Redis) -> Any:
            reply = _send_raw(client, lambda: iter([probe_cmd]), 1, hash_ahead)[0]
            if isinstance(reply, BaseException):  # NOSCRIPT, HKV_NOSTORE ...: run() retries
                raise reply
            return reply

        probe = self._run(go)
        out: list[bool | HostKVError] = []
        ship: list[int] = []
        for i, ((k, p, _), st) in enumerate(zip(checked, probe, strict=True)):
            if st == 0x73:  # 's': already stored
                out.append(False)
            elif st == 0x66:  # 'f': another writer's reservation
                failed.add(k)
                out.append(InFlightError(f"key {hexes[i][:16]} is being written by another writer", key=k))
            elif p is not None and p in failed:
                failed.add(k)
                out.append(UnknownKeyError(f"parent {p.hex()[:16]} was not stored"))
            else:
                ship.append(i)
                out.append(True)
        dedup = len(checked) - len(ship) - sum(isinstance(x, HostKVError) for x in out)
        if ship:
            for i, err in zip(ship, self._publish(checked, views, hexes, ship, salt_tag, digests, remote),
                              strict=True):
                if err is None:
                    continue
                if err is False:
                    dedup += 1
                else:
                    failed.add(checked[i][0])
                out[i] = err
        self._tally("dedup", dedup)
        return out

    def _publish(self, checked: Sequence[tuple[Key, Key | None, int]], views: Sequence[memoryview],
                 hexes: Sequence[str], ship: Sequence[int], salt_tag: str,
                 digests: Mapping[int, int], remote: Mapping[Key, str]) -> list[HostKVError | bool | None]:
        """One pipeline: ``SET`` each shipped page to its staging key, with a ``put`` script after
        every group of pages; per shipped item ``None`` (stored), ``False`` (stored meanwhile by
        another writer) or its error.

        Groups (``_GROUP_PAGES`` pages, ``_GROUP_BYTES`` bytes) let the server run a group's
        script while the client still sends the next group's pages (large pages); on the busy
        2-core development VM, 16-page groups at 64 KiB cost more in per-script work than they
        saved, so a 64-page batch of small pages is one group.
        """
        groups: list[list[int]] = [[]]
        staged = 0
        for i in ship:
            n = checked[i][2]
            if groups[-1] and (len(groups[-1]) >= _GROUP_PAGES or staged + n > _GROUP_BYTES):
                groups.append([])
                staged = 0
            groups[-1].append(i)
            staged += n
        bases = [self._next_id("b") for _ in groups]  # generations: base.1, base.2 ... (put script)
        prefix = f"{self._prefix}w:".encode()
        px = str(self._flight_ms).encode()
        set_tail = b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(px), px)
        sha = self._link.sha("put").encode()
        meta = self._meta.encode()
        tag = salt_tag.encode()

        def commands() -> Iterator[list[Piece]]:
            for group, base in zip(groups, bases, strict=True):
                b = base.encode()
                head: list[Part] = [b"EVALSHA", sha, b"1", meta, tag, b, b"%d" % len(group)]
                # The script's four arguments per page, RESP-encoded in one step each (this runs
                # once per page: generic per-argument encoding costs more than the SET itself).
                items: list[bytes] = []
                for j, i in enumerate(group, 1):
                    k, p, n = checked[i]
                    view = views[i]
                    digest = digests.get(i)
                    if digest is None:
                        digest = checksum(view)  # overlaps the previous page's transfer
                    name = b"%s%s:%s.%d" % (prefix, hexes[i].encode(), b, j)
                    # SET name <page + trailer> PX ttl, encoded by hand: three pieces, the page
                    # uncopied.  The TTL frees the staging key if this client dies before the script.
                    yield [b"*5\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(name), name, n + TRAILER_NBYTES),
                           view, _TRAILER.pack(k, digest, n, _MAGIC) + set_tail]
                    ns, ds = b"%d" % n, b"%d" % digest
                    tok = remote.get(k)
                    ph = (b"" if p is None else b">%s %s" % (p.hex().encode(), tok.encode()) if tok
                          else p.hex().encode())
                    items.append(b"$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (
                        len(hexes[i]), hexes[i].encode(), len(ph), ph, len(ns), ns, len(ds), ds))
                cmd = _encode(head)
                cmd[0] = b"*%d\r\n" % (len(head) + 4 * len(group))
                yield [*cmd, *items]
            if self._wait:
                yield self._wait_command()

        extra = 1 if self._wait else 0

        def go(client: redis.Redis) -> list[Any]:
            replies = _send_raw(client, commands, len(ship) + len(groups) + extra)
            pos = 0
            for group in groups:  # a script's error (NOSCRIPT, HKV_NOSTORE ...) is retried by run()
                pos += len(group)
                if isinstance(replies[pos], BaseException):
                    raise replies[pos]
                pos += 1
            return replies

        results = self._run(go)
        unreplicated = self._unreplicated(results[-1]) if extra else None
        out: list[HostKVError | bool | None] = []
        stored = nbytes = 0
        pos = 0
        for group in groups:
            statuses = results[pos + len(group)]
            for j, (i, raw) in enumerate(zip(group, statuses, strict=True)):
                st = raw.decode()
                k, p, n = checked[i]
                if st == "ok":
                    stored += 1
                    nbytes += n
                    out.append(unreplicated)
                elif st == "dup":
                    out.append(False)
                elif st == "busy":
                    out.append(InFlightError(f"key {hexes[i][:16]} is being written by another writer", key=k))
                elif st == "noparent":
                    out.append(UnknownKeyError(f"parent {p.hex()[:16] if p else '?'} is not stored"))
                elif st == "nodata":
                    err = results[pos + j]
                    if isinstance(err, redis.exceptions.OutOfMemoryError):
                        out.append(ServerOutOfMemoryError(f"redis refused the page: {err}"))
                    else:
                        out.append(StorageIOError(f"the page's bytes did not reach the server ({err!r})"))
                elif st.startswith("cap"):
                    _, budget, used, sealed = st.split()
                    out.append(CapacityError(
                        f"{n} bytes do not fit: budget {budget}, used {used}, sealed {sealed} "
                        "(leased/in-flight entries and their ancestors cannot be evicted); nothing was evicted"))
                else:  # pragma: no cover - a script/client version mismatch
                    out.append(StorageIOError(f"unexpected put status {st!r}"))
            pos += len(group) + 1
        self._tally("seals", stored)
        self._tally("bytes_written", nbytes)
        return out

    # -- reads -------------------------------------------------------------------------------
    def _read(self, k: Key, out: object, span: ByteSpan | None) -> int | Corrupt | None:
        page = self._fetch([k], [None])[0]
        if not isinstance(page, memoryview):
            return page  # a miss, or Corrupt: the front drops the entry (_drop_damaged) and misses
        span = ByteSpan.whole(len(page)) if span is None else span.validate(len(page))
        dst = writable_buffer(out, span.nbytes)
        dst[:] = page[span.offset : span.end]
        return span.nbytes

    def _drop_damaged(self, k: Key, token: object) -> bool:
        if self._readonly:  # counted and a miss, but left for a writer (verify --repair) to drop
            return token != _MAYBE_ORPHAN or self._orphans([k.hex()]) > 0
        if token == _MAYBE_ORPHAN:
            # the GET missed: an orphan only if the metadata outlived the bytes, which the script
            # decides atomically (a seal may have landed since the GET)
            if not int(self._eval("drop_orphan", k.hex())):
                return False
            _log.warning("dropped %s (with its subtree): its bytes were missing on the server", k.hex()[:16])
            return True
        _log.warning("dropping %s and its subtree: its checksum/trailer does not match", k.hex()[:16])
        # the digest of the value this read got: the script drops the entry only if those bytes
        # are still the stored ones (another reader may have dropped it and a writer sealed the
        # key again since; that good page, with its subtree, stays)
        return int(self._eval("drop", k.hex(), "", "read", str(token))) > 0

    def read_bytes(self, key: bytes, span: ByteSpan | None = None) -> bytes | None:
        """The entry's bytes (or ``span`` of them), or ``None``: one round trip (the base class's
        ``entry`` + ``read`` would take two), with the front's rules (as in ``read``)."""
        k = self._key(key)
        if span is not None and not isinstance(span, ByteSpan):
            check_span(span, 0)  # raises: a wrong type is an error also for a key that misses
        self._check_usable()
        page = self._settle([k], self._fetch([k], [None]))[0]
        if page is None:
            return None
        span = check_span(span, len(page))
        self._tally_hit(span.nbytes)
        return bytes(page[span.offset : span.end])

    def read_many(self, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]:
        """Read whole entries into ``outs[i]`` in one round trip; ``False`` per miss.

        The bytes are received straight into ``outs[i]`` and verified there, so on a miss
        (including a checksum failure) ``outs[i]`` may hold garbage: use it only where ``True``.
        An ``outs[i]`` smaller than its entry raises ``InvalidArgumentError`` (the others are
        still filled).
        """
        ks, outs = self._read_many_args(keys, outs)
        dsts = [_whole(o) for o in outs]
        self._check_usable()
        got = self._fetch(ks, dsts)
        if (len(dsts) > 1 and any(isinstance(p, Corrupt) and p is not _ORPHAN_CHECK for p in got)
                and overlapping(dsts)):
            # (bytes received into an output buffer that aliases another overwrote that one's
            # before their check: the stored entries are not corrupt, and are not dropped)
            raise InvalidArgumentError("read_many's output buffers overlap: give each key a buffer of its own",
                                       hint="nothing was dropped; which outs[i] hold their entry is undefined")
        pages = self._settle(ks, got)
        short = None
        nbytes = 0
        for i, (page, dst) in enumerate(zip(pages, dsts, strict=True)):
            if page is None:
                continue
            if page.obj is not dst.obj:  # did not fit the caller's buffer
                short = (i, len(page), len(dst))
                pages[i] = None
                continue
            nbytes += len(page)
        hits = sum(p is not None for p in pages)
        self._tally("hits", hits)
        self._tally("bytes_read", nbytes)
        if short is not None:
            raise InvalidArgumentError(f"out[{short[0]}] holds {short[2]} bytes, the entry has {short[1]}")
        return [p is not None for p in pages]

    def read_many_bytes(self, keys: Sequence[bytes]) -> list[bytes | None]:
        """The verified bytes of each entry (``None`` per miss), in one round trip."""
        ks = self._keys(keys)
        self._check_usable()
        pages = self._settle(ks, self._fetch(ks, [None] * len(ks)))
        out = [None if p is None else bytes(p) for p in pages]
        self._tally("hits", sum(p is not None for p in pages))
        self._tally("bytes_read", sum(len(p) for p in pages if p is not None))
        return out

    def _fetch(self, keys: Sequence[Key], dests: Sequence[memoryview | None]) -> list[memoryview | Corrupt | None]:
        """Per key its verified page bytes (in ``dests[i]`` when it is large enough), or
        :class:`Corrupt` (the trailer or checksum is wrong: its token is the digest of the value
        read, :func:`_digest`; or the GET missed: then the entry may be an orphan, metadata
        without bytes — ``_drop_damaged`` decides), or ``None`` (a miss without an entry).
        Counts nothing and drops nothing (the front, or :meth:`_settle`).

        One pipeline GETs every page and refreshes their LRU ticks.
        """
        if not keys:
            return []
        hexes = [k.hex() for k in keys]
        names = [(self._prefix + "d:" + h).encode() for h in hexes]
        # The LRU refresh (and the store-wide read counters) ride in the same pipeline; a
        # read-only client writes nothing, so it sends a PING instead.
        touch: list[Part] = ([b"PING"] if self._readonly else
                             [b"EVALSHA", self._link.sha("touch").encode(), b"1", self._meta.encode(),
                              *(h.encode() for h in hexes)])
        # A stored value is at most the budget plus its trailer (a page that does not fit the budget is
        # refused), and may exceed Redis's 512 MiB default on a server configured to take it.
        max_bulk = max(MAX_BULK, self._budget + TRAILER_NBYTES)
        try:
            got = self._run(lambda c: _get_into(c, names, touch, dests, max_bulk))
        except StorageIOError as exc:
            # The budget this client saw may be stale (another client resized the store and
            # stored a larger page): read it again and retry once under the new limit.
            if not isinstance(exc.__cause__, ReplyTooLong):
                raise
            budget = self._run(lambda c: c.hget(self._meta, "budget"))
            if budget is None or max(MAX_BULK, int(budget) + TRAILER_NBYTES) <= max_bulk:
                raise
            self._budget = int(budget)
            max_bulk = self._budget + TRAILER_NBYTES
            got = self._run(lambda c: _get_into(c, names, touch, dests, max_bulk))
        pages: list[memoryview | Corrupt | None] = []
        for k, (page, trailer) in zip(keys, got, strict=True):
            if page is None or trailer is None:
                pages.append(_ORPHAN_CHECK)
                continue
            ok = False
            if len(trailer) == TRAILER_NBYTES:
                echo, digest, n, magic = _TRAILER.unpack(trailer)
                ok = (magic == _MAGIC and echo == k and n == len(page)
                      and (not self._verify_reads or checksum(page) == digest))
            pages.append(page if ok else Corrupt(_digest(page, trailer)))
        return pages

    def _orphans(self, hexes: Sequence[str]) -> int:
        """How many of ``hexes`` have metadata but no bytes (read-only: nothing is dropped)."""
        def go(c: redis.Redis) -> list[Any]:
            pipe = c.pipeline(transaction=False)
            for h in hexes:
                pipe.exists(self._prefix + "e:" + h)
                pipe.exists(self._prefix + "d:" + h)
            res: list[Any] = pipe.execute()
            return res

        flags = self._run(go)
        return sum(1 for i in range(0, len(flags), 2) if flags[i] and not flags[i + 1])

    def _settle(self, keys: Sequence[Key], got: Sequence[memoryview | Corrupt | None]) -> list[memoryview | None]:
        """The front's checksum rule for the batch reads: drop what :meth:`_fetch` found damaged
        (with subtrees; the possible orphans in one script call), count the checksum failures and
        the misses; per key the page or ``None``."""
        pages = [p if isinstance(p, memoryview) else None for p in got]
        orphans = [k.hex() for k, p in zip(keys, got, strict=True) if p is _ORPHAN_CHECK]
        failures = 0
        # Deepest first: a batch is usually a chain, root first, and dropping a damaged parent
        # first would take its damaged child along uncounted.
        for k, page in reversed(list(zip(keys, got, strict=True))):
            if isinstance(page, Corrupt) and page is not _ORPHAN_CHECK and self._drop_damaged(k, page.token):
                failures += 1
        if orphans:
            n = self._orphans(orphans) if self._readonly else int(self._eval("drop_orphan", *orphans))
            if n:
                failures += n
                _log.warning("dropped %d entries (with subtrees) whose bytes were missing on the server", n)
        self._tally("checksum_failures", failures)
        self._tally("misses", sum(p is None for p in pages))
        return pages

    # -- eviction ----------------------------------------------------------------------------
    def _evict(self, ks: list[Key] | None, nbytes: int) -> EvictReport:
        self._writable("evict")
        if ks is not None:
            if not ks:
                return EvictReport()
            reply = self._evict_keys_call([k.hex() for k in ks])
            if reply[0] == b"retained":
                raise RetainedError(f"entry {reply[1].decode()[:16]} is retained, or an ancestor of a retained "
                                    "entry; nothing was evicted")
            n, b, skipped = reply
        else:
            n, b, skipped = self._eval("evict_bytes", self._next_id("v"), str(self._memo_ms), str(nbytes))
        return EvictReport(int(n), int(b), int(skipped))

    def _evict_keys_call(self, hexes: Sequence[str]) -> Any:
        """The ``evict_keys`` script's reply for these subtrees (the sharded store's levels too),
        under a call id: a resend after a lost reply gets the first run's result back."""
        return self._eval("evict_keys", self._next_id("v"), str(self._memo_ms), *hexes)

    # -- anchors -----------------------------------------------------------------------------
    def _put_anchor(self, k: Key, name: str, blob: bytes) -> None:
        self._writable("put_anchor")
        if len(blob) > _ANCHOR_MAX:
            raise InvalidArgumentError(f"anchor of {len(blob)} bytes exceeds the {_ANCHOR_MAX}-byte limit")
        st = self._eval("put_anchor", k.hex(), name, blob).decode()
        if st == "noentry":
            raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored", hint="seal the page before its anchors")
        if st.startswith("cap"):
            _, budget, used, sealed = st.split()
            raise CapacityError(f"anchor of {len(blob)} bytes does not fit: budget {budget}, used {used}, "
                                f"sealed {sealed}; nothing was evicted")

    def _get_anchor(self, k: Key, name: str) -> bytes | None:
        value = self._run(lambda c: c.hget(self._prefix + "a:" + k.hex(), name))
        if isinstance(value, str):  # only with decode_responses, which this provider never sets
            return value.encode()
        return value

    def _list_anchors(self, k: Key) -> dict[str, int]:
        flat = self._eval("list_anchors", k.hex())
        return {flat[i].decode(): int(flat[i + 1]) for i in range(0, len(flat), 2)}

    def _deepest_anchor(self, ks: list[Key], name: str) -> int:
        if not ks:
            return 0
        return int(self._eval("deepest_anchor", name, *[k.hex() for k in ks]))

    # -- retained prefixes (SupportsRetain) ---------------------------------------------------
    def retain(self, keys: Sequence[bytes]) -> int:
        """Mark sealed entries retained, all or nothing (``UnknownKeyError`` for one not stored,
        ``CapacityError`` when the marked entries with their ancestors would exceed
        ``retain_share * budget``); returns how many were newly marked.  A retained entry and its
        ancestors are never evicted for room; an explicit ``evict`` of one raises
        ``RetainedError``.  The marks live on the server (every client sees them, they survive
        restarts with the store)."""
        ks = self._keys(keys)
        self._check_usable()
        self._writable("retain")
        if not ks:
            return 0
        newly, _ = self._retain_step("mark", [k.hex() for k in ks])
        return newly

    def unretain(self, keys: Sequence[bytes]) -> int:
        """Clear the marks of ``keys`` (not marked or not stored: ignored); how many were cleared."""
        ks = self._keys(keys)
        self._check_usable()
        self._writable("unretain")
        if not ks:
            return 0
        cleared, _ = self._retain_step("unmark", [k.hex() for k in ks])
        return cleared

    def _retain_step(self, mode: str, hexes: Sequence[str]) -> tuple[int, list[tuple[int, str]]]:
        """One ``retain`` script call: (count, the parents in other shards the refcount change goes
        on to, as (shard, hex)) — empty outside a sharded store."""
        reply = self._eval("retain", mode, repr(self._retain_share), *hexes)
        st = reply[0].decode()
        if st == "missing":
            raise UnknownKeyError(f"entry {reply[1].decode()[:16]} is not stored (sealed); nothing was retained",
                                  hint="retain sealed entries only")
        if st == "cap":
            held, adding, cap = (int(x) for x in reply[1:4])
            raise CapacityError(f"retaining {adding} more bytes would exceed the retained share: {held} of "
                                f"{cap} bytes are retained; nothing was marked",
                                hint="raise retain_share= (a fraction of the budget) or unretain other entries")
        remote = []
        for raw in reply[2:]:
            shard, h = raw.decode().split(" ", 1)
            remote.append((int(shard), h))
        return int(reply[1]), remote

    # -- leases ------------------------------------------------------------------------------
    def _lease(self, ks: list[Key]) -> Lease:
        self._writable("lease")  # a lease is a write on the server (it pins the entries)
        lid = self._next_id("l")
        bits = self._eval("lease", lid, str(self._lease_ms), *[k.hex() for k in ks]) if ks else b""
        present = [b == 0x31 for b in bits]
        lease = Lease(self, ks, present, token=lid if any(present) else None)
        if lease.token is not None:
            with self._lock:
                self._live_leases[lid] = lease
            self._start_keeper()
        return lease

    def _release_lease(self, lease: Lease) -> None:
        lid = lease.token
        if not isinstance(lid, str):
            return
        with self._lock:
            self._live_leases.pop(lid, None)
        if self._closed or os.getpid() != self._pid:
            return
        try:
            self._eval("release", lid)
        except HostKVError as exc:  # cleanup warns; the lease expires after lease_ttl
            warnings.warn(f"lease release failed ({exc}); it expires after lease_ttl", stacklevel=3)

    # -- verification ------------------------------------------------------------------------
    def verify(self, *, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Fetch every page and check its trailer and checksum; ``repair`` drops corrupt ones
        with their subtrees.  Reads run in pipelined batches; the store stays online."""
        check_flag(repair, "repair")
        check_progress(progress)
        self._check_usable()
        if repair:
            self._writable("verify(repair=True)")
        report = VerifyReport()
        total = int(self._run(lambda c: c.hget(self._meta, "entries")) or 0)
        for batch in self._scan_entries(256):
            hexes = [k.hex() for k in batch]

            def go(client: redis.Redis, hexes: list[str] = hexes) -> list[Any]:
                pipe = client.pipeline(transaction=False)
                for h in hexes:
                    pipe.get(self._prefix + "d:" + h)
                    pipe.hmget(self._prefix + "e:" + h, "k", "r")
                res: list[Any] = pipe.execute()
                return res

            res = self._run(go)
            for j, k in enumerate(batch):
                value, (ck, gen) = res[2 * j], res[2 * j + 1]
                if gen is None:
                    continue  # evicted between SCAN and GET
                report.checked += 1
                parsed = None if value is None else parse_trailer(value, k)
                good = (parsed is not None and ck is not None and int(ck) == parsed[1]
                        and checksum(memoryview(value)[: parsed[0]]) == parsed[1])
                if not good:
                    report.corrupt.append(k)
                    if repair:
                        # The GET and the HMGET are not atomic: the entry may have been dropped
                        # and sealed again in between, and the generation be the new one's.  The
                        # bytes read name the version that failed (as a read's drop does).
                        digest = "none" if value is None else _digest(memoryview(value), b"")
                        report.dropped += int(self._eval("drop", k.hex(), gen.decode(), "", digest))
            if progress is not None:
                progress(report.checked, max(total, report.checked))
        return report

    # -- the rest ----------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return self._budget

    @property
    def namespace(self) -> str:
        return self._namespace

    def stats(self) -> ProviderStats:
        self._check_usable()

        def go(client: redis.Redis) -> list[Any]:
            pipe = client.pipeline(transaction=False)
            pipe.hgetall(self._meta)
            pipe.zcard(self._prefix + "fz")
            res: list[Any] = pipe.execute()
            return res

        meta_raw, flights = self._run(go)
        meta = {k.decode(): v.decode() for k, v in meta_raw.items()}
        if not meta:  # emptied under us: the next mutating call re-creates it
            meta = {}

        def g(name: str) -> int:
            return int(meta.get(name, 0))

        if meta.get("budget"):
            self._budget = int(meta["budget"])
        counters = self._tallies()
        return ProviderStats(
            name=self.name,
            entries=g("entries"),
            used_bytes=g("used"),
            budget_bytes=self._budget,
            anchors=g("anchors"),
            leased=g("leased"),
            retained=g("retained"),
            retained_bytes=g("retained_bytes"),
            in_flight=int(flights),
            evictions=g("evictions"),
            evicted_bytes=g("evicted_bytes"),
            extra={
                # kept on the server (every client, since the store was created); the other
                # counters are this instance's own calls (hostkv stats tells them apart; the
                # store's own hits, reads and writes are in store_counters())
                "store_wide": ["evictions", "evicted_bytes", "retained", "retained_bytes", "store_seals",
                               "store_checksum_failures", "expired_leases", "expired_reservations"],
                "namespace": self._namespace,
                "store_seals": g("seals"),
                "store_checksum_failures": g("checksum_failures"),
                "expired_leases": g("expired_leases"),
                "expired_reservations": g("expired_reservations"),
                "store_resets": self._resets,
            },
            **counters,
        )

    def store_counters(self) -> dict[str, int]:
        """The store's counters, kept on the server by the scripts (``HINCRBY`` in the same
        atomic step as what they count), so they cover every client of the store since it was
        created (``SupportsStoreCounters``): ``hostkv stats`` from any machine shows a running
        engine's real figures.  ``bytes_read`` counts whole pages fetched (a span read fetches
        the page); read-only clients (``readonly=true``) count nothing, they write nothing."""
        self._check_usable()
        values = self._run(lambda c: c.hmget(self._meta, _STORE_COUNTERS))
        return {name: int(v or 0) for name, v in zip(_STORE_COUNTERS, values, strict=True)}

    def __enter__(self) -> RedisProvider:
        return self

    def describe(self) -> dict[str, Any]:
        return {**super().describe(), "url": _redact(self._url), "namespace": self._namespace,
                "readonly": self._readonly, "retain_share": self._retain_share,
                "cluster": self._link.cluster, "lease_ttl_s": self._lease_ms / 1000,
                "reservation_ttl_s": self._flight_ms / 1000, "verify_reads": self._verify_reads,
                "checksum": CHECKSUM_ALGORITHM, "format_version": FORMAT_VERSION}

    def close(self) -> None:
        self._check_not_forked()  # a forked child must not touch the parent's sockets
        if self._closed:
            return
        # New write-path calls get ClosedError from here on; those under way finish first, so a
        # seal is not aborted under its feet and a reservation they make is registered (below).
        self._quiesce()
        self._stop.set()
        with self._lock:
            lids = list(self._live_leases.keys())
            flights = list(self._live_flights.values())
            self._live_leases.clear()
            self._live_flights.clear()
        # (after the snapshot: a reservation dropped by now was queued by its __del__)
        pairs = [(r.hex, r.rid) for r in flights if r.state == "open"] + self._take_dropped()
        try:
            if lids:
                self._eval("release", *lids)
            if pairs:
                for r in flights:
                    if r.state == "open":
                        r._finish("aborted")
                self._eval("abort", str(len(pairs)), *(x for pair in pairs for x in pair))
        except HostKVError as exc:
            warnings.warn(f"releasing leases/reservations at close failed ({exc}); they expire", stacklevel=2)
        self._closed = True
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(timeout=5)
        self._link.close()


class RedissProvider(RedisProvider):
    """``rediss://`` — the same store over TLS (redis-py's ``ssl_*`` URL options apply)."""

    name: ClassVar[str] = "rediss"
    _url_scheme: ClassVar[str] = "rediss"


class RedisClusterProvider(RedisProvider):
    """``redis+cluster://host:port`` — a store on a Redis Cluster (one slot per namespace)."""

    name: ClassVar[str] = "redis+cluster"
    _url_scheme: ClassVar[str] = "redis"
    _cluster_mode: ClassVar[bool] = True


class RedissClusterProvider(RedisProvider):
    """``rediss+cluster://host:port`` — a Redis Cluster over TLS."""

    name: ClassVar[str] = "rediss+cluster"
    _url_scheme: ClassVar[str] = "rediss"
    _cluster_mode: ClassVar[bool] = True
