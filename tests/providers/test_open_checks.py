"""Issue 16 items 1, 3, 4, 9, 10, 11: what every open path of the persistent providers checks
before it trusts (or deletes) anything on disk.  Each test failed on the code before the fix."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

import hostkv_providers as hk
from hostkv_providers.errors import CorruptStoreError, StoreNotFoundError, UnsafeStoreError
from hostkv_providers.testing import chain, page_bytes, put_chain

PAGE = 16384
SCHEMES = ("mmap", "lmdb")


def _url(scheme: str, path: Path, **opts: str) -> str:
    base = {"budget": "8MiB", **({"slot": "16KiB"} if scheme == "mmap" else {}), **opts}
    return f"{scheme}://{path}?" + "&".join(f"{k}={v}" for k, v in base.items())


def _filled(scheme: str, path: Path, n: int = 6) -> list[hk.Key]:
    keys = chain(f"open-checks/{scheme}", n)
    with hk.open(_url(scheme, path)) as p:
        put_chain(p, keys, PAGE)
    return keys


def _files(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in sorted(root.rglob("*")) if f.is_file()
            and f.name not in ("lock.mdb", "writer.lock", "hostkv.lock")}


# -- item 1: the mmap manifest is checksummed; nothing is deleted on its say-so -------------------


def test_mmap_manifest_with_a_changed_generation_refuses_and_deletes_nothing(tmp_path: Path) -> None:
    store = tmp_path / "s"
    keys = _filled("mmap", store)
    man_path = store / "manifest.json"
    man = json.loads(man_path.read_text())
    man["generation"] += 1  # still valid JSON: the old code deleted every file of the real generation
    man_path.write_text(json.dumps(man, indent=1, sort_keys=True))
    before = _files(store)
    for readonly in ("true", "false"):
        with pytest.raises(CorruptStoreError, match="checksum"):
            hk.open(f"mmap://{store}", readonly=readonly)
    assert _files(store) == before
    # the real generation back (the checksum recomputed): every page is still there
    from hostkv_providers.providers.mmap._recovery import _MANIFEST_CHECKSUM, _manifest_digest

    fixed = json.loads(before["manifest.json"])
    fixed["generation"] -= 1
    fixed[_MANIFEST_CHECKSUM] = _manifest_digest({k: v for k, v in fixed.items() if k != _MANIFEST_CHECKSUM})
    man_path.write_text(json.dumps(fixed, indent=1, sort_keys=True))
    with hk.open(f"mmap://{store}") as p:
        assert [p.read_bytes(k) for k in keys] == [page_bytes(k, PAGE) for k in keys]


def _strip_checksum(store: Path, **changes: object) -> None:
    """Make ``store``'s manifest one of the format before ``manifest_xxh3`` existed."""
    man_path = store / "manifest.json"
    man = json.loads(man_path.read_text())
    man.pop("manifest_xxh3")
    man.update(changes)
    man_path.write_text(json.dumps(man, indent=1, sort_keys=True))


def test_mmap_legacy_manifest_without_checksum_opens_and_is_migrated(tmp_path: Path) -> None:
    """Compat: a store written before ``manifest_xxh3`` existed (its manifest lacks the field)
    opens when the generation it names checks out; a writer open rewrites it with the checksum.
    The code before this refused every such store outright."""
    store = tmp_path / "s"
    keys = _filled("mmap", store)
    _strip_checksum(store)
    before = _files(store)
    with hk.open(f"mmap://{store}", readonly="true") as p:  # a reader: nothing rewritten
        assert [p.read_bytes(k) for k in keys] == [page_bytes(k, PAGE) for k in keys]
    assert _files(store) == before
    with hk.open(f"mmap://{store}") as p:
        assert [p.read_bytes(k) for k in keys] == [page_bytes(k, PAGE) for k in keys]
    assert "manifest_xxh3" in json.loads((store / "manifest.json").read_text())  # migrated
    with hk.open(f"mmap://{store}", readonly="true") as p:
        assert p.present(keys) == [True] * len(keys)
        assert p.verify().ok


