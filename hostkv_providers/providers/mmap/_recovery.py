"""Opening an mmap store: directory adoption, manifest, loading the snapshot and replaying the
journal, validating the records against the slot headers, rebuilding the accounting."""

from __future__ import annotations

import contextlib
import json
import logging
import mmap
import os
import re
import secrets
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import numpy as np
import numpy.typing as npt
import xxhash

from hostkv_providers._checks import check_anchor_name
from hostkv_providers._checksum import CHECKSUM_ALGORITHM
from hostkv_providers._errors import (
    CorruptStoreError,
    IncompatibleStoreError,
    InvalidArgumentError,
    StorageIOError,
    StoreNotFoundError,
)
from hostkv_providers._keys import FORMAT_VERSION, KEY_ALGORITHM
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._slotfile import (
    FLAG_ANCHOR,
    SLOT_MAGIC,
    ReadResult,
    SlotFile,
)

from ._format import (
    _DATA_NAME,
    _DEFAULT_BUDGET,
    _DEFAULT_SLOT,
    _JOURNAL_MAGIC,
    _KNOWN_NAME,
    _MANIFEST_LIMIT,
    _MAX_FILE,
    _REC_DELETE,
    _SNAP_HEADER,
    _SNAP_MAGIC,
    _TAG_MAX,
    _WORDS,
    MMAP_FORMAT,
    MMAP_FORMAT_VERSION,
    MMAP_READABLE_VERSIONS,
    OP_ANCHOR,
    OP_DROP,
    OP_RETAIN,
    OP_SEAL,
    REC_NBYTES,
    RECORD_DTYPE,
    RECORD_FOLD,
    _columns,
    _fold_columns,
    _folds_ok,
    _read_exact,
    _records_of,
    _unsafe,
)
from ._index import _Anchor, _Index
from ._snapshot import _Snapshots

if TYPE_CHECKING:
    pass


_log = logging.getLogger(__name__)

#: The manifest's own checksum field: XXH3-64 (hex) of the canonical JSON of every other field.
_MANIFEST_CHECKSUM = "manifest_xxh3"
_LEGACY = object()  # "the manifest has no checksum field" (an older format)
#: the fields of a manifest written before ``manifest_xxh3`` existed
_LEGACY_FIELDS = frozenset({
    "format", "format_version", "store_format_version", "key_algorithm", "checksum_algorithm", "record_fold",
    "record_nbytes", "store_id", "generation", "slot_nbytes", "file_nbytes", "budget_bytes", "created"})


def _manifest_digest(fields: Mapping[str, Any]) -> str:
    canonical = json.dumps(dict(fields), sort_keys=True, separators=(",", ":")).encode()
    return f"{xxhash.xxh3_64_intdigest(canonical):016x}"


