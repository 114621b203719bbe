"""The wire under ``redis://``: the connection to the store's slot (:class:`_Link`: scripts
loaded, cluster redirects and transient errors retried, errors made typed), pipelined commands
written straight from the caller's buffers (:func:`_send_raw`), replies parsed into them
(:class:`_Reply`, :func:`_get_into`), and the pool of page-sized buffers.  No store logic: that
is :mod:`hostkv_redis._provider`'s."""

from __future__ import annotations

import contextlib
import logging
import re
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, TypeVar

import redis
from hostkv_providers.errors import (
    HostKVError,
    InvalidArgumentError,
    StorageIOError,
)
from hostkv_providers.providers import writable_buffer
from redis._parsers.base import BaseParser
from redis.backoff import ExponentialBackoff
from redis.cluster import RedisCluster
from redis.retry import Retry

from ._errors import ServerOutOfMemoryError, ServerUnavailableError
from ._scripts import SCRIPTS, TRAILER_NBYTES

T = TypeVar("T")
_log = logging.getLogger("hostkv_redis")
_SEND_GROUP = 1 << 20  # bytes of commands handed to the socket at once by _send_raw
#: The longest bulk reply (a GET's page and trailer) accepted by default: Redis's own
#: ``proto-max-bulk-len`` default, so no value a default server stores is refused.  A store whose
#: budget admits larger pages reads with a larger limit (``RedisProvider._fetch``).  A longer
#: length in a reply header is a malformed reply, refused before anything is allocated for it.
MAX_BULK = 512 << 20


class ReplyTooLong(redis.exceptions.InvalidResponse):
    """A reply longer than the reader's limit: malformed, or a page of a store whose budget grew
    since this client last read it (the caller may read the budget again and retry once)."""
_MAX_LINE = 64 << 10  # a reply's header line (a length, an integer, a status or an error message)
_MAX_DEPTH = 8  # nesting of array replies (the scripts' deepest is 2)
_MIN_RATE = 64 << 10  # bytes/s a value must arrive at, after a socket timeout's grace (_Reply.into)
_LENGTH = re.compile(rb"-1|[0-9]{1,19}")
_INTEGER = re.compile(rb"-?[0-9]{1,19}")

# --------------------------------------------------------------------------------------------
# The connection: one redis.Redis for the store's slot, scripts loaded, errors made typed
# --------------------------------------------------------------------------------------------


