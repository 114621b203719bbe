"""Filesystem helpers for the persistent providers (mmap, lmdb): private files, atomic writes,
writer locks, durable syncs.

Every function here turns ``OSError`` into the library's typed errors (``NoSpaceError`` for
ENOSPC/EDQUOT, ``UnsafeStoreError`` for symlinks, foreign owners and loose permissions,
``LockedError`` for a held lock, ``StorageIOError`` otherwise) so that a provider never leaks a
bare ``OSError`` to an engine.

Security rules (RELIABILITY.md S1): store directories are 0700 and files 0600, both owned by the
current user; a symlink anywhere *inside* a store is refused (``O_NOFOLLOW`` on every open, and
``lstat`` checks on directories).  The store directory itself may be reached through symlinked
parents (``/var/cache -> /nvme/cache`` is an operator's choice), but the last component must not
be a symlink.

Fault injection: :data:`fsync` and :data:`fdatasync` are module attributes that every durable
path in this package calls through, so tests can monkeypatch them to raise ``EIO`` and check
that no seal is acknowledged after a failed sync (R7).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import secrets
import stat
import threading
from collections.abc import Callable, Sequence

from hostkv_providers._errors import (
    HostKVError,
    LockedError,
    NoSpaceError,
    StorageIOError,
    StoreNotFoundError,
    UnsafeStoreError,
)

__all__ = [
    "CRASH_ENV",
    "CRASH_POINTS",
    "DIR_MODE",
    "crash_point",
    "register_crash_points",
    "reset_crash_points",
    "FILE_MODE",
    "LockFile",
    "atomic_write",
    "check_not_foreign",
    "check_private_dir",
    "check_store_entries",
    "prepare_store_dir",
    "check_private_fd",
    "ensure_private_dir",
    "fallocate",
    "fdatasync",
    "fsync",
    "fsync_dir",
    "install_temp",
    "io_error",
    "is_temp_name",
    "lexists",
    "listdir",
    "open_private",
    "read_small_file",
    "remove_temp_files",
    "sync_fd",
    "temp_name",
    "write_temp",
    "write_all",
    "TEMP_MARK",
]

DIR_MODE = 0o700
FILE_MODE = 0o600
#: Temporary files carry this marker in their name; a writer removes leftovers on open (R3).
TEMP_MARK = ".tmp-"

_NOSPACE = (errno.ENOSPC, errno.EDQUOT)

# Indirection points for fault injection (see the module docstring).
fsync: Callable[[int], None] = os.fsync
fdatasync: Callable[[int], None] = getattr(os, "fdatasync", os.fsync)


def io_error(exc: OSError, what: str) -> HostKVError:
    """The typed error for an ``OSError`` raised while doing ``what`` (use ``raise ... from exc``)."""
    if exc.errno in _NOSPACE:
        return NoSpaceError(f"no space left while {what}: {exc.strerror}")
    if exc.errno == errno.ELOOP:
        return UnsafeStoreError(f"refusing a symlink while {what}")
    return StorageIOError(f"I/O error while {what}: {exc.strerror or exc}")


# -- directories ---------------------------------------------------------------------------------


def lexists(path: str, what: str) -> bool:
    """Whether ``path`` exists (a final symlink is not followed).  Unlike ``os.path.lexists``,
    an error other than "no such file" raises (typed) instead of reading as "missing": an EIO on
    the manifest's ``lstat`` once made open create a new, empty store over an existing one."""
    try:
        os.lstat(path)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError as exc:
        raise io_error(exc, what) from exc
    return True


def listdir(path: str) -> list[str]:
    """``os.listdir`` with typed errors."""
    try:
        return os.listdir(path)
    except OSError as exc:
        raise io_error(exc, f"listing {path}") from exc


def ensure_private_dir(path: str) -> None:
    """Create ``path`` (mode 0700, parents as needed) if missing, then :func:`check_private_dir`."""
    try:
        os.makedirs(path, mode=DIR_MODE, exist_ok=True)
    except FileExistsError:
        pass  # exists but is not a directory: reported by the check below
    except OSError as exc:
        raise io_error(exc, f"creating the store directory {path}") from exc
    check_private_dir(path)


