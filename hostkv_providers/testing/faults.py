"""I/O fault injection for file-backed stores (RELIABILITY.md: "ENOSPC / EIO").

:class:`IOFaults` wraps the ``os`` functions a store uses (and ``mmap.mmap`` and the package's sync
indirections :data:`hostkv_providers.providers._fsutil.fsync`/``fdatasync``) for the duration of a ``with``
block.  Calls that touch the store directory — by path under it, or by a descriptor that
``os.open`` returned for such a path — are counted, each with its kind (``"pwrite"``,
``"fsync"``...) and its call site (the first frame in the library outside ``testing``); every
other call passes straight through.  Arm it with :meth:`IOFaults.arm` to make the ``n``-th
counted call raise ``OSError(errno)`` instead of running (once: the fault then clears).

Typical use: run a workload once to count its calls, then once per index ``n`` with the fault at
call ``n``, and check that every operation either succeeds or raises one of the library's typed
errors, that nothing acknowledged is lost, and that writes resume after the fault.

Calls a test itself makes on the store through the wrapped functions are counted (and failed)
too: make them outside the ``with`` block, or with the builtin ``open`` and ``os.f*`` calls.

``os.close`` is tracked (to forget descriptors) but never failed: Linux frees the descriptor even
when ``close`` reports an error, and the library only closes after it is done with a file.
"""

from __future__ import annotations

import errno as _errno
import mmap
import os
import sys
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from typing import Any

from hostkv_providers.providers import _fsutil

__all__ = ["FD_KINDS", "PATH_KINDS", "IOFaults"]

#: ``os`` functions whose first argument is a path.
PATH_KINDS = ("open", "rename", "replace", "unlink", "listdir", "lstat", "stat", "mkdir", "chmod")
#: ``os`` functions whose first argument is a descriptor.
FD_KINDS = ("write", "pwrite", "read", "pread", "preadv", "fstat", "posix_fallocate", "ftruncate")

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_TESTING_DIR = os.path.dirname(os.path.abspath(__file__))
_FSUTIL = os.path.abspath(_fsutil.__file__)