class _Link:
    """The connection to the server holding one store.

    Standalone: a ``redis.Redis``.  Cluster: a ``RedisCluster`` used only to find the master that
    owns the store's slot; all traffic then goes to that master's plain ``redis.Redis``, so
    pipelines (and ``MULTI``) work unchanged.  On ``MOVED``/failover the topology is refreshed and
    the call retried; every script is idempotent by its client-generated id, so a retry after a
    lost reply cannot double-apply.
    """

    def __init__(self, url: str, cluster: bool, meta_key: str, timeout: float, retries: int,
                 shared: RedisCluster | None = None) -> None:
        self.url = url
        self.cluster = cluster
        self.meta_key = meta_key
        self.retries = retries
        kwargs: dict[str, Any] = {
            "socket_timeout": timeout,
            "socket_connect_timeout": timeout,
            "retry": Retry(ExponentialBackoff(cap=0.5, base=0.02), retries),
        }
        self._lock = threading.Lock()
        self._shas: dict[str, str] = {}
        self._cluster: RedisCluster | None = None
        self._client: redis.Redis | None = None
        self._owns_cluster = shared is None
        try:
            if shared is not None:  # one cluster client (and one pool per node) for many stores
                self._cluster = shared
            elif cluster:
                self._cluster = RedisCluster.from_url(url, **kwargs)
            else:
                self._client = redis.Redis.from_url(url, **kwargs)
        except (redis.exceptions.RedisError, OSError) as exc:
            raise ServerUnavailableError(f"cannot connect to {_redact(url)}: {exc}") from exc
        except ValueError as exc:
            raise InvalidArgumentError(f"bad redis URL {_redact(url)}: {exc}") from exc

    def client(self) -> redis.Redis:
        if self._client is not None and not self.cluster:
            return self._client
        with self._lock:
            if self._client is None:
                assert self._cluster is not None
                node = self._cluster.get_node_from_key(self.meta_key)  # type: ignore[no-untyped-call]
                self._client = self._cluster.get_redis_connection(node)
            return self._client

    def refresh(self) -> None:
        """Forget the slot's master (cluster) so the next call asks the cluster again."""
        if self._cluster is None:
            return
        with self._lock:
            self._client = None
            # a failure here is reported by the next call, as a typed error
            with contextlib.suppress(redis.exceptions.RedisError, OSError):
                self._cluster.nodes_manager.initialize()

    def load_scripts(self, client: redis.Redis) -> None:
        shas = {name: str(client.script_load(src)) for name, src in SCRIPTS.items()}
        self._shas = shas

    def sha(self, name: str) -> str:
        sha = self._shas.get(name)
        if sha is None:  # computed locally; NOSCRIPT on first use loads them all
            import hashlib

            sha = hashlib.sha1(SCRIPTS[name].encode()).hexdigest()
            self._shas[name] = sha
        return sha

    def run(self, fn: Callable[[redis.Redis], T], on_nostore: Callable[[redis.Redis], None]) -> T:
        """Call ``fn(client)``, mapping redis-py's exceptions to the core's typed errors.

        NOSCRIPT → load the scripts and retry; HKV_NOSTORE (the server came back empty) →
        ``on_nostore`` re-creates the store metadata and retries; MOVED/ASK/TRYAGAIN/CLUSTERDOWN/
        READONLY in a cluster → refresh the topology and retry.
        """
        attempts = max(2, self.retries + 2)
        last: BaseException | None = None
        # What a failed attempt asks the next one to do first.  Never done in the except handler
        # itself: a connection lost while reloading the scripts or re-creating the store must go
        # through the mapping below like any other failure, not escape as redis-py's exception.
        reload = nostore = False
        for attempt in range(attempts):
            try:
                client = self.client()
                if reload:
                    self.load_scripts(client)
                    reload = False
                if nostore:
                    on_nostore(client)
                    nostore = False
                return fn(client)
            except HostKVError:
                raise  # typed already (on_nostore's verdict on the store, or fn's own)
            except redis.exceptions.NoScriptError as exc:
                reload = True
                last = exc
                continue
            except redis.exceptions.OutOfMemoryError as exc:
                raise ServerOutOfMemoryError(f"redis refused a write: {exc}") from exc
            except (
                redis.exceptions.AskError,
                redis.exceptions.TryAgainError,
                redis.exceptions.ClusterDownError,
                redis.exceptions.ReadOnlyError,
            ) as exc:
                last = exc
                if not self.cluster:
                    raise StorageIOError(f"redis: {exc}", hint="the server is a replica or in cluster mode; "
                                         "use a redis+cluster:// URL or the master") from exc
                self.refresh()
                _sleep_backoff(attempt)
                continue
            except redis.exceptions.ResponseError as exc:
                msg = str(exc)
                if msg.startswith("HKV_NOSTORE"):
                    nostore = True
                    last = exc
                    continue
                if self.cluster and _transient_cluster_error(msg):
                    # A script stopped by the migration guard (its slot is MIGRATING: it wrote
                    # nothing), or the cluster is down during a failover: retry after a refresh.
                    last = exc
                    if attempt + 1 < attempts:
                        self.refresh()
                        _sleep_backoff(attempt)
                        continue
                    raise ServerUnavailableError(f"redis cluster {_redact(self.url)}: {msg}",
                                                 hint="a slot is migrating or a failover is under way; retry") from exc
                raise StorageIOError(f"redis: {msg}") from exc
            except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
                last = exc
                if self.cluster and attempt + 1 < attempts:
                    self.refresh()
                    _sleep_backoff(attempt)
                    continue
                raise ServerUnavailableError(f"redis server {_redact(self.url)} unavailable: {exc}") from exc
            except redis.exceptions.RedisClusterException as exc:
                last = exc
                if attempt + 1 < attempts:
                    self.refresh()
                    _sleep_backoff(attempt)
                    continue
                raise ServerUnavailableError(f"redis cluster {_redact(self.url)}: {exc}") from exc
            except redis.exceptions.RedisError as exc:
                raise StorageIOError(f"redis: {exc}") from exc
            except ValueError as exc:
                # a reply of the wrong shape for what fn (or on_nostore) makes of it (int(),
                # decode() ...): typed like a malformed reply, which redis-py's parser raises
                raise StorageIOError(f"redis: malformed reply: {exc}") from exc
        raise ServerUnavailableError(f"redis server {_redact(self.url)}: gave up after {attempts} attempts: {last}")

    def close(self) -> None:
        try:
            if self._cluster is not None:
                if self._owns_cluster:
                    self._cluster.close()
            elif self._client is not None:
                self._client.close()
        except Exception as exc:  # cleanup warns, never raises
            warnings.warn(f"closing the redis connection failed: {exc!r}", stacklevel=2)


