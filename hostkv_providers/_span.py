"""``ByteSpan``: the one way to address bytes of an entry."""

from __future__ import annotations

from dataclasses import dataclass

from hostkv_providers._errors import SpanError

__all__ = ["ByteSpan"]


@dataclass(frozen=True, slots=True)
class ByteSpan:
    """A half-open byte range ``[offset, offset + nbytes)`` of one entry.

    Construction validates the span on its own (non-negative ints); :meth:`validate` checks it
    against an entry's size.  ``nbytes == 0`` is allowed (an empty read is a no-op).
    """

    offset: int
    nbytes: int

    def __post_init__(self) -> None:
        for name in ("offset", "nbytes"):
            value = getattr(self, name)
            if type(value) is not int:  # bool is an int subclass: refuse it too
                raise SpanError(f"ByteSpan.{name} must be an int, got {type(value).__name__}")
            if value < 0:
                raise SpanError(f"ByteSpan.{name} must be >= 0, got {value}")

    @property
    def end(self) -> int:
        """One past the last byte."""
        return self.offset + self.nbytes

    @classmethod
    def whole(cls, nbytes: int) -> ByteSpan:
        """The span covering an entry of ``nbytes`` bytes."""
        return cls(0, nbytes)

    def validate(self, size: int) -> ByteSpan:
        """Return ``self`` if it lies inside an entry of ``size`` bytes, else raise ``SpanError``."""
        if self.end > size:
            raise SpanError(
                f"span [{self.offset}, {self.end}) exceeds the entry size {size}",
            )
        return self

    def __repr__(self) -> str:
        return f"ByteSpan({self.offset}, {self.nbytes})"
