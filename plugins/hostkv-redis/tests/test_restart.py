"""A server killed and restarted (empty) mid-run: typed errors while it is down, then recovery,
and never a wrong byte."""

from __future__ import annotations

import threading
import warnings
from collections.abc import Callable

import pytest
from hostkv_providers import HostKVError, StorageIOError
from hostkv_providers.testing import chain, key_of, page_bytes

from hostkv_redis import RedisProvider, ReservationLostError, ServerUnavailableError
from hostkv_redis.servers import RedisServer

PAGE = 4096


def test_restart_sequence(own_server: RedisServer) -> None:
    p = RedisProvider(own_server.url, budget_bytes=64 * PAGE, namespace="rs", timeout=1.0, retries=1)
    keys = chain("restart", 10)
    assert p.put_many([(k, keys[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(keys)]) == [True] * 10
    res = p.reserve(key_of("restart-open"), keys[-1], PAGE)
    assert res is not None
    res.write(0, page_bytes(key_of("restart-open"), PAGE))
    lease = p.lease(keys)

    own_server.stop()
    calls: list[Callable[[], object]] = [
        lambda: p.present(keys),
        lambda: p.longest_prefix(keys),
        lambda: p.read_bytes(keys[0]),
        lambda: p.read_many_bytes(keys),
        lambda: p.put(key_of("restart-x"), None, b"x" * PAGE),
        lambda: p.lease(keys),
        lambda: p.stats(),
        lambda: p.evict(nbytes=PAGE),
        lambda: res.seal(),
    ]
    for call in calls:
        with pytest.raises(ServerUnavailableError) as err:
            call()
        assert isinstance(err.value, StorageIOError) and err.value.hint
    assert res.state == "open"  # nothing was acknowledged
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        lease.release()  # cleanup warns, the lease would expire server-side
    assert any("lease" in str(w.message) for w in caught)

    own_server.start()  # same port, empty (no persistence)
    assert p.present(keys) == [False] * 10  # a miss, not an error, never old bytes
    assert p.read_bytes(keys[0]) is None
    with pytest.raises(ReservationLostError):
        res.seal()
    assert p.put(keys[0], None, page_bytes(keys[0], PAGE))
    assert p.read_bytes(keys[0]) == page_bytes(keys[0], PAGE)
    st = p.stats()
    assert st.extra["store_resets"] == 1 and st.budget_bytes == 64 * PAGE and st.entries == 1
    p.close()


def test_restart_under_load(own_server: RedisServer) -> None:
    """A worker saves and reads chains while the server is killed and restarted twice."""
    p = RedisProvider(own_server.url, budget_bytes=32 * PAGE, namespace="rl", timeout=1.0, retries=1)
    stop = threading.Event()
    lock = threading.Lock()
    counts = {"ok": 0, "errors": 0, "wrong": 0}
    unexpected: list[BaseException] = []
    progress = threading.Condition(lock)

    def bump(what: str) -> None:
        with lock:
            counts[what] += 1
            progress.notify_all()

    def worker() -> None:
        i = 0
        while not stop.is_set():
            keys = chain(f"load-{i % 7}", 1 + i % 6)
            try:
                p.put_many([(k, keys[j - 1] if j else None, page_bytes(k, PAGE)) for j, k in enumerate(keys)])
                for k, got in zip(keys, p.read_many_bytes(keys), strict=True):
                    if got is not None and got != page_bytes(k, PAGE):
                        bump("wrong")
                with p.lease(keys) as lease:
                    out = [bytearray(PAGE) for _ in range(lease.prefix_len)]
                    hits = p.read_many(list(keys[: lease.prefix_len]), out)
                    for k, o, hit in zip(keys, out, hits, strict=False):
                        if hit and bytes(o) != page_bytes(k, PAGE):
                            bump("wrong")
                bump("ok")
            except (StorageIOError, ReservationLostError):
                bump("errors")
            except HostKVError as exc:  # any other typed error is unexpected here
                unexpected.append(exc)
                bump("errors")
            except BaseException as exc:
                unexpected.append(exc)
                return
            i += 1

    def wait_for(what: str, n: int) -> None:
        with lock:
            assert progress.wait_for(lambda: counts[what] >= n or bool(unexpected), timeout=120), counts

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # lease releases during the outage warn by design
        t = threading.Thread(target=worker)
        t.start()
        try:
            for _ in range(2):
                wait_for("ok", counts["ok"] + 20)
                own_server.stop()
                wait_for("errors", counts["errors"] + 3)
                own_server.start()
            wait_for("ok", counts["ok"] + 20)
        finally:
            stop.set()
            t.join(60)
    assert not t.is_alive()
    assert unexpected == []
    assert counts["wrong"] == 0
    assert p.stats().extra["store_resets"] >= 1
    p.close()


