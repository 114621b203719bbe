"""Review mends of the pinned arena (reproduced, each failed before): pieces of a chain run given
back to the arena (an aborted run, or the eviction of more than 8 pages of one size) merged into
one free run across a chunk boundary — the chunks are separate allocations, so an entry cut from
it got a region cut short at the first chunk's end (a read returned bytes never written under the
key; with verify=read a sound entry failed its checksum and was dropped) and a chain-run page a
DMA address past its chunk; and reserve_many racing close() raised an untyped IndexError while
building its pages' addresses from chunks close() was unmapping."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

import pytest

from hostkv_providers import ClosedError, HostKVError, PinnedProvider, UsedAfterForkError
from hostkv_providers.device._hostmem import OrdinaryAllocator
from hostkv_providers.testing import chain, key_of

B = 4096


def _p(blocks: int, chunk_blocks: int, verify: bool) -> PinnedProvider:
    return PinnedProvider(blocks * B, block=B, chunk=chunk_blocks * B, allocator=OrdinaryAllocator(),
                          background=False, prefault=False, verify_reads=verify)


def _straddling_runs(p: PinnedProvider) -> list[tuple[int, int]]:
    a = p._arena
    return [(s, n) for s, n in a._runs.items() if s // a.bpc != (s + n - 1) // a.bpc]


def _abort_run(p: PinnedProvider, n: int) -> None:
    ks = [key_of(f"run-{i}") for i in range(n)]
    rc = p.reserve_many(ks, [None, *ks[:-1]], B)
    assert rc.run is not None  # the chunk-level run path
    rc.abort()


def test_free_runs_never_span_chunks_after_run_abort() -> None:
    p = _p(4, 2, False)
    try:
        _abort_run(p, 4)
        assert _straddling_runs(p) == [], f"free run spans chunks: {dict(p._arena._runs)}"
    finally:
        p.close()


@pytest.mark.parametrize("verify", [False, True])
def test_an_entry_cut_after_a_run_abort_reads_back_whole(verify: bool) -> None:
    """verify=False: the read returned bytes never written under the key; verify=True: the
    sound entry failed its checksum and was dropped as corrupt."""
    p = _p(4, 2, verify)
    try:
        _abort_run(p, 4)
        data = os.urandom(4 * B)
        k = key_of("big")
        assert p.put(k, None, data)
        out = bytearray(4 * B)
        assert p.read(k, out)
        assert bytes(out) == data
        assert p.stats().checksum_failures == 0
    finally:
        p.close()


def test_wrong_bytes_after_chain_eviction() -> None:
    # >8 pages of one size evicted for room go back through release_pages as well
    p = _p(16, 2, False)
    try:
        ks = [key_of(f"c-{i}") for i in range(16)]
        assert p.put_many([(k, None if i == 0 else ks[i - 1], os.urandom(B)) for i, k in enumerate(ks)]) == [True] * 16
        data = os.urandom(12 * B)
        k = key_of("big8")
        assert p.put(k, None, data)  # evicts the chain for room
        out = bytearray(12 * B)
        assert p.read(k, out)
        assert bytes(out) == data, "read returned bytes that were never written under this key"
    finally:
        p.close()


def test_chain_run_pages_never_cross_a_chunk() -> None:
    """Three 2-block pages in two 3-block chunks: a run cannot hold them (one page per chunk);
    before, a merged free run handed out a page whose DMA address ran past its chunk's end."""
    p = _p(6, 3, False)
    try:
        _abort_run(p, 6)
        ks = [key_of(f"two-{i}") for i in range(3)]
        rc = p.reserve_many(ks, [None, *ks[:-1]], 2 * B)
        chunks = [(c.address, c.address + c.view.nbytes) for c in p._arena.chunks]
        if rc.pages is not None:
            for addr in rc.pages.addresses.tolist():
                assert any(lo <= addr and addr + 2 * B <= hi for lo, hi in chunks), \
                    f"page at {addr:#x} runs past the end of its chunk: a DMA writes outside the arena"
        for r in rc.reservations:  # page by page: each region inside one chunk, the page whole
            if r is not None:
                regs = r.regions()
                assert sum(g.view.nbytes for g in regs) == 2 * B
                for g in regs:
                    assert any(lo <= g.address and g.address + g.view.nbytes <= hi for lo, hi in chunks)
        rc.abort()
        assert _straddling_runs(p) == []
    finally:
        p.close()