def prepare_store_dir(path: str, *, create: bool = True) -> None:
    """A writer's store directory (the rule every built-in provider follows, docs/providers).

    Missing: created 0700 (with ``create``; else ``StoreNotFoundError``).  Existing: it must pass
    :func:`check_private_dir` — except an *empty* directory of our own that no other user can
    write (typically a ``mkdir`` under the default umask, 0755), which is adopted and tightened
    to 0700.  Group/other write permission is refused even on an empty directory: another user
    could have put files in it, or could replace them later."""
    if not lexists(path, f"looking for {path}"):
        if not create:
            raise StoreNotFoundError(f"no store at {path}")
        ensure_private_dir(path)
        return
    try:
        check_private_dir(path)
    except UnsafeStoreError:
        st = os.lstat(path)
        if (stat.S_ISDIR(st.st_mode) and not stat.S_ISLNK(st.st_mode) and st.st_uid == os.geteuid()
                and not stat.S_IMODE(st.st_mode) & 0o022 and stat.S_IMODE(st.st_mode) & 0o700 == 0o700
                and not listdir(path)):
            try:
                os.chmod(path, DIR_MODE)
            except OSError as exc:
                raise io_error(exc, f"tightening {path} to 0700") from exc
            check_private_dir(path)
        else:
            raise


def check_not_foreign(path: str, own: Callable[[str], bool]) -> None:
    """Refuse to create a store in a directory that holds files of something else: a writer
    open that finds no store there may create one only in an empty directory (``own(name)``
    names the files a store's own creation may have left: lock files, temp files)."""
    foreign = sorted(n for n in listdir(path) if not own(n) and not is_temp_name(n))
    if foreign:
        raise StoreNotFoundError(
            f"{path} holds no store but other files ({', '.join(foreign[:3])}{' ...' if len(foreign) > 3 else ''}); "
            "refusing to turn it into one",
            hint="give an empty or new directory; only `hostkv copy`, `bench` and `demo` create stores")


def check_store_entries(path: str) -> list[str]:
    """Every entry of the store directory ``path`` (by ``lstat``, nothing is followed or opened):
    no symlinks, every file and directory ours and not accessible to group/other.  Readers and
    writers run the same check (a read-only open once followed a symlink out of the store).
    Returns the names."""
    names = listdir(path)
    for name in names:
        full = os.path.join(path, name)
        try:
            st = os.lstat(full)
        except FileNotFoundError:
            continue  # removed meanwhile (a writer's rotation): nothing to check
        except OSError as exc:
            raise io_error(exc, f"inspecting {full}") from exc
        if stat.S_ISLNK(st.st_mode):
            raise UnsafeStoreError(f"{full} is a symlink; symlinks inside a store are refused")
        _check_owner_mode(st, full, DIR_MODE if stat.S_ISDIR(st.st_mode) else FILE_MODE)
    return names


