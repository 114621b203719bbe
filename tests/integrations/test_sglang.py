"""HostKVStorage built by SGLang's StorageBackendFactory (dynamic backend), called as HiCache does."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("sglang.srt.mem_cache.hicache_storage")

import _sglang_engine as eng
from _engine_helpers import corrupt_page, run_engine

from hostkv_providers.integrations.sglang import HostKVStorage


def _url(tmp_path: Path, name: str = "kv") -> str:
    return f"mmap://{tmp_path / name}?budget=64MiB&slot=32KiB"


def _shared_url(tmp_path: Path) -> str:
    # Several backends (TP ranks) open one store at once: LMDB's many-process store.
    return f"lmdb://{tmp_path / 'shared'}?budget=64MiB"


def _inner(backend: object) -> HostKVStorage:
    # The factory returns our class, or SGLang's failure-injector proxy around it when its test
    # environment variables are set.
    inner = getattr(backend, "_backend", backend)
    assert isinstance(inner, HostKVStorage)
    return inner


def test_store_restart_hit_bytes_equal(tmp_path: Path) -> None:
    url = _url(tmp_path)
    assert "stored 300" in run_engine("_sglang_engine.py", "store", url, "1", "300")
    backend = eng.make_backend(url)
    try:
        hashes = eng.page_hashes(1, 300)
        assert eng.hit_query(backend, hashes) == 300
        loaded, equal = eng.fetch(backend, hashes)
        assert loaded == 300 and all(equal)
        inner = _inner(backend)
        ours = inner._keyer.keys(hashes)
        infos = [inner.provider.entry(k) for k in ours]
        # Within a controller batch (STORAGE_BATCH_SIZE pages) SGLang's chain is the tree.
        assert infos[1] is not None and infos[1].parent == ours[0]
        assert all(i is not None and i.salt_tag == inner.salt.tag for i in infos)
    finally:
        backend.close()


def test_prefix_keys_link_batches(tmp_path: Path) -> None:
    backend = eng.make_backend(_url(tmp_path))
    try:
        inner = _inner(backend)
        hashes = eng.page_hashes(2, 6)
        from sglang.srt.mem_cache.hicache_storage import HiCacheStorageExtraInfo

        # batch_set_v1's chain: prefix_keys precede the batch, so the first page has a parent.
        pairs = inner._chain(hashes[3:], HiCacheStorageExtraInfo(prefix_keys=hashes[:3]))
        assert pairs[0][1] == inner._keyer.key(hashes[2]) and pairs[1][1] == pairs[0][0]
    finally:
        backend.close()


def test_tp_ranks_are_isolated_and_mla_is_shared(tmp_path: Path) -> None:
    url = _shared_url(tmp_path)
    hashes = eng.page_hashes(3, 20)
    r0, r1 = eng.make_backend(url, tp_rank=0, tp_size=2), eng.make_backend(url, tp_rank=1, tp_size=2)
    try:
        assert _inner(r0).salt.tag != _inner(r1).salt.tag
        assert eng.backup(r0, hashes, rank=0) == 20
        assert eng.hit_query(r1, hashes) == 0  # rank 1 never sees rank 0's heads
        assert eng.backup(r1, hashes, rank=1) == 20
        assert eng.fetch(r0, hashes, rank=0) == (20, [True] * 20)
        assert eng.fetch(r1, hashes, rank=1) == (20, [True] * 20)
    finally:
        r0.close()
        r1.close()
    # TP size and model are in the salt too.
    for kw in ({"tp_rank": 0, "tp_size": 1}, {"tp_rank": 0, "tp_size": 2, "model": "other/model"},
               {"tp_rank": 0, "tp_size": 2, "namespace": "tenant-b"}):
        b = eng.make_backend(url, **kw)  # type: ignore[arg-type]
        try:
            assert eng.hit_query(b, hashes) == 0, kw
        finally:
            b.close()
    # MLA KV is replicated across TP ranks: one copy, written by rank 0, read by every rank.
    m0 = eng.make_backend(url, tp_rank=0, tp_size=2, mla=True)
    m1 = eng.make_backend(url, tp_rank=1, tp_size=2, mla=True)
    try:
        assert _inner(m0).salt.tag == _inner(m1).salt.tag
        assert eng.backup(m1, hashes) == 20 and eng.hit_query(m0, hashes) == 0  # rank 1 is not a writer
        assert eng.backup(m0, hashes) == 20 and eng.hit_query(m1, hashes) == 20
    finally:
        m0.close()
        m1.close()


def test_corrupted_page_is_a_miss_never_wrong_bytes(tmp_path: Path) -> None:
    url = _url(tmp_path)
    hashes = eng.page_hashes(4, 10)
    b = eng.make_backend(url)
    try:
        assert eng.backup(b, hashes) == 10
    finally:
        b.close()
    needle = eng.page_tensor(hashes[6]).view(torch.uint8).numpy()[:256].tobytes()
    assert corrupt_page(tmp_path / "kv", needle) == 1
    b = eng.make_backend(url)
    try:
        assert eng.hit_query(b, hashes) == 10  # the index still lists it ...
        loaded, equal = eng.fetch(b, hashes)
        assert loaded == 6 and all(equal)  # ... but its read fails its checksum: a miss
        assert eng.hit_query(b, hashes) == 6  # and it is gone, with its subtree
        assert _inner(b).stats.load_misses >= 1
    finally:
        b.close()


def test_concurrent_prefetch_and_backup_threads(tmp_path: Path) -> None:
    # HiCacheController runs its prefetch (hit query + get) and backup (set) threads at once.
    b = eng.make_backend(_url(tmp_path))
    errors: list[BaseException] = []
    chains = [eng.page_hashes(100 + i, 40) for i in range(4)]

    def writer(hashes: list[str]) -> None:
        try:
            assert eng.backup(b, hashes) == 40
        except BaseException as exc:
            errors.append(exc)

    def reader(hashes: list[str]) -> None:
        try:
            for _ in range(5):
                n = eng.hit_query(b, hashes)
                loaded, equal = eng.fetch(b, hashes[:n])
                assert all(equal) and loaded <= n
        except BaseException as exc:
            errors.append(exc)

    try:
        threads = [threading.Thread(target=writer, args=(c,)) for c in chains]
        threads += [threading.Thread(target=reader, args=(c,)) for c in chains]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert all(eng.hit_query(b, c) == 40 for c in chains)
    finally:
        b.close()


def test_clear_removes_only_this_configuration(tmp_path: Path) -> None:
    url = _shared_url(tmp_path)
    hashes = eng.page_hashes(5, 8)
    a, other = eng.make_backend(url), eng.make_backend(url, namespace="other")
    try:
        eng.backup(a, hashes)
        eng.backup(other, hashes)
        a.clear()
        assert eng.hit_query(a, hashes) == 0 and eng.hit_query(other, hashes) == 8
    finally:
        a.close()
        other.close()


def test_missing_url_is_a_typed_error(tmp_path: Path) -> None:
    from hostkv_providers.errors import InvalidArgumentError

    with pytest.raises(InvalidArgumentError):
        eng.make_backend("")