def test_mmap_legacy_manifest_naming_a_wrong_generation_is_refused_and_deletes_nothing(tmp_path: Path) -> None:
    """A legacy manifest (no checksum) is trusted only as far as its generation's files vouch
    for it: a changed generation digit (no index files of that generation), or a generation
    whose index header does not check out, refuses every open and deletes nothing."""
    store = tmp_path / "s"
    keys = _filled("mmap", store)
    man = json.loads((store / "manifest.json").read_text())
    gen = man["generation"]
    _strip_checksum(store, generation=gen + 1)  # the flipped digit of item 1, without a checksum
    before = _files(store)
    for readonly in ("true", "false"):
        with pytest.raises(CorruptStoreError, match="no checksum"):
            hk.open(f"mmap://{store}", readonly=readonly)
    assert _files(store) == before
    # the right generation, but its journal header tampered with: refused as well
    legacy = json.loads(before["manifest.json"])
    legacy["generation"] = gen
    (store / "manifest.json").write_text(json.dumps(legacy, indent=1, sort_keys=True))
    journal = store / f"index.{gen}.journal"
    raw = bytearray(journal.read_bytes())
    raw[10] ^= 0xFF  # inside the store id the header carries
    journal.write_bytes(bytes(raw))
    snap = store / f"index.{gen}.snap"
    if snap.exists():
        snap.unlink()
    before = _files(store)
    for readonly in ("true", "false"):
        with pytest.raises(CorruptStoreError, match="does not check out"):
            hk.open(f"mmap://{store}", readonly=readonly)
    assert _files(store) == before
    # the checksum field's own name damaged: not a legal older manifest (unknown field), refused
    legacy["manifest_xxi3"] = "0" * 16
    (store / "manifest.json").write_text(json.dumps(legacy, indent=1, sort_keys=True))
    with pytest.raises(CorruptStoreError, match="not a manifest of an older format"):
        hk.open(f"mmap://{store}", readonly="true")
    assert len(keys) == 6


def test_mmap_legacy_manifest_never_lets_a_writer_delete_other_generations(tmp_path: Path) -> None:
    """A legacy manifest beside files of another generation (a compaction cut short) opens its
    own generation, but neither deletes the other one nor rewrites itself (it would then vouch
    for itself and the next writer open would delete them)."""
    store = tmp_path / "s"
    keys = _filled("mmap", store)
    gen = json.loads((store / "manifest.json").read_text())["generation"]
    _strip_checksum(store)
    other = store / f"index.{gen + 1}.journal"
    other.write_bytes((store / f"index.{gen}.journal").read_bytes())
    other.chmod(0o600)
    for _ in range(2):
        with hk.open(f"mmap://{store}") as p:
            assert [p.read_bytes(k) for k in keys] == [page_bytes(k, PAGE) for k in keys]
            assert any("no checksum" in problem for problem in p.describe()["last_recovery"]["problems"])
        assert other.exists()
        assert "manifest_xxh3" not in json.loads((store / "manifest.json").read_text())


def test_mmap_manifest_nested_deep_is_a_typed_error(tmp_path: Path) -> None:
    store = tmp_path / "s"
    _filled("mmap", store)
    man_path = store / "manifest.json"
    man_path.write_text("[" * 5000 + "]" * 5000)  # item 11: a bare RecursionError before
    for readonly in ("true", "false"):
        with pytest.raises(CorruptStoreError):
            hk.open(f"mmap://{store}", readonly=readonly)


# -- item 3: a random snapshot does not make the store look empty ---------------------------------


def test_mmap_random_snapshot_refuses_instead_of_reading_as_empty(tmp_path: Path) -> None:
    store = tmp_path / "s"
    _filled("mmap", store)
    with hk.open(f"mmap://{store}") as p:  # a clean close writes the snapshot
        assert p.stats().entries == 6
    snaps = list(store.glob("index.*.snap"))
    assert snaps
    size = snaps[0].stat().st_size
    snaps[0].write_bytes(os.urandom(size))
    before = _files(store)
    for readonly in ("true", "false"):
        with pytest.raises(CorruptStoreError, match="snapshot header"):
            hk.open(f"mmap://{store}", readonly=readonly)
    assert _files(store) == before  # the writer did not write an empty index over it


# -- item 4 (library side): no provider adopts a directory of unrelated files ---------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_writer_open_never_adopts_a_directory_of_other_files(tmp_path: Path, scheme: str) -> None:
    d = tmp_path / "junk"
    d.mkdir(mode=0o700)
    (d / "notes.txt").write_text("mine")
    (d / "notes.txt").chmod(0o600)
    with pytest.raises(StoreNotFoundError):
        hk.open(_url(scheme, d))
    assert sorted(os.listdir(d)) in (["notes.txt"], ["hostkv.lock", "notes.txt"], ["notes.txt", "writer.lock"])
    with pytest.raises(StoreNotFoundError):
        hk.open(f"{scheme}://{d}", readonly="true")