def check_private_dir(path: str) -> None:
    """Refuse a store directory that is a symlink, not a directory, not ours, or group/world
    accessible (``UnsafeStoreError``)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StorageIOError(f"store directory {path} does not exist") from None
    except OSError as exc:
        raise io_error(exc, f"inspecting {path}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStoreError(f"store directory {path} is a symlink; refusing to follow it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStoreError(f"store path {path} is not a directory")
    _check_owner_mode(st, path, DIR_MODE)
    if stat.S_IMODE(st.st_mode) & 0o500 != 0o500:
        # mode 000 (or 0300 ...): this user cannot list or enter it, so every file would read as
        # missing ("holds no store" suggested the data was gone)
        raise UnsafeStoreError(
            f"store directory {path} has mode {stat.S_IMODE(st.st_mode):04o}: this user cannot list or enter it",
            hint=f"chmod 0700 {path}")


def _check_owner_mode(st: os.stat_result, path: str, allowed: int) -> None:
    if st.st_uid != os.geteuid():
        raise UnsafeStoreError(f"{path} is owned by uid {st.st_uid}, not by this user ({os.geteuid()})")
    loose = stat.S_IMODE(st.st_mode) & ~allowed & 0o777
    if loose & 0o077:
        raise UnsafeStoreError(
            f"{path} has mode {stat.S_IMODE(st.st_mode):04o}; group/other bits {loose:04o} are not allowed",
            hint=f"chmod {allowed:04o} {path}",
        )


# -- files ---------------------------------------------------------------------------------------


def check_private_fd(fd: int, path: str) -> os.stat_result:
    """Refuse an open file that is not a regular file owned by us with mode 0600 or tighter."""
    try:
        st = os.fstat(fd)
    except OSError as exc:
        raise io_error(exc, f"inspecting {path}") from exc
    if not stat.S_ISREG(st.st_mode):
        raise UnsafeStoreError(f"{path} is not a regular file")
    _check_owner_mode(st, path, FILE_MODE)
    return st


def open_private(path: str, flags: int, *, create: bool = False, exclusive: bool = False) -> int:
    """``os.open`` a file inside a store: never follows a symlink, close-on-exec, mode 0600 on
    creation, and checked with :func:`check_private_fd`.  Returns the descriptor."""
    flags |= os.O_NOFOLLOW | os.O_CLOEXEC
    if create:
        flags |= os.O_CREAT
    if exclusive:
        flags |= os.O_EXCL
    try:
        fd = os.open(path, flags, FILE_MODE)
    except FileNotFoundError:
        raise
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeStoreError(f"{path} is a symlink; symlinks inside a store are refused") from exc
        raise io_error(exc, f"opening {path}") from exc
    try:
        check_private_fd(fd, path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_small_file(path: str, limit: int) -> bytes:
    """The whole content of a private file of at most ``limit`` bytes (checked before reading)."""
    fd = open_private(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise UnsafeStoreError(f"{path} is {size} bytes; at most {limit} expected")
        chunks = []
        left = size
        while left > 0:
            chunk = os.read(fd, left)
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)
    except HostKVError:
        raise
    except OSError as exc:
        raise io_error(exc, f"reading {path}") from exc
    finally:
        os.close(fd)


def write_all(fd: int, data: bytes | memoryview, offset: int | None = None, what: str = "writing") -> None:
    """Write every byte (``os.write`` or ``os.pwrite`` at ``offset``), retrying short writes."""
    view = memoryview(data).cast("B")
    done = 0
    try:
        while done < view.nbytes:
            n = os.write(fd, view[done:]) if offset is None else os.pwrite(fd, view[done:], offset + done)
            if n <= 0:
                raise StorageIOError(f"short write ({done} of {view.nbytes} bytes) while {what}")
            done += n
    except HostKVError:
        raise
    except OSError as exc:
        raise io_error(exc, what) from exc


def fallocate(fd: int, offset: int, nbytes: int, what: str) -> None:
    """Reserve disk blocks with ``posix_fallocate`` (ENOSPC → ``NoSpaceError``).

    Writing through an mmap of a *sparse* file on a full filesystem kills the process with
    SIGBUS; after ``posix_fallocate`` succeeded the blocks exist and stores cannot fail that way.
    """
    try:
        os.posix_fallocate(fd, offset, nbytes)
    except OSError as exc:
        raise io_error(exc, what) from exc


def sync_fd(fd: int, what: str, *, data_only: bool = True) -> None:
    """``fdatasync``/``fsync`` through the injectable hooks; any failure → ``StorageIOError``.

    Never retry a failed sync into a success: after a failed fsync Linux may have dropped the
    dirty pages and marked them clean, so a second fsync would "succeed" without the data (R7).
    """
    try:
        (fdatasync if data_only else fsync)(fd)
    except OSError as exc:
        raise io_error(exc, what) from exc


def fsync_dir(path: str) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError as exc:
        raise io_error(exc, f"opening directory {path} to sync it") from exc
    try:
        sync_fd(fd, f"syncing directory {path}", data_only=False)
    finally:
        os.close(fd)


def temp_name(final_path: str) -> str:
    """A fresh temp path next to ``final_path`` (same directory, so ``rename`` is atomic)."""
    head, tail = os.path.split(final_path)
    return os.path.join(head, f"{TEMP_MARK}{tail}.{os.getpid()}.{secrets.token_hex(4)}")


def is_temp_name(name: str) -> bool:
    return name.startswith(TEMP_MARK)


def atomic_write(path: str, data: bytes, *, durable: bool = True) -> None:
    """Replace ``path`` with ``data`` atomically: temp file (0600), write, fsync, rename, fsync
    the directory.  A crash leaves either the old file or the new one, plus at worst a temp file
    that :func:`remove_temp_files` reclaims.  ``durable=False`` skips both syncs (tests, ``none``)."""
    install_temp(write_temp(path, data, durable=durable), path, durable=durable)


def write_temp(path: str, data: bytes | Sequence[bytes | memoryview], *, durable: bool = True) -> str:
    """The first half of :func:`atomic_write`: ``data`` (or the concatenation of its parts) in a
    fresh temp file next to ``path`` (synced when ``durable``); returns its path.  The caller
    installs it with :func:`install_temp` or removes it; a crash leaves it for
    :func:`remove_temp_files`."""
    tmp = temp_name(path)
    fd = open_private(tmp, os.O_WRONLY, create=True, exclusive=True)
    try:
        try:
            for part in [data] if isinstance(data, bytes) else data:
                write_all(fd, part, what=f"writing {tmp}")
            if durable:
                sync_fd(fd, f"syncing {tmp}", data_only=False)
        finally:
            os.close(fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return tmp


def install_temp(tmp: str, path: str, *, durable: bool = True) -> None:
    """The second half of :func:`atomic_write`: rename ``tmp`` over ``path`` (the temp file is
    removed if that fails), then sync the directory when ``durable``."""
    try:
        os.rename(tmp, path)
    except OSError as exc:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise io_error(exc, f"renaming {tmp} to {path}") from exc
    if durable:
        fsync_dir(os.path.dirname(path) or ".")


def remove_temp_files(directory: str) -> list[str]:
    """Delete leftover temp files (from a crash mid-``atomic_write``) in ``directory``; only the
    writer calls this, with the writer lock held.  Returns the names removed."""
    removed = []
    try:
        names = os.listdir(directory)
    except OSError as exc:
        raise io_error(exc, f"listing {directory}") from exc
    for name in names:
        if is_temp_name(name):
            full = os.path.join(directory, name)
            try:
                st = os.lstat(full)
                if stat.S_ISREG(st.st_mode) or stat.S_ISLNK(st.st_mode):
                    os.unlink(full)
                    removed.append(name)
            except OSError:
                pass
    return removed


# -- locks ---------------------------------------------------------------------------------------


class LockFile:
    """An advisory ``flock`` on a private lock file.

    ``flock`` (not ``fcntl`` record locks) on purpose: record locks belong to the *process* and
    vanish when any descriptor of the file is closed, and two opens in one process never conflict;
    ``flock`` locks belong to the open file description, so a second ``LockFile`` on the same path
    conflicts even inside one process, and the kernel drops the lock when the holder dies
    (kill -9 included), so a crashed writer never leaves a stale lock.

    Parameters
    ----------
    path:
        The lock file (created 0600 if missing).
    exclusive:
        Exclusive (writer) or shared lock.
    blocking:
        Wait for the lock instead of raising ``LockedError`` at once.
    """

    def __init__(self, path: str, *, exclusive: bool = True, blocking: bool = False) -> None:
        self.path = path
        self.exclusive = exclusive
        self._lock = threading.Lock()
        self._fd: int | None = open_private(path, os.O_RDWR, create=True)
        op = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if blocking else fcntl.LOCK_NB)
        try:
            fcntl.flock(self._fd, op)
        except OSError as exc:
            os.close(self._fd)
            self._fd = None
            if exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                holder = _read_holder(path)
                raise LockedError(
                    f"{path} is locked by another {'writer' if exclusive else 'process'}{holder}"
                ) from None
            raise io_error(exc, f"locking {path}") from exc
        if exclusive:
            # Informational only (the flock is the truth): who holds it, for the error message.
            try:
                os.ftruncate(self._fd, 0)
                os.pwrite(self._fd, f"{os.getpid()}\n".encode(), 0)
            except OSError:
                pass

    @property
    def held(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Drop the lock; idempotent."""
        with self._lock:
            if self._fd is None:
                return
            fd, self._fd = self._fd, None
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
        finally:
            os.close(fd)

    def __enter__(self) -> LockFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


