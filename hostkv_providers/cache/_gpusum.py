"""Checksums on the GPU for the cache's save and restore paths (issue 14 items 2 and 3).

Save: when the provider's entries are checksummed in ``xxh3-256k-tree`` and the engine's pages sit
in CUDA memory, each chunk's pages are hashed by a kernel on a stream of the cache's own, ordered
after the save's ``after=`` position; the chunk's device-to-host copy is ordered after the hash
(so ``copied()`` implies the hash read the blocks too), and the chunk is sealed with those
checksums: no hashing on the host at all.

Restore: a chunk restored from zero-copy views whose provider handed out the pages' checksums
(``HostPages.checksums``) is hashed again in the engine's blocks right after its host-to-device
copy (on the host when the planes are in host memory: the CPU copy engine); a page whose
checksum differs truncates the result at that page, exactly as a host-side checksum failure
does (``result.pages`` leading pages are good; the engine recomputes the rest).
"""

from __future__ import annotations

import contextlib
import ctypes
from collections.abc import Sequence
from typing import Any

import numpy as np

from hostkv_providers._blockhash import TREE_ALGORITHM, tree_checksum_parts
from hostkv_providers.device._cuda import c_array

__all__ = ["RestoreCheck", "SaveSums", "prepare", "restore_check", "save_sums"]


def _hasher_for(planes: Any) -> Any:
    if getattr(planes, "device", -1) < 0:
        return None
    try:
        from hostkv_providers.device import _cuda
        from hostkv_providers.device._hash import PageHasher
    except Exception:  # no cuda.bindings at all: the host hashes
        return None
    if not _cuda.available() or not PageHasher.supports(planes):
        return None
    return PageHasher.get(planes.device)


def prepare(provider: Any, engine: Any) -> None:
    """Build the GPU page hasher now if this cache's saves (and verified restores) will use it.

    Its NVRTC compile is a one-time cost per process: built lazily, it landed inside the engine's
    first save (H200, 1,600 pages, fresh processes: 87.5-88.7 ms against 67.5-70.6 ms with the
    hasher built here; making the cache then takes 20-34 ms).  Called when the cache is made,
    i.e. at the engine's start-up.  A hasher that cannot be built
    here is left to the first save, which reports it as before.  (The planes are not known yet,
    so a cache whose planes the hasher cannot take, ``PageHasher.supports``, builds it for
    nothing: 20-35 ms once per process.)"""
    if getattr(provider, "checksum_algorithm", None) != TREE_ALGORITHM or not hasattr(engine, "mark"):
        return
    ordinal = getattr(engine, "device", None)
    if not isinstance(ordinal, int) or ordinal < 0:
        return
    # Any failure is left to the first save, where it surfaced before (a cache is still made).
    with contextlib.suppress(Exception):
        from hostkv_providers.device import _cuda
        from hostkv_providers.device._hash import PageHasher

        if _cuda.available():
            PageHasher.get(ordinal)


class SaveSums:
    """Per-save state: the hash stream (behind the save's ``after`` mark)."""

    def __init__(self, hasher: Any, planes: Any, engine: Any, after: Any) -> None:
        self.hasher = hasher
        self.planes = planes
        self.engine = engine
        self.stream = hasher.dev.stream(low_priority=False)
        if after is not None:
            # the blocks as the engine's stream leaves them at the save() call (a StreamMark)
            with hasher.dev.scope():
                after.wait_in(self.stream)

    def enqueue(self, bids: Sequence[int]) -> tuple[Any, Any]:
        """Hash pages ``bids`` now; returns ``(digests, mark)``: the mark orders the chunk's copy
        after the hash (pass it as the copy's ``after``)."""
        dg = self.hasher.enqueue(self.planes, bids, self.stream)
        return dg, self.engine.mark(int(self.stream))

    def close(self) -> None:
        from hostkv_providers.device import _cuda

        with self.hasher.dev.scope():
            _cuda.driver().cuStreamDestroy(self.stream)


