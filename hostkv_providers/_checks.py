"""The argument checks every provider shares: each raises a typed ``InvalidArgumentError`` (or
``SpanError``) with a hint, so a bad input never reaches a medium."""

from __future__ import annotations

import math
from collections.abc import Sequence

from hostkv_providers._errors import InvalidArgumentError
from hostkv_providers._span import ByteSpan

__all__ = [
    "ANCHOR_NAME_MAX",
    "check_anchor_name",
    "check_flag",
    "check_progress",
    "check_retain_share",
    "check_span",
    "check_timeout",
    "readable_bytes",
    "scatter_into",
    "writable_buffer",
]

ANCHOR_NAME_MAX = 64


def check_retain_share(value: object) -> float:
    """Validate the ``retain_share`` option (``SupportsRetain``): a fraction in (0, 1]."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise InvalidArgumentError(f"retain_share must be a fraction in (0, 1], got {value!r}",
                                   hint="e.g. retain_share=0.5: at most half the budget may be retained")
    return float(value)


def check_anchor_name(name: object) -> str:
    """Validate an anchor name: 1..64 printable ASCII characters."""
    if not isinstance(name, str) or not 1 <= len(name) <= ANCHOR_NAME_MAX:
        raise InvalidArgumentError(f"anchor name must be a str of 1..{ANCHOR_NAME_MAX} chars, got {name!r}")
    if not name.isascii() or not name.isprintable():
        raise InvalidArgumentError(f"anchor name must be printable ASCII, got {name!r}")
    return name


def check_timeout(value: object, what: str = "timeout") -> float:
    """Validate a timeout in seconds: a real number ``>= 0`` (``inf``: no limit).  ``nan`` is
    refused: every deadline comparison with it is false, so a wait on it would never end."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidArgumentError(f"{what} must be a number of seconds, got {type(value).__name__}")
    seconds = float(value)
    if math.isnan(seconds) or seconds < 0:
        raise InvalidArgumentError(f"{what} must be >= 0 seconds, got {value!r}")
    return seconds


def check_span(span: object, size: int) -> ByteSpan:
    """``span`` (a :class:`ByteSpan` or ``None``: the whole entry) checked against an entry of
    ``size`` bytes; ``InvalidArgumentError`` for anything else, ``SpanError`` outside the entry."""
    if span is None:
        return ByteSpan.whole(size)
    if not isinstance(span, ByteSpan):
        raise InvalidArgumentError(f"span must be a ByteSpan or None, got {type(span).__name__}",
                                   hint="pass ByteSpan(offset, nbytes)")
    return span.validate(size)


def check_progress(progress: object) -> None:
    """``progress`` must be ``None`` or a callable ``progress(done, total)``."""
    if progress is not None and not callable(progress):
        raise InvalidArgumentError(f"progress must be a callable(done, total) or None, got {type(progress).__name__}")


def check_flag(value: object, what: str) -> bool:
    """``value`` must be a ``bool`` (``repair="no"`` would otherwise read as true)."""
    if type(value) is not bool:
        raise InvalidArgumentError(f"{what} must be True or False, got {value!r}")
    return value


def writable_buffer(out: object, nbytes: int) -> memoryview:
    """A flat, writable byte view of ``out`` with at least ``nbytes`` bytes."""
    try:
        view = memoryview(out)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"out must support the buffer protocol, got {type(out).__name__}"
        ) from None
    if view.readonly:
        raise InvalidArgumentError("out must be a writable buffer")
    if not view.c_contiguous:
        raise InvalidArgumentError("out must be C-contiguous")
    view = view.cast("B") if view.format != "B" or view.ndim != 1 else view
    if view.nbytes < nbytes:
        raise InvalidArgumentError(f"out holds {view.nbytes} bytes, {nbytes} needed")
    return view[:nbytes]


def _scatter_buffers(into: object) -> list[memoryview]:
    """``read_anchor``'s ``into``: one writable buffer or a sequence of them, as whole flat views."""
    items = list(into) if isinstance(into, (list, tuple)) else [into]
    if not items:
        raise InvalidArgumentError("into must be a writable buffer or a non-empty sequence of them")
    out = []
    for b in items:
        writable_buffer(b, 0)  # writable and C-contiguous, else a typed error
        view = memoryview(b)  # type: ignore[arg-type]
        out.append(view.cast("B") if view.format != "B" or view.ndim != 1 else view)
    return out


def scatter_into(bufs: Sequence[memoryview], src: memoryview) -> None:
    """Copy ``src`` into ``bufs`` in order (a scatter copy); ``InvalidArgumentError`` when they
    hold fewer bytes than ``src``."""
    room = sum(b.nbytes for b in bufs)
    if room < src.nbytes:
        raise InvalidArgumentError(f"the buffers hold {room} bytes, the anchor is {src.nbytes}",
                                   hint="size them with list_anchors(key)[name]")
    pos = 0
    for b in bufs:
        n = min(b.nbytes, src.nbytes - pos)
        if n <= 0:
            break
        b[:n] = src[pos: pos + n]
        pos += n


def readable_bytes(data: object) -> memoryview:
    """A flat, read-only byte view of ``data`` (any buffer)."""
    try:
        view = memoryview(data)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(
            f"data must support the buffer protocol, got {type(data).__name__}"
        ) from None
    if not view.c_contiguous:
        raise InvalidArgumentError("data must be C-contiguous")
    return view.cast("B") if view.format != "B" or view.ndim != 1 else view


def overlapping(views: Sequence[memoryview]) -> bool:
    """Whether any two of ``views`` (flat byte views) share memory.  For a batch read's failure
    path only (an address per view): a copy into a buffer that aliases another output buffer
    overwrites that one's bytes before their check, which then fails and must not count as
    corruption of the stored entry."""
    import numpy as np

    if len(views) < 2:
        return False
    starts = np.array([np.frombuffer(v, dtype=np.uint8).ctypes.data if v.nbytes else 0 for v in views],
                      dtype=np.uint64)
    sizes = np.array([v.nbytes for v in views], dtype=np.uint64)
    keep = sizes > 0
    starts, sizes = starts[keep], sizes[keep]
    order = np.argsort(starts, kind="stable")
    starts, ends = starts[order], starts[order] + sizes[order]
    return bool((starts[1:] < ends[:-1]).any())
