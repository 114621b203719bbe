"""Store-wide live counters (``SupportsStoreCounters``): an engine-like child process writes,
reads, misses, evicts and hits a corrupt page; the parent, another process, reads the figures with
``hostkv stats --json`` while the child is still running and sees exactly the child's numbers;
they survive restarts, add up over concurrent processes, and count checksum failures store-wide.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import textwrap
import urllib.parse
import warnings
from pathlib import Path
from typing import Any

import pytest

import hostkv_providers as hk
from hostkv_providers.providers import SupportsStoreCounters, TieredProvider

ROOT = Path(__file__).resolve().parents[2]
PAGE = 48 << 10

# The engine-like child: stores ``n`` root pages (key and bytes derived from ``seed``, so the
# parent recomputes them), reads ``hits`` of them back and ``misses`` unknown keys, evicts
# ``evict`` of them, reads every key named in ``extra_reads`` (hex), prints its own stats as one
# JSON line, then stays alive until its stdin closes.
CHILD = textwrap.dedent("""
    import hashlib, json, sys
    import hostkv_providers as hk
    url, seed, n, hits, misses, evict = sys.argv[1], sys.argv[2], *map(int, sys.argv[3:7])
    extra = [bytes.fromhex(h) for h in sys.argv[7].split(",") if h] if len(sys.argv) > 7 else []
    PAGE = 48 << 10
    def key(i): return hashlib.sha256(f"{seed}/{i}".encode()).digest()
    def page(i): return key(i) + hashlib.shake_256(key(i)).digest(PAGE - 32)
    p = hk.open(url)
    got = [p.put(key(i), None, page(i), salt_tag="t") for i in range(n)]
    if hasattr(p, "flush"):
        p.flush()  # tiered: every page written back before the evictions below
    buf = bytearray(PAGE)
    ok = [p.read(key(i), buf) and bytes(buf) == page(i) for i in range(hits)]
    missed = [p.read(hashlib.sha256(f"miss/{seed}/{i}".encode()).digest(), buf) for i in range(misses)]
    ev = p.evict([key(i) for i in range(n - evict, n)]) if evict else None
    extra_hits = [p.read(k, buf) for k in extra]
    if hasattr(p, "flush"):
        p.flush()
    st = p.stats()
    print(json.dumps({"stored": sum(got), "ok": sum(ok), "missed": sum(missed), "extra_hits": sum(extra_hits),
                      "evicted": ev.entries if ev else 0, "hits": st.hits, "misses": st.misses,
                      "seals": st.seals, "bytes_read": st.bytes_read, "bytes_written": st.bytes_written,
                      "checksum_failures": st.checksum_failures}), flush=True)
    sys.stdin.read()
    p.close()