class IOFaults:
    """Count, and on demand fail, the I/O calls a store makes (see the module docstring).

    Parameters
    ----------
    root:
        The store directory; only calls on it and below are counted.
    sites:
        Record the call site of every counted call (:attr:`sites`; walking the stack costs more
        than the call) — else only the failed call's.
    real_sync:
        Whether a store file's ``fsync``/``fdatasync`` that is not failed really runs (default
        ``False``: this is about error handling, not durability, and a real sync costs
        milliseconds on this kind of disk; the power-cut simulation tests durability).
    """

    def __init__(self, root: str, *, sites: bool = True, real_sync: bool = False) -> None:
        self.root = os.path.abspath(root)
        self.real_sync = real_sync
        self.record_sites = sites
        self.count = 0
        self.kinds: Counter[str] = Counter()
        self.sites: Counter[tuple[str, str, int]] = Counter()  # (kind, module file, line)
        #: The kind of every counted call, in order (with ``sites=True``).
        self.calls: list[str] = []
        #: ``(kind, site, path)`` of the call that was failed, once it was.
        self.fired: tuple[str, tuple[str, str, int], str] | None = None
        self._arm_at = 0
        self._errno = _errno.EIO
        self._sticky = False
        self._fd_path: dict[int, str] = {}
        self._saved: list[tuple[object, str, Any]] = []

    # -- control ---------------------------------------------------------------------------------
    def arm(self, n: int, err: int = _errno.EIO, *, sticky: bool = False) -> None:
        """Fail the ``n``-th counted call from now on (1-based) with ``OSError(err)``; with
        ``sticky``, that call and every later one until :meth:`disarm` (a device that stays
        broken, a disk that stays full: error paths' own cleanup fails too)."""
        self.count = 0
        self.kinds.clear()
        self.sites.clear()
        self.calls.clear()
        self.fired = None
        self._arm_at = n
        self._errno = err
        self._sticky = sticky

    def disarm(self) -> None:
        self._arm_at = 0
        self._sticky = False

    # -- bookkeeping -----------------------------------------------------------------------------
    def _ours(self, path: object) -> str | None:
        if isinstance(path, int):
            return self._fd_path.get(path)
        if isinstance(path, bytes):
            path = os.fsdecode(path)
        if not isinstance(path, (str, os.PathLike)):
            return None
        p = os.path.abspath(os.fspath(path))
        return p if p == self.root or p.startswith(self.root + os.sep) else None

    def _site(self) -> tuple[str, int]:
        """The library line that asked for this I/O: the first frame in the package outside
        ``testing`` and outside the ``_fsutil`` helpers (which every provider shares)."""
        f = sys._getframe(2)
        fallback = ("?", 0)
        while f is not None:
            name = f.f_code.co_filename
            if name.startswith(_PKG_DIR) and not name.startswith(_TESTING_DIR):
                here = os.path.relpath(name, os.path.dirname(_PKG_DIR)), f.f_lineno
                if name != _FSUTIL:
                    return here
                if fallback[1] == 0:
                    fallback = here
            f = f.f_back  # type: ignore[assignment]
        return fallback

    def _count(self, kind: str, path: str) -> None:
        self.count += 1
        self.kinds[kind] += 1
        fire = self._arm_at > 0 and (self.count == self._arm_at or (self._sticky and self.count > self._arm_at))
        if self.record_sites or fire:
            site = (kind, *self._site())
            self.sites[site] += 1
        if self.record_sites:
            self.calls.append(kind)
        if fire:
            if not self._sticky:
                self._arm_at = 0
            if self.fired is None:
                self.fired = (kind, site, path)
            raise OSError(self._errno, f"injected {_errno.errorcode[self._errno]} ({kind} #{self.count})", path)

    # -- wrappers --------------------------------------------------------------------------------
    def _wrap_path(self, kind: str, real: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(path: Any, *args: Any, **kw: Any) -> Any:
            mine = self._ours(path)
            if mine is not None:
                self._count(kind, mine)
            out = real(path, *args, **kw)
            if mine is not None:
                if kind == "open":
                    self._fd_path[out] = mine
                elif kind in ("rename", "replace") and args:
                    dst = self._ours(args[0])
                    for fd, p in list(self._fd_path.items()):
                        if p == mine and dst is not None:
                            self._fd_path[fd] = dst  # a temp file renamed into place
            return out

        return wrapper

    def _wrap_fd(self, kind: str, real: Callable[..., Any]) -> Callable[..., Any]:
        skip = kind in ("fsync", "fdatasync")

        def wrapper(fd: Any, *args: Any, **kw: Any) -> Any:
            mine = self._ours(fd) if isinstance(fd, int) else None
            if mine is not None:
                self._count(kind, mine)
                if skip and not self.real_sync:
                    return None
            return real(fd, *args, **kw)

        return wrapper

    def __enter__(self) -> IOFaults:
        def patch(obj: object, name: str, new: Any) -> None:
            self._saved.append((obj, name, getattr(obj, name)))
            setattr(obj, name, new)

        for kind in PATH_KINDS:
            patch(os, kind, self._wrap_path(kind, getattr(os, kind)))
        for kind in FD_KINDS:
            patch(os, kind, self._wrap_fd(kind, getattr(os, kind)))
        patch(_fsutil, "fsync", self._wrap_fd("fsync", _fsutil.fsync))
        patch(_fsutil, "fdatasync", self._wrap_fd("fdatasync", _fsutil.fdatasync))
        real_mmap = mmap.mmap

        def mmap_wrapper(fd: int, *args: Any, **kw: Any) -> mmap.mmap:
            mine = self._ours(fd)
            if mine is not None:
                self._count("mmap", mine)
            return real_mmap(fd, *args, **kw)

        patch(mmap, "mmap", mmap_wrapper)
        real_close = os.close

        def close_wrapper(fd: int) -> None:
            self._fd_path.pop(fd, None)
            real_close(fd)

        patch(os, "close", close_wrapper)
        return self

    def __exit__(self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None) -> None:
        while self._saved:
            obj, name, old = self._saved.pop()
            setattr(obj, name, old)