def _whole(out: object) -> memoryview:
    """A flat writable byte view of all of ``out`` (validated like ``writable_buffer``)."""
    try:
        size = memoryview(out).nbytes  # type: ignore[arg-type]
    except TypeError:
        size = 0
    return writable_buffer(out, size)


_TRANSIENT = ("non local key", "cluster is down", "TRYAGAIN", "CLUSTERDOWN", "MOVED ", "ASK ", "LOADING",
              "MASTERDOWN", "READONLY")


def _transient_cluster_error(msg: str) -> bool:
    """An error reply that means "not here, not now" in a cluster (never a verdict on the data)."""
    return any(t in msg for t in _TRANSIENT)


def _sleep_backoff(attempt: int) -> None:
    threading.Event().wait(min(0.5, 0.02 * (2**attempt)))


def _redact(url: str) -> str:
    """The URL without its password (operators paste these into tickets)."""
    return re.sub(r"(://[^:/@]*:)[^@/]*@", r"\1***@", url)


Piece = bytes | memoryview
Part = Piece | tuple[Piece, ...]
_SMALL = 16384  # pieces below this are copied into one joined buffer; larger ones are sent as they are


def _nbytes(piece: Piece) -> int:
    return piece.nbytes if isinstance(piece, memoryview) else len(piece)


def _encode(args: Sequence[Part]) -> list[Piece]:
    """RESP-encode one command into pieces; a tuple argument is one bulk string sent as several
    buffers (never concatenated here: see :func:`_coalesce`)."""
    out: list[Piece] = [b"*%d\r\n" % len(args)]
    for arg in args:
        if isinstance(arg, tuple):
            out.append(b"$%d\r\n" % sum(_nbytes(x) for x in arg))
            out.extend(arg)
        else:
            out.append(b"$%d\r\n" % _nbytes(arg))
            out.append(arg)
        out.append(b"\r\n")
    return out


def _coalesce(pieces: Iterable[Piece]) -> list[Piece]:
    """Join runs of small pieces into one buffer each; pass large ones (pages) through uncopied.

    That is how a page and its 56-byte trailer reach the server as one value without ever being
    concatenated in client memory (a fresh 2 MiB buffer per page costs more in page faults than
    sending it), while headers and small arguments still go out in few ``sendall`` calls.
    """
    out: list[Piece] = []
    small: list[Piece] = []
    for piece in pieces:
        if _nbytes(piece) < _SMALL:
            small.append(piece)
            continue
        if small:
            out.append(b"".join(small))
            small.clear()
        out.append(piece)
    if small:
        out.append(b"".join(small))
    return out


def _pack(commands: Sequence[Sequence[Part]]) -> list[Piece]:
    """RESP-encode ``commands`` as a few buffers ready for ``send_packed_command``."""
    return _coalesce(p for args in commands for p in _encode(args))


def _on_connection(client: redis.Redis, run: Callable[[Any, int], T]) -> T:
    """``run(conn, attempt)`` on a pooled connection, retried once on a fresh one when the first
    fails with a connection error (a stale pooled connection: the server restarted).  Any failure
    disconnects the connection, so a half-read reply stream is never reused; ``run`` may also
    disconnect it itself.  The commands ``run`` sends must be idempotent."""
    pool = client.connection_pool
    for attempt in (0, 1):
        conn: Any = pool.get_connection()  # redis-py's Connection is only partly annotated
        try:
            return run(conn, attempt)
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError) as exc:
            conn.disconnect()
            if attempt:
                if isinstance(exc, OSError) and not isinstance(exc, redis.exceptions.RedisError):
                    raise redis.exceptions.ConnectionError(str(exc)) from exc
                raise
        except ValueError as exc:
            conn.disconnect()
            if isinstance(exc, HostKVError):  # (InvalidArgumentError is a ValueError: the caller's)
                raise
            # _Reply checks what it parses; this is the backstop that keeps a reply it did not
            # foresee typed (a ValueError would escape _Link.run's mapping)
            raise redis.exceptions.InvalidResponse(f"malformed reply: {exc}") from exc
        except BaseException:
            conn.disconnect()
            raise
        finally:
            pool.release(conn)
    raise AssertionError("unreachable")  # pragma: no cover


