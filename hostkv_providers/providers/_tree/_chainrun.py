"""A :class:`~hostkv_providers.ChainRun` over one run of a provider's :class:`TreeIndex` (pinned,
tiered): the state a run goes through, its split on ``materialize``, the seal's preconditions."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from hostkv_providers._chain import ChainRun
from hostkv_providers._errors import IncompleteWriteError, ReservationError
from hostkv_providers._keys import Key
from hostkv_providers._reservation import Reservation

__all__ = ["TreeChainRun"]


class TreeChainRun(ChainRun):
    """``keys`` reserved as one ``TreeIndex`` run (``run``) of ``prov`` (which has ``_lock``,
    ``_index`` and ``_check_usable``): ``state`` is ``open``, then ``sealed``, ``aborted`` or
    ``materialized`` (split into per-page flights; the run itself is inert from then on)."""

    __slots__ = ("_prov", "_run", "keys", "n", "nbytes", "parent", "salt_tag", "sealed", "state", "written")

    def __init__(self, prov: Any, run: Any, keys: list[Key], parent: Key | None, nbytes: int, salt_tag: str) -> None:
        self._prov = prov
        self._run = run
        self.keys = keys
        self.parent = parent
        self.n = len(keys)
        self.nbytes = nbytes
        self.salt_tag = salt_tag
        self.state = "open"
        self.written = False
        self.sealed = 0

    def _split(self) -> str:
        """For ``materialize``: split an open run into per-page flights of the index; the state
        the pages are in (``open`` when the run was)."""
        with self._prov._lock:
            if self.state == "open":
                self._prov._index.split_run(self._run)
                self.state = "materialized"
                return "open"
            return self.state

    def _per_page(self, state: str, make: Callable[[Key, Key | None, Any], Reservation],
                  inner: Iterable[Any]) -> list[Reservation]:
        """The run as one reservation per page, for ``materialize`` (after :meth:`_split` gave
        ``state``): ``make(key, parent, item)`` for each page and its item of ``inner``, marked
        written when the run was (the base mark only: the run's own memory is already marked),
        finished in ``state`` unless the run was open."""
        out: list[Reservation] = []
        for k, p, item in zip(self.keys, [self.parent, *self.keys[:-1]], inner, strict=True):
            r = make(k, p, item)
            if self.written:
                Reservation.mark_written(r)
            if state != "open":
                r._finish(state)
            out.append(r)
        return out

    def _cancel(self) -> bool:
        """For ``abort`` of a provider whose memory needs no more than its index: an open run's
        flights cancelled under the provider's lock; whether it was open."""
        with self._prov._lock:
            if self.state != "open":
                return False
            self._prov._index.cancel_run(self._run)
            self.state = "aborted"
            return True

    def _check_sealable(self) -> None:
        """The seal's preconditions: the provider usable, the run open and written."""
        self._prov._check_usable()
        if self.state != "open":
            raise ReservationError(f"this chain run is {self.state}", hint="reserve the pages again")
        if not self.written:
            raise IncompleteWriteError("the chain run's pages were not marked written",
                                       hint="call ReservedChain.mark_written() once the copy into .pages is done")
