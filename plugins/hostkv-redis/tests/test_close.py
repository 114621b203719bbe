"""close() against calls under way, and reservations their writers dropped (issue 16)."""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable
from typing import Any

import pytest
from hostkv_providers import ClosedError, Key, Reservation, ReservationError, UsedAfterForkError
from hostkv_providers.testing import key_of, page_bytes

from hostkv_redis import RedisProvider
from hostkv_redis.servers import RedisServer

PAGE = 4096
Make = Callable[..., RedisProvider]


def _server_flights(server: RedisServer, namespace: str) -> int:
    with server.client() as c:
        return int(c.zcard(f"hkv:{{{namespace}}}:fz"))


def _slow_seal(p: RedisProvider, k: Key) -> tuple[Reservation, threading.Event, threading.Event]:
    """A reservation of ``k``'s page, written; its seal, once called, sets ``inside`` on its way to
    the server and waits there until ``release`` is set."""
    res = p.reserve(k, None, PAGE)
    assert res is not None
    res.write(0, page_bytes(k, PAGE))
    inside, release = threading.Event(), threading.Event()
    ship = p._seal_batch

    def slow_seal(batch: Any) -> Any:
        inside.set()
        release.wait(10)
        return ship(batch)

    p._seal_batch = slow_seal  # type: ignore[method-assign, assignment]
    return res, inside, release


def test_a_seal_refused_by_a_closing_provider_leaves_no_flight(make_redis: Make, redis_server: RedisServer) -> None:
    """The race test_hostile_close_while_writing hit (in_flight == 1 after a reopen): a put's
    reservation is made, close() begins, the put's seal is refused (ClosedError) and the put drops
    its reservation before close() looked at the registry of open reservations, which is weak.
    Deterministic here: close's first step is taken by hand."""
    p = make_redis()
    k = key_of("closing-seal")
    res = p.reserve(k, None, PAGE)
    assert res is not None
    res.write(0, page_bytes(k, PAGE))
    p._quiesce()  # what close() does first: new write calls get ClosedError
    with pytest.raises(ClosedError):
        p.seal(res)
    del res
    gc.collect()
    assert _server_flights(redis_server, p.namespace) == 1
    p.close()
    assert _server_flights(redis_server, p.namespace) == 0
    q = RedisProvider(redis_server.url, namespace=p.namespace)
    try:
        assert not q.in_flight(k) and q.stats().in_flight == 0
        assert q.put(k, None, page_bytes(k, PAGE))
    finally:
        q.close()


def test_a_dropped_open_reservation_is_aborted_by_the_next_renewal(make_redis: Make,
                                                                   redis_server: RedisServer) -> None:
    p = make_redis(keepalive=False)
    k = key_of("dropped-open")
    res = p.reserve(k, None, PAGE)
    del res
    gc.collect()
    assert _server_flights(redis_server, p.namespace) == 1
    p.renew()
    assert _server_flights(redis_server, p.namespace) == 0
    assert not p.in_flight(k)
    assert p.stats().used_bytes == 0


def test_close_waits_for_a_seal_under_way(make_redis: Make, redis_server: RedisServer) -> None:
    """A seal that started before close() completes (it is not aborted under its feet); a
    reserve after close() began gets ClosedError."""
    p = make_redis()
    k = key_of("close-waits")
    res, inside, release = _slow_seal(p, k)
    errors: list[BaseException] = []

    def seal() -> None:
        try:
            p.seal(res)
        except BaseException as exc:
            errors.append(exc)

    t = threading.Thread(target=seal)
    t.start()
    assert inside.wait(10)
    closer = threading.Thread(target=p.close)
    closer.start()
    while not p._closing:
        threading.Event().wait(0.001)
    with pytest.raises(ClosedError):
        p.reserve(key_of("after-close"), None, PAGE)
    release.set()
    t.join(10)
    closer.join(10)
    assert errors == [] and res.state == "sealed"
    q = RedisProvider(redis_server.url, namespace=p.namespace)
    try:
        assert q.read_bytes(k) == page_bytes(k, PAGE)
        assert q.stats().in_flight == 0
    finally:
        q.close()


def test_errors_from_a_connection_close_shut_are_closed_errors(make_redis: Make) -> None:
    """A read whose connection close() shut meanwhile raises ClosedError (not the socket's
    ValueError/AttributeError, not ServerUnavailableError)."""
    p = make_redis()
    k = key_of("shut-read")
    p.put(k, None, page_bytes(k, PAGE))
    run = p._link.run

    def shut_then_run(fn: object, on_nostore: object) -> object:
        p._closed = True  # close() finished in another thread ...
        p._link.close()   # ... and shut the connection
        raise ValueError("I/O operation on closed socket")  # what redis-py says then

    p._link.run = shut_then_run  # type: ignore[method-assign, assignment]
    try:
        with pytest.raises(ClosedError):
            p.read_bytes(k)
    finally:
        p._link.run = run  # type: ignore[method-assign]
        p._closed = False


def test_racing_seal_and_abort_is_typed(make_redis: Make) -> None:
    p = make_redis()
    k = key_of("race-claim")
    res, inside, release = _slow_seal(p, k)
    t = threading.Thread(target=p.seal, args=(res,))
    t.start()
    assert inside.wait(10)
    with pytest.raises(ReservationError):
        p.abort(res)
    with pytest.raises(ReservationError):
        p.seal(res)
    release.set()
    t.join(10)
    assert res.state == "sealed" and p.read_bytes(k) == page_bytes(k, PAGE)


def test_close_in_a_forked_child_raises(make_redis: Make) -> None:
    import os

    p = make_redis()
    pid = os.fork()
    if pid == 0:  # the child: close() must refuse, not touch the parent's sockets
        code = 1
        try:
            p.close()
        except UsedAfterForkError:
            code = 0
        except BaseException:
            code = 2
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
    assert p.present([key_of("fork")]) == [False]  # the parent's provider still works