class _Recovery(_Snapshots):
    """Open, load and replay (a part of :class:`MmapProvider`)."""

    # -- open ------------------------------------------------------------------------------------
    def _open(self, budget: int | None, slot_nbytes: int | None, file_nbytes: int | None, create: bool) -> None:
        manifest_path = self._p("manifest.json")
        if self._readonly:
            _fsutil.check_private_dir(self.path)
        else:
            _fsutil.prepare_store_dir(self.path, create=create)
        _fsutil.check_store_entries(self.path)  # readers check what writers check (issue 16 item 9)
        lock_path = self._p("writer.lock")
        made_lock = False
        if not self._readonly:
            made_lock = not _fsutil.lexists(lock_path, f"looking for {lock_path}")
            self._lockfile = _fsutil.LockFile(lock_path)
        exists = _fsutil.lexists(manifest_path, f"looking for {manifest_path}")
        if not exists:
            if self._readonly or not create:
                raise StoreNotFoundError(f"no mmap store at {self.path} (manifest.json missing)")
            # never adopt a directory holding something else (issue 16 item 4)
            try:
                _fsutil.check_not_foreign(self.path, lambda name: name == "writer.lock")
            except BaseException:
                # (and leave nothing behind in it: a writer.lock left in an lmdb store's directory
                # made every later open of that store refuse it as holding a foreign file)
                if made_lock:
                    with contextlib.suppress(OSError):
                        os.unlink(lock_path)
                raise
            self._create_store(budget, slot_nbytes, file_nbytes)
        man = self._read_manifest()
        self._manifest = man
        self._gen = int(man["generation"])
        self._slot = int(man["slot_nbytes"])
        legacy = _MANIFEST_CHECKSUM not in man
        #: other generations' files a legacy manifest leaves alone (it may not vouch for them)
        self._legacy_keep: list[str] = []
        if legacy:
            self._check_legacy_generation(man)
        if slot_nbytes is not None and slot_nbytes != self._slot:
            raise IncompatibleStoreError(
                f"{self.path} has {self._slot}-byte slots, the URL asks for {slot_nbytes}",
                hint="drop the slot= option or compact into a new store")
        self._store_id = bytes.fromhex(str(man["store_id"]))
        self._budget = budget if budget is not None else int(man["budget_bytes"])
        fb = file_nbytes if file_nbytes is not None else int(man.get("file_nbytes", 0)) or min(self._budget, _MAX_FILE)
        self._file_slots = max(1, fb // self._slot)
        self._idx.budget = self._budget
        t_open = time.monotonic()
        if not self._readonly:
            self._cleanup_dir()
            self._load()
        else:
            self._load_reader()
        #: what this open found and repaired (``describe()["last_recovery"]``)
        self._recovery: dict[str, Any] = {
            "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "by_pid": os.getpid(),
            "readonly": self._readonly, "seconds": round(time.monotonic() - t_open, 4),
            "entries": int(self._idx.count), "problems": list(self._problems[:5]),
            "problems_total": len(self._problems), "stale_entries_dropped": int(self._stale_at_open),
        }
        if not self._readonly:
            if not self._files:  # preallocate the first data file now: a full disk fails at open
                self._add_data_file(self._file_slots)
            self._open_journal_for_append()
            # A legacy manifest whose generation checked out is migrated: rewritten with its
            # checksum.  Beside other generations it is not (it may be the file that is wrong;
            # rewritten, it would vouch for itself and the next writer open would delete them):
            # compact writes a checksummed one.  A version-1 store is upgraded: its records are
            # all valid version-2 records.
            if not self._legacy_keep and (
                    legacy or self._budget != int(man["budget_bytes"])
                    or man.get("format_version") != MMAP_FORMAT_VERSION
                    or (file_nbytes is not None and file_nbytes != int(man.get("file_nbytes", 0)))):
                man = dict(man, budget_bytes=self._budget, file_nbytes=self._file_slots * self._slot,
                           format_version=MMAP_FORMAT_VERSION)
                self._write_manifest(man)
                self._manifest = man
                if legacy:
                    _log.info("%s: manifest.json of an older format (no checksum) rewritten with its checksum",
                              self.path)
            if self._idx.used_cost > self._budget:
                self._free_rows_storage(self._idx.evict_cost(self._idx.used_cost - self._budget), journal=True)
            if self._load_needs_snapshot:
                self._snapshot()

    def _create_store(self, budget: int | None, slot_nbytes: int | None, file_nbytes: int | None) -> None:
        slot = _DEFAULT_SLOT if slot_nbytes is None else slot_nbytes
        if type(slot) is not int or slot <= 0 or slot % 4096:
            raise InvalidArgumentError(f"slot size must be a positive multiple of 4096, got {slot!r}")
        b = _DEFAULT_BUDGET if budget is None else budget
        if b < slot:
            raise InvalidArgumentError(f"budget {b} is smaller than one slot ({slot})")
        fb = min(b, _MAX_FILE) if file_nbytes is None else file_nbytes
        if fb < slot:
            raise InvalidArgumentError(f"file_size {fb} is smaller than one slot ({slot})")
        man: dict[str, Any] = {
            "format": MMAP_FORMAT,
            "format_version": MMAP_FORMAT_VERSION,
            "store_format_version": FORMAT_VERSION,
            "key_algorithm": KEY_ALGORITHM,
            "checksum_algorithm": CHECKSUM_ALGORITHM,
            "record_fold": RECORD_FOLD,
            "record_nbytes": REC_NBYTES,
            "store_id": secrets.token_bytes(16).hex(),
            "generation": 1,
            "slot_nbytes": slot,
            "file_nbytes": fb // slot * slot,
            "budget_bytes": b,
            "created": time.time(),
        }
        self._write_manifest(man)

    def _write_manifest(self, man: Mapping[str, Any]) -> None:
        body = {k: v for k, v in man.items() if k != _MANIFEST_CHECKSUM}
        body[_MANIFEST_CHECKSUM] = _manifest_digest(body)
        _fsutil.atomic_write(self._p("manifest.json"), json.dumps(body, indent=1, sort_keys=True).encode())

    def _disk_generation(self) -> int | None:
        """The generation the manifest on disk names, or ``None`` if it cannot be read."""
        try:
            gen = self._read_manifest().get("generation")
        except Exception:
            return None
        return gen if isinstance(gen, int) else None

    def _read_manifest(self) -> dict[str, Any]:
        path = self._p("manifest.json")
        raw = _fsutil.read_small_file(path, _MANIFEST_LIMIT)
        if raw.count(b"[") + raw.count(b"{") > 64:
            # json.loads recurses per level: 5,000 levels raised a bare RecursionError
            raise CorruptStoreError(f"{path} nests deeper than a manifest does",
                                    hint="restore the manifest or remove the store")
        try:
            man = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError, RecursionError):
            raise CorruptStoreError(f"{path} is not valid JSON",
                                    hint="restore the manifest or remove the store") from None
        if not isinstance(man, dict) or man.get("format") != MMAP_FORMAT:
            raise IncompatibleStoreError(f"{path} does not describe an mmap store (format {man.get('format')!r})"
                                         if isinstance(man, dict) else f"{path} is not a manifest")
        version = man.get("format_version")
        if version not in MMAP_READABLE_VERSIONS:
            raise IncompatibleStoreError(
                f"{self.path} is an mmap store of format version {version!r}; this build reads versions "
                f"{', '.join(map(str, MMAP_READABLE_VERSIONS))}",
                hint="open it with the hostkv-providers version that wrote it, or remove the store")
        for field, want in (("key_algorithm", KEY_ALGORITHM), ("checksum_algorithm", CHECKSUM_ALGORITHM),
                            ("record_fold", RECORD_FOLD), ("record_nbytes", REC_NBYTES),
                            ("store_format_version", FORMAT_VERSION)):
            if man.get(field) != want:
                raise IncompatibleStoreError(f"{self.path}: {field} is {man.get(field)!r}, this build uses {want!r}")
        # A manifest whose digest fails refuses to open, whatever it says: one flipped digit of
        # "generation" once made the next writer delete every file of the real generation.  One
        # written before the checksum existed (no field at all) is checked against the files of
        # the generation it names instead (_check_legacy_generation, at open).
        recorded = man.get(_MANIFEST_CHECKSUM, _LEGACY)
        if recorded is not _LEGACY and recorded != _manifest_digest(
                {k: v for k, v in man.items() if k != _MANIFEST_CHECKSUM}):
            raise CorruptStoreError(
                f"{path} fails its checksum" if isinstance(recorded, str) else f"{path} carries no checksum",
                hint="nothing was changed; restore manifest.json from a backup, or remove the store")
        for field in ("generation", "slot_nbytes", "budget_bytes"):
            v = man.get(field)
            if type(v) is not int or v <= 0:
                raise CorruptStoreError(f"{path}: field {field} is {v!r}")
        if man["slot_nbytes"] % 4096 or man["slot_nbytes"] > 1 << 34:
            raise CorruptStoreError(f"{path}: slot size {man['slot_nbytes']} is not a multiple of 4096")
        sid = man.get("store_id")
        if not isinstance(sid, str) or not re.fullmatch(r"[0-9a-f]{32}", sid):
            raise CorruptStoreError(f"{path}: bad store_id")
        return man

    def _check_legacy_generation(self, man: Mapping[str, Any]) -> None:
        """A manifest without ``manifest_xxh3`` (written before the field existed) is trusted
        only as far as the files of the generation it names vouch for it: at least one index file
        of that generation (unless the store holds no data and index files at all), every one of
        them with a header that checks out and names this store (and this generation), every data
        file of it a slot file of this store and slot size.  Anything else is
        ``CorruptStoreError`` and nothing is changed.  Files of other generations are kept
        (``_legacy_keep``): the manifest may be the file that is wrong."""
        path = self._p("manifest.json")
        gen = self._gen
        hint = "nothing was changed; restore manifest.json from a backup, or remove the store"
        # a legal older manifest holds exactly the fields of that format: anything else (the
        # checksum field's name itself damaged, say) is not one
        unknown = sorted(set(man) - _LEGACY_FIELDS)
        if unknown or not isinstance(man.get("file_nbytes", 0), int) or not isinstance(
                man.get("created", 0.0), (int, float)):
            raise CorruptStoreError(
                f"{path} carries no checksum and is not a manifest of an older format"
                + (f" (unknown fields {', '.join(map(repr, unknown[:3]))})" if unknown else ""), hint=hint)
        names = _fsutil.listdir(self.path)
        index_ours = [n for n in (self._snap_name(gen), self._journal_name(gen)) if n in names]
        data_ours = [n for n in names if (m := _DATA_NAME.match(n)) and int(m.group(1)) == gen]
        others = sorted(n for n in names if (m := re.match(r"^(?:data|index)\.(\d{1,9})\.", n))
                        and int(m.group(1)) != gen and _KNOWN_NAME.match(n))
        if not index_ours and (data_ours or others):
            raise CorruptStoreError(
                f"{path} carries no checksum (an older format) and names generation {gen}, which has no index "
                "file", hint=hint)
        store_id = bytes.fromhex(str(man["store_id"]))
        for name in index_ours:
            full = self._p(name)
            try:
                fd = _fsutil.open_private(full, os.O_RDONLY)
            except FileNotFoundError:
                continue  # removed meanwhile (a writer's rotation): the load reports what is left
            try:
                head = os.pread(fd, REC_NBYTES, 0)
            except OSError as exc:
                raise _fsutil.io_error(exc, f"reading {full}") from exc
            finally:
                os.close(fd)
            if name.endswith(".snap"):
                ok = (len(head) >= 64 and head[:8] == _SNAP_MAGIC and head[8:24] == store_id
                      and xxhash.xxh3_64_intdigest(head[:56]) == int.from_bytes(head[56:64], "little"))
            else:
                ok = (len(head) == REC_NBYTES and head[:8] == _JOURNAL_MAGIC and head[8:24] == store_id
                      and int.from_bytes(head[24:32], "little") == gen
                      and xxhash.xxh3_64_intdigest(head[:152]) == int.from_bytes(head[152:160], "little"))
            if not ok:
                raise CorruptStoreError(
                    f"{path} carries no checksum (an older format) and the header of {name} does not check out "
                    f"for generation {gen} of this store", hint=hint)
        for name in data_ours:
            SlotFile.open(self._p(name), writable=False, store_id=store_id, slot_nbytes=self._slot).close()
        self._legacy_keep = others
        if others:
            self._problems_note(f"manifest.json carries no checksum (an older format) and other generations are "
                                f"present ({', '.join(others[:2])}): kept, manifest not rewritten; run compact")

    def _cleanup_dir(self) -> None:
        """Writer only: reclaim temp files and files of another generation (half-done
        compactions, R3); refuse symlinks and unknown files are left alone."""
        names = _fsutil.listdir(self.path)
        ours = [n for n in names if re.match(rf"^index\.{self._gen}\.", n)]
        others = [n for n in names if re.match(r"^index\.\d{1,9}\.", n) and n not in ours]
        if others and not ours:
            # the manifest names a generation with no index at all while another generation has
            # one: deleting "the other generation" would delete the store
            raise CorruptStoreError(
                f"{self.path}: the manifest names generation {self._gen}, the index files are "
                f"{', '.join(sorted(others)[:2])}", hint="nothing was deleted; restore manifest.json")
        removed = _fsutil.remove_temp_files(self.path)
        if removed:
            self._problems_note(f"removed {len(removed)} leftover temp file(s)")
        for name in _fsutil.listdir(self.path):
            full = self._p(name)
            if os.path.islink(full):
                raise _unsafe(f"{full} is a symlink; symlinks inside a store are refused")
            m = re.match(r"^(?:data|index)\.(\d{1,9})\.", name)
            if m and int(m.group(1)) != self._gen and _KNOWN_NAME.match(name) and name not in self._legacy_keep:
                with contextlib.suppress(OSError):
                    os.unlink(full)

    def _problems_note(self, text: str) -> None:
        self._problems.append(text)

    # -- loading the index -----------------------------------------------------------------------
    def _load_reader(self) -> None:
        """A reader's load, retried when the writer swaps files underneath (snapshot rotation,
        compaction deleting the old generation between our listing and our opens)."""
        for attempt in range(8):
            try:
                if attempt:
                    man = self._read_manifest()
                    self._manifest = man
                    self._gen = int(man["generation"])
                    self._idx = _Index(self._budget)
                    self._problems = []
                self._load()
                return
            except (CorruptStoreError, StorageIOError, FileNotFoundError):
                if attempt == 7:
                    raise
                time.sleep(0.01 * (attempt + 1))

    def _load(self) -> None:
        """Open data files and rebuild the index from snapshot + journal (module docstring)."""
        self._load_needs_snapshot = False
        sig = self._signature()  # before reading: a change made while we load triggers the next refresh
        self._open_data_files()
        snap, snap_seq = self._read_snapshot()
        jcols = self._read_journal(snap_seq)
        self._jrecords = jcols.shape[1]
        cols = np.concatenate([snap, jcols], axis=1) if jcols.shape[1] else snap
        self._apply_records(cols, n_snap=snap.shape[1])
        # new records must sort after everything the snapshot covers
        self._idx.clock = max(self._idx.clock, snap_seq + 1)
        self._state_sig = sig

    def _signature(self) -> tuple[Any, ...]:
        sig: list[Any] = []
        for name in ("manifest.json", self._snap_name(self._gen), self._journal_name(self._gen)):
            try:
                st = os.stat(self._p(name))
                sig.append((st.st_ino, st.st_size, st.st_mtime_ns))
            except OSError:
                sig.append(None)
        sig.append(tuple(sorted(n for n in _fsutil.listdir(self.path) if _DATA_NAME.match(n))))
        return tuple(sig)

    def _open_data_files(self) -> None:
        for sf in self._files.values():
            sf.close()
        self._files = {}
        for name in sorted(_fsutil.listdir(self.path)):
            m = _DATA_NAME.match(name)
            if not m or int(m.group(1)) != self._gen:
                continue
            sf = SlotFile.open(self._p(name), writable=not self._readonly, store_id=self._store_id,
                               slot_nbytes=self._slot)
            if sf.file_id != int(m.group(2)) or sf.file_id in self._files:
                sf.close()
                raise CorruptStoreError(f"{name}: file id {sf.file_id} does not match its name")
            sf.io = self._io
            self._files[sf.file_id] = sf
        self._free = {fid: np.ones(sf.slot_count, np.bool_) for fid, sf in self._files.items()}

    def _read_snapshot(self) -> tuple[npt.NDArray[np.uint64], int]:
        path = self._p(self._snap_name(self._gen))
        try:
            fd = _fsutil.open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            return np.zeros((_WORDS, 0), np.uint64), 0
        mm: mmap.mmap | None = None
        try:
            size = os.fstat(fd).st_size
            head = os.pread(fd, 64, 0)
            if size > _SNAP_HEADER + (1 << 20):
                # large: map it populated (one call instead of a fault per 4 KiB) and let the
                # column transpose be the only copy
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0),
                               prot=mmap.PROT_READ)
                body: bytes | memoryview = memoryview(mm)[_SNAP_HEADER:]
            else:
                body = _read_exact(fd, _SNAP_HEADER, max(0, size - _SNAP_HEADER))
        except OSError as exc:
            raise _fsutil.io_error(exc, f"reading {path}") from exc
        finally:
            os.close(fd)
        try:
            return self._parse_snapshot(head, body)
        finally:
            if mm is not None:
                if isinstance(body, memoryview):
                    body.release()
                mm.close()

    def _parse_snapshot(self, head: bytes, body: bytes | memoryview) -> tuple[npt.NDArray[np.uint64], int]:
        seq = 0
        ok_header = (len(head) == 64 and head[:8] == _SNAP_MAGIC
                     and xxhash.xxh3_64_intdigest(head[:56]) == int.from_bytes(head[56:64], "little")
                     and head[8:24] == self._store_id)
        count = len(body) // REC_NBYTES
        if ok_header:
            seq = int.from_bytes(head[24:32], "little")
            declared = int.from_bytes(head[32:40], "little")
            if declared != count:
                self._problems_note(f"snapshot declares {declared} records, holds {count}")
                self._load_needs_snapshot = True
        else:
            # The snapshot is installed by rename, never torn: a header that fails its checksum is
            # damage, and salvaging the records after it made a random file read as an empty store
            # (a writer then wrote that empty index over it).  Refuse; nothing is changed.
            raise CorruptStoreError(
                f"{self._p(self._snap_name(self._gen))}: snapshot header fails its checksum "
                "(or names another store)",
                hint="nothing was changed; restore the file from a backup, or remove the store")
        view = np.frombuffer(body[: count * REC_NBYTES], RECORD_DTYPE)
        W = _columns(view)
        del view
        good = _fold_columns(W)
        if not good.all():
            self._problems_note(f"snapshot: {int((~good).sum())} damaged record(s) skipped")
            self._load_needs_snapshot = True
            W = W[:, good]
            W[11] = 0  # positions moved: parent hints are void, parents are searched instead
        return W, seq

    def _read_journal(self, after_seq: int) -> npt.NDArray[np.uint64]:
        path = self._p(self._journal_name(self._gen))
        try:
            fd = _fsutil.open_private(path, os.O_RDONLY)
        except FileNotFoundError:
            self._jvalid_end = REC_NBYTES
            self._last_mode = 0
            return np.zeros((_WORDS, 0), np.uint64)
        try:
            size = os.fstat(fd).st_size
            raw = _read_exact(fd, 0, size)
        except OSError as exc:
            raise _fsutil.io_error(exc, f"reading {path}") from exc
        finally:
            os.close(fd)
        head = raw[:REC_NBYTES]
        if not (len(head) == REC_NBYTES and head[:8] == _JOURNAL_MAGIC
                and xxhash.xxh3_64_intdigest(head[:152]) == int.from_bytes(head[152:160], "little")):
            # a power cut (durability=none) or a truncation can take the header with it: the
            # records carry their own checksums and are salvaged one by one
            self._problems_note("journal header damaged: records salvaged")
            self._load_needs_snapshot = True
        else:
            self._last_mode = head[32]
        # the journal is preallocated ahead with zeros: parse only up to the last nonzero byte
        body = raw[REC_NBYTES:]
        used = len(body.rstrip(b"\0"))
        count = -(-used // REC_NBYTES)
        chunk = body[: count * REC_NBYTES].ljust(count * REC_NBYTES, b"\0")
        recs = np.frombuffer(chunk, RECORD_DTYPE)
        good = _folds_ok(recs) & (recs["op"] != 0)
        nz = np.flatnonzero(good)
        last = int(nz[-1]) + 1 if len(nz) else 0
        self._jvalid_end = REC_NBYTES + last * REC_NBYTES
        bad_inside = int(last - good[:last].sum())
        tail = recs[last:]
        if len(tail):
            # Records after the last valid one: a torn append (kill -9 or a power cut mid-write)
            # leaves the record's end zero; a complete record that does not verify is damage.
            complete = int((tail["fold"] != 0).sum())
            if complete:
                bad_inside += complete
            else:
                self._torn_tail = True
        if bad_inside:
            self._problems_note(f"journal: {bad_inside} damaged record(s) skipped")
            self._load_needs_snapshot = True
        recs = recs[:last][good[:last]]
        out = _columns(np.ascontiguousarray(recs[recs["seq"] > after_seq]))
        return out

    def _apply_records(self, W: npt.NDArray[np.uint64], n_snap: int = 0) -> None:
        """Final state of the records ``W`` (uint64 columns, see :func:`_columns`; snapshot
        records first, then the journal's, in order; the last record per key wins), validated
        against the slot headers and the tree, loaded into the index; free maps rebuilt.
        Vectorised end to end: one sort of the keys, one of the slots, no Python work per entry."""
        u8 = np.uint64(0xFF)
        n_all = W.shape[1]
        max_seq = int(W[18].max()) if n_all else 0
        max_gen = int(W[15].max()) if n_all else 0
        op_all = W[0] & u8
        ent_mask = (op_all == OP_SEAL) | (op_all == OP_DROP)
        anchor_pos = np.flatnonzero(op_all == OP_ANCHOR)
        if ent_mask.all():
            ent_pos = np.arange(n_all)
            E = W
        else:
            ent_pos = np.flatnonzero(ent_mask)
            E = W[:, ent_pos]
        m = E.shape[1]
        k64 = E[1]
        order = np.argsort(k64, kind="stable")
        sk = k64[order]
        if m and m == n_all and bool((sk[1:] != sk[:-1]).all()) and bool(((E[0] & u8) == OP_SEAL).all()):
            self._apply_unique(W, order, sk, n_snap, max_seq, max_gen, anchor_pos)
            return
        is_win = np.zeros(m, np.bool_)
        winner_of = np.zeros(m, np.int64)
        if m:
            ends = np.flatnonzero(np.append(sk[1:] != sk[:-1], True))
            sizes = np.diff(np.concatenate([[-1], ends]))
            last = order[ends]  # the latest record of each 64-bit key prefix
            winner_of[order] = np.repeat(last, sizes)
            exact = True
            if (sizes > 1).any():
                members = order[np.repeat(sizes > 1, sizes)]
                exact = bool((E[1:5][:, members] == E[1:5][:, winner_of[members]]).all())
            if exact:
                is_win[last] = True
            else:
                # distinct keys sharing a 64-bit prefix (astronomically rare, or a hostile file)
                latest: dict[bytes, int] = {}
                for i in range(m):
                    latest[E[1:5, i].tobytes()] = i
                for i in range(m):
                    winner_of[i] = latest[E[1:5, i].tobytes()]
                is_win[list(latest.values())] = True
        is_win &= (E[0] & u8) == OP_SEAL
        lp = np.flatnonzero(is_win)  # live records, in record order
        n = len(lp)
        L = E if n == m else E[:, lp]
        live_of_ent = np.full(m, -1, np.int64)
        live_of_ent[lp] = np.arange(n)
        order_w = order[is_win[order]]
        base_row = live_of_ent[order_w]  # live rows in key-prefix order
        base_k64 = k64[order_w]
        # parents: the snapshot's position hints (no search), a binary search for the rest
        has_parent = ((L[0] >> np.uint64(8)) & np.uint64(1)).astype(np.bool_)
        prow = np.full(n, -1, np.int64)
        if n:
            hint = L[11].astype(np.int64) - 1
            rec_pos = ent_pos[lp]
            use = has_parent & (hint >= 0) & (hint < n_snap) & (rec_pos < n_snap)
            cand = np.full(n, -1, np.int64)
            if use.any():
                ent_of_pos = np.full(n_all, -1, np.int64)
                ent_of_pos[ent_pos] = np.arange(m)
                hp = ent_of_pos[hint[use]]
                got = np.full(len(hp), -1, np.int64)
                ok_hp = hp >= 0
                got[ok_hp] = live_of_ent[winner_of[hp[ok_hp]]]
                cand[use] = got
            ok_c = cand >= 0
            ci = np.flatnonzero(ok_c)
            same = np.ones(len(ci), np.bool_)
            for w in range(4):
                same &= L[1 + w][cand[ci]] == L[5 + w][ci]
            prow[ci[same]] = cand[ci[same]]
            rest = np.flatnonzero(has_parent & (prow < 0))
            if len(rest):
                pos = np.minimum(np.searchsorted(base_k64, L[5][rest]), n - 1)
                for _ in range(8):  # walk over equal 64-bit prefixes (rare)
                    r = base_row[pos]
                    eq_prefix = base_k64[pos] == L[5][rest]
                    hit = eq_prefix.copy()
                    for w in range(4):
                        hit &= L[1 + w][r] == L[5 + w][rest]
                    prow[rest[hit]] = r[hit]
                    nxt = ~hit & eq_prefix & (pos + 1 < n)
                    if not nxt.any():
                        break
                    rest, pos = rest[nxt], pos[nxt] + 1
        self._finish_load(L, prow, has_parent, ent_pos[lp], n_snap, base_k64, base_row)
        self._finish_anchors_and_gens(W, anchor_pos, max_seq, max_gen)

    def _finish_anchors_and_gens(self, W: npt.NDArray[np.uint64], anchor_pos: npt.NDArray[np.intp],
                                 max_seq: int, max_gen: int) -> None:
        idx = self._idx
        anchors = _records_of(W, anchor_pos)
        seal_seq = idx.tick
        # anchors (rare; Python per anchor): valid only if newer than the entry's seal
        idx.anchors = {}
        if len(anchors):
            for rec in anchors:
                key = rec["key"].tobytes()
                row = idx.row_of(key)
                if row < 0 or int(rec["seq"]) < int(seal_seq[row]):  # older than the entry's seal
                    continue
                nlen = int(rec["name_len"])
                name_raw = rec.tobytes()[40 : 40 + min(nlen, 64)]
                try:
                    name = check_anchor_name(name_raw.decode("ascii"))
                except (UnicodeDecodeError, InvalidArgumentError):
                    self._problems_note("an anchor record with an invalid name was skipped")
                    continue
                table = idx.anchors.setdefault(row, {})
                old = table.pop(name, None)
                if old is not None:
                    self._release_run(old.file, old.slot, old.nslots)
                    idx.add_cost(row, -old.cost)
                a = _Anchor(int(rec["file"]), int(rec["slot"]), int(rec["nslots"]), int(rec["nbytes"]),
                            int(rec["gen"]), int(rec["checksum"]), int(rec["nslots"]) * self._slot)
                if rec["flags"] & _REC_DELETE:  # an anchor dropped by verify(repair=True)
                    if not table:
                        idx.anchors.pop(row, None)
                    continue
                if not self._run_ok(a.file, a.slot, a.nslots, a.nbytes) or not self._run_free(a.file, a.slot, a.nslots):
                    continue
                hdr_ok = self._files[a.file].check(a.slot, key=key, generation=a.gen, nbytes=a.nbytes,
                                                   checksum=a.checksum, verify=False) == ReadResult.OK
                if not hdr_ok:
                    self._problems_note(f"anchor {name!r} of {key.hex()[:16]} did not match its slot header: dropped")
                    self._load_needs_snapshot = True
                    continue
                table[name] = a
                self._mark_used(a.file, np.array([a.slot]), np.array([a.nslots]))
                idx.cost[row] += a.cost
                idx.sealed_cost += a.cost
                idx.used_cost += a.cost
        self._load_retain_marks(W, seal_seq)
        idx.clock = max(idx.clock, max_seq + 1)
        # a header written just before a crash may carry a generation no record mentions: the
        # writer starts above every generation on the medium (readers never write)
        hdr_gen = 0 if self._readonly else self._max_header_gen()
        self._next_gen = max(self._next_gen, max_gen + 1, hdr_gen + 1)

    def _load_retain_marks(self, W: npt.NDArray[np.uint64], seal_seq: npt.NDArray[np.int64]) -> None:
        """Apply the ``OP_RETAIN`` records (rare; in order, the last per entry wins; one older
        than the entry's seal belonged to an earlier entry of that key), then count the cover."""
        idx = self._idx
        pos = np.flatnonzero((W[0] & np.uint64(0xFF)) == OP_RETAIN)
        if not len(pos):
            return
        for rec in _records_of(W, pos):
            row = idx.row_of(rec["key"].tobytes())
            if row < 0 or int(rec["seq"]) < int(seal_seq[row]):
                continue
            idx.retained[row] = not (int(rec["flags"]) & _REC_DELETE)
        idx.count_retained()

    def _max_header_gen(self) -> int:
        best = 0
        for sf in self._files.values():
            h = sf.headers(populate=sf.slot_count > 4096)
            if len(h):
                best = max(best, int(h["generation"].max()))
        return best

    def _finish_load(self, L: npt.NDArray[np.uint64], prow: npt.NDArray[np.int64],
                     has_parent: npt.NDArray[np.bool_], rec_pos: npt.NDArray[np.intp], n_snap: int,
                     base_k64: npt.NDArray[np.uint64], base_row: npt.NDArray[np.int64]) -> None:
        """Validate the live records ``L`` (parents ``prow`` resolved), prune, load the index and
        the free maps.  ``rec_pos``: each live record's position among all records."""
        idx = self._idx
        n = L.shape[1]
        # Slot headers are compared for journal records always, for snapshot records when the
        # last writer may have reused slots without journaling it first (durability=none, an
        # unknown or damaged journal).  Every read compares the header again anyway; this only
        # makes the accounting exact at open.  Snapshot records of a sync/process writer cannot
        # be stale after kill -9: a slot is reused only after its drop record is journaled.
        check_all = self._last_mode not in (1, 2) or bool(self._problems)
        subset = None if check_all else np.flatnonzero(rec_pos >= n_snap)
        ok = self._records_valid(L, subset)
        dropped_stale = int(n - ok.sum())
        ok &= ~has_parent | (prow >= 0)
        keep, parent_rows = self._prune(ok, prow)
        dropped_tree = n - len(keep) - dropped_stale
        if len(keep) != n:
            L = L[:, keep]
            remap = np.full(n, -1, np.int64)
            remap[keep] = np.arange(len(keep))
            nb = remap[base_row]
            sel = nb >= 0
            base_row, base_k64 = nb[sel], base_k64[sel]
        if dropped_stale:
            self._stale_at_open = dropped_stale
            self._problems_note(f"{dropped_stale} index record(s) did not match their slot header "
                                "(or overlapped another): entries dropped")
            self._load_needs_snapshot = True
        if dropped_tree > 0:
            self._orphans_at_open = dropped_tree
            self._problems_note(f"{dropped_tree} entries without a valid stored parent dropped")
            self._load_needs_snapshot = True
        nslots = (L[0] >> np.uint64(32)).astype(np.int64)
        idx.load_columns(L, parent_rows, nslots * self._slot, base_k64, base_row)
        files = (L[13] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        slots = (L[13] >> np.uint64(32)).astype(np.int64)
        for fid in self._files:
            sel = files == fid
            self._mark_used(fid, slots[sel], nslots[sel])

    def _apply_unique(self, W: npt.NDArray[np.uint64], order: npt.NDArray[np.intp], sk: npt.NDArray[np.uint64],
                      n_snap: int, max_seq: int, max_gen: int, anchor_pos: npt.NDArray[np.intp]) -> None:
        """The common reopen: only seal records with distinct keys (a snapshot, maybe a short
        journal): no last-record-wins bookkeeping, parents straight from the hints."""
        n = W.shape[1]
        has_parent = ((W[0] >> np.uint64(8)) & np.uint64(1)).astype(np.bool_)
        hint = W[11].astype(np.int64) - 1
        prow = np.full(n, -1, np.int64)
        pos = np.arange(n)
        use = has_parent & (hint >= 0) & (hint < n_snap) & (pos < n_snap)
        cand = np.where(use, hint, 0)
        same = use.copy()
        for w in range(4):
            same &= W[1 + w][cand] == W[5 + w]
        prow[same] = cand[same]
        rest = np.flatnonzero(has_parent & ~same)
        if len(rest):
            at = np.minimum(np.searchsorted(sk, W[5][rest]), n - 1)
            r = order[at]
            hit = sk[at] == W[5][rest]
            for w in range(4):
                hit &= W[1 + w][r] == W[5 + w][rest]
            prow[rest[hit]] = r[hit]
        self._finish_load(W, prow, has_parent, pos, n_snap, sk, order.astype(np.int64))
        self._finish_anchors_and_gens(W, anchor_pos, max_seq, max_gen)

    def _records_valid(self, L: npt.NDArray[np.uint64], subset: npt.NDArray[np.intp] | None = None
                       ) -> npt.NDArray[np.bool_]:
        """Vectorised over live record columns: a plausible run inside a known file, not
        overlapping a newer record's run, whose slot header echoes the record (magic, key,
        generation, size, checksum; page, not anchor).  One sort by slot serves both checks and
        makes the header-table reads sequential."""
        n = L.shape[1]
        ok = np.zeros(n, np.bool_)
        if not n:
            return ok
        nslots = (L[0] >> np.uint64(32)).astype(np.int64)
        tag_len = (L[0] >> np.uint64(16)) & np.uint64(0xFF)
        nbytes = L[14].astype(np.int64)
        file = (L[13] & np.uint64(0xFFFFFFFF)).astype(np.int64)
        slot = (L[13] >> np.uint64(32)).astype(np.int64)
        shape_ok = (nslots >= 1) & (nbytes >= 1) & (nbytes <= nslots * self._slot) \
            & (nslots == -(-nbytes // self._slot)) & (tag_len <= _TAG_MAX)
        if subset is not None and not len(subset):
            # only trusted records (a clean sync/process snapshot, no journal): shape and bounds
            for fid, sf in self._files.items():
                ok |= shape_ok & (file == fid) & (slot + nslots <= sf.slot_count)
            return ok
        so = np.argsort((file << 40) | slot, kind="stable")
        f, sl, e = file[so], slot[so], slot[so] + nslots[so]
        clash = np.flatnonzero((f[1:] == f[:-1]) & (sl[1:] < e[:-1]))
        if len(clash):
            seq = L[18][so]
            older = np.where(seq[clash] < seq[clash + 1], so[clash], so[clash + 1])
            shape_ok[older] = False
        in_subset = None
        if subset is not None:
            in_subset = np.zeros(n, np.bool_)
            in_subset[subset] = True
        for fid, sf in self._files.items():
            rows = so[(f == fid)]
            rows = rows[shape_ok[rows] & (slot[rows] + nslots[rows] <= sf.slot_count)]
            if in_subset is not None:
                ok[rows[~in_subset[rows]]] = True  # trusted (see the caller)
                rows = rows[in_subset[rows]]
            if not len(rows):
                continue
            T = sf.headers(populate=len(rows) > 4096).view(np.uint64).reshape(sf.slot_count, 16)
            H = T[slot[rows]]
            match = ((H[:, 0] == np.uint64(SLOT_MAGIC)) & (H[:, 9] == L[15][rows]) & (H[:, 10] == L[14][rows])
                     & (H[:, 11] == L[16][rows]) & ((H[:, 12] & np.uint64(FLAG_ANCHOR)) == 0))
            for w in range(4):
                match &= H[:, 1 + w] == L[1 + w][rows]
            ok[rows[match]] = True
        return ok

    @staticmethod
    def _prune(ok: npt.NDArray[np.bool_], prow: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.intp],
                                                                                  npt.NDArray[np.int64]]:
        """Keep a node only if it and every ancestor are ``ok`` and the chain reaches a root
        (cycles never do); returns ``(kept indices, their parents renumbered)``."""
        n = len(ok)
        ok = ok.copy()
        anc = prow.copy()
        for _ in range(64):  # pointer jumping: 2**64 > any chain
            idx = np.flatnonzero(anc >= 0)
            if not len(idx):
                break
            up = anc[idx]
            ok[idx] &= ok[up]
            anc[idx] = anc[up]
        ok &= anc < 0
        keep = np.flatnonzero(ok)
        if len(keep) == n:
            return keep, prow
        remap = np.full(n, -1, np.int64)
        remap[keep] = np.arange(len(keep))
        newp = prow[keep]
        return keep, np.where(newp >= 0, remap[np.maximum(newp, 0)], -1)