""")


def key(seed: str, i: int) -> bytes:
    return hashlib.sha256(f"{seed}/{i}".encode()).digest()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    paths = [str(ROOT), str(ROOT / "cli"), *filter(None, env.get("PYTHONPATH", "").split(os.pathsep))]
    env["PYTHONPATH"] = os.pathsep.join(paths)
    return env


class Engine:
    """The child process, alive until :meth:`stop`."""

    def __init__(self, tmp: Path, url: str, seed: str, n: int, hits: int, misses: int, evict: int,
                 extra: list[bytes] | None = None) -> None:
        script = tmp / "engine_child.py"
        script.write_text(CHILD)
        self.proc = subprocess.Popen(
            [sys.executable, str(script), url, seed, str(n), str(hits), str(misses), str(evict),
             ",".join(k.hex() for k in extra or [])],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env())
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            self.proc.kill()
            raise AssertionError(f"engine child failed: {self.proc.communicate()[1][-3000:]}")
        self.report: dict[str, int] = json.loads(line)

    def stop(self) -> None:
        assert self.proc.stdin is not None and self.proc.stdout is not None and self.proc.stderr is not None
        self.proc.stdin.close()
        rc = self.proc.wait(timeout=60)
        err = self.proc.stderr.read()
        self.proc.stdout.close()
        self.proc.stderr.close()
        assert rc == 0, err


def cli_counters(url: str) -> dict[str, Any]:
    """``hostkv stats --json URL`` in a separate process (the operator's view)."""
    out = subprocess.run([sys.executable, "-m", "hostkv_cli", "stats", "--json", url], capture_output=True,
                         text=True, env=_env(), timeout=120)
    assert out.returncode == 0, out.stderr
    doc = json.loads(out.stdout)
    assert doc["store_counters_scope"] == "store"
    counters: dict[str, Any] = doc["store_counters"]
    return counters


def corrupt_on_disk(store: Path, k: bytes) -> int:
    """Flip one byte in the middle of the page whose bytes start with ``k`` (the medium itself;
    the needle is longer than the key, which slot headers echo)."""
    needle = k + hashlib.shake_256(k).digest(32)
    n = 0
    for path in sorted(store.rglob("*.slots")):
        data = path.read_bytes()
        at = data.find(needle)
        if at >= 0:
            with open(path, "r+b") as f:
                f.seek(at + PAGE // 2)
                b = f.read(1)
                f.seek(at + PAGE // 2)
                f.write(bytes([b[0] ^ 0x5A]))
            n += 1
    return n


@pytest.mark.parametrize("scheme", ["mmap", "lmdb"])
def test_cli_sees_a_live_engine_exact_counts_across_restarts(tmp_path: Path, scheme: str) -> None:
    store = tmp_path / scheme
    url = f"{scheme}://{store}?budget=64MiB"
    plain = f"{scheme}://{store}"
    e = Engine(tmp_path, url, "a", n=20, hits=7, misses=5, evict=3)
    try:
        assert e.report == {"stored": 20, "ok": 7, "missed": 0, "extra_hits": 0, "evicted": 3, "hits": 7,
                            "misses": 5, "seals": 20, "bytes_read": 7 * PAGE, "bytes_written": 20 * PAGE,
                            "checksum_failures": 0}
        c = cli_counters(plain)  # while the engine runs
        assert {k: c[k] for k in ("hits", "misses", "bytes_read", "seals", "bytes_written", "evictions",
                                  "checksum_failures", "aborts", "dedup")} == {
            "hits": 7, "misses": 5, "bytes_read": 7 * PAGE, "seals": 20, "bytes_written": 20 * PAGE,
            "evictions": 3, "checksum_failures": 0, "aborts": 0, "dedup": 0}
        assert c["evicted_bytes"] >= 3 * PAGE
    finally:
        e.stop()
    # restart: the figures are still there, and the next engine adds on top of them
    assert cli_counters(plain)["seals"] == 20
    assert corrupt_on_disk(store, key("a", 0)) == 1
    e = Engine(tmp_path, url, "b", n=4, hits=4, misses=1, evict=0, extra=[key("a", 0), key("a", 1)])
    try:
        assert e.report["extra_hits"] == 1 and e.report["checksum_failures"] == 1  # a(0) failed, a(1) hit
        c = cli_counters(plain)
        assert (c["seals"], c["hits"], c["misses"]) == (24, 7 + 4 + 1, 5 + 1 + 1)
        assert c["bytes_read"] == 12 * PAGE and c["bytes_written"] == 24 * PAGE
        assert c["checksum_failures"] == 1 and c["evictions"] == 3
    finally:
        e.stop()


def test_concurrent_processes_add_up_exactly(tmp_path: Path) -> None:
    store = tmp_path / "l"
    url = f"lmdb://{store}?budget=64MiB"
    engines = [Engine(tmp_path, url, seed, n=10, hits=10, misses=2, evict=0) for seed in "xyz"]
    try:
        c = cli_counters(f"lmdb://{store}")
        assert (c["seals"], c["hits"], c["misses"], c["bytes_written"]) == (30, 30, 6, 30 * PAGE)
        with hk.open(f"lmdb://{store}") as p:  # a fourth process-like instance sees the same sums
            assert isinstance(p, SupportsStoreCounters)
            assert p.store_counters()["hits"] == 30
    finally:
        for e in engines:
            e.stop()


def test_tiered_counts_per_tier_for_an_outside_reader(tmp_path: Path) -> None:
    slow = f"mmap://{tmp_path / 's'}?budget=64MiB"
    url = ("tiered://?fast=" + urllib.parse.quote("pinned://?budget=16MiB", safe="")
           + "&slow=" + urllib.parse.quote(slow, safe=""))
    e = Engine(tmp_path, url, "t", n=12, hits=5, misses=2, evict=2)  # it flush()es before reporting
    try:
        c = cli_counters(url)
        assert (c["seals"], c["hits"], c["misses"], c["evictions"]) == (12, 5, 2, 2)
        assert (c["fast.seals"], c["fast.hits"], c["fast_hits"], c["slow_hits"]) == (12, 5, 5, 0)
        assert (c["slow.seals"], c["write_backs"], c["slow.bytes_written"]) == (12, 12, 12 * PAGE)
        assert c["slow.evictions"] == 2 and c["write_back_queue"] == 0 and c["promotions"] == 0
        # the slow store's own URL shows the same, with the tiered layer's columns beside its own
        raw = cli_counters(f"mmap://{tmp_path / 's'}")
        assert TieredProvider.counters_view(raw) == c
    finally:
        e.stop()


def test_every_built_in_provider_has_the_capability(tmp_path: Path) -> None:
    for url in ("pinned://?budget=4MiB", f"mmap://{tmp_path / 'm'}?budget=4MiB", f"lmdb://{tmp_path / 'l'}"):
        with hk.open(url) as p:
            assert isinstance(p, SupportsStoreCounters) and "store_counters" in type(p).capability_names()
            c = p.store_counters()
            for k in ("hits", "misses", "bytes_read", "seals", "bytes_written", "evictions", "checksum_failures"):
                assert c[k] == 0, (url, k)
    with hk.open("pinned://?budget=4MiB") as p:  # in-process: the instance's own figures
        p.put(key("p", 0), None, b"x" * 1000)
        assert isinstance(p, SupportsStoreCounters)
        assert p.read(key("p", 0), bytearray(1000)) and p.store_counters()["hits"] == 1


def test_a_reader_writes_nothing_and_a_damaged_file_is_replaced(tmp_path: Path) -> None:
    store = tmp_path / "m"
    with hk.open(f"mmap://{store}?budget=4MiB") as p:
        p.put(key("r", 0), None, b"y" * 5000)
    counters = store / "counters"
    before = counters.read_bytes()
    with hk.open(f"mmap://{store}?readonly=true") as r:
        assert r.read(key("r", 0), bytearray(5000)) and isinstance(r, SupportsStoreCounters)
        assert r.store_counters()["seals"] == 1  # sees the writers' figures ...
    assert counters.read_bytes() == before  # ... and never writes to the store
    counters.write_bytes(b"not a counters file")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with hk.open(f"mmap://{store}") as p:
            assert p.read(key("r", 0), bytearray(5000))  # the store itself is untouched
            assert isinstance(p, SupportsStoreCounters)
            assert p.store_counters()["hits"] == 1 and p.store_counters()["seals"] == 0
    assert any("not a counters file" in str(w.message) for w in caught)


def test_a_killed_process_keeps_its_counts_but_not_its_gauges(tmp_path: Path) -> None:
    from hostkv_providers.providers import _counters

    d = tmp_path / "c"
    d.mkdir(mode=0o700)
    script = textwrap.dedent(f"""
        import sys, time
        from hostkv_providers.providers._counters import StoreCounters
        c = StoreCounters.open({str(d)!r})
        c.columns(["hits"]); c.columns(["queue"], gauge=True)
        c.add("hits", 5); c.set_gauge("queue", 9)
        print("ready", flush=True)
        time.sleep(60)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, env=_env())
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        assert _counters.read_counters(str(d)) == {"hits": 5, "queue": 9}
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if proc.stdout is not None:
            proc.stdout.close()
    assert _counters.read_counters(str(d)) == {"hits": 5, "queue": 0}
    mine = _counters.StoreCounters.open(str(d))  # may reuse the dead row: adds on top
    assert mine is not None
    try:
        mine.columns(["hits"])
        mine.add("hits", 1)
        assert mine.totals() == {"hits": 6, "queue": 0}
    finally:
        mine.close()
