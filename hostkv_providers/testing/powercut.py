"""A power-cut simulator for file-backed stores (RELIABILITY.md: "power-cut simulation").

:class:`PowerCut` watches one store directory in-process and keeps a model of what a power cut
would leave on the disk, faithful to Linux semantics:

* data reaches a file through ``write``/``pwrite`` *and* through ``MAP_SHARED`` stores; the model
  never looks at system-call arguments, it reads the file's current bytes (the page cache) through
  a descriptor of its own;
* ``fsync``/``fdatasync`` of a file makes the file's current bytes and size durable (that inode's
  *durable copy*); ``fsync`` of the directory makes its current name → inode map durable;
* a create, rename or unlink is durable only once the directory is synced;
* everything not synced may or may not have reached the disk: in an :meth:`PowerCut.image`, every
  name whose binding changed since the last directory sync takes its old or its new inode, every
  512-byte sector that differs from the durable copy independently takes its new or its old bytes,
  and a changed file size takes the new or the old size.

The hooks are the package's sync indirections, :data:`hostkv_providers.providers._fsutil.fsync` and
:data:`~hostkv_providers.providers._fsutil.fdatasync` (``fsync_dir`` and every ``SlotFile.sync`` call through
them; the provider never uses ``msync``/``mmap.flush``: on Linux ``fdatasync`` of the descriptor
writes back the pages dirtied through a shared mapping as well).  At every hook on a file of the
store, *before* the sync takes effect (power lost while it was issued), :attr:`PowerCut.on_sync`
is called: that is where a test captures images.  Syncs of other files (an image being checked)
are not modelled (and, like the store's, performed only with ``passthrough=True``).

The real sync is skipped by default (``passthrough=False``): the model decides what is durable, and
a real ``fsync`` costs milliseconds on this kind of disk.  The simulator keeps a read-only
descriptor open on every inode it has seen, so an unlinked inode's number cannot be reused while
the durable directory map may still name it, and its current bytes stay readable.

Usage::

    with PowerCut(store_dir, seed=1) as pc:
        pc.on_sync = lambda what: maybe_capture(pc)      # e.g. with some probability
        ... run a workload on the provider at store_dir ...
        files = pc.image(random.Random(7))               # name -> bytes after a power cut now
        write_image(files, "/tmp/img-7")                 # 0700 directory, 0600 files
"""

from __future__ import annotations

import contextlib
import os
import random
import stat
from collections.abc import Callable
from types import TracebackType

import numpy as np

from hostkv_providers.providers import _fsutil

__all__ = ["SECTOR", "PowerCut", "write_image"]

#: The unit in which unsynced writes independently reach the disk or not.
SECTOR = 512


