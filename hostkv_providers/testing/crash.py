"""A reusable kill -9 harness for persistent providers (RELIABILITY.md: "kill -9 cycles",
"named crash points").

A forked child opens a provider URL and runs a deterministic workload — chains of pages whose
bytes are :func:`~hostkv_providers.testing.page_bytes` of their key, anchors, reads that check
bytes, explicit evictions, aborts, leases, an occasional compaction — and reports through a pipe
every acknowledgement it actually received (a ``seal``/``put_anchor`` that returned).  The parent
SIGKILLs it at a random moment (or the child kills itself at a named crash point), then reopens
the store and checks the two promises:

* **0 wrong bytes**: every entry the store lists reads back exactly ``page_bytes(key, nbytes)``
  (anchors: ``anchor_bytes``), or is a miss;
* **100% of acknowledged seals readable**: every key whose seal was acknowledged (and that the
  child did not announce it would evict) is present and correct.

Usage (any persistent provider whose URL reopens the same store)::

    from hostkv_providers.testing.crash import CrashHarness, Workload

    h = CrashHarness("mmap:///tmp/store?budget=4MiB", Workload(page_nbytes=16384), seed=1)
    for _ in range(200):
        r = h.cycle(kill_after=h.rng.uniform(0.0, 0.05))   # one child, killed, store verified
        assert r.ok, r.describe()
    r = h.cycle(crash_at="mmap.seal.after_journal:2")     # child kills itself at that point
    assert r.killed and r.ok

The acknowledgement protocol is conservative by construction: a key counts as acknowledged only
once the parent has *received* its record, which the child writes after ``seal`` returned; a key
the child is about to evict is announced *before* ``evict`` is called, so it is no longer
required (but must still read correctly if it survives).  The parent bounds the store's size by
evicting the chains of old cycles after verifying them.

Children are ``os.fork()``-ed (Linux), so a cycle costs milliseconds; the child never returns into
the caller's code (``os._exit``).  The parent must not hold the store open across a cycle.
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import struct
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field

from hostkv_providers._capabilities import (
    SupportsBatch,
    SupportsCompact,
    SupportsIterate,
    SupportsVerify,
)
from hostkv_providers._errors import CapacityError, HostKVError, InFlightError, UnknownKeyError
from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider
from hostkv_providers._registry import open_provider
from hostkv_providers.testing._pages import anchor_bytes, key_of, page_bytes

__all__ = ["ANCHOR_NAME", "CrashHarness", "CycleResult", "Workload", "verify_store"]

#: The anchor the workload attaches to some pages.
ANCHOR_NAME = "state"

# Pipe records: one op byte + 32-byte key (+ for "!" a 4-byte length and a UTF-8 message).
_ACK_SEAL = b"S"  # seal of key returned
_ACK_ANCHOR = b"A"  # put_anchor(key, ANCHOR_NAME) returned
_WILL_EVICT = b"D"  # key (and its subtree) is about to be evicted: no longer required
_WRONG = b"W"  # the child read wrong bytes for key
_READY = b"R"  # the store is open (key field unused)
_DONE = b"F"  # the workload finished without being killed
_ERROR = b"!"  # an unexpected exception in the child
_REC = 33


@dataclass(frozen=True)
class Workload:
    """What the child does.  Sizes are small on purpose: a cycle should take ~0.1-0.2 s.

    Attributes
    ----------
    page_nbytes:
        Size of every page.
    steps:
        Operations before the child exits on its own (when it is not killed first).
    chains, chain_len:
        Each cycle writes up to ``chains`` new chains of up to ``chain_len`` pages.
    p_read, p_evict, p_anchor, p_abort, p_lease, p_dedup, p_compact:
        Per-step probabilities of the other operations (a page write otherwise).
    p_batch:
        Per-step probability of a batch call (providers with ``SupportsBatch``): half of them
        ``put_many`` the next pages (up to 4) of a chain, half ``read_many`` sealed pages.
    threads:
        Threads running the workload at once in the child, each on its own ``chains`` chains
        (concurrent seals: group commit, snapshots while other threads seal).
    """

    page_nbytes: int = 16384
    steps: int = 400
    chains: int = 4
    chain_len: int = 16
    p_read: float = 0.15
    p_evict: float = 0.03
    p_anchor: float = 0.08
    p_abort: float = 0.03
    p_lease: float = 0.03
    p_dedup: float = 0.03
    p_compact: float = 0.0
    p_batch: float = 0.0
    threads: int = 1

    def budget_bytes(self, keep_cycles: int, slack: float = 2.0) -> int:
        """A budget large enough that no policy eviction happens while ``keep_cycles`` cycles'
        chains are kept (policy eviction of acknowledged pages would read as "missing")."""
        pages = (keep_cycles + 1) * self.chains * self.threads * self.chain_len
        anchors = pages * (64 + 255 * 8)
        return int((pages * self.page_nbytes + anchors) * slack)


@dataclass
class CycleResult:
    """Outcome of one :meth:`CrashHarness.cycle`."""

    cycle: int
    killed: bool  # the child died by SIGKILL (from the parent or a crash point)
    exit_status: int  # raw wait status
    acked_this_cycle: int
    required: int  # acknowledged keys that must be readable after this cycle
    checked: int  # entries read back and compared
    wrong: list[str] = field(default_factory=list)  # "key: reason" for wrong bytes
    missing: list[str] = field(default_factory=list)  # acknowledged but not readable
    child_errors: list[str] = field(default_factory=list)
    open_error: str | None = None
    verify_problems: list[str] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def ok(self) -> bool:
        return not (self.wrong or self.missing or self.child_errors or self.open_error or self.verify_problems)

    def describe(self) -> str:
        parts = [f"cycle {self.cycle}: killed={self.killed} acked={self.acked_this_cycle} "
                 f"required={self.required} checked={self.checked}"]
        for name in ("wrong", "missing", "child_errors", "verify_problems"):
            items = getattr(self, name)
            if items:
                parts.append(f"{name} ({len(items)}): {items[:5]}")
        if self.open_error:
            parts.append(f"open failed: {self.open_error}")
        return "; ".join(parts)


def verify_store(provider: Provider, required: set[Key], required_anchors: set[Key], page_nbytes: int,
                 known: set[Key] | None = None) -> tuple[int, list[str], list[str]]:
    """Check an open store: every listed (or ``known``) entry reads its expected bytes, every
    ``required`` key is present.  Returns ``(checked, wrong, missing)``."""
    wrong: list[str] = []
    missing: list[str] = []
    if isinstance(provider, SupportsIterate):
        keys = {Key(e.key) for e in provider.iter_entries()}
    else:
        keys = set(known or ()) | required
    checked = 0
    for key in sorted(keys | required):
        info = provider.entry(key)
        if info is None:
            if key in required:
                missing.append(key.hex()[:16])
            continue
        data = provider.read_bytes(key)
        checked += 1
        if data is None:
            if key in required:
                missing.append(f"{key.hex()[:16]} (read miss)")
            continue
        if info.nbytes != page_nbytes or data != page_bytes(key, page_nbytes):
            wrong.append(f"{key.hex()[:16]}: {info.nbytes} bytes, not the sealed page")
            continue
        blob = provider.get_anchor(key, ANCHOR_NAME)
        if blob is not None and blob != anchor_bytes(key, ANCHOR_NAME, _anchor_nbytes(key)):
            wrong.append(f"{key.hex()[:16]}: wrong anchor bytes")
        elif blob is None and key in required_anchors:
            missing.append(f"{key.hex()[:16]} (anchor)")
    return checked, wrong, missing


def _anchor_nbytes(key: bytes) -> int:
    return 64 + key[0] * 8


class CrashHarness:
    """Runs kill -9 cycles against one store (see the module docstring).

    Parameters
    ----------
    url:
        The provider URL; opened by the child (writer) and by the parent to verify.
    workload:
        What the child does.
    seed:
        Makes keys, operation choices and kill times reproducible (``self.rng``).
    keep_cycles:
        The parent evicts chains older than this many cycles after verifying, so the store
        stays small and every cycle stays fast.
    open_verify:
        Also run ``verify()`` (when supported) after each reopen and report its findings.
    """

    def __init__(self, url: str, workload: Workload | None = None, *, seed: int = 0, keep_cycles: int = 3,
                 open_verify: bool = False, opener: Callable[[str], Provider] = open_provider) -> None:
        self.url = url
        self.workload = workload or Workload()
        self.seed = seed
        self.rng = random.Random(seed)
        self.keep_cycles = keep_cycles
        self.open_verify = open_verify
        self._open = opener
        self.cycles = 0
        self.required: set[Key] = set()
        self.required_anchors: set[Key] = set()
        self.known: set[Key] = set()
        self._roots_by_cycle: dict[int, list[Key]] = {}

    # -- the child -------------------------------------------------------------------------------
    def _child(self, wfd: int, cycle: int, env: dict[str, str]) -> None:
        os.environ.update(env)
        try:
            rng = random.Random((self.seed << 20) ^ cycle)
            w = self.workload
            provider = self._open(self.url)
            os.write(wfd, _READY + bytes(32))
            if w.threads == 1:
                _run_workload(provider, w, rng, cycle, self.seed, wfd)
            else:
                errors: list[BaseException] = []

                def run(t: int) -> None:
                    try:
                        _run_workload(provider, w, random.Random((self.seed << 24) ^ (cycle << 4) ^ t), cycle,
                                      self.seed, wfd, first_chain=t * w.chains)
                    except BaseException as exc:
                        errors.append(exc)

                ts = [threading.Thread(target=run, args=(t,)) for t in range(w.threads)]
                for t in ts:
                    t.start()
                for t in ts:
                    t.join()
                if errors:
                    raise errors[0]
            provider.close()
            os.write(wfd, _DONE + bytes(32))
        except BaseException:
            msg = traceback.format_exc()[-2000:].encode()
            with contextlib.suppress(OSError):
                os.write(wfd, _ERROR + struct.pack("<I", len(msg)) + bytes(28) + msg)
            os._exit(3)
        os._exit(0)

    # -- one cycle -------------------------------------------------------------------------------
    def cycle(self, *, kill_after: float | None = None, crash_at: str | None = None,
              env: dict[str, str] | None = None, timeout: float = 60.0, min_acks: int = 0) -> CycleResult:
        """Fork a child running the workload; SIGKILL it ``kill_after`` seconds after the store
        is open (``None``: let it finish or die at ``crash_at``, a ``point:n`` crash point);
        then reopen the store and verify it.  The required set carries over between cycles.

        ``min_acks`` starts the ``kill_after`` clock only once the child has acknowledged that
        many seals in this cycle (or finished): how much work a cycle covers then does not depend
        on how fast a loaded machine runs the child, so a test can assert coverage without
        asserting a rate."""
        t0 = time.monotonic()
        self.cycles += 1
        cycle = self.cycles
        child_env = dict(env or {})
        if crash_at is not None:
            child_env["HOSTKV_CRASH_AT"] = crash_at
        rfd, wfd = os.pipe()
        pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            os.close(rfd)
            try:
                self._child(wfd, cycle, child_env)
            finally:
                os._exit(4)
        os.close(wfd)
        buf = bytearray()
        ready_at: float | None = None
        deadline = t0 + timeout
        killed_by_us = False
        eof = False
        acks = 0
        parsed = 0
        while not eof:
            now = time.monotonic()
            if ready_at is None and _has_ready(buf):
                if acks < min_acks:
                    n, parsed = _count_acks(buf, parsed)
                    acks += n
                if acks >= min_acks:
                    ready_at = now
            if kill_after is not None and ready_at is not None and now >= ready_at + kill_after:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                killed_by_us = True
                kill_after = None
            if now >= deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                kill_after = None
            wait = 0.05
            if kill_after is not None and ready_at is not None:
                wait = max(0.0, min(wait, ready_at + kill_after - now))
            readable, _, _ = select.select([rfd], [], [], wait)
            if readable:
                chunk = os.read(rfd, 65536)
                if not chunk:
                    eof = True
                buf += chunk
        os.close(rfd)
        _, status = os.waitpid(pid, 0)
        killed = os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL
        result = CycleResult(cycle, killed, status, 0, 0, 0)
        if os.WIFSIGNALED(status) and not killed:
            result.child_errors.append(f"child died by signal {os.WTERMSIG(status)}")
        self._apply(buf, result)
        if not killed and not killed_by_us and os.WIFEXITED(status) and os.WEXITSTATUS(status) not in (0,):
            result.child_errors.append(f"child exited with status {os.WEXITSTATUS(status)}")
        self._verify(result)
        result.seconds = time.monotonic() - t0
        return result

    def _apply(self, buf: bytearray, result: CycleResult) -> None:
        i = 0
        n = len(buf)
        while i + _REC <= n:
            op = bytes(buf[i : i + 1])
            key = Key(bytes(buf[i + 1 : i + _REC]))
            i += _REC
            if op == _ACK_SEAL:
                self.required.add(key)
                self.known.add(key)
                result.acked_this_cycle += 1
            elif op == _ACK_ANCHOR:
                self.required_anchors.add(key)
            elif op == _WILL_EVICT:
                self.required.discard(key)
                self.required_anchors.discard(key)
            elif op == _WRONG:
                result.wrong.append(f"{key.hex()[:16]} (read in the child)")
            elif op == _ERROR:
                (length,) = struct.unpack("<I", key[:4])
                result.child_errors.append(bytes(buf[i : i + length]).decode("utf-8", "replace"))
                i += length
        # roots of this cycle's chains, for later trimming
        self._roots_by_cycle[result.cycle] = [
            key_of(f"crash/{self.seed}/{result.cycle}/{c}/0")
            for c in range(self.workload.chains * self.workload.threads)
        ]

    def _verify(self, result: CycleResult) -> None:
        try:
            provider = self._open(self.url)
        except HostKVError as exc:
            result.open_error = f"{type(exc).__name__}: {exc}"
            return
        try:
            checked, wrong, missing = verify_store(provider, self.required, self.required_anchors,
                                                   self.workload.page_nbytes, self.known)
            result.checked = checked
            result.wrong += wrong
            result.missing += missing
            result.required = len(self.required)
            if self.open_verify and isinstance(provider, SupportsVerify):
                rep = provider.verify(repair=False)
                result.verify_problems += [f"corrupt {k.hex()[:16]}" for k in rep.corrupt] + rep.problems
            self._trim(provider, result.cycle)
        finally:
            provider.close()

    def _trim(self, provider: Provider, cycle: int) -> None:
        old = [c for c in self._roots_by_cycle if c <= cycle - self.keep_cycles]
        roots: list[Key] = []
        for c in old:
            roots += self._roots_by_cycle.pop(c)
        if not roots:
            return
        for c_keys in _chain_keys_of_roots(self.seed, old, self.workload):
            for k in c_keys:
                self.required.discard(k)
                self.required_anchors.discard(k)
                self.known.discard(k)
        provider.evict(roots)

    def run(self, cycles: int, *, max_kill_after: float = 0.05, min_acks: int = 0) -> list[CycleResult]:
        """``cycles`` cycles, each killed at a uniformly random time in ``[0, max_kill_after)``
        (counted from the ``min_acks``-th acknowledged seal of the cycle, see :meth:`cycle`)."""
        return [self.cycle(kill_after=self.rng.uniform(0.0, max_kill_after), min_acks=min_acks)
                for _ in range(cycles)]


def _has_ready(buf: bytearray) -> bool:
    return len(buf) >= _REC and buf[0:1] == _READY


def _count_acks(buf: bytearray, start: int) -> tuple[int, int]:
    """Seal acknowledgements among the complete records of ``buf`` from offset ``start``; returns
    ``(count, offset of the first record not parsed yet)``."""
    n = 0
    i = start
    while i + _REC <= len(buf):
        op = buf[i : i + 1]
        if op == _ERROR:
            (length,) = struct.unpack("<I", buf[i + 1 : i + 5])
            if i + _REC + length > len(buf):
                break
            i += _REC + length
            continue
        if op == _ACK_SEAL:
            n += 1
        i += _REC
    return n, i


def _chain_keys_of_roots(seed: int, cycles: list[int], w: Workload) -> list[list[Key]]:
    return [[key_of(f"crash/{seed}/{cy}/{c}/{i}") for i in range(w.chain_len)]
            for cy in cycles for c in range(w.chains * w.threads)]


def _run_workload(provider: Provider, w: Workload, rng: random.Random, cycle: int, seed: int, wfd: int, *,
                  first_chain: int = 0) -> None:
    """The child's loop (module docstring) over chains ``first_chain ..`` (one thread's).  Reports
    through ``wfd`` (records are shorter than ``PIPE_BUF``: threads' writes never interleave)."""
    chains = [[key_of(f"crash/{seed}/{cycle}/{c}/{i}") for i in range(w.chain_len)]
              for c in range(first_chain, first_chain + w.chains)]
    written = [0] * w.chains  # sealed prefix length per chain
    sealed: list[Key] = []
    ops = [("read", w.p_read), ("evict", w.p_evict), ("anchor", w.p_anchor), ("lease", w.p_lease),
           ("dedup", w.p_dedup), ("compact", w.p_compact), ("batch", w.p_batch)]
    for _ in range(w.steps):
        r = rng.random()
        op = "write"
        for name, p in ops:
            if r < p:
                op = name
                break
            r -= p
        c = rng.randrange(w.chains)
        if op == "read" and sealed:
            key = rng.choice(sealed)
            data = provider.read_bytes(key)
            if data is not None and data != page_bytes(key, w.page_nbytes):
                os.write(wfd, _WRONG + key)
            continue
        if op == "evict" and written[c]:
            cut = rng.randrange(written[c])
            for k in chains[c][cut : written[c]]:
                os.write(wfd, _WILL_EVICT + k)  # announced before the evict call
            provider.evict([chains[c][cut]])
            gone = set(chains[c][cut:])
            sealed = [k for k in sealed if k not in gone]
            written[c] = cut
            continue
        if op == "anchor" and sealed:
            key = rng.choice(sealed)
            try:
                provider.put_anchor(key, ANCHOR_NAME, anchor_bytes(key, ANCHOR_NAME, _anchor_nbytes(key)))
            except (UnknownKeyError, CapacityError):
                continue
            os.write(wfd, _ACK_ANCHOR + key)
            continue
        if op == "lease" and sealed:
            with provider.lease(rng.sample(sealed, min(3, len(sealed)))):
                pass
            continue
        if op == "dedup" and sealed:
            key = rng.choice(sealed)
            ch = next(ch for ch in chains if key in ch)
            idx = ch.index(key)
            with contextlib.suppress(UnknownKeyError):
                provider.put(key, ch[idx - 1] if idx else None, page_bytes(key, w.page_nbytes))
            continue
        if op == "compact" and isinstance(provider, SupportsCompact):
            provider.compact()
            continue
        if op == "batch" and isinstance(provider, SupportsBatch):
            if sealed and rng.random() < 0.5:
                keys = rng.sample(sealed, min(4, len(sealed)))
                outs = [bytearray(w.page_nbytes) for _ in keys]
                for key, hit, out in zip(keys, provider.read_many(keys, outs), outs, strict=True):
                    if hit and bytes(out) != page_bytes(key, w.page_nbytes):
                        os.write(wfd, _WRONG + key)
                continue
            i = written[c]
            todo = range(i, min(i + 4, w.chain_len))
            if not todo:
                continue
            got = provider.put_many([(chains[c][j], chains[c][j - 1] if j else None,
                                      page_bytes(chains[c][j], w.page_nbytes)) for j in todo])
            for j, g in zip(todo, got, strict=True):
                if g is True:
                    os.write(wfd, _ACK_SEAL + chains[c][j])  # only after put_many returned
                    sealed.append(chains[c][j])
                elif g is not False:  # an error: the items after it failed too
                    if isinstance(g, CapacityError):
                        _evict_some(provider, chains, written, sealed, wfd)
                    break
                written[c] = j + 1
            continue
        # write the next page of chain c (or abort one)
        i = written[c]
        if i >= w.chain_len:
            continue
        key = chains[c][i]
        parent = chains[c][i - 1] if i else None
        try:
            res = provider.reserve(key, parent, w.page_nbytes)
        except (InFlightError, UnknownKeyError):
            continue
        except CapacityError:
            _evict_some(provider, chains, written, sealed, wfd)
            continue
        if res is None:  # survived from an earlier cycle? keys are per cycle: dedup of our own
            written[c] = i + 1
            continue
        data = page_bytes(key, w.page_nbytes)
        if rng.random() < w.p_abort:
            res.write(0, memoryview(data)[: w.page_nbytes // 2])
            res.abort()
            continue
        half = w.page_nbytes // 2
        res.write(half, memoryview(data)[half:])
        res.write(0, memoryview(data)[:half])
        res.seal()
        os.write(wfd, _ACK_SEAL + key)  # only after seal() returned
        sealed.append(key)
        written[c] = i + 1


def _evict_some(provider: Provider, chains: list[list[Key]], written: list[int], sealed: list[Key],
                wfd: int) -> None:
    """Make room by evicting this cycle's longest chain tail (announced first)."""
    c = max(range(len(chains)), key=lambda j: written[j])
    if not written[c]:
        return
    cut = written[c] // 2
    for k in chains[c][cut : written[c]]:
        os.write(wfd, _WILL_EVICT + k)
    provider.evict([chains[c][cut]])
    dropped = set(chains[c][cut:])
    sealed[:] = [k for k in sealed if k not in dropped]
    written[c] = cut