# -- item 10: one rule for a pre-made empty directory ----------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_empty_directory_rule_is_the_same_for_every_provider(tmp_path: Path, scheme: str) -> None:
    """An empty directory of our own that others cannot write (0755: a mkdir under umask 022)
    is adopted and tightened to 0700 (lmdb refused it, mmap adopted it); one that others can
    write (0775, 0777) is refused by both (mmap adopted it)."""
    ok = tmp_path / "ok"
    ok.mkdir()
    ok.chmod(0o755)
    with hk.open(_url(scheme, ok)) as p:
        put_chain(p, chain("empty-dir", 2), PAGE)
    assert ok.stat().st_mode & 0o777 == 0o700
    for mode in (0o775, 0o777, 0o757):
        bad = tmp_path / f"bad{mode:o}"
        bad.mkdir()
        bad.chmod(mode)
        with pytest.raises(UnsafeStoreError):
            hk.open(_url(scheme, bad))
        assert os.listdir(bad) == []


# -- item 9: every open path checks what the writer open checks -----------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_read_only_opens_refuse_symlinks_and_loose_files(tmp_path: Path, scheme: str) -> None:
    store = tmp_path / "s"
    _filled(scheme, store)
    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * 4096)
    outside.chmod(0o600)
    link = store / ("data.1.0009.slots" if scheme == "mmap" else "slots/00000099.slots")
    link.symlink_to(outside)
    for readonly in ("true", "false"):
        with pytest.raises(UnsafeStoreError, match="symlink"):
            hk.open(f"{scheme}://{store}", readonly=readonly)
    link.unlink()
    lock = store / ("writer.lock" if scheme == "mmap" else "hostkv.lock")
    victims = [p for p in (lock, *sorted(store.rglob("*.slots"))) if p.exists()]
    assert victims
    for victim in victims[:2]:
        mode = victim.stat().st_mode & 0o777
        victim.chmod(0o644)
        with pytest.raises(UnsafeStoreError):
            hk.open(f"{scheme}://{store}", readonly="true")
        victim.chmod(mode)
    if scheme == "lmdb":
        (store / "slots").chmod(0o755)
        with pytest.raises(UnsafeStoreError):
            hk.open(f"{scheme}://{store}", readonly="true")
        (store / "slots").chmod(0o700)
    with hk.open(f"{scheme}://{store}", readonly="true") as p:
        assert p.stats().entries == 6


# -- item 15 (library side): an own store at mode 000 --------------------------------------------


@pytest.mark.parametrize("scheme", SCHEMES)
def test_own_store_at_mode_000_is_refused_with_a_chmod_hint(tmp_path: Path, scheme: str) -> None:
    store = tmp_path / "s"
    _filled(scheme, store)
    store.chmod(0o000)
    try:
        for readonly in ("true", "false"):
            with pytest.raises(UnsafeStoreError, match="cannot list or enter") as info:
                hk.open(f"{scheme}://{store}", readonly=readonly)
            assert "chmod 0700" in info.value.hint
    finally:
        store.chmod(0o700)


def test_lmdb_entry_record_with_a_huge_size_is_a_miss(tmp_path: Path) -> None:
    """Item 11: an entry record with a valid CRC and nbytes=2**40 gave MemoryError from
    read_bytes and a misleading InvalidArgumentError from read.  Records are parsed with bounds:
    such a record is a corrupt entry, i.e. a miss."""
    import lmdb

    from hostkv_providers.providers.lmdb._format import _Entry

    store = tmp_path / "s"
    keys = _filled("lmdb", store, 3)
    env = lmdb.open(str(store), subdir=True, max_dbs=16, lock=True)
    db = env.open_db(b"entries")
    with env.begin(write=True) as txn:
        e = _Entry.unpack(keys[2], txn.get(keys[2], db=db))
        e.nbytes = 1 << 40
        txn.put(keys[2], e.pack(), db=db)
    env.close()
    with hk.open(f"lmdb://{store}") as p:
        assert p.read_bytes(keys[2]) is None
        assert p.read(keys[2], bytearray(PAGE)) is False
        assert p.read_bytes(keys[1]) == page_bytes(keys[1], PAGE)