def _read_holder(path: str) -> str:
    try:
        with open(path, "rb") as f:
            text = f.read(32).decode("ascii", "replace").strip()
        return f" (pid {text})" if text.isdigit() else ""
    except OSError:
        return ""


# -- crash points (tests) ------------------------------------------------------------------------

#: Every crash point a provider module has registered (``register_crash_points``).
CRASH_POINTS: dict[str, str] = {}
CRASH_ENV = "HOSTKV_CRASH_AT"
_crash_hits: dict[str, int] = {}
_crash_spec: tuple[int, str] = (-1, "")


def reset_crash_points() -> None:
    """Forget the cached ``HOSTKV_CRASH_AT`` value and hit counts (after changing the environment
    in-process; a forked child re-reads it by itself)."""
    global _crash_spec
    _crash_spec = (-1, "")
    _crash_hits.clear()


def _crash_spec_after_fork() -> None:
    # A forked child re-reads the environment; resetting here instead of comparing os.getpid()
    # on every call keeps a disabled crash point at one tuple lookup (write paths pass 4 of them
    # per page, and getpid() is a real system call).
    global _crash_spec
    _crash_spec = (-1, "")


os.register_at_fork(after_in_child=_crash_spec_after_fork)


def register_crash_points(points: dict[str, str]) -> None:
    """Declare named crash points (``name -> what has happened when it fires``) so the crash
    tests can enumerate them and check that each one is reached."""
    CRASH_POINTS.update(points)


def crash_point(name: str) -> None:
    """SIGKILL this process at the ``n``-th time ``name`` is reached, when the environment says
    ``HOSTKV_CRASH_AT=name:n`` (or the short ``CRASH_AT=name:n``).  A no-op otherwise (one dict
    lookup), so the points stay compiled into production code and test the real protocol."""
    global _crash_spec
    if _crash_spec[0] < 0:  # read the environment once per process (a fork re-reads it)
        _crash_spec = (os.getpid(), os.environ.get(CRASH_ENV) or os.environ.get("CRASH_AT") or "")
    spec = _crash_spec[1]
    if not spec:
        return
    point, _, count = spec.rpartition(":")
    if point != name:
        return
    hits = _crash_hits.get(name, 0) + 1
    _crash_hits[name] = hits
    if hits >= max(1, int(count) if count.isdigit() else 1):
        os.kill(os.getpid(), 9)
