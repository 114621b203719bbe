"""Conformance family: lifecycle (use after close, after fork) and threads."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Sequence

import pytest

from hostkv_providers._capabilities import SupportsIterate, SupportsVerify, SupportsViews
from hostkv_providers._errors import CapacityError, ClosedError, InFlightError, UnknownKeyError, UsedAfterForkError
from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers.testing._pages import chain, key_of, page_bytes, put_chain, put_page

from ._base import ProviderFactory, SuiteBase, _check_budget, _fork_failure, _wait_child


class LifecycleTests(SuiteBase):
    """Conformance tests: lifecycle (use after close, after fork) and threads."""

    def test_closed_provider(self, provider: Provider) -> None:
        key = key_of("closed")
        nbytes = self._pages(1)
        put_page(provider, key, None, nbytes)
        res = provider.reserve(key_of("closed-open"), None, nbytes)
        assert res is not None
        lease = provider.lease([key])
        provider.close()
        provider.close()  # idempotent
        assert provider.closed
        calls: list[Callable[[], object]] = [
            lambda: provider.present([key]),
            lambda: provider.longest_prefix([key]),
            lambda: provider.entry(key),
            lambda: provider.reserve(key_of("closed-2"), None, nbytes),
            lambda: provider.write(res, 0, b"\x00"),
            lambda: provider.seal(res),
            lambda: provider.read(key, bytearray(nbytes)),
            lambda: provider.read_bytes(key),
            lambda: provider.put(key_of("closed-3"), None, b"\x00" * nbytes),
            lambda: provider.in_flight(key),
            lambda: provider.wait_sealed(key, 0.01),
            lambda: provider.evict([key]),
            lambda: provider.evict(nbytes=1),
            lambda: provider.put_anchor(key, "a", b"x"),
            lambda: provider.get_anchor(key, "a"),
            lambda: provider.list_anchors(key),
            lambda: provider.deepest_anchor([key], "a"),
            lambda: provider.lease([key]),
            lambda: provider.stats(),
            lambda: provider.abort(res),
        ]
        for cap, method in ((SupportsIterate, "iter_entries"), (SupportsVerify, "verify")):
            if isinstance(provider, cap):
                calls.append(getattr(provider, method))
        if isinstance(provider, SupportsViews):
            calls.append(lambda: provider.view(lease, key))
        for call in calls:
            with pytest.raises(ClosedError):
                call()
        lease.release()  # releasing after close must not raise

    def test_use_after_fork(self, provider: Provider) -> None:
        if not hasattr(os, "fork"):
            pytest.skip("no os.fork on this platform")
        key = key_of("fork")
        nbytes = self._pages(1)
        put_page(provider, key, None, nbytes)
        res = provider.reserve(key_of("fork-open"), None, nbytes)
        assert res is not None
        calls: list[Callable[[], object]] = [
            lambda: provider.present([key]),
            lambda: provider.entry(key),
            lambda: provider.reserve(key_of("fork-2"), None, nbytes),
            lambda: provider.write(res, 0, b"\x00"),
            lambda: provider.seal(res),
            lambda: provider.abort(res),
            lambda: provider.read(key, bytearray(nbytes)),
            lambda: provider.in_flight(key),
            lambda: provider.evict([key]),
            lambda: provider.put_anchor(key, "a", b"x"),
            lambda: provider.get_anchor(key, "a"),
            lambda: provider.list_anchors(key),
            lambda: provider.lease([key]),
            lambda: provider.stats(),
        ]
        with warnings.catch_warnings():
            # Python 3.12+ warns about fork() in a multi-threaded process; the child only checks
            # that the provider refuses to be used, then exits without touching anything else.
            warnings.simplefilter("ignore", DeprecationWarning)
            pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                for i, call in enumerate(calls):
                    try:
                        call()
                        code = 10 + i  # no error at all
                        break
                    except UsedAfterForkError:
                        continue
                    except BaseException:
                        code = 50 + i  # a wrong error type
                        break
            finally:
                os._exit(code)
        code = _wait_child(pid, timeout=120.0)
        assert code == 0, _fork_failure(code, len(calls))
        # the parent is unaffected
        assert provider.read_bytes(key) == page_bytes(key, nbytes)
        res.write(0, page_bytes(key_of("fork-open"), nbytes))
        res.seal()

    def test_use_after_fork_while_busy(self, provider: Provider) -> None:
        """Fork while another thread is inside the provider (likely holding its lock): the child
        must get ``UsedAfterForkError`` at once, not wait forever on a lock copied in the held
        state."""
        if not hasattr(os, "fork"):
            pytest.skip("no os.fork on this platform")
        keys = chain("fork-busy", 4)
        nbytes = self._pages(1)
        put_chain(provider, keys, nbytes)
        stop = threading.Event()
        errors: list[BaseException] = []

        def busy() -> None:
            out = bytearray(nbytes)
            try:
                while not stop.is_set():
                    provider.present(keys)
                    provider.read(keys[-1], out)
                    with provider.lease(keys):
                        pass
            except BaseException as exc:
                errors.append(exc)

        worker = threading.Thread(target=busy)
        worker.start()
        codes = []
        try:
            for _ in range(5):
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", DeprecationWarning)
                    pid = os.fork()
                if pid == 0:  # pragma: no cover - runs in the child
                    code = 1
                    try:
                        provider.present(keys)
                    except UsedAfterForkError:
                        code = 0
                    except BaseException:
                        code = 2
                    finally:
                        os._exit(code)
                codes.append(_wait_child(pid, timeout=20.0))
                if codes[-1] != 0:
                    break  # one hung or wrong child is the finding; don't wait on more
        finally:
            stop.set()
            worker.join(60)
        assert errors == []
        assert codes == [0] * 5, "; ".join(
            "ok" if c == 0 else "no error in the child" if c == 1 else _fork_failure(c, 1) for c in codes
        )

    # ==========================================================================================
    # Threads
    # ==========================================================================================
    def test_threads_shared_and_distinct_chains(self, provider_factory: ProviderFactory) -> None:
        p = provider_factory(48)
        nbytes = self._pages(1)
        shared = chain("threads-shared", 12)
        errors: list[str] = []
        counts = {"reads": 0, "hits": 0}
        lock = threading.Lock()
        stop = threading.Event()

        def save(keys: Sequence[Key]) -> None:
            parent: Key | None = None
            for k in keys:
                try:
                    res = p.reserve(k, parent, nbytes)
                except InFlightError:
                    if not p.wait_sealed(k, 30.0):
                        return  # the other writer aborted or the entry was evicted: stop this chain
                    parent = k
                    continue
                except (UnknownKeyError, CapacityError):
                    return  # parent evicted under pressure, or everything leased right now
                if res is not None:
                    res.write(0, page_bytes(k, nbytes))
                    res.seal()
                parent = k

        def writer(w: int) -> None:
            try:
                for i in range(self.thread_ops // 10):
                    save(shared[: 4 + (i + w) % 8])
                    save(chain(f"threads-w{w}-{i}", 1 + i % 4))
                    _check_budget(p)
            except BaseException as exc:  # report, don't hang the test
                errors.append(f"writer {w}: {exc!r}")

        def reader(r: int) -> None:
            try:
                out = bytearray(nbytes)
                i = 0
                while not stop.is_set() or i < 20:
                    k = shared[(r + i) % len(shared)] if i % 2 else chain(f"threads-w{r}-{i % 15}", 1)[0]
                    hit = p.read(k, out)
                    if hit and bytes(out) != page_bytes(k, nbytes):
                        errors.append(f"reader {r}: wrong bytes for {k.hex()[:12]}")
                    with p.lease(shared) as lease:
                        for j in range(lease.prefix_len):
                            if not p.read(shared[j], out):
                                errors.append(f"reader {r}: leased {j} missing")
                            elif bytes(out) != page_bytes(shared[j], nbytes):
                                errors.append(f"reader {r}: wrong leased bytes at {j}")
                    with lock:
                        counts["reads"] += 1
                        counts["hits"] += hit
                    i += 1
            except BaseException as exc:
                errors.append(f"reader {r}: {exc!r}")

        writers = [threading.Thread(target=writer, args=(w,)) for w in range(self.thread_count)]
        readers = [threading.Thread(target=reader, args=(r,)) for r in range(self.thread_count)]
        for t in writers + readers:
            t.start()
        for t in writers:
            t.join(300)
        stop.set()
        for t in readers:
            t.join(300)
        assert not any(t.is_alive() for t in writers + readers), "threads deadlocked"
        assert errors == []
        assert counts["reads"] > 0
        st = p.stats()
        assert st.used_bytes <= st.budget_bytes
        assert st.in_flight == 0
        n = p.longest_prefix(shared)
        for k in shared[:n]:
            assert p.read_bytes(k) == page_bytes(k, nbytes)