def save_sums(provider: Any, engine: Any, planes: Any, after: Any) -> SaveSums | None:
    """A :class:`SaveSums` when this save can take its checksums from the GPU, else ``None``."""
    if getattr(provider, "checksum_algorithm", None) != TREE_ALGORITHM or not hasattr(engine, "mark"):
        return None
    hasher = _hasher_for(planes)
    if hasher is None:
        return None
    return SaveSums(hasher, planes, engine, after)


class RestoreCheck:
    """Per-restore state: verifies chunks restored from views, on a stream of its own."""

    def __init__(self, hasher: Any, planes: Any) -> None:
        self.hasher = hasher
        self.planes = planes
        self.stream = hasher.dev.stream(low_priority=False)

    def gate_stream(self) -> int | None:
        """The stream to pass as a restore's ``before=`` so that :meth:`enqueue` with ``gated``
        needs no wait on the transfer (``None``: this check has no stream)."""
        return int(self.stream)

    def enqueue(self, transfer: Any, bids: Sequence[int], *, gated: bool = False) -> Any:
        """Hash the blocks ``bids`` once ``transfer`` (their H2D copy) is done: behind its event
        (``transfer.wait_on``, which waits until the engine has issued the copies), or, with
        ``gated``, behind the restore's gate on :meth:`gate_stream` (the transfer was made with
        ``before=`` that stream: nothing to wait for here)."""
        if not gated:
            with self.hasher.dev.scope():
                transfer.wait_on(int(self.stream))
        return self.hasher.enqueue(self.planes, bids, self.stream)

    @staticmethod
    def good_prefix(digests: Any, expected: np.ndarray[Any, np.dtype[np.uint64]]) -> int:
        """How many leading pages match their stored checksums."""
        got = np.array(digests.roots(), dtype=np.uint64)
        bad = np.flatnonzero(got != expected[: len(got)])
        return int(bad[0]) if bad.size else len(got)

    def close(self) -> None:
        from hostkv_providers.device import _cuda

        with self.hasher.dev.scope():
            _cuda.driver().cuStreamDestroy(self.stream)


class _HostDigests:
    """The host's twin of ``PageDigests`` for planes in host memory (the CPU copy engine): the
    pages' checksums computed from the restored blocks once their copy is done."""

    def __init__(self, transfer: Any, planes: Any, bids: Sequence[int]) -> None:
        self._transfer = transfer
        self._planes = planes
        self._bids = list(bids)

    def roots(self) -> list[int]:
        self._transfer.wait()
        planes = self._planes
        specs = sorted(planes.layout.planes, key=lambda sp: sp.offset)
        out = []
        for b in self._bids:
            parts = [c_array(ctypes.c_char, sp.nbytes).from_address(planes.slice_address(sp.index, b)) for sp in specs]
            out.append(tree_checksum_parts(parts))
        return out

    def close(self) -> None:
        self._planes = None


class HostRestoreCheck(RestoreCheck):
    """:class:`RestoreCheck` for planes in host memory: the check runs on the host."""

    def __init__(self, planes: Any) -> None:  # no hasher, no stream
        self.planes = planes

    def gate_stream(self) -> int | None:
        return None  # (checked on the host, after the transfer's wait)

    def enqueue(self, transfer: Any, bids: Sequence[int], *, gated: bool = False) -> Any:
        return _HostDigests(transfer, self.planes, bids)

    def close(self) -> None:
        self.planes = None


def restore_check(planes: Any) -> RestoreCheck | None:
    """A :class:`RestoreCheck` when restores into ``planes`` can be verified: on the GPU for
    CUDA planes, on the host for host planes (the CPU copy engine)."""
    if getattr(planes, "device", 0) < 0 and hasattr(planes, "slice_address"):
        return HostRestoreCheck(planes)
    hasher = _hasher_for(planes)
    return None if hasher is None else RestoreCheck(hasher, planes)
