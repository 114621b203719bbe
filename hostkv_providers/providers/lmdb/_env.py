"""The per-process environment handle of an lmdb store (:class:`_Shared`): opening and checking
the store, read and write transactions (map growth, retries), the slot files, maintenance helpers."""

from __future__ import annotations

import collections
import contextlib
import os
import shutil
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ClassVar

import lmdb
import msgpack

from hostkv_providers._checksum import CHECKSUM_ALGORITHM
from hostkv_providers._errors import (
    CorruptStoreError,
    HostKVError,
    IncompatibleStoreError,
    InvalidArgumentError,
    LockedError,
    NoSpaceError,
    StorageIOError,
    StoreNotFoundError,
    UsedAfterForkError,
)
from hostkv_providers._keys import FORMAT_VERSION, KEY_ALGORITHM, Key
from hostkv_providers.providers import _fsutil
from hostkv_providers.providers._slotfile import (
    SlotFile,
)

from . import _format, _walk
from ._format import (
    _DB_NAMES,
    _DEFAULT_BUDGET,
    _FLIGHT,
    _LOCK_NAME,
    _LOCK_TIMEOUT,
    _OWN_FILES,
    _SLOT_DIR,
    _TOUCH_FLUSH,
    STORE_FORMAT,
    STORE_VERSION,
    _BadRecord,
    _check_manifest_bytes,
    _Counters,
    _crash,
    _file_id_of,
    _filesystem_full,
    _slot_path,
    _unpack_lease,
)
from ._gate import _alive, _Gate, _lmdb_error, _Raise, _Ticket
from ._txn import _Tx
from ._walk import walk_tree

# --------------------------------------------------------------------------------------------
# The per-process environment handle
# --------------------------------------------------------------------------------------------


#: ``HOSTKV_LMDB_TREE_CHECK=0`` skips the check of LMDB's tree in a child process at open.
TREE_CHECK_ENV = "HOSTKV_LMDB_TREE_CHECK"


def _walk_tree(path: str) -> None:
    """Touch every page of the store's LMDB B-trees (``_walk.walk_tree`` over its databases)."""
    walk_tree(path, _DB_NAMES)