def _send_raw(client: redis.Redis, commands: Callable[[], Iterator[list[Piece]]], count: int,
              meanwhile: Callable[[], None] | None = None) -> list[Any]:
    """Send the ``count`` already RESP-encoded commands that ``commands()`` yields (each as a list
    of pieces) as one pipeline on one pooled connection; per command its raw reply or its
    ``ResponseError``.

    Commands go to the socket in groups of about ``_SEND_GROUP`` bytes as they are produced, so
    the producer's work for the next one (checksumming a page) overlaps the transfer of this one.
    ``meanwhile()`` runs after the last command is sent and before the first reply is read: work
    that fills the round trip instead of sleeping through it (on a busy host, a thread that blocks
    on the reply can wait a scheduler slice to be woken).  A stale pooled connection (the server
    restarted) is retried once on a fresh one: every command sent this way is idempotent.
    """
    def run(conn: Any, attempt: int) -> list[Any]:
        health = attempt == 0
        # What _coalesce does, inlined into one pass (this loop runs a few times per page).
        out: list[Piece] = []
        small: list[Piece] = []
        queued = 0
        for pieces in commands():
            for piece in pieces:
                n = piece.nbytes if isinstance(piece, memoryview) else len(piece)
                queued += n
                if n < _SMALL:
                    small.append(piece)
                else:
                    if small:
                        out.append(b"".join(small))
                        small = []
                    out.append(piece)
            if queued >= _SEND_GROUP:  # few large sendall calls, small pieces coalesced
                if small:
                    out.append(b"".join(small))
                    small = []
                conn.send_packed_command(out, check_health=health)
                health, out, queued = False, [], 0
        if small:
            out.append(b"".join(small))
        if out:
            conn.send_packed_command(out, check_health=health)
        if meanwhile is not None:
            meanwhile()
        sock = getattr(conn, "_sock", None)
        if sock is None:  # pragma: no cover - an unusual connection class
            raise redis.exceptions.ConnectionError("no socket")
        # Replies are read by the lean reader (redis-py's parser costs about twice as much per
        # reply, and a put_many batch has one reply per page).  An error reply is a value
        # here, so the stream stays aligned.
        reader = _Reply(sock)
        replies = [reader.reply() for _ in range(count)]
        if reader.pos != len(reader.buf):  # more bytes than replies: never reuse this stream
            conn.disconnect()
        return replies

    return _on_connection(client, run)