class PowerCut:
    """The durable state of one directory's regular files, as a power cut would leave it.

    Parameters
    ----------
    root:
        The store directory (flat: subdirectories are ignored).
    passthrough:
        Also perform the real ``fsync``/``fdatasync`` after the model's bookkeeping.

    Attributes
    ----------
    on_sync:
        ``callable(kind)`` called at every sync of the store (``kind`` is ``"file"`` or ``"dir"``)
        before it takes effect, and at every named crash point the code passes
        (:func:`hostkv_providers.providers._fsutil.crash_point`; ``kind`` is ``"point:<name>"``): capture
        images there.  Not called re-entrantly.
    syncs:
        Syncs seen, by kind.
    """

    def __init__(self, root: str, *, passthrough: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.passthrough = passthrough
        self.on_sync: Callable[[str], None] | None = None
        self.syncs: dict[str, int] = {"file": 0, "dir": 0}
        self._fds: dict[int, int] = {}  # inode -> our O_RDONLY descriptor (keeps the inode alive)
        self._durable: dict[int, bytes] = {}  # inode -> durable bytes (size = len)
        self._dir_durable: dict[str, int] = {}  # name -> inode, as of the last directory sync
        self._orig: tuple[Callable[[int], None], Callable[[int], None]] | None = None
        self._orig_point: Callable[[str], None] | None = None
        self._in_hook = False
        self._root_id: tuple[int, int] | None = None

    # -- installation ----------------------------------------------------------------------------
    def install(self) -> None:
        """Route ``_fsutil.fsync``/``fdatasync`` through the model; the directory's current
        entries are taken as durable (the store starts from a synced state)."""
        if self._orig is not None:
            return
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        st = os.stat(self.root)
        self._root_id = (st.st_dev, st.st_ino)
        self._orig = (_fsutil.fsync, _fsutil.fdatasync)
        cur = self._scan()
        for ino in set(cur.values()):
            self._durable[ino] = self._current(ino)
        self._dir_durable = dict(cur)
        _fsutil.fsync = self._fsync
        _fsutil.fdatasync = self._fdatasync
        self._orig_point = _fsutil.crash_point
        setattr(_fsutil, "crash_point", self._crash_point)  # noqa: B010  (a module function: mypy refuses =)

    def uninstall(self) -> None:
        """Restore the real syncs and close the descriptors the model holds."""
        if self._orig is not None:
            _fsutil.fsync, _fsutil.fdatasync = self._orig
            self._orig = None
        if self._orig_point is not None:
            setattr(_fsutil, "crash_point", self._orig_point)  # noqa: B010
            self._orig_point = None
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

    def __enter__(self) -> PowerCut:
        self.install()
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        self.uninstall()

    # -- the model -------------------------------------------------------------------------------
    def _scan(self) -> dict[str, int]:
        """The directory's current regular files (name -> inode); opens a descriptor on each new
        inode."""
        out: dict[str, int] = {}
        for name in os.listdir(self.root):
            full = os.path.join(self.root, name)
            try:
                st = os.lstat(full)
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            if st.st_ino not in self._fds:
                try:
                    fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                if os.fstat(fd).st_ino != st.st_ino:  # replaced between lstat and open
                    os.close(fd)
                    continue
                self._fds[st.st_ino] = fd
            out[name] = st.st_ino
        return out

    def _current(self, ino: int) -> bytes:
        """The inode's current bytes (the page cache, mapping stores included)."""
        fd = self._fds[ino]
        size = os.fstat(fd).st_size
        chunks = []
        done = 0
        while done < size:
            chunk = os.pread(fd, size - done, done)
            if not chunk:
                break
            chunks.append(chunk)
            done += len(chunk)
        return b"".join(chunks)

    def _which(self, fd: int) -> tuple[str, int] | None:
        """``("dir", 0)`` for the store directory, ``("file", inode)`` for one of its files."""
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            return ("dir", 0) if (st.st_dev, st.st_ino) == self._root_id else None
        if not stat.S_ISREG(st.st_mode) or self._root_id is None or st.st_dev != self._root_id[0]:
            return None
        if st.st_ino not in self._fds:
            self._scan()
        return ("file", st.st_ino) if st.st_ino in self._fds else None

    def _sync(self, fd: int, data_only: bool) -> None:
        assert self._orig is not None
        real = self._orig[1] if data_only else self._orig[0]
        which = None if self._in_hook else self._which(fd)
        if which is None:
            if self.passthrough:
                real(fd)
            return
        kind, ino = which
        self.syncs[kind] += 1
        self._scan()
        if self.on_sync is not None:
            self._in_hook = True
            try:
                self.on_sync(kind)  # power lost while this sync was in flight
            finally:
                self._in_hook = False
        if self.passthrough:
            real(fd)
        if kind == "dir":
            self._dir_durable = self._scan()
        else:
            self._durable[ino] = self._current(ino)

    def _crash_point(self, name: str) -> None:
        if self.on_sync is not None and not self._in_hook:
            self._in_hook = True
            try:
                self.on_sync(f"point:{name}")  # a power cut at a named step of a protocol
            finally:
                self._in_hook = False
        if self._orig_point is not None:
            self._orig_point(name)

    def _fsync(self, fd: int) -> None:
        self._sync(fd, False)

    def _fdatasync(self, fd: int) -> None:
        self._sync(fd, True)

    # -- images ----------------------------------------------------------------------------------
    def image(self, rng: random.Random, *, p_new: float | None = None,
              p_name: float | None = None) -> dict[str, bytes]:
        """The directory's files after a power cut *now*: ``name -> bytes``.

        ``p_new``: probability that an unsynced sector (or size change) reached the disk;
        ``p_name``: that an unsynced name change did.  Random per image when ``None`` (drawn from
        all-old, all-new and mixtures, so both extremes are covered)."""
        if p_new is None:
            p_new = rng.choice((0.0, 1.0, 0.5, rng.random()))
        if p_name is None:
            p_name = rng.choice((0.0, 1.0, 0.5, rng.random()))
        cur = self._scan()
        # temp names carry a pid and a random token: order by what they stand for, so that a
        # seeded rng gives the same image in every run
        names = sorted(set(cur) | set(self._dir_durable), key=_stable_name)
        contents: dict[int, bytes] = {}
        out: dict[str, bytes] = {}
        for name in names:
            old, new = self._dir_durable.get(name), cur.get(name)
            ino = old if old == new else (new if rng.random() < p_name else old)
            if ino is None:
                continue
            if ino not in contents:
                contents[ino] = self._mix(ino, rng, p_new)
            out[name] = contents[ino]
        return out

    def _mix(self, ino: int, rng: random.Random, p_new: float) -> bytes:
        old = self._durable.get(ino, b"")
        new = self._current(ino) if ino in self._fds else old
        if old == new:
            return old
        size = len(old) if len(old) == len(new) else (len(new) if rng.random() < p_new else len(old))
        if size == 0:
            return b""
        padded = -(-size // SECTOR) * SECTOR
        o = np.frombuffer(old[:size].ljust(padded, b"\0"), np.uint8).reshape(-1, SECTOR)
        n = np.frombuffer(new[:size].ljust(padded, b"\0"), np.uint8).reshape(-1, SECTOR)
        differ = (o != n).any(axis=1)
        gen = np.random.default_rng(rng.getrandbits(64))
        take = differ & (gen.random(len(differ)) < p_new)
        mixed = np.where(take[:, None], n, o)
        return mixed.tobytes()[:size]

    @property
    def durable_names(self) -> dict[str, int]:
        """The directory's durable name -> inode map (for tests of the model itself)."""
        return dict(self._dir_durable)


def _stable_name(name: str) -> tuple[str, str]:
    return (name.rsplit(".", 2)[0], "") if _fsutil.is_temp_name(name) else (name, name)


def write_image(files: dict[str, bytes], dest: str) -> None:
    """Write an image (``name -> bytes``) into a new directory ``dest`` (0700, files 0600)."""
    os.mkdir(dest, 0o700)
    for name, data in files.items():
        fd = os.open(os.path.join(dest, name), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            view = memoryview(data)
            done = 0
            while done < len(view):
                done += os.write(fd, view[done:])
        finally:
            os.close(fd)