def check_tree(path: str, *, fork: bool, timeout: float = 120.0) -> None:
    """Walk LMDB's tree in a child process (a fork before this process opens the environment,
    else a fresh interpreter); ``CorruptStoreError`` if the child dies by a signal, reports an
    LMDB error, or hangs.  Never raises for a store that is fine."""
    if not os.path.lexists(os.path.join(path, "data.mdb")):
        return
    rfd, wfd = os.pipe()
    if fork:
        import warnings as _warnings

        with _warnings.catch_warnings():
            _warnings.simplefilter("ignore", DeprecationWarning)  # fork with threads: the child only walks
            pid = os.fork()
        if pid == 0:  # pragma: no cover - runs in the child
            code = 0
            try:
                os.close(rfd)
                import faulthandler

                faulthandler.disable()  # its death is the answer, not a crash report
                _walk_tree(path)
            except BaseException as exc:
                with contextlib.suppress(BaseException):
                    os.write(wfd, f"{type(exc).__name__}: {exc}".encode()[:2000])
                code = 3
            os._exit(code)
        os.close(wfd)
        proc = None
    else:
        import subprocess
        import sys

        os.close(wfd)
        os.close(rfd)
        # the walk's own file as the script: the child imports lmdb, not this package (~1 s)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p))
        proc = subprocess.Popen([sys.executable, _walk.__file__, path, *_DB_NAMES], env=env,
                                stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        pid = proc.pid
    deadline = time.monotonic() + timeout
    status = None
    while status is None:
        done, st = os.waitpid(pid, os.WNOHANG)
        if done:
            status = st
            break
        if time.monotonic() > deadline:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            if proc is None:
                os.close(rfd)
            raise CorruptStoreError(f"{path}: checking LMDB's tree did not finish in {timeout:.0f} s (a cycle?)",
                                    hint=_TREE_HINT)
        time.sleep(0.002)
    if proc is None:
        msg = b""
        while chunk := os.read(rfd, 4096):
            msg += chunk
        os.close(rfd)
        text = msg.decode("utf-8", "replace")
    else:
        lines = (proc.stderr.read() if proc.stderr else b"").decode("utf-8", "replace").strip().splitlines()
        text = lines[-1] if lines else ""
        if proc.stderr:
            proc.stderr.close()
    if os.WIFSIGNALED(status):
        raise CorruptStoreError(
            f"{path}: LMDB's index is damaged (walking its tree killed a check process with "
            f"{signal.Signals(os.WTERMSIG(status)).name})", hint=_TREE_HINT)
    if os.WEXITSTATUS(status) != 0:
        raise CorruptStoreError(f"{path}: LMDB's index is damaged ({text or 'the check failed'})", hint=_TREE_HINT)


_TREE_HINT = ("verify --repair cannot rebuild LMDB's own pages and reading them would kill the reader: "
              "restore data.mdb from a backup, or remove the store (the engine recomputes the pages)")


class _Shared:
    """One LMDB environment (and slot files) per store per process, shared by its providers.

    LMDB forbids opening one environment twice in a process (closing either would drop the
    other's locks), so providers opened on the same directory share this handle.
    """

    _registry: ClassVar[dict[tuple[int, int, int], _Shared]] = {}
    _registry_lock: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def acquire(cls, path: str, *, durability: str, map_size: int, map_max: int, file_nbytes: int,
                budget: int | None, readonly: bool = False) -> _Shared:
        if readonly:
            # never create anything: a read-only open of a typo'd path must not make a store
            _fsutil.check_private_dir(path)
            # (_fsutil.lexists: an EACCES is an error, not "missing")
            if not _fsutil.lexists(os.path.join(path, "data.mdb"), f"looking for {path}/data.mdb"):
                raise StoreNotFoundError(f"{path} holds no lmdb store (no data.mdb)")
        else:
            _fsutil.prepare_store_dir(path)
        st = os.stat(path)
        ident = (os.getpid(), st.st_dev, st.st_ino)
        with cls._registry_lock:
            handle = cls._registry.get(ident)
            if handle is None:
                handle = cls(path, ident, durability=durability, map_size=map_size, map_max=map_max,
                             file_nbytes=file_nbytes, readonly=readonly)
                cls._registry[ident] = handle
            elif (handle.durability == "sync") != (durability == "sync"):
                raise InvalidArgumentError(
                    f"{path} is already open in this process with durability={handle.durability}",
                    hint="open every provider of one store in one process with the same durability")
            handle.refs += 1
        try:
            if not readonly:
                if not handle.maintained:  # the handle was opened read-only first
                    handle.reclaim_dead()
                    handle.maintained = True
                handle.apply_budget(budget)
        except BaseException:
            handle.release()
            raise
        return handle

    def __init__(self, path: str, ident: tuple[int, int, int], *, durability: str, map_size: int, map_max: int,
                 file_nbytes: int, readonly: bool = False) -> None:
        self.path = path
        self.readonly = readonly
        self.maintained = not readonly
        self.ident = ident
        self.durability = durability
        self.map_max = map_max
        self.file_nbytes = file_nbytes
        self.refs = 0
        self.gate = _Gate()
        self.leader = threading.Lock()
        self.leader_owner: int | None = None
        # re-entrant: a garbage-collected Lease may release itself from a finalizer that runs
        # while this thread is inside a qlock block
        self.qlock = threading.RLock()
        self.deferred: collections.deque[Callable[[_Tx], Any]] = collections.deque()
        self.maint = threading.Condition(self.qlock)
        self.maint_owner: int | None = None  # the thread running a compaction, if any
        self.queue: list[_Ticket] = []
        self.touches: dict[Key, float] = {}
        self.files: dict[int, SlotFile] = {}
        self.files_lock = threading.Lock()
        self.retired: list[SlotFile] = []  # stale cached handles (see slot_file), closed at close_files
        # Keys known present as of removal epoch `present_epoch` (see LmdbProvider._hits).
        self.present_cache: set[bytes] = set()
        self.present_epoch = -1
        self.cache_lock = threading.Lock()
        self.slot_dir = os.path.join(path, _SLOT_DIR)
        self._exclusive_during_open = False
        _format._crash_armed = bool(os.environ.get(_fsutil.CRASH_ENV) or os.environ.get("CRASH_AT"))
        self._check_contents()
        self.lock = self._shared_lock()
        t_open = time.monotonic()
        #: what opening this store did to recover it (``describe()["last_recovery"]``)
        self.recovery: dict[str, Any] = {"at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                                         "by_pid": os.getpid(), "readonly": readonly}
        try:
            alone = False if readonly else self._try_exclusive()
            if (alone or readonly) and os.environ.get(TREE_CHECK_ENV, "1") != "0":
                # LMDB trusts its pages: a damaged B-tree page kills the process that walks it
                # with SIGABRT (mdb.c assertions).  Walk the tree in a child first where damage
                # is possible: at a restart (no other process has the store open) and in
                # read-only opens (the CLI); the engine never dies by a signal (issue 16 item 2).
                check_tree(self.path, fork=True)
            self.env = self._open_env(map_size)
            try:
                self.dbs = self._open_dbs()
                self.store_id = self._check_manifest()
                if not readonly:
                    _fsutil.ensure_private_dir(self.slot_dir)
                    if alone:
                        self._recover_files()
                    self.recovery["files_checked"] = alone  # temp/orphan files reclaimed (alone only)
                    self.recovery["dead_owners_reclaimed"] = self.reclaim_dead()
                self.recovery["seconds"] = round(time.monotonic() - t_open, 4)
            except BaseException:
                self.env.close()
                raise
        except BaseException:
            self.lock.release()
            raise

    # -- opening ---------------------------------------------------------------------------------
    def _check_contents(self) -> None:
        """Refuse a directory that holds something other than an lmdb store, or unsafe files."""
        try:
            names = os.listdir(self.path)
        except OSError as exc:
            raise _fsutil.io_error(exc, f"listing {self.path}") from exc
        foreign = [n for n in names if n not in _OWN_FILES and not _fsutil.is_temp_name(n)]
        if foreign:
            cls = IncompatibleStoreError if "data.mdb" in names else StoreNotFoundError
            raise cls(
                f"{self.path} is not an lmdb store (it holds {', '.join(sorted(foreign)[:3])})",
                hint="point lmdb:// at an empty directory or an existing lmdb store")
        for name in ("data.mdb", "lock.mdb", _LOCK_NAME):
            full = os.path.join(self.path, name)
            if _fsutil.lexists(full, f"looking for {full}"):
                os.close(_fsutil.open_private(full, os.O_RDONLY))  # symlink/owner/mode checks
        # Every open, read-only ones included, checks what the writer checks (issue 16 item 9): a
        # symlinked or loose slots/ directory, and slot files that are symlinks, foreign-owned or
        # readable/writable by others (a read-only open followed them out of the store).
        if _SLOT_DIR in names:
            _fsutil.check_private_dir(self.slot_dir)
            for name in _fsutil.listdir(self.slot_dir):
                full = os.path.join(self.slot_dir, name)
                os.close(_fsutil.open_private(full, os.O_RDONLY))

    def _shared_lock(self) -> _fsutil.LockFile:
        deadline = time.monotonic() + _LOCK_TIMEOUT
        while True:
            try:
                return _fsutil.LockFile(os.path.join(self.path, _LOCK_NAME), exclusive=False)
            except LockedError:
                if time.monotonic() >= deadline:
                    raise LockedError(f"{self.path} is being compacted by another process",
                                      hint="retry when the compaction has finished") from None
                time.sleep(0.01)

    def _try_exclusive(self) -> bool:
        """Take the lock exclusively if no other process has the store open: then recovery may
        remove orphans that nobody else can be creating.  ``False``: others are attached, the
        lock is held shared.  ``True``: held exclusively until :meth:`_downgrade`."""
        self.lock.release()
        try:
            ex = _fsutil.LockFile(os.path.join(self.path, _LOCK_NAME), exclusive=True)
        except LockedError:
            self.lock = self._shared_lock()
            return False
        # Keep the exclusive lock through recovery; _downgrade() swaps it for a shared one.
        self.lock = ex
        self._exclusive_during_open = True
        return True

    def _downgrade(self) -> None:
        if self._exclusive_during_open:
            self.lock.release()
            self.lock = self._shared_lock()
            self._exclusive_during_open = False

    def _open_env(self, map_size: int) -> Any:
        data = os.path.join(self.path, "data.mdb")
        try:
            existing = os.path.getsize(data)
        except OSError:
            existing = 0
        try:
            env = lmdb.open(
                self.path,
                # an existing store keeps its (preallocated) size; the map grows from there
                map_size=existing if existing >= 1 << 20 else map_size,
                subdir=True,
                readonly=False,
                create=True,
                mode=0o600,  # py-lmdb's default 0644 would make the index world-readable
                max_dbs=len(_DB_NAMES) + 2,
                max_readers=1024,
                max_spare_txns=4,
                lock=True,
                writemap=False,  # a power cut can corrupt a writemap environment
                # sync: LMDB fsyncs the data pages at every commit and we sync the meta page
                # with env.sync() after a batch of seals (one group commit); process/none never
                # sync (kill -9 safe: committed pages are in the page cache).
                sync=self.durability == "sync",
                metasync=False,
                readahead=False,  # random point reads of a large index
            )
        except lmdb.Error as exc:
            if "already open in this process" in str(exc):
                # py-lmdb's registry of open environments survives fork(): the parent has it open
                raise UsedAfterForkError(
                    f"{self.path} is open in the parent of this forked process; py-lmdb refuses a second open",
                    hint="open the store only after fork in each process, or start workers with 'spawn'",
                ) from None
            raise _lmdb_error(exc, f"opening {self.path}") from exc
        try:
            if not self.readonly:
                self._preallocate(int(env.info()["map_size"]))
        except BaseException:
            env.close()
            raise
        try:
            env.reader_check()  # clear the reader slots of killed processes
        except lmdb.Error as exc:
            env.close()
            raise _lmdb_error(exc, "checking stale readers") from exc
        for name in ("data.mdb", "lock.mdb"):
            full = os.path.join(self.path, name)
            with contextlib.suppress(OSError, NotImplementedError):
                os.chmod(full, 0o600, follow_symlinks=False)  # LMDB applies the umask, not less
        return env

    def _preallocate(self, nbytes: int) -> None:
        """``posix_fallocate`` data.mdb to the map size: LMDB then never extends the file, so a
        full filesystem shows up here as a clean ``NoSpaceError`` instead of an LMDB commit
        failing with a bare EIO halfway through a transaction (R6)."""
        fd = _fsutil.open_private(os.path.join(self.path, "data.mdb"), os.O_RDWR)
        try:
            if os.fstat(fd).st_size < nbytes:
                _fsutil.fallocate(fd, 0, nbytes, f"preallocating {nbytes} bytes for the LMDB index")
        finally:
            os.close(fd)

    def _open_dbs(self) -> dict[str, Any]:
        dbs: dict[str, Any] = {}
        try:
            # read-only: a write transaction that changes nothing writes nothing to data.mdb
            with self.env.begin(write=True) as txn:
                for name in _DB_NAMES:
                    dbs[name] = self.env.open_db(name.encode(), txn=txn, create=not self.readonly)
        except lmdb.NotFoundError:
            raise IncompatibleStoreError(f"{self.path} is not a complete lmdb store (a database is missing)") from None
        except lmdb.Error as exc:
            raise _lmdb_error(exc, "opening the index databases") from exc
        return dbs

    def _check_manifest(self) -> bytes:
        meta = self.dbs["meta"]
        try:
            with self.env.begin(write=True) as txn:
                raw = txn.get(b"manifest", db=meta)
                if raw is None and self.readonly:
                    raise IncompatibleStoreError(f"{self.path} holds no initialized lmdb store")
                if raw is None:
                    if txn.stat(self.dbs["entries"])["entries"]:
                        raise CorruptStoreError(f"{self.path}: index has entries but no manifest")
                    store_id = os.urandom(16)
                    manifest = {
                        "store_format": STORE_FORMAT,
                        "store_version": STORE_VERSION,
                        "format_version": FORMAT_VERSION,
                        "key_algorithm": KEY_ALGORITHM,
                        "checksum_algorithm": CHECKSUM_ALGORITHM,
                        "store_id": store_id,
                        "created": time.time(),
                    }
                    txn.put(b"manifest", msgpack.packb(manifest, use_bin_type=True), db=meta)
                    c = _Counters(None)
                    c.budget = _DEFAULT_BUDGET
                    txn.put(b"counters", c.pack(), db=meta)
                    return store_id
        except lmdb.Error as exc:
            raise _lmdb_error(exc, "reading the manifest") from exc
        return _check_manifest_bytes(bytes(raw), self.path)

    def _recover_files(self) -> None:
        """With no other process attached: remove temp files, a half-done compaction and slot
        files that no committed transaction registered (R3)."""
        try:
            _fsutil.remove_temp_files(self.slot_dir)
            for name in os.listdir(self.path):
                full = os.path.join(self.path, name)
                if _fsutil.is_temp_name(name):
                    if os.path.isdir(full) and not os.path.islink(full):
                        shutil.rmtree(full, ignore_errors=True)
                    else:
                        with contextlib.suppress(OSError):
                            os.unlink(full)
            with self.env.begin() as txn:
                known = {int.from_bytes(k, "big") for k, _ in txn.cursor(db=self.dbs["files"])}
            for name in os.listdir(self.slot_dir):
                fid = _file_id_of(name)
                if fid is not None and fid not in known:
                    with contextlib.suppress(OSError):
                        os.unlink(os.path.join(self.slot_dir, name))
        except OSError as exc:
            raise _fsutil.io_error(exc, f"recovering {self.path}") from exc
        except lmdb.Error as exc:
            raise _lmdb_error(exc, "listing slot files") from exc
        finally:
            self._downgrade()

    def apply_budget(self, budget: int | None) -> None:
        if budget is None:
            return

        def op(tx: _Tx) -> None:
            if tx.c.budget != budget:
                tx.c.budget = budget
                if tx.c.used > budget:
                    tx.evict_lru(tx.c.used - budget)

        self.submit(op)

    # -- transactions ------------------------------------------------------------------------------
    def _adopt_map_size(self) -> None:
        with self.gate.exclusive():
            try:
                self.env.set_mapsize(0)  # another process grew the map: adopt its size
            except lmdb.Error as exc:
                raise _lmdb_error(exc, "adopting the map size") from exc

    def _grow(self, *, headroom: bool = False) -> None:
        limit = self.map_max + max(self.map_max // 16, 2 << 20) if headroom else self.map_max
        with self.gate.exclusive():
            cur = int(self.env.info()["map_size"])
            if cur >= limit:
                raise NoSpaceError(f"the LMDB index reached map_max ({self.map_max} bytes)",
                                   hint="raise the map_max option, or lower inline_max/the budget")
            new = min(cur * 2, limit) if cur < self.map_max else limit
            self._preallocate(new)  # first: on ENOSPC the map stays as it was
            try:
                self.env.set_mapsize(new)
            except lmdb.Error as exc:
                raise _lmdb_error(exc, "growing the map") from exc

    @contextlib.contextmanager
    def read(self, buffers: bool = False) -> Iterator[Any]:
        """A short read transaction."""
        while True:
            self.gate.acquire_shared()
            try:
                txn = self.env.begin(buffers=buffers)
            except lmdb.MapResizedError:
                self.gate.release_shared()
                self._adopt_map_size()
                continue
            except lmdb.Error as exc:
                self.gate.release_shared()
                raise _lmdb_error(exc, "starting a read transaction") from exc
            break
        try:
            yield txn
        except lmdb.Error as exc:
            raise _lmdb_error(exc, "reading the index") from exc
        finally:
            txn.abort()
            self.gate.release_shared()

    def submit(self, fn: Callable[[_Tx], Any], *, durable: bool = False, sync_files: Sequence[SlotFile] = (),
               frees: bool = False) -> Any:
        """Run ``fn`` in a write transaction, batched with other threads' (group commit).

        ``fn`` runs in a nested transaction: if it raises, only its own changes are rolled back.
        ``sync_files`` are synced before the transaction commits; with ``durable`` the commit is
        synced before this returns (``durability=sync``).  ``frees``: the op only removes things
        (evict, abort, release); such ops may use the map's headroom past ``map_max``, so a full
        index can always be evicted from.
        """
        ticket = _Ticket(fn, durable and self.durability == "sync", sync_files if self.durability == "sync" else (),
                         frees)
        me = threading.get_ident()
        with self.qlock:
            while self.maint_owner is not None and self.maint_owner != me:
                self.maint.wait()  # a compaction in this process has the store to itself
            self.queue.append(ticket)
        with self.leader:
            self.leader_owner = me
            try:
                if not ticket.done:
                    with self.qlock:
                        batch, self.queue = self.queue, []
                    while self.deferred:
                        batch.append(_Ticket(self.deferred.popleft(), False, (), True))
                    self._run_batch(batch)
            finally:
                self.leader_owner = None
        if ticket.error is not None:
            raise ticket.error
        return ticket.result

    def _run_batch(self, batch: list[_Ticket]) -> None:
        try:
            self._run_batch_inner(batch)
        except BaseException as exc:  # never leave a waiter without an answer
            for t in batch:
                if not t.done and t.error is None:
                    t.error = exc if isinstance(exc, HostKVError) else _lmdb_error(exc, "committing")
            if not isinstance(exc, (HostKVError, lmdb.Error)):
                raise
        finally:
            for t in batch:
                t.done = True

    def _run_batch_inner(self, batch: list[_Ticket]) -> None:
        # 1. Page bytes reach stable storage before the transaction that points at them.
        synced: dict[int, BaseException | None] = {}
        for t in batch:
            for sf in t.sync_files:
                if id(sf) not in synced:
                    try:
                        sf.sync()
                        synced[id(sf)] = None
                    except HostKVError as exc:  # R7: every seal waiting on a failed sync fails
                        synced[id(sf)] = exc
                err = synced[id(sf)]
                if err is not None and t.error is None:
                    t.error = err
        live = [t for t in batch if t.error is None]
        with self.qlock:
            touches, self.touches = self.touches, {}
        # 2. One transaction for the whole batch.
        while True:
            for t in live:
                t.result, t.error = None, None
            try:
                self._commit_batch(live, touches)
                break
            except lmdb.MapFullError:
                # nothing was committed; retry the whole batch in a larger map
                try:
                    self._grow(headroom=all(t.frees for t in live))
                except NoSpaceError as exc:
                    if all(t.frees for t in live):
                        raise
                    # at map_max: fail what adds to the index, retry what frees (it may use the
                    # headroom), so a full index can always be evicted from
                    for t in live:
                        if not t.frees:
                            t.error = exc
                    live = [t for t in live if t.frees]
                    touches = {}
            except lmdb.MapResizedError:
                self._adopt_map_size()
            except lmdb.Error as exc:
                err = _lmdb_error(exc, "committing a transaction")
                if not isinstance(err, NoSpaceError) and _filesystem_full(self.path):
                    # LMDB reports a short write as EIO; on a full filesystem that is ENOSPC
                    err = NoSpaceError(f"no space left while committing to {self.path}: {exc}")
                for t in live:
                    t.error = err
                return
        # 3. durability=sync: the commit itself reaches stable storage before any seal returns.
        if any(t.durable and t.error is None for t in live):
            try:
                self.env.sync(True)
            except lmdb.Error as exc:
                err = StorageIOError(f"syncing the LMDB index failed: {exc}")
                for t in live:
                    if t.durable and t.error is None:
                        t.error = err

    def sync_index(self) -> None:
        """``durability=sync``: make every committed transaction durable (LMDB's meta page; its
        data pages were synced by each commit) — for a caller that committed with
        ``durable=False`` and must be durable before it returns.  ``StorageIOError`` on failure
        (never retried into a success, R7)."""
        if self.durability != "sync":
            return
        self.gate.acquire_shared()
        try:
            self.env.sync(True)
        except lmdb.Error as exc:
            raise StorageIOError(f"syncing the LMDB index failed: {exc}") from exc
        finally:
            self.gate.release_shared()

    def _commit_batch(self, live: list[_Ticket], touches: dict[Key, float]) -> None:
        self.gate.acquire_shared()
        try:
            txn = self.env.begin(write=True)
            try:
                if touches:
                    tx = _Tx(self, txn)
                    tx.apply_touches(touches)
                    tx.save()
                for t in live:
                    child = self.env.begin(write=True, parent=txn)
                    try:
                        tx = _Tx(self, child)
                        result = t.fn(tx)
                        tx.save()
                    except (lmdb.MapFullError, lmdb.MapResizedError):
                        child.abort()
                        raise  # the whole batch is retried in a larger map
                    except lmdb.Error as exc:
                        child.abort()
                        t.error = _lmdb_error(exc, "updating the index")
                        continue
                    except _BadRecord as exc:
                        child.abort()
                        t.error = CorruptStoreError(f"damaged index record: {exc}")
                        continue
                    except Exception as exc:
                        child.abort()
                        t.error = exc
                        continue
                    child.commit()
                    if isinstance(result, _Raise):
                        t.error = result.exc
                    else:
                        t.result = result
                _crash("lmdb.txn.before_commit")
                txn.commit()
                _crash("lmdb.txn.after_commit")
            except BaseException:
                txn.abort()
                raise
        finally:
            self.gate.release_shared()

    def submit_later(self, fn: Callable[[_Tx], Any]) -> None:
        """Queue a freeing op without waiting (safe from finalizers and from the leader itself):
        it runs with the next batch of this process, or at close."""
        self.deferred.append(fn)

    def touch(self, key: Key) -> None:
        """Record an LRU refresh from a read; written with the next transaction of this process."""
        with self.qlock:
            self.touches[key] = time.time()
            flush = len(self.touches) >= _TOUCH_FLUSH
        if flush:
            self.submit(lambda tx: None)

    # -- slot files --------------------------------------------------------------------------------
    def slot_file(self, file_id: int) -> SlotFile:
        sf = self.files.get(file_id)
        if sf is not None and _same_file(sf):
            return sf
        with self.files_lock:
            sf = self.files.get(file_id)
            if sf is not None and not _same_file(sf):
                # A handle cached by a transaction that created the file and then rolled back:
                # another process has since created the file under the same id (the orphan
                # unlinked). Reading or writing the old inode dropped that process's good pages as
                # corrupt and stored this one's where nobody reads them. Retired, not closed: a
                # reader of this process may still be in it.
                self.retired.append(self.files.pop(file_id))
                sf = None
            if sf is None:
                sf = SlotFile.open(_slot_path(self.slot_dir, file_id), writable=True, store_id=self.store_id)
                if sf.file_id != file_id:
                    sf.close()
                    raise CorruptStoreError(f"slot file {file_id} names itself {sf.file_id}")
                self.files[file_id] = sf
            return sf

    def create_slot_file(self, file_id: int, slot_nbytes: int, slot_count: int) -> SlotFile:
        """Create slot file ``file_id`` (inside the write transaction that registers it)."""
        path = _slot_path(self.slot_dir, file_id)
        with self.files_lock:
            old = self.files.pop(file_id, None)
            if old is not None:
                old.close()
            if os.path.lexists(path):
                # Ids are allocated inside write transactions, so an existing file with an id the
                # index does not know is an orphan of a transaction that never committed.
                try:
                    os.unlink(path)
                except OSError as exc:
                    raise _fsutil.io_error(exc, f"removing orphan {path}") from exc
            # Durable in every mode (one sync per new slot file, rare): without it a power cut in
            # process/none mode could leave the registered name on an empty or short file, which
            # open refuses — losing recent seals is allowed there, losing the store is not (the
            # mmap provider's power-cut images found exactly this).
            sf = SlotFile.create(path, slot_nbytes=slot_nbytes, slot_count=slot_count, file_id=file_id,
                                 store_id=self.store_id)
            self.files[file_id] = sf
            return sf

    def close_files(self) -> None:
        with self.files_lock:
            for sf in [*self.files.values(), *self.retired]:
                sf.close()
            self.files.clear()
            self.retired.clear()

    # -- maintenance -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def maintenance(self) -> Iterator[None]:
        """Run the block as the only writer thread of this process (compaction): other threads'
        writes wait; those queued before are committed first."""
        me = threading.get_ident()
        with self.qlock:
            while self.maint_owner is not None:
                self.maint.wait()
            self.maint_owner = me
        try:
            self.submit(lambda tx: None)  # commits whatever other threads queued before us
            yield
        finally:
            with self.qlock:
                self.maint_owner = None
                self.maint.notify_all()

    def reclaim_dead(self) -> int:
        """Release the reservations and leases of dead processes (and expired leases)."""
        with self.read() as txn:
            dead_f = [bytes(k) for k, v in txn.cursor(db=self.dbs["flights"])
                      if len(v) != _FLIGHT.size or not _alive(bytes(v[:20]))]
            now = time.time()
            dead_l = []
            for k, v in txn.cursor(db=self.dbs["leases"]):
                try:
                    owner, expiry, _ = _unpack_lease(v)
                except _BadRecord:
                    owner, expiry = b"", 0.0
                if expiry < now or not owner or not _alive(owner):
                    dead_l.append(bytes(k))
        if not dead_f and not dead_l:
            return 0

        def op(tx: _Tx) -> int:
            n = 0
            for k in dead_f:
                try:
                    fl = tx.flight(Key(k))
                except _BadRecord:
                    tx.t.delete(k, db=tx.db["flights"])
                    n += 1
                    continue
                if fl is not None and not _alive(fl.owner):
                    tx.drop_flight(Key(k), fl)
                    n += 1
            for lid in dead_l:
                n += tx.release_lease(lid)
            return n

        return int(self.submit(op, frees=True))

    def release(self) -> None:
        with self._registry_lock:
            self.refs -= 1
            if self.refs > 0:
                return
            self._registry.pop(self.ident, None)
        self.close_files()
        with self.gate.exclusive():
            self.env.close()
        self.lock.release()


def _same_file(sf: SlotFile) -> bool:
    """Whether ``sf``'s open file is still the one at its path (a stat per call: one per slot
    file per batch, next to reads of whole pages)."""
    try:
        a, b = os.fstat(sf.fd), os.stat(sf.path)
    except FileNotFoundError:
        return True  # gone from the directory (compacted away): what the index says decides
    except (OSError, HostKVError):
        return False
    return (a.st_ino, a.st_dev) == (b.st_ino, b.st_dev)