class _Reply:
    """A minimal RESP2/RESP3 reader on a connection's socket, for the pipelines of this module.

    redis-py parses a ``GET`` reply into a fresh ``bytes`` object, which the caller then copies
    into its own buffer: for multi-MiB pages the allocation's page faults and the copy cost more
    than the transfer.  This reader receives each page straight into the caller's buffer
    (``recv_into``).  It is used on a pooled connection with no reply pending, and the connection
    is dropped on any error, so the stream can never be misaligned for the next user.

    What it parses comes from the network, so every length and integer is checked (a malformed
    one raises ``InvalidResponse``, never ``ValueError``), a length above ``max_bulk`` is refused
    before anything is allocated for it, a header line must end within ``_MAX_LINE`` bytes and
    within the socket timeout of its first byte, and a value must keep coming at ``_MIN_RATE``: a
    server that trickles a reply (each byte resets the socket timeout) cannot hold a caller.
    """

    def __init__(self, sock: Any, max_bulk: int = MAX_BULK) -> None:
        self.sock = sock
        self.buf = bytearray()
        self.pos = 0
        self.max_bulk = max_bulk

    def _fill(self) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise redis.exceptions.ConnectionError("the server closed the connection")
        if self.pos:
            del self.buf[: self.pos]
            self.pos = 0
        self.buf += chunk

    def line(self) -> bytes:
        started = 0.0  # when the line's first byte arrived (0: none yet)
        while True:
            end = self.buf.find(b"\r\n", self.pos)
            if end >= 0:
                out = bytes(self.buf[self.pos : end])
                self.pos = end + 2
                return out
            if len(self.buf) > self.pos:  # a line begun: it must end soon, and short
                if len(self.buf) - self.pos > _MAX_LINE:
                    raise redis.exceptions.InvalidResponse(
                        f"a reply line longer than {_MAX_LINE} bytes: {self._head()!r}")
                now = time.monotonic()
                if not started:
                    started = now
                else:
                    timeout = self.sock.gettimeout()
                    if timeout is not None and now - started > timeout:
                        raise redis.exceptions.InvalidResponse(
                            f"a reply line did not end within {timeout} s of its first byte: {self._head()!r}")
            self._fill()

    def _head(self) -> bytes:
        return bytes(self.buf[self.pos : self.pos + 20])

    def length(self, head: bytes) -> int:
        """The length in a bulk or aggregate header (``$5``, ``*3``): -1 (null) or 0..max_bulk."""
        digits = head[1:]
        if not _LENGTH.fullmatch(digits):
            raise redis.exceptions.InvalidResponse(f"malformed length in reply header {head[:24]!r}")
        n = int(digits)
        if n > self.max_bulk:
            raise ReplyTooLong(f"reply length {n} exceeds the {self.max_bulk}-byte limit (a malformed reply?)")
        return n

    def into(self, dst: memoryview) -> None:
        """Fill ``dst`` from the stream: buffered bytes first, then straight from the socket.

        Each ``recv`` restarts the socket timeout, so a server that trickles a value could hold the
        caller as long as it liked: the rest must arrive within a timeout plus its size at
        ``_MIN_RATE`` (far below any link a page store is usable over)."""
        have = min(len(self.buf) - self.pos, len(dst))
        dst[:have] = self.buf[self.pos : self.pos + have]
        self.pos += have
        got = have
        if got == len(dst):
            return
        timeout = self.sock.gettimeout()
        deadline = None if timeout is None else time.monotonic() + timeout + (len(dst) - got) / _MIN_RATE
        while got < len(dst):
            n = self.sock.recv_into(dst[got:])
            if not n:
                raise redis.exceptions.ConnectionError("the server closed the connection")
            got += n
            if deadline is not None and got < len(dst) and time.monotonic() > deadline:
                raise redis.exceptions.InvalidResponse(
                    f"a {len(dst)}-byte value still {len(dst) - got} bytes short past its deadline "
                    f"(the server sends it slower than {_MIN_RATE} bytes/s)")

    def bulk(self, size: int) -> memoryview:
        """A bulk string's ``size`` bytes and its CRLF (checked: a length that lied would leave
        the stream misaligned), in a new buffer; the view covers the bytes without the CRLF."""
        data = memoryview(bytearray(size + 2))
        self.into(data)
        _check_crlf(data[size:])
        return data[:size]

    def value(self, dst: memoryview | None) -> tuple[memoryview | None, bytes | None]:
        """One reply to ``GET``: ``(page view, trailer)``, ``(None, None)`` for a null.

        The page lands in ``dst`` when it fits, else in a new buffer.
        """
        head = self.line()
        kind = head[:1]
        if kind in (b"_",) or head == b"$-1":
            return None, None
        if kind == b"-":
            raise _error(head)
        if kind != b"$":
            raise redis.exceptions.InvalidResponse(f"unexpected reply {head[:20]!r} to GET")
        total = self.length(head)
        if total < 0:
            return None, None
        n = total - TRAILER_NBYTES
        if n < 0:  # not one of our values at all: hand the raw bytes back for the trailer check
            raw = self.bulk(total)
            return raw[:0], bytes(raw)
        page = dst[:n] if dst is not None and len(dst) >= n else memoryview(bytearray(n))
        self.into(page)
        tail = memoryview(bytearray(TRAILER_NBYTES + 2))
        self.into(tail)
        _check_crlf(tail[TRAILER_NBYTES:])
        return page, bytes(tail[:TRAILER_NBYTES])

    def reply(self, depth: int = 0) -> Any:
        """One whole reply, parsed like redis-py without decoding (an error reply is returned as
        redis-py's exception instance, not raised)."""
        head = self.line()
        kind = head[:1]
        if kind == b"+":
            return head[1:]
        if kind == b"-":
            return _error(head)
        if kind == b":":
            if not _INTEGER.fullmatch(head[1:]):
                raise redis.exceptions.InvalidResponse(f"malformed integer reply {head[:24]!r}")
            return int(head[1:])
        if kind in (b"$", b"="):
            size = self.length(head)
            if size < 0:
                return None
            return bytes(self.bulk(size))
        if kind in (b"*", b"~", b">"):
            size = self.length(head)
            if size > 0 and depth >= _MAX_DEPTH:
                raise redis.exceptions.InvalidResponse(f"reply nested deeper than {_MAX_DEPTH} arrays")
            return None if size < 0 else [self.reply(depth + 1) for _ in range(size)]
        if kind == b"_":
            return None
        raise redis.exceptions.InvalidResponse(f"unexpected reply {head[:20]!r}")

    def skip(self) -> object:
        """Any other reply (the touch script's integer, or an error), parsed loosely."""
        head = self.line()
        kind = head[:1]
        if kind == b"-":
            return _error(head)
        if kind in (b":", b"+", b"_", b"#", b","):
            return head[1:]
        if kind in (b"$", b"!", b"="):
            size = self.length(head)
            if size >= 0:
                self.bulk(size)
            return None
        raise redis.exceptions.InvalidResponse(f"unexpected reply {head[:20]!r}")


