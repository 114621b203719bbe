"""One store spread over every master of a Redis Cluster: ``shards`` single-slot stores, one
placement rule.

Redis Cluster is atomic per hash slot only, and every invariant of the contract needs several
keys in one atomic step.  So the store is cut into ``shards`` *shards*, each a complete
single-slot store (its own hash tag, metadata, budget share, LRU set, scripts: exactly
:class:`~hostkv_redis.RedisProvider` on one slot), and pages are placed so that what must be
atomic together lives together:

* **Placement groups.**  A chain is cut into groups of ``group`` consecutive pages (depths
  ``0..g-1``, ``g..2g-1``, ...).  A group lives in the shard picked by its first page's key
  (``key[:8] mod shards``: the key is already a keyed cryptographic hash, so this is uniform).
  Inside a group, parent links are local and the shard's scripts keep the tree, the leaf-only
  LRU, the budget guard, leases and in-flight reservations exactly as before.  A group's first
  page is a *local root* of its shard; its parent lives in another shard (or the same one by
  chance).  A shared 32-page system prompt is 32/g groups on as many shards, and each of 1,000
  continuations after it starts new groups on shards of its own, so the load spreads.
* **Shard tags** are chosen so that shard ``i``'s slot falls in the ``i``-th of ``shards`` equal
  slot ranges: a cluster whose masters own contiguous, equal slot ranges (what ``redis-cli
  --cluster create`` and ``CLUSTER ADDSLOTSRANGE`` splits give) gets ``shards / masters`` shards
  each, and a reshard moves whole shards.
* **Cross-shard links are pins** (no script can span slots): a group's first page in shard B
  pins its parent in shard A (``xpin``, a member of ``x:<parent>`` counted in ``xc``) *before* it
  is published, which fails if the parent is gone (the write then fails typed); a pinned page is
  no leaf in A (never LRU-evicted, skipped by ``evict(keys)``).  Removing the child queues the
  release in B's outbox in the same script; clients drain outboxes into idempotent releases in
  A (the renewal thread each second; ``evict``/``abort``/a failed ``seal`` at once).  A crash
  in between leaves A's page pinned longer, the safe side; :meth:`reconcile_pins` cleans up.
  ``evict(keys)`` follows the pins into the other shards and removes deepest level first.  A
  page dropped *by force* (a checksum failure, its bytes gone) takes its child groups along:
  the drop script queues their pins in its drop outbox in the same step, and the client that
  dropped removes those subtrees by force at once (``xdrop``, level by level); one it left (it
  died) is taken by the renewal threads after a grace of a few seconds.
  Every chain lookup (``longest_prefix``, ``lease``, ``deepest_anchor``) still checks *every*
  key of the chain, shard by shard, so a hit never includes a page whose ancestor is gone even
  where no pin could help (a page deleted behind the library's back).
* **Budget per shard**: ``budget / shards`` each, enforced atomically by the shard's scripts, so
  the store never exceeds ``budget`` in total without a cross-slot counter (there is none).
  Eviction takes leaves only (store-wide), in LRU order within a shard, not across shards; a
  shard full of pages held only by pins evicts the pinning child groups elsewhere
  (least recently used first).

Locating a key whose depth the client does not know (``present`` of loose keys, the parent of a
``put_many`` that starts mid-chain) costs one ``locate`` script per shard, pipelined per master;
every key placed by a chain call is remembered client-side (bounded) so the usual flow (lookup,
lease, read, save the rest) never needs it.  Only placements the server confirmed are remembered
(a page this client published, a located key, a lookup's keys as far as their parent links say
the caller's list is one chain): a wrong depth would misplace every later write under that key.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import itertools
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, ClassVar, TypeVar

import numpy as np
import redis
from hostkv_providers.errors import (
    CapacityError,
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
    ByteSpan,
    Corrupt,
    EntryInfo,
    EvictReport,
    Key,
    Lease,
    Progress,
    Provider,
    ProviderStats,
    Reservation,
    VerifyReport,
    check_flag,
    check_progress,
    check_span,
)
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.crc import key_slot
from redis.retry import Retry

from ._errors import ServerUnavailableError
from ._provider import RedisProvider, _check_options, _check_readonly
from ._wire import _redact

__all__ = ["DEFAULT_GROUP", "DEFAULT_SHARDS", "RedisShardedProvider", "shard_tags"]

T = TypeVar("T")
R = TypeVar("R")

DEFAULT_SHARDS = 48
DEFAULT_GROUP = 4
_SLOTS = 16384
_MEMO_MAX = 1 << 20  # keys whose placement this client remembers (cleared when full)
_NS_MAX = 52  # a shard's namespace adds ".<i>.<j>" and must stay within RedisProvider's 64
# A forced drop's cascade into other shards is carried out by the client that dropped, at once
# (it counts what went: verify's report); the renewal threads take one left this long (its
# client died in between).
_CASCADE_GRACE_MS = 5000
_NAMESPACE = re.compile(rf"[A-Za-z0-9_.-]{{1,{_NS_MAX}}}")  # RedisProvider's pattern, shorter


def shard_tags(namespace: str, shards: int) -> list[str]:
    """The hash tags (shard namespaces) of a sharded store: shard ``i``'s slot lies in the
    ``i``-th of ``shards`` equal slot ranges, so contiguous equal slot splits spread them evenly.
    Deterministic: every client computes the same list."""
    out = []
    for i in range(shards):
        lo, hi = i * _SLOTS // shards, (i + 1) * _SLOTS // shards
        j = 0
        while True:
            tag = f"{namespace}.{i}.{j}"
            if lo <= key_slot(tag.encode()) < hi:
                out.append(tag)
                break
            j += 1
    return out


class RedisShardedProvider(Provider):
    """A store spread over every master of a Redis Cluster (see the module docstring).

    Parameters are those of :class:`~hostkv_redis.RedisProvider` plus:

    shards:
        Number of single-slot shards (fixed for the store's life; recorded and checked).  More
        shards spread better over masters and after resharding; each costs one script call per
        chain lookup that touches it and holds ``budget / shards``.
    group:
        Pages per placement group (fixed, recorded).  Smaller groups spread a shared prefix's
        continuations more evenly and touch more shards per lookup.
    """

    name: ClassVar[str] = "redis+cluster"
    persistent: ClassVar[bool] = True
    multiprocess: ClassVar[bool] = True
    _tag_max = 128  # as RedisProvider's

    @classmethod
    def from_url(cls, location: str, options: Mapping[str, str]) -> Provider:
        """``redis+cluster://host:port?shards=N&group=G&...`` (see :meth:`RedisProvider.from_url`)."""
        from ._provider import RedisClusterProvider

        opts = dict(options)
        opts.setdefault("shards", str(DEFAULT_SHARDS))
        return RedisClusterProvider.from_url(location, opts)

    def __init__(
        self,
        url: str,
        *,
        budget_bytes: int | None = None,
        namespace: str = "default",
        shards: int = DEFAULT_SHARDS,
        group: int = DEFAULT_GROUP,
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
    ) -> None:
        super().__init__()
        self._readonly = _check_readonly(readonly, budget_bytes, resize)
        if type(shards) is not int or not 1 <= shards <= 4096:
            raise InvalidArgumentError(f"shards must be an int in [1, 4096], got {shards!r}")
        if type(group) is not int or not 1 <= group <= 1024:
            raise InvalidArgumentError(f"group must be an int in [1, 1024], got {group!r}")
        if not isinstance(namespace, str) or not _NAMESPACE.fullmatch(namespace):
            raise InvalidArgumentError(f"a sharded store's namespace must match [A-Za-z0-9_.-]{{1,{_NS_MAX}}}, "
                                       f"got {namespace!r}")
        if budget_bytes is not None and (type(budget_bytes) is not int or budget_bytes < shards):
            raise InvalidArgumentError(f"budget must be an int >= shards ({shards}), got {budget_bytes!r}")
        _check_options(url, lease_ttl=lease_ttl, reservation_ttl=reservation_ttl, timeout=timeout,
                       retries=retries, wait_replicas=wait_replicas, wait_timeout=wait_timeout,
                       retain_share=retain_share)
        self._namespace = namespace
        self._url = url
        self._nshards = shards
        self._group = group
        self._tags = shard_tags(namespace, shards)
        try:
            self._cluster = RedisCluster.from_url(
                url, socket_timeout=timeout, socket_connect_timeout=timeout,
                retry=Retry(ExponentialBackoff(cap=0.5, base=0.02), retries))
        except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
            # (RedisClusterException is no RedisError: "Redis Cluster cannot be connected" ...)
            raise ServerUnavailableError(f"cannot connect to {_redact(url)}: {exc}") from exc
        except ValueError as exc:
            raise InvalidArgumentError(f"bad redis URL {_redact(url)}: {exc}") from exc
        self._shards: list[RedisProvider] = []
        self._memo: dict[bytes, int] = {}  # key -> shard * group + depth % group
        self._memo_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="hostkv-redis-shard")
        try:
            self._check_layout()
            for i, tag in enumerate(self._tags):
                # budget / shards each, the remainder spread over the first shards: the sum is exact
                per = None if budget_bytes is None else budget_bytes // shards + (i < budget_bytes % shards)
                self._shards.append(RedisProvider(
                    url, budget_bytes=per, namespace=tag, cluster=True, lease_ttl=lease_ttl,
                    reservation_ttl=reservation_ttl, timeout=timeout, retries=retries,
                    verify_reads=verify_reads, resize=resize, keepalive=False,
                    wait_replicas=wait_replicas, wait_timeout=wait_timeout, readonly=readonly,
                    retain_share=retain_share,
                    _shared_cluster=self._cluster))
        except BaseException:
            for s in self._shards:
                s.close()
            self._pool.shutdown(wait=False)
            self._cluster.close()
            raise
        self._sha = {name: self._shards[0]._link.sha(name)
                     for name in ("present", "locate", "deepest_anchor", "xpin", "xunpin", "xout", "xack",
                                  "xsub", "xlist", "xheld", "xhot", "retained_in", "xdrop", "links",
                                  "lru_head", "probe")}
        self._nonce = os.urandom(6).hex()
        self._pins = itertools.count()
        self._pin_grace_ms = int(2 * reservation_ttl * 1000)
        # One renewal thread for all shards (each shard's own would be `shards` threads).
        self._stop = threading.Event()
        self._keeper: threading.Thread | None = None
        if keepalive and not readonly:  # (a read-only client holds nothing and drains no outbox)
            self._keeper = threading.Thread(target=self._keep, args=(min(lease_ttl, reservation_ttl) / 3,),
                                            name="hostkv-redis-renew", daemon=True)
            self._keeper.start()

    def _keep(self, every: float) -> None:
        # Renewals every `every`; the outboxes of cross-shard pin releases once a second (a
        # parent whose child group went stays pinned until then: the safe side).
        last = time.monotonic()
        while not self._stop.wait(min(every, 1.0)):
            with contextlib.suppress(HostKVError):
                self._drain(min_age_ms=_CASCADE_GRACE_MS)
            if time.monotonic() - last < every:
                continue
            last = time.monotonic()
            for s in self._shards:
                if self._stop.is_set():
                    return
                try:
                    s.renew()  # no round trip for a shard with nothing to renew
                except HostKVError:
                    continue  # unreachable now (or closed); expiry takes over if it lasts

    def _check_layout(self) -> None:
        """Record (shards, group) on first open; refuse another layout (placement depends on it)."""
        layout = f"shards={self._nshards} group={self._group}"
        name = f"hkv:{{{self._namespace}}}:layout"
        for attempt in range(8):
            try:
                node = self._cluster.get_redis_connection(self._cluster.get_node_from_key(name))  # type: ignore[no-untyped-call]
                if not self._readonly:  # a read-only open records nothing
                    node.set(name, layout, nx=True)
                found = node.get(name)
                single = node.exists(f"hkv:{{{self._namespace}}}:m")
                break
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError) as exc:
                if attempt == 7:
                    raise ServerUnavailableError(f"redis cluster {_redact(self._url)}: {exc}") from exc
                self._cluster.nodes_manager.initialize()
                threading.Event().wait(min(0.5, 0.02 * 2 ** attempt))
        recorded = found.decode() if isinstance(found, bytes) else found
        if recorded is None and self._readonly:
            raise StoreNotFoundError(f"no sharded store {self._namespace!r} on {_redact(self._url)}",
                                     hint="check the namespace= option (a read-only open never creates a store)")
        if recorded is not None and recorded != layout:
            raise IncompatibleStoreError(f"store {self._namespace!r} was created with {recorded}, not {layout}",
                                         hint="open it with the recorded shards= and group=")
        if single:
            raise IncompatibleStoreError(f"namespace {self._namespace!r} holds a single-slot store",
                                         hint="open it with shards=1, or use another namespace")

    # -- placement ---------------------------------------------------------------------------
    def _head_shard(self, keys: np.ndarray) -> np.ndarray:
        heads: np.ndarray = keys[:, :8].copy().view("<u8")[:, 0] % np.uint64(self._nshards)
        return heads

    def _chain_shards(self, keys: Sequence[Key], first: int | None = None) -> np.ndarray:
        """Shard of each key of a chain (array ops, no per-page objects).  ``first`` is the first
        key's placement code (``None``: it starts a group, as a root does)."""
        n = len(keys)
        g = self._group
        pos0 = 0 if first is None else first % g
        arr = np.frombuffer(b"".join(keys), dtype=np.uint8).reshape(n, 32)
        start = (g - pos0) % g  # index of the first group boundary after keys[0]
        out = np.empty(n, dtype=np.int64)
        lead = n if start == 0 and pos0 else min(start, n)
        if pos0:
            assert first is not None
            out[:lead] = first // g
        else:
            lead = 0
        if lead < n:
            heads = self._head_shard(arr[lead::g]).astype(np.int64)
            out[lead:] = np.repeat(heads, g)[: n - lead]
        return out

    def _remember(self, keys: Sequence[Key], codes: Sequence[int]) -> None:
        with self._memo_lock:
            if len(self._memo) + len(keys) > _MEMO_MAX:
                self._memo.clear()
            self._memo.update(zip(keys, codes, strict=True))

    def _chain_codes(self, keys: Sequence[Key], shards: np.ndarray, first: int) -> list[int]:
        g = self._group
        codes: list[int] = (shards * g + (np.arange(len(keys)) + first % g) % g).tolist()
        return codes

    def _locate(self, keys: Sequence[Key]) -> list[int]:
        """Placement code of each key (``shard * group + depth % group``), ``-1`` when no shard
        stores it.  Remembered keys cost nothing; the rest one ``locate`` script per shard,
        pipelined per master."""
        out = [-1] * len(keys)
        unknown: list[int] = []
        with self._memo_lock:
            for i, k in enumerate(keys):
                c = self._memo.get(k)
                if c is None:
                    unknown.append(i)
                else:
                    out[i] = c
        if unknown:
            hexes = [keys[i].hex() for i in unknown]
            g = str(self._group)
            replies = self._fan([(s, "locate", [g, *hexes]) for s in range(self._nshards)])
            found_k, found_c = [], []
            for s, rep in enumerate(replies):
                for j, d in enumerate(rep):
                    if int(d) >= 0 and out[unknown[j]] < 0:
                        out[unknown[j]] = s * self._group + int(d)
                        found_k.append(keys[unknown[j]])
                        found_c.append(out[unknown[j]])
            if found_k:
                self._remember(found_k, found_c)
        return out

    # -- fan-out -----------------------------------------------------------------------------
    def _node_of(self, shard: int) -> Any:
        return self._cluster.get_node_from_key(self._shards[shard]._meta)  # type: ignore[no-untyped-call]

    def _by_node(self, shards: Sequence[int]) -> dict[str, list[int]]:
        groups: dict[str, list[int]] = {}
        for s in shards:
            try:
                name = str(self._node_of(s).name)
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError,
                    AttributeError):  # topology in flux: the shard's own retries sort it out
                name = f"?{s}"
            groups.setdefault(name, []).append(s)
        return groups

    def _fan(self, calls: Sequence[tuple[int, str, Sequence[str]]]) -> list[Any]:
        """Run read-only scripts ``(shard, name, args)``: one pipeline per master, masters in
        parallel (one round trip per master for all the shards it holds).  A call whose reply is
        an error (a moved slot, a failover, NOSCRIPT on a new master) is retried alone through
        its shard's provider, which refreshes the topology and maps errors to typed ones."""
        out: list[Any] = [None] * len(calls)
        by: dict[str, list[int]] = {}
        index = self._by_node([s for s, _, _ in calls])
        where = {s: n for n, ss in index.items() for s in ss}
        for i, (s, _, _) in enumerate(calls):
            by.setdefault(where[s], []).append(i)

        def node_run(idx: list[int]) -> None:
            failed = idx
            try:
                client = self._cluster.get_redis_connection(self._node_of(calls[idx[0]][0]))
                pipe = client.pipeline(transaction=False)
                for i in idx:
                    s, name, args = calls[i]
                    pipe.evalsha(self._sha[name], 1, self._shards[s]._meta, *args)
                replies = pipe.execute(raise_on_error=False)
                failed = []
                for i, rep in zip(idx, replies, strict=True):
                    if isinstance(rep, BaseException):
                        failed.append(i)
                    else:
                        out[i] = rep
            except (redis.exceptions.RedisError, redis.exceptions.RedisClusterException, OSError, AttributeError):
                pass  # the whole pipeline failed: every call takes the slow path
            for i in failed:
                s, name, args = calls[i]
                out[i] = self._shards[s]._eval(name, *args)

        self._parallel([lambda idx=idx: node_run(idx) for idx in by.values()])  # type: ignore[misc]
        return out

    def _parallel(self, fns: Sequence[Callable[[], None]]) -> None:
        """Run ``fns`` concurrently (one per master); re-raise the first failure."""
        if len(fns) == 1:
            fns[0]()
            return
        futures = [self._pool.submit(f) for f in fns]
        first: BaseException | None = None
        for f in futures:
            try:
                f.result()
            except BaseException as exc:
                first = first or exc
        if first is not None:
            raise first

    def _each(self, work: Mapping[int, T], fn: Callable[[RedisProvider, T], R]) -> dict[int, R]:
        """``fn(shard, work[s])`` for every shard in ``work``: the shards of one master in turn,
        masters in parallel."""
        results: dict[int, R] = {}
        def node_run(ss: list[int]) -> None:
            for s in ss:
                results[s] = fn(self._shards[s], work[s])
        self._parallel([lambda ss=ss: node_run(ss) for ss in self._by_node(list(work)).values()])  # type: ignore[misc]
        return results

    # -- lookups -----------------------------------------------------------------------------
    # (the public verbs are the front's, in Provider; these are the drivers it calls, over the
    # shards' drivers, so every call is validated and counted once, here)
    def _longest_prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of ``keys`` (a chain that starts at a root) are stored: every key
        is checked, one ``present`` script per shard touched, one round trip per master."""
        ks = self._keys(keys)
        if not ks:
            return 0
        bits, _ = self._chain_present(ks)
        return int(np.argmin(bits)) if not bits.all() else len(ks)

    def _chain_present(self, ks: Sequence[Key]) -> tuple[np.ndarray, int | None]:
        """Presence of each key of a chain, and the first key's placement code.

        A chain usually starts at a root, or at a key this client placed before: then one
        ``links`` script per shard touched, plus a ``locate`` of the first key in the same
        pipelines, which confirms that it starts a group.  A chain that starts inside a group
        (a suffix of a longer chain) is re-placed from the first key's located position.

        The found keys' placement codes are remembered only as far as the server confirms them
        (``links``: a group's first page is a local root there, any other page's parent is the key
        before it): a caller's list need not be one chain (two stored roots that share a shard
        are both found, as in a single-slot store), and a depth computed from it would misplace
        every later write of this client under the second one."""
        first = self._memo.get(ks[0])
        for _ in range(2):
            shards = self._chain_shards(ks, first)
            order = np.argsort(shards, kind="stable")
            cuts = np.flatnonzero(np.diff(shards[order])) + 1
            groups = np.split(order, cuts)
            # (a shard's keys in chain order: a page inside a group follows its parent there)
            calls = [(int(shards[grp[0]]), "links", [ks[i].hex() for i in grp.tolist()]) for grp in groups]
            if first is None:
                calls.append((int(shards[0]), "locate", [str(self._group), ks[0].hex()]))
            replies = self._fan(calls)
            if first is None:
                d = int(replies.pop()[0])
                if d != 0:  # not a group's first page where a root's would be: find where it is
                    first = self._locate([ks[0]])[0]
                    if first < 0:
                        return np.zeros(len(ks), dtype=bool), None
                    continue
                first = int(shards[0]) * self._group
            links = np.zeros(len(ks), dtype=np.uint8)
            for grp, rep in zip(groups, replies, strict=True):
                links[grp] = np.frombuffer(rep, dtype=np.uint8)
            bits = links != 0x30  # '0': not stored
            n = int(np.argmin(bits)) if not bits.all() else len(ks)
            if n:
                codes = self._chain_codes(ks[:n], shards[:n], first)
                # confirmed: the first key (memo or locate), then while each group's first page
                # is a local root ('2') and each other page hangs under the key before it ('1')
                want = np.where(np.asarray(codes) % self._group == 0, 0x32, 0x31)
                ok = links[:n] == want
                ok[0] = True
                m = int(np.argmin(ok)) if not ok.all() else n
                self._remember(ks[:m], codes[:m])
            return bits, first
        raise AssertionError("unreachable")  # pragma: no cover

    def _present(self, keys: Sequence[bytes]) -> list[bool]:
        ks = self._keys(keys)
        if not ks:
            return []
        codes = self._locate(ks)
        work: dict[int, list[int]] = {}
        for i, c in enumerate(codes):
            if c >= 0:
                work.setdefault(c // self._group, []).append(i)
        out = [False] * len(ks)
        replies = self._fan([(s, "present", [ks[i].hex() for i in idx]) for s, idx in work.items()])
        for idx, rep in zip(work.values(), replies, strict=True):
            for i, b in zip(idx, rep, strict=True):
                out[i] = b == 0x31
        return out

    def _shard_of(self, key: Key) -> RedisProvider | None:
        c = self._locate([key])[0]
        return None if c < 0 else self._shards[c // self._group]

    def _entry(self, k: Key) -> EntryInfo | None:
        shard = self._shard_of(k)
        if shard is None:
            return None
        return shard._entry(k)

    def _in_flight(self, k: Key) -> bool:
        c = self._memo.get(k)
        if c is not None:
            return self._shards[c // self._group]._in_flight(k)
        return any(self._each(dict.fromkeys(range(self._nshards), k), lambda s, kk: s._in_flight(kk)).values())

    # -- placement of new pages --------------------------------------------------------------
    def _place(self, items: Sequence[tuple[Key, Key | None]], fixed: Mapping[Key, int] | None = None) -> list[int]:
        """Placement code of each new ``(key, parent)``; a parent may be an earlier item.
        ``-1`` when the parent is neither an earlier item nor stored.  ``fixed``: keys already
        stored (at that code), whatever parent the caller names for them."""
        g = self._group
        known: dict[Key, int] = dict(fixed or {})
        loose = [p for k, p in items if p is not None]
        if loose:
            with self._memo_lock:
                missing = [p for p in loose if p not in self._memo]
            in_call = {k for k, _ in items}
            missing = [p for p in dict.fromkeys(missing) if p not in in_call]
            if missing:
                for q, c in zip(missing, self._locate(missing), strict=True):
                    known[q] = c
        out: list[int] = []
        for k, p in items:
            if fixed and k in fixed:
                c = fixed[k]
            elif p is None:
                c = int(self._head_shard(np.frombuffer(k, dtype=np.uint8).reshape(1, 32))[0]) * g
            else:
                pc = known.get(p)
                if pc is None:
                    pc = self._memo.get(p, -1)
                if pc < 0:
                    c = -1
                elif (pc % g) + 1 == g:  # a new group starts: placed by its own first key
                    c = int(self._head_shard(np.frombuffer(k, dtype=np.uint8).reshape(1, 32))[0]) * g
                else:
                    c = pc + 1
            known[k] = c
            out.append(c)
        return out

    def _stored_elsewhere(self, items: Sequence[tuple[Key, int]]) -> dict[Key, int | HostKVError]:
        """Of new ``(key, placement code)`` pairs, those that this client saw stored (or
        reserved) at another code: their code there if still stored, or ``InFlightError`` if a
        reservation holds them there (one ``probe`` per shard, in parallel).

        A key is stored once, whatever parent a caller names for it (the single-slot store
        checks the key, not the link: a dedup).  Here a parent decides the shard, so the same
        key under another parent would land in another shard, a second copy that the shard's own
        scripts cannot see.  Only the placement memo is searched: a key can be anywhere, and
        asking every shard about every new page would multiply a write's server work by
        ``shards`` (see docs/providers/redis.md, "Not done")."""
        memo: list[tuple[Key, int]] = []
        with self._memo_lock:
            for k, c in items:
                m = self._memo.get(k)
                if m is not None and m != c:
                    memo.append((k, m))
        if not memo:
            return {}
        by: dict[int, list[tuple[Key, int]]] = {}
        for k, m in memo:
            by.setdefault(m // self._group, []).append((k, m))
        order = list(by.items())
        replies = self._fan([(s, "probe", [x for k, _ in kms for x in (k.hex(), "")]) for s, kms in order])
        out: dict[Key, int | HostKVError] = {}
        for (_, kms), rep in zip(order, replies, strict=True):
            for (k, m), st in zip(kms, rep, strict=True):
                if st == 0x73:  # 's': stored there
                    out[k] = m
                elif st == 0x66:  # 'f': a live reservation there
                    out[k] = InFlightError(f"key {k.hex()[:16]} is being written by another writer", key=k)
        return out

    # -- writes ------------------------------------------------------------------------------
    def _reserve(self, k: Key, p: Key | None, n: int, salt_tag: str) -> Reservation | None:
        self._shards[0]._writable("reserve")
        c = self._place([(k, p)])[0]
        if p is not None and c < 0:
            raise UnknownKeyError(f"parent {p.hex()[:16]} is not stored")
        there = self._stored_elsewhere([(k, c)]).get(k)
        if isinstance(there, HostKVError):
            raise there
        if there is not None:
            return None  # already stored (under another parent): a dedup, as in a single-slot store
        g = self._group
        s = c // g
        if p is None or c % g:
            res: Reservation | None = self._roomy(
                s, n, lambda: self._shards[s]._reserve_remote(k, p, n, salt_tag, ""))
        else:
            # A group's first page: its parent is in another shard, whose scripts cannot see
            # this one.  Pin the parent there first (that fails if it is gone), then reserve;
            # the pin is released if the reservation is not taken (or later, through this
            # shard's outbox, when it is aborted, expires or the page is removed).
            pc = self._memo.get(p)
            if pc is None:  # placed moments ago, but the bounded memo was cleared since
                pc = self._locate([p])[0]
            if pc < 0:
                raise UnknownKeyError(f"parent {p.hex()[:16]} is not stored")
            ps = pc // g
            token = self._pin_token(s, k)
            if self._fan([(ps, "xpin", ["1", p.hex(), token])])[0] != b"1":
                raise UnknownKeyError(f"parent {p.hex()[:16]} is not stored")
            try:
                res = self._roomy(s, n, lambda: self._shards[s]._reserve_remote(k, p, n, salt_tag, f"{ps} {token}"))
            except BaseException:
                self._unpin([(ps, p, token)])
                raise
            if res is None:
                self._unpin([(ps, p, token)])
        if res is not None:
            self._remember([k], [c])
        return res

    # -- cross-shard pins (see _scripts._XPIN) -----------------------------------------------
    def _roomy(self, shard: int, cost: int, fn: Callable[[], R]) -> R:
        """``fn()``; on ``CapacityError``, :meth:`_make_room_in` the shard and try once more,
        unless ``cost`` bytes could not fit there even then (:meth:`_could_fit`)."""
        try:
            return fn()
        except CapacityError:
            if not self._could_fit(self._shards[shard], cost) or not self._make_room_in([shard]):
                raise
        return fn()

    @staticmethod
    def _could_fit(sp: RedisProvider, cost: int) -> bool:
        """Whether ``cost`` more bytes could fit shard ``sp`` once everything evictable there is
        gone: not past its budget less its in-flight and retained bytes (neither can be evicted).
        :meth:`_make_room_in` evicts child groups in *other* shards; for a write that cannot fit
        anyway that would only lose unrelated pages, and the ``CapacityError`` it then raises
        promises that nothing was evicted.  (Leased pages are not counted: it may still fail.)"""
        raw = sp._run(lambda c: c.hmget(sp._meta, "budget", "used", "sealed", "retained_bytes"))
        budget, used, sealed, retained = (int(x or 0) for x in raw)
        return cost <= budget - (used - sealed) - retained

    def _make_room_in(self, shards: Sequence[int], pinned: int = 2) -> int:
        """Evict the child groups (in other shards) of the ``pinned`` least recently used pinned
        pages in each of ``shards``, so that those pages become leaves there again.

        A shard's budget is its own: it can be full of pages that nothing holds *there* but the
        pins of child groups elsewhere (a group's tail and the group above it), while the rest of
        the store has leaves.  Its scripts cannot evict across shards, so the client does, from
        the bottom of those subtrees up (never a punctured chain).  Not exact LRU order: the
        subtrees are chosen by their pinned page's LRU position, not by their own.
        Returns the number of queued pin releases applied plus entries evicted (0: nothing
        changed, a retry would fail the same way)."""
        # First the releases still queued in every outbox: child groups that their own shard's
        # scripts already evicted (the budget guard's LRU step) hold their parents here until a
        # client applies the release, which the renewal thread does only once a second.  Such a
        # parent is a leaf again once released, with no eviction elsewhere; the caller must retry
        # then even if the step below evicts nothing (its pinned pages may be exactly those).
        released = self._drain()
        roots: dict[int, list[str]] = {}
        for rep in self._fan([(s, "xhot", [str(pinned)]) for s in dict.fromkeys(shards)]):
            for raw in rep:
                cs, ch, _ = raw.decode().split(":", 2)
                roots.setdefault(int(cs), []).append(ch)
        return released + (self._evict_subtrees(roots).entries if roots else 0)

    def _pin_token(self, shard: int, key: Key) -> str:
        """A pin of the group-first page ``key`` (in ``shard``) on its parent: unique per write
        attempt, so a failed attempt releases only its own pin, never another writer's."""
        return f"{shard}:{key.hex()}:{self._nonce}.{next(self._pins):x}"

    def _unpin(self, pins: Sequence[tuple[int, Key | str, str]]) -> None:
        """Release pins ``(parent shard, parent, pin)`` (idempotent), one call per shard."""
        by: dict[int, list[str]] = {}
        for ps, p, token in pins:
            by.setdefault(ps, []).extend([p if isinstance(p, str) else p.hex(), token])
        if by:
            self._fan([(ps, "xunpin", args) for ps, args in by.items()])

    def _drain(self, shards: Sequence[int] | None = None, *, min_age_ms: int = 0) -> int:
        """:meth:`_outboxes`; how many releases and cascaded drops were applied (0: none)."""
        return sum(self._outboxes(shards, min_age_ms=min_age_ms))

    def _outboxes(self, shards: Sequence[int] | None = None, *, min_age_ms: int = 0) -> tuple[int, int]:
        """Apply what the scripts of ``shards`` (all: ``None``) queued for other shards, then drop
        it from their outboxes; returns (pin releases applied, entries dropped by cascades).

        * Releases (``xo``): the pins of removed group-first pages, released in the parents'
          shards.
        * Cascades (``xd``, entries at least ``min_age_ms`` old): a page dropped by force (a
          checksum failure, or its bytes gone) takes its subtree along, which includes the child
          groups pinned on it in other shards; each goes there by force too (``xdrop``), and
          so on down, so a child is never readable while its parent is gone.

        Idempotent (both steps check the pin they act on): a crash in between repeats them."""
        todo = dict.fromkeys(range(self._nshards) if shards is None else shards, min_age_ms)
        released = dropped = 0
        while todo:
            order = list(todo.items())
            replies = self._fan([(s, "xout", ["256", str(age)]) for s, age in order])
            pins: list[tuple[int, str, str]] = []
            drops: dict[int, list[str]] = {}
            acks: dict[int, list[bytes]] = {}
            for (s, _), rep in zip(order, replies, strict=True):
                for raw in rep:
                    text = raw.decode()
                    if text.startswith("d "):  # "d <ms> <pin>", the pin "<child shard>:<child>:<nonce>"
                        pin = text.split(" ", 2)[2]
                        cs, ch, _ = pin.split(":", 2)
                        drops.setdefault(int(cs), []).extend([ch, pin])
                    else:
                        ps, ph, token = text.split(" ", 2)
                        pins.append((int(ps), ph, token))
                    acks.setdefault(s, []).append(raw)
            if not acks:
                break
            if drops:
                order_d = list(drops.items())
                dropped += sum(int(n) for n in self._fan([(cs, "xdrop", hs) for cs, hs in order_d]))
            self._unpin(pins)
            self._fan([(s, "xack", [x.decode() for x in xs]) for s, xs in acks.items()])
            released += len(pins)
            # again: a full outbox, and the shards a cascade reached (their own child groups and
            # the releases of the pins on the dropped pages, at once whatever their age)
            nxt = {s: age for (s, age), rep in zip(order, replies, strict=True) if len(rep) >= 256}
            nxt.update(dict.fromkeys(drops, 0))
            todo = nxt
        return released, dropped

    def _res_shard(self, reservation: Reservation) -> RedisProvider:
        owner = reservation.provider if isinstance(reservation, Reservation) else None
        if not any(owner is s for s in self._shards):
            raise ReservationError("not a reservation of this provider")
        assert isinstance(owner, RedisProvider)
        return owner

    # write, seal and abort stay public verbs here: a reservation belongs to its shard's provider
    # (whose front validates and counts it), this one only routes it there.
    def write(self, reservation: Reservation, offset: int, data: object) -> None:
        self._check_usable()
        self._res_shard(reservation).write(reservation, offset, data)

    def seal(self, reservation: Reservation) -> None:
        self._check_usable()
        shard = self._res_shard(reservation)
        try:
            shard.seal(reservation)
        except HostKVError:
            # a failed seal cancels the reservation; a group-first page's pin is in the outbox
            with contextlib.suppress(HostKVError):
                self._drain([self._shards.index(shard)])
            raise

    def abort(self, reservation: Reservation) -> None:
        shard = self._res_shard(reservation)
        self._check_usable()
        shard.abort(reservation)
        if not self._closed:
            with contextlib.suppress(HostKVError):
                self._drain([self._shards.index(shard)])

    def put_many(self, items: Sequence[tuple[bytes, bytes | None, object]], *,
                 salt_tag: str = "") -> list[bool | HostKVError]:
        """:meth:`RedisProvider.put_many` over the shards (see :meth:`_put_many`); pages that did
        not fit their shard are tried once more after :meth:`_make_room_in` that shard.

        Every item (its data too) is checked before anything is pinned or sent, as the
        single-slot store does: a shard that refused a bad item after the others had published
        theirs would leave a refused call partly stored."""
        args = self._put_many_args(items, salt_tag, tag_max=self._tag_max)
        self._check_usable()
        self._shards[0]._writable("put_many")
        with self._write_call():
            return self._put_many_retry(args, salt_tag)

    def _put_many_retry(self, args: Sequence[tuple[Key, Key | None, memoryview]],
                        salt_tag: str) -> list[bool | HostKVError]:
        out, codes = self._put_many(args, salt_tag)
        # make room only in a shard where some page that did not fit could fit then (_could_fit)
        smallest: dict[int, int] = {}
        for i, r in enumerate(out):
            if isinstance(r, CapacityError):
                s = codes[i] // self._group
                smallest[s] = min(smallest.get(s, args[i][2].nbytes), args[i][2].nbytes)
        room = [s for s, ok in self._each(smallest, self._could_fit).items() if ok]
        if not room or not self._make_room_in(room):
            return out
        again = [i for i, r in enumerate(out) if r is not True and r is not False]
        second, _ = self._put_many([args[i] for i in again], salt_tag)
        for i, r in zip(again, second, strict=True):
            out[i] = r
        return out

    def _put_many(self, args: Sequence[tuple[Key, Key | None, memoryview]],
                  salt_tag: str) -> tuple[list[bool | HostKVError], list[int]]:
        """:meth:`RedisProvider.put_many` over the shards (``args`` checked by the caller): each
        shard's pages in one call (its probe and put pipeline), masters in parallel.  Per item
        ``True``/``False``/its error; a page whose parent failed fails too (a group head
        published meanwhile in another shard is evicted again, best effort: otherwise an
        unreachable orphan that ages out)."""
        self._check_usable()
        checked: list[tuple[Key, Key | None]] = [(k, p) for k, p, _ in args]
        codes = self._place(checked)
        out: list[bool | HostKVError | None] = [None] * len(args)
        # A key this client saw stored under another placement is a dedup (or in flight), not
        # a second copy; the pages under it in this call are placed from where it really is.
        there = self._stored_elsewhere([(k, c) for (k, _), c in zip(checked, codes, strict=True) if c >= 0])
        if there:
            codes = self._place(checked, {k: c for k, c in there.items() if isinstance(c, int)})
        g = self._group
        # A page that starts a group pins its parent in the parent's shard before it is
        # published (one xpin call per shard, a round trip per master): strictly for a parent
        # outside this call (it must be stored: else the page fails), ahead of its creation for a
        # parent that is an earlier item (published in parallel; its put counts the pin).
        in_call = {k: c for (k, _), c in zip(checked, codes, strict=True) if k not in there}
        pins: dict[int, tuple[int, Key, str]] = {}  # item -> (parent shard, parent, pin)
        calls: dict[tuple[int, str], list[int]] = {}
        for i, ((k, p), c) in enumerate(zip(checked, codes, strict=True)):
            if k in there:
                continue
            if p is not None and c >= 0 and c % g == 0:
                pc = in_call.get(p, self._memo.get(p, -1))
                if pc < 0:
                    continue  # placed from a located parent that the memo lost: treated as gone
                pins[i] = (pc // g, p, self._pin_token(c // g, k))
                calls.setdefault((pc // g, "0" if p in in_call else "1"), []).append(i)
        gone: set[int] = set()
        if calls:
            order = list(calls.items())
            replies = self._fan([(ps, "xpin", [strict, *(x for i in idx for x in (pins[i][1].hex(), pins[i][2]))])
                                 for (ps, strict), idx in order])
            for (_, idx), rep in zip(order, replies, strict=True):
                gone.update(i for i, b in zip(idx, rep, strict=True) if b != 0x31)
        bad: set[Key] = set()
        work: dict[int, list[int]] = {}
        for i, c in enumerate(codes):
            k, p = checked[i]
            found = there.get(k)
            if isinstance(found, HostKVError):
                bad.add(k)
                out[i] = found
            elif found is not None:
                out[i] = False  # stored already (under another parent): a dedup
            elif c < 0 or i in gone or (p is not None and c % g == 0 and i not in pins) or (p is not None and p in bad):
                bad.add(k)
                out[i] = UnknownKeyError(f"parent {p.hex()[:16] if p else '?'} is not stored")
            else:
                work.setdefault(c // g, []).append(i)
        dedup = sum(1 for k, _ in checked if isinstance(there.get(k), int))
        if dedup:
            self._tally("dedup", dedup)  # (the shards count their own)

        def put(shard: RedisProvider, idx: list[int]) -> None:
            sub = [args[i] for i in idx]
            # a group's first page: its parent is recorded (xp, xs) with its pin (xm), not linked
            remote = {checked[i][0]: f"{pins[i][0]} {pins[i][2]}" for i in idx if i in pins}
            res = shard.put_many(sub, salt_tag=salt_tag, _remote=remote)
            # recorded here, at once: if another shard's call raises, these pages are published
            # all the same and must keep their pins (below)
            for i, got in zip(idx, res, strict=True):
                out[i] = got

        try:
            self._each(work, put)
        finally:
            # pins of pages not published now (already stored by another writer, failed) are
            # released; a published page keeps its pin, and so does one whose shard's call
            # raised (it may be published: a pin that no page holds is released by
            # reconcile_pins, while an unpinned child group could outlive its parent)
            with contextlib.suppress(HostKVError):
                self._unpin([pins[i] for i in pins if out[i] is not None and out[i] is not True])
        # A page whose parent (an earlier item) failed did not get a valid chain above it.
        failed: set[Key] = set()
        orphans: dict[int, list[Key]] = {}
        for i, (k, p) in enumerate(checked):
            r = out[i]
            if isinstance(r, HostKVError):
                failed.add(k)
            elif p is not None and p in failed:
                failed.add(k)
                if r is True and codes[i] % g == 0:
                    orphans.setdefault(codes[i] // g, []).append(k)
                out[i] = UnknownKeyError(f"parent {p.hex()[:16]} was not stored")
        if orphans:
            # best effort: an unreachable orphan is never a hit; its pin goes with it (outbox)
            with contextlib.suppress(HostKVError):
                self._evict_subtrees(orphans)
        # Remembered: the pages published here, at the code they were published at.  Not a
        # dedup: a page found stored in its shard may sit at another depth there (stored under
        # another parent), and a wrong code would misplace every later write under it.
        stored = [(checked[i][0], codes[i]) for i in range(len(args)) if out[i] is True]
        if stored:
            self._remember([k for k, _ in stored], [c for _, c in stored])
        return [r if r is not None else StorageIOError("internal: no result") for r in out], codes

    # -- reads -------------------------------------------------------------------------------
    def _group_keys(self, ks: Sequence[Key]) -> tuple[dict[int, list[int]], list[int]]:
        codes = self._locate(ks)
        work: dict[int, list[int]] = {}
        missing = []
        for i, c in enumerate(codes):
            if c < 0:
                missing.append(i)
            else:
                work.setdefault(c // self._group, []).append(i)
        return work, missing

    def _read(self, k: Key, out: object, span: ByteSpan | None) -> int | Corrupt | None:
        c = self._locate([k])[0]
        if c < 0:
            return None
        got = self._shards[c // self._group]._read(k, out, span)
        return Corrupt((c // self._group, got.token)) if isinstance(got, Corrupt) else got

    def _drop_damaged(self, k: Key, token: object) -> bool:
        assert isinstance(token, tuple)  # (shard, the shard's token), from _read
        dropped = self._shards[token[0]]._drop_damaged(k, token[1])
        if dropped:
            self._cascade([token[0]])
        return dropped

    def _cascade(self, shards: Sequence[int]) -> int:
        """After a forced drop in ``shards`` (a read's checksum failure, verify's repair): its
        subtree in the other shards goes now (:meth:`_outboxes`), not a second later; entries
        removed there.  A failure leaves it queued for the renewal threads (never lost)."""
        with contextlib.suppress(HostKVError):
            return self._outboxes(shards)[1]
        return 0

    def _reading(self, shard: RedisProvider, fn: Callable[[RedisProvider], T]) -> T:
        """``fn(shard)``, a read through the shard's own front (which drops what fails its
        checksum, with the subtree in that shard), then the drop's cascade into other shards."""
        before = shard._tallies()["checksum_failures"]
        try:
            return fn(shard)
        finally:
            # (this thread's drop raised the count; another thread's only costs a drain)
            if shard._tallies()["checksum_failures"] != before:
                self._cascade([self._shards.index(shard)])

    def read_bytes(self, key: bytes, span: ByteSpan | None = None) -> bytes | None:
        """The shard's one-round-trip ``read_bytes`` (its front's rules and counters)."""
        k = self._key(key)
        if span is not None and not isinstance(span, ByteSpan):
            check_span(span, 0)  # raises: a wrong type is an error also for a key that misses
        self._check_usable()
        c = self._locate([k])[0]
        if c < 0:
            self._tally("misses")  # (as the shard's front would have)
            return None
        return self._reading(self._shards[c // self._group], lambda shard: shard.read_bytes(k, span))

    def read_many(self, keys: Sequence[bytes], outs: Sequence[object]) -> list[bool]:
        """:meth:`RedisProvider.read_many` over the shards, masters in parallel."""
        ks, outs = self._read_many_args(keys, outs)
        self._check_usable()
        work, missing = self._group_keys(ks)
        self._tally("misses", len(missing))
        out = [False] * len(ks)
        res = self._each(work, lambda s, idx: self._reading(
            s, lambda shard: shard.read_many([ks[i] for i in idx], [outs[i] for i in idx])))
        for s, idx in work.items():
            for i, r in zip(idx, res[s], strict=True):
                out[i] = r
        return out

    def read_many_bytes(self, keys: Sequence[bytes]) -> list[bytes | None]:
        ks = self._keys(keys)
        self._check_usable()
        work, missing = self._group_keys(ks)
        self._tally("misses", len(missing))
        out: list[bytes | None] = [None] * len(ks)
        res = self._each(work, lambda s, idx: self._reading(
            s, lambda shard: shard.read_many_bytes([ks[i] for i in idx])))
        for s, idx in work.items():
            for i, r in zip(idx, res[s], strict=True):
                out[i] = r
        return out

    # -- leases ------------------------------------------------------------------------------
    def _lease(self, ks: list[Key]) -> Lease:
        """Pin ``keys`` in every shard that holds some (one lease script per shard, atomic per
        shard); ``present``/``prefix_len`` say what was pinned, so a chain's usable prefix stops
        at the first page that was gone when its shard was asked."""
        self._shards[0]._writable("lease")
        work, _ = self._group_keys(ks)
        subs: dict[int, Lease] = {}

        def take(s: RedisProvider, idx: list[int]) -> None:
            subs[s_index[id(s)]] = s._lease([ks[i] for i in idx])

        s_index = {id(sp): i for i, sp in enumerate(self._shards)}
        try:
            self._each(work, take)
        except BaseException:
            for lz in subs.values():  # a shard failed: give back what the others pinned
                lz.release()
            raise
        present = [False] * len(ks)
        for s, idx in work.items():
            for i, b in zip(idx, subs[s].present, strict=True):
                present[i] = b
        held = [lz for lz in subs.values() if lz.token is not None]
        for lz in subs.values():
            if lz.token is None:
                lz.release()
        return Lease(self, ks, present, token=held or None)

    def _release_lease(self, lease: Lease) -> None:
        subs = lease.token
        if isinstance(subs, list):
            for lz in subs:
                if isinstance(lz, Lease):
                    lz.release()

    # -- eviction ----------------------------------------------------------------------------
    def _evict(self, ks: list[Key] | None, nbytes: int) -> EvictReport:
        """``keys``: each key's subtree, across shards (:meth:`_evict_subtrees`).  ``nbytes``:
        LRU leaves (store-wide leaves: pinned pages are none) until ``nbytes`` are freed or
        nothing is evictable, as a single-slot store peels them.

        In rounds: the shards that have a leaf, oldest leaf first (their least recently used
        leaves' last use), each get a share of what is still missing in proportion to its used
        bytes, until the shares cover it (so a small ``nbytes`` goes to the oldest leaf's shard
        alone, not a page from every shard); then the evicted group-first pages' pins are
        released, which makes their parents in other shards leaves for the next round."""
        self._shards[0]._writable("evict")
        report = EvictReport()
        if ks is not None:
            work, _ = self._group_keys(ks)
            return self._evict_subtrees({s: [ks[i] for i in idx] for s, idx in work.items()}, explicit=True)
        self._drain()  # released pins first, so that their parents count as leaves
        while report.nbytes < nbytes:
            heads = self._fan([(s, "lru_head", []) for s in range(self._nshards)])
            cand = sorted((int(lu), s, int(used)) for s, (lu, used) in enumerate(heads) if int(lu) >= 0)
            if not cand:
                if not self._drain():  # (a concurrent removal's releases may have made leaves)
                    break
                continue
            need = nbytes - report.nbytes
            total = sum(u for _, _, u in cand) or 1
            share: dict[int, int] = {}
            given = 0
            for _, s, u in cand:
                n = min(need - given, max(1, -(-need * u // total)))
                share[s] = n
                given += n
                if given >= need:
                    break
            parts = self._each(share, lambda sp, n: sp._evict(None, n))
            for r in parts.values():
                report = EvictReport(report.entries + r.entries, report.nbytes + r.nbytes,
                                     report.skipped + r.skipped)
            released = self._drain(list(parts))  # the evicted group-first pages' pins
            if not any(r.entries for r in parts.values()) and not released:
                break  # (leaves seen a moment ago were taken by another client meanwhile)
        return report

    def _evict_subtrees(self, roots: Mapping[int, Sequence[Key | str]], *, explicit: bool = False) -> EvictReport:
        """Remove the subtrees of ``roots`` (per shard) across shards: the child groups pinned on
        them are found level by level (one ``xsub`` per shard per level, a round trip per master)
        and removed deepest level first; after each level its pins are released, so that the
        level above is a leaf again when its turn comes.  Held pages (leased, in flight, or with a
        child group pinned meanwhile by a concurrent writer) are skipped with their ancestors."""
        levels: list[dict[int, list[str]]] = []
        cur = {s: [k if isinstance(k, str) else k.hex() for k in ks] for s, ks in roots.items() if ks}
        seen: set[tuple[int, str]] = set()
        while cur:
            levels.append(cur)
            order = list(cur.items())
            nxt: dict[int, list[str]] = {}
            for rep in self._fan([(s, "xsub", hs) for s, hs in order]):
                for raw in rep:
                    cs, ch, _ = raw.decode().split(":", 2)
                    if (int(cs), ch) not in seen:
                        seen.add((int(cs), ch))
                        nxt.setdefault(int(cs), []).append(ch)
            cur = nxt
        if explicit:
            # a retained entry (or an ancestor of one) anywhere below: nothing goes (every level
            # is checked before any is evicted)
            calls = [(s, "retained_in", hs) for lvl in levels for s, hs in lvl.items()]
            for got in self._fan(calls):
                if got:
                    raise RetainedError(f"entry {got.decode()[:16]} is retained, or an ancestor of a "
                                        "retained entry; nothing was evicted")
        report = EvictReport()
        for lvl in reversed(levels):
            parts = self._each(lvl, lambda s, hs: s._evict_keys_call(hs))
            for hs, reply in ((lvl[s], r) for s, r in parts.items()):
                if reply[0] == b"retained":  # (for room, or retained meanwhile): held, skipped
                    if explicit:
                        raise RetainedError(f"entry {reply[1].decode()[:16]} is retained, or an ancestor "
                                            "of a retained entry")
                    report = EvictReport(report.entries, report.nbytes, report.skipped + len(hs))
                    continue
                n, b, skipped = reply
                report = EvictReport(report.entries + int(n), report.nbytes + int(b), report.skipped + int(skipped))
            self._drain(list(lvl))
        return report

    # -- retained prefixes (SupportsRetain) ---------------------------------------------------
    def retain(self, keys: Sequence[bytes]) -> int:
        """:meth:`RedisProvider.retain` over the shards: each shard marks its keys (its cap is
        ``retain_share`` of its own budget share), then the refcount goes on to the ancestors in
        other shards (counted there, no cap check: they are already held by their child groups'
        pins).  All or nothing: a missing key fails before anything is marked; a shard over its
        share undoes the marks made in the others."""
        ks = list(dict.fromkeys(self._keys(keys)))
        self._check_usable()
        self._shards[0]._writable("retain")
        if not ks:
            return 0
        work, missing = self._group_keys(ks)
        if missing:
            raise UnknownKeyError(f"entry {ks[missing[0]].hex()[:16]} is not stored (sealed); nothing was retained",
                                  hint="retain sealed entries only")
        infos = {k: self._shards[s]._infos([ks[i] for i in idx]) for s, idx in work.items() for k in [s]}
        todo: dict[int, list[str]] = {}
        for s, idx in work.items():
            for i, info in zip(idx, infos[s], strict=True):
                if info is None:
                    raise UnknownKeyError(f"entry {ks[i].hex()[:16]} is not stored (sealed); nothing was retained")
                if not info.retained:
                    todo.setdefault(s, []).append(ks[i].hex())
        done: dict[int, list[str]] = {}
        try:
            for s, hexes in todo.items():
                _, more = self._shards[s]._retain_step("mark", hexes)
                done[s] = hexes
                # The count goes on to the ancestors in other shards now, shard by shard: the
                # undo below takes back with "down" exactly what each mark added there with "up"
                # (deferred to the end, a failure undid counts that were never added: -1), and
                # a concurrent retain never sees a count here that its ancestors elsewhere lack.
                self._propagate("up", more)
        except HostKVError:
            for s, hexes in done.items():  # undo: exactly the marks this call made
                self._propagate("down", self._shards[s]._retain_step("unmark", hexes)[1])
            raise
        return sum(len(h) for h in todo.values())

    def unretain(self, keys: Sequence[bytes]) -> int:
        ks = list(dict.fromkeys(self._keys(keys)))
        self._check_usable()
        self._shards[0]._writable("unretain")
        if not ks:
            return 0
        work, _ = self._group_keys(ks)
        cleared = 0
        for s, idx in work.items():
            n, more = self._shards[s]._retain_step("unmark", [ks[i].hex() for i in idx])
            cleared += n
            self._propagate("down", more)
        return cleared

    def _propagate(self, mode: str, todo: list[tuple[int, str]]) -> None:
        """Carry a retain refcount change ("up"/"down") to parents in other shards, level by
        level (one call per shard per level)."""
        while todo:
            by: dict[int, list[str]] = {}
            for s, h in todo:
                by.setdefault(s, []).append(h)
            todo = []
            for s, hexes in by.items():
                todo += self._shards[s]._retain_step(mode, hexes)[1]

    # -- anchors -----------------------------------------------------------------------------
    def _stored_shard(self, k: Key) -> RedisProvider:
        shard = self._shard_of(k)
        if shard is None:
            raise UnknownKeyError(f"entry {k.hex()[:16]} is not stored", hint="seal the page before its anchors")
        return shard

    def _put_anchor(self, k: Key, name: str, blob: bytes) -> None:
        self._shards[0]._writable("put_anchor")
        self._stored_shard(k)._put_anchor(k, name, blob)

    def _get_anchor(self, k: Key, name: str) -> bytes | None:
        shard = self._shard_of(k)
        return None if shard is None else shard._get_anchor(k, name)

    def _list_anchors(self, k: Key) -> dict[str, int]:
        shard = self._shard_of(k)
        return {} if shard is None else shard._list_anchors(k)

    def _deepest_anchor(self, ks: list[Key], name: str) -> int:
        if not ks:
            return 0
        bits, first = self._chain_present(ks)
        n = int(np.argmin(bits)) if not bits.all() else len(ks)
        if not n:
            return 0
        shards = self._chain_shards(ks[:n], first)
        work: dict[int, list[int]] = {}
        for i, s in enumerate(shards.tolist()):
            work.setdefault(s, []).append(i)
        replies = self._fan([(s, "deepest_anchor", [name, *(ks[i].hex() for i in idx)]) for s, idx in work.items()])
        best = 0
        for idx, rep in zip(work.values(), replies, strict=True):
            if int(rep):
                best = max(best, idx[int(rep) - 1] + 1)
        return best

    # -- the rest ----------------------------------------------------------------------------
    @property
    def budget_bytes(self) -> int:
        return sum(s.budget_bytes for s in self._shards)

    @property
    def namespace(self) -> str:
        return self._namespace

    @property
    def shard_providers(self) -> tuple[RedisProvider, ...]:
        """The single-slot store of each shard (for inspection and the independent checks)."""
        return tuple(self._shards)

    def shard_of(self, key: bytes) -> int | None:
        """The shard that stores ``key`` (``None`` when none does)."""
        c = self._locate([self._key(key)])[0]
        return None if c < 0 else c // self._group

    def load_by_master(self) -> dict[str, int]:
        """Used bytes per master (``host:port``), summed over the shards it holds now."""
        used = self._each(dict.fromkeys(range(self._nshards), 0), lambda s, _: s.stats().used_bytes)
        out: dict[str, int] = {}
        for s, u in used.items():
            name = str(self._node_of(s).name)
            out[name] = out.get(name, 0) + u
        return out

    def stats(self) -> ProviderStats:
        self._check_usable()
        parts = list(self._each(dict.fromkeys(range(self._nshards), 0), lambda s, _: s.stats()).values())
        total: dict[str, int] = {}
        own = self._tallies()  # the verbs counted by this front; the shards' fronts counted the rest
        for f in ("entries", "used_bytes", "budget_bytes", "anchors", "leased", "in_flight", "retained",
                  "retained_bytes", "evictions",
                  "evicted_bytes", "hits", "misses", "seals", "aborts", "dedup", "checksum_failures",
                  "bytes_written", "bytes_read"):
            total[f] = sum(int(getattr(p, f)) for p in parts) + own.get(f, 0)
        return ProviderStats(name=self.name, extra={"namespace": self._namespace, "shards": self._nshards,
                                                    "group": self._group,
                                                    "store_wide": ["evictions", "evicted_bytes", "retained",
                                                                   "retained_bytes"]}, **total)

    def store_counters(self) -> dict[str, int]:
        """Every shard's :meth:`RedisProvider.store_counters`, summed (the store-wide counters
        of all clients, kept on the servers)."""
        self._check_usable()
        total: dict[str, int] = {}
        for part in self._each(dict.fromkeys(range(self._nshards), 0), lambda s, _: s.store_counters()).values():
            for name, n in part.items():
                total[name] = total.get(name, 0) + n
        return total

    def iter_entries(self) -> Iterator[EntryInfo]:
        self._check_usable()
        return (info for s in self._shards for info in s.iter_entries())

    def verify(self, *, repair: bool = False, progress: Progress | None = None) -> VerifyReport:
        """Every shard's :meth:`RedisProvider.verify`; with ``repair``, also the cross-shard pins
        reconciled (:meth:`reconcile_pins`)."""
        check_flag(repair, "repair")
        check_progress(progress)
        self._check_usable()
        report = VerifyReport()
        for i, s in enumerate(self._shards):
            r = s.verify(repair=repair)
            report.checked += r.checked
            report.corrupt.extend(r.corrupt)
            report.dropped += r.dropped
            if r.dropped:  # the dropped subtrees' child groups in other shards go too
                report.dropped += self._cascade([i])
            if progress is not None:
                progress(report.checked, report.checked)
        if repair:
            self.reconcile_pins()
        return report

    def reconcile_pins(self) -> int:
        """Release pins that no page holds any more; returns how many.

        First every outbox is drained (releases queued by removed group-first pages).  Then each
        pin (``x:`` hashes, one SCAN per shard) is checked against its child's shard: a pin that
        neither the sealed child nor its live reservation holds, and that is older than twice
        ``reservation_ttl`` (a younger one may belong to a write still under way), is released.
        Leftovers come from a client that died between pinning and publishing, or between a
        removal and the drain of its outbox (both leave a parent pinned: never a punctured chain)."""
        self._check_usable()
        self._shards[0]._writable("reconcile_pins")
        self._drain()
        lists = self._fan([(s, "xlist", []) for s in range(self._nshards)])
        cand: list[tuple[int, str, str]] = []
        for ps, rep in enumerate(lists):
            now = int(rep[0])
            for j in range(1, len(rep), 3):
                ph, token, ms = rep[j].decode(), rep[j + 1].decode(), int(rep[j + 2])
                if now - ms > self._pin_grace_ms:
                    cand.append((ps, ph, token))
        by: dict[int, list[int]] = {}
        for i, (_, _, token) in enumerate(cand):
            by.setdefault(int(token.split(":", 1)[0]), []).append(i)
        order = list(by.items())
        held = self._fan([(cs, "xheld", [x for i in idx for x in (cand[i][2].split(":")[1], cand[i][2])])
                          for cs, idx in order])
        dead = [cand[i] for (_, idx), rep in zip(order, held, strict=True)
                for i, b in zip(idx, rep, strict=True) if b != 0x31]
        self._unpin(dead)
        return len(dead)

    def renew(self) -> list[str]:
        self._check_usable()
        return [x for s in self._shards for x in s.renew()]

    def describe(self) -> dict[str, Any]:
        d = self._shards[0].describe()
        d.update(super().describe())
        d.update({"namespace": self._namespace, "shards": self._nshards, "group": self._group,
                  "url": _redact(self._url)})
        return d

    def __enter__(self) -> RedisShardedProvider:
        return self

    def close(self) -> None:
        self._check_not_forked()  # a forked child must not touch the parent's sockets
        if self._closed:
            return
        self._quiesce()  # this front's write calls (reserve, put_many) finish first
        self._stop.set()
        if self._keeper is not None and self._keeper is not threading.current_thread():
            self._keeper.join(timeout=5)
        for s in self._shards:
            s.close()
        self._closed = True
        self._pool.shutdown(wait=True)
        with contextlib.suppress(Exception):  # cleanup never raises
            self._cluster.close()