PAGE = 4096


@pytest.mark.parametrize("path", ["run", "pages"])
def test_reserve_many_racing_close_raises_only_typed_errors(path: str) -> None:
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    bad: list[str] = []
    try:
        for it in range(1500):
            p = PinnedProvider(64 * PAGE, block=PAGE, chunk=8 * PAGE, allocator=OrdinaryAllocator(),
                               background=False, prefault=False)
            go = threading.Event()

            def work(p: PinnedProvider = p, it: int = it, go: threading.Event = go) -> None:
                go.set()
                i = 0
                root = chain(f"root{it}", 1)[0]
                while True:
                    i += 1
                    ks = chain(f"r{it}/{i}", 4)
                    try:
                        if path == "run":
                            rc = p.reserve_many(ks, [None, *ks[:-1]], PAGE)
                        else:  # page by page: a sealed page in the chain declines the run path
                            if i == 1:
                                p.put(root, None, bytes(PAGE))
                            ks = [root, *ks]
                            rc = p.reserve_many(ks, [None, *ks[:-1]], PAGE)
                            assert rc.run is None
                        rc.abort()
                    except ClosedError:
                        return
                    except HostKVError as exc:
                        if "clos" in str(exc).lower():
                            return
                        bad.append(f"{type(exc).__name__}: {exc}")
                        return
                    except BaseException as exc:
                        import traceback
                        tb = traceback.extract_tb(exc.__traceback__)[-1]
                        bad.append(f"{type(exc).__name__}: {exc} at {tb.filename.split('/')[-1]}:{tb.lineno} {tb.name}")
                        return

            t = threading.Thread(target=work)
            t.start()
            go.wait()
            threading.Event().wait((it % 13) * 1e-4)
            p.close()
            t.join(30)
            if bad:
                break
    finally:
        sys.setswitchinterval(old)
    assert bad == [], bad


def _child_outcome(call: Callable[[PinnedProvider], object]) -> str:
    p = PinnedProvider(16 * B, block=B, allocator=OrdinaryAllocator(), background=False, prefault=False)
    try:
        r, w = os.pipe()
        p._claim_lock.acquire()  # another thread is inside _call_begin / _call_end at the fork
        pid = os.fork()
        if pid == 0:  # child
            os.close(r)
            signal.alarm(5)
            try:
                call(p)
                out = b"returned"
            except UsedAfterForkError:
                out = b"UsedAfterForkError"
            except BaseException as exc:
                out = type(exc).__name__.encode()
            os.write(w, out)
            os._exit(0)
        p._claim_lock.release()
        os.close(w)
        _, status = os.waitpid(pid, 0)
        got = os.read(r, 100).decode()
        os.close(r)
        if os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGALRM:
            return "hung (killed by SIGALRM after 5 s)"
        return got
    finally:
        p.close()


FORK_KEYS = [key_of(f"fork-{i}") for i in range(3)]




@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_reserve_many_in_a_forked_child_raises_instead_of_hanging() -> None:
    """reserve_many became a write call without the usability check that comes first: in a child
    forked while another thread held the call lock it hung for good (put_many raises)."""
    k = FORK_KEYS
    assert _child_outcome(lambda p: p.put_many([(k[0], None, b"x" * B)])) == "UsedAfterForkError"
    assert _child_outcome(lambda p: p.reserve_many(k, [None, k[0], k[1]], B)) == "UsedAfterForkError"