def _check_crlf(end: memoryview) -> None:
    if end.tobytes() != b"\r\n":
        raise redis.exceptions.InvalidResponse(f"a bulk reply not followed by CRLF but {bytes(end)!r}")


def _error(head: bytes) -> redis.exceptions.RedisError:
    """redis-py's exception for an error reply (MOVED, NOSCRIPT, OOM ... map to their classes)."""
    err: redis.exceptions.RedisError = BaseParser.parse_error(  # type: ignore[no-untyped-call]
        head[1:].decode(errors="replace"))
    return err


def _get_into(client: redis.Redis, names: Sequence[bytes], touch: Sequence[Part],
              dests: Sequence[memoryview | None],
              max_bulk: int = MAX_BULK) -> list[tuple[memoryview | None, bytes | None]]:
    """Pipelined GET of ``names`` (page bytes into ``dests`` where given) followed by ``touch``;
    a value longer than ``max_bulk`` is a malformed reply."""
    packed = _pack([*([b"GET", n] for n in names), touch])
    def run(conn: Any, attempt: int) -> list[tuple[memoryview | None, bytes | None]]:
        conn.send_packed_command(packed, check_health=attempt == 0)
        sock = getattr(conn, "_sock", None)
        if sock is None:  # pragma: no cover - an unusual connection class
            raise redis.exceptions.ConnectionError("no socket")
        reader = _Reply(sock, max_bulk)
        out = [reader.value(d) for d in dests]
        last = reader.skip()
        if reader.pos != len(reader.buf):  # more bytes than replies: never reuse this stream
            conn.disconnect()
        # The LRU refresh is best effort (the pages were read consistently), except that a
        # server which forgot the scripts must reload them.
        if isinstance(last, redis.exceptions.NoScriptError):
            raise last
        return out

    return _on_connection(client, run)


class _BufferPool:
    """Reuses reservation buffers of the same size: page sizes repeat, and a fresh multi-MiB
    ``bytearray`` per page costs its zero-fill page faults every time.  Bounded by ``max_nbytes``."""

    def __init__(self, max_nbytes: int) -> None:
        self._lock = threading.Lock()
        self._free: dict[int, list[bytearray]] = {}
        self._held = 0
        self._max = max_nbytes

    def take(self, nbytes: int) -> bytearray:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                self._held -= nbytes
                return free.pop()
        return bytearray(nbytes)

    def give(self, buf: bytearray) -> None:
        n = len(buf)
        with self._lock:
            if self._held + n <= self._max:
                self._free.setdefault(n, []).append(buf)
                self._held += n
