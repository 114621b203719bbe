"""Issue 16 item 7, deterministically: ``close()`` while another thread is inside ``put()``.

The writer thread is held inside its reservation (after the reserve's commit, before the
reservation is handed back) until ``close()`` has begun.  The old lmdb code closed anyway: the
flight committed to LMDB was not among the reservations close() aborted, so after a reopen
``used_bytes`` counted it, ``reserve`` of the key raised ``InFlightError`` and ``wait_sealed``
returned False until the process exited.  Now ``close()`` waits for the call under way; the
``put`` completes or raises ``ClosedError``, and nothing stays in flight.  Also: a seal racing
an abort of the same reservation (the front's claim), on every persistent built-in provider."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest

import hostkv_providers as hk
from hostkv_providers.errors import ClosedError, ReservationError
from hostkv_providers.testing import key_of, page_bytes

PAGE = 16384


def _url(scheme: str, path: Path) -> str:
    extra = "&slot=16KiB&file_size=1MiB" if scheme == "mmap" else "&file_size=1MiB"
    return f"{scheme}://{path}?budget=8MiB{extra}"


def _hold_after_reserve(monkeypatch: pytest.MonkeyPatch, scheme: str, provider: Any,
                        reached: threading.Event) -> None:
    """Make the next reserve of ``provider`` wait, after its commit, until close() began."""
    def closing() -> bool:
        return bool(getattr(provider, "_closing", False)) or provider.closed

    if scheme == "lmdb":
        from hostkv_providers.providers.lmdb import _provider as mod

        real = mod._crash

        def crash(name: str) -> None:
            if name == "lmdb.reserve.after_commit" and not reached.is_set():
                reached.set()
                deadline = time.monotonic() + 30
                while not closing() and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(0.05)  # (the old close() then ran to its end)
            real(name)

        monkeypatch.setattr(mod, "_crash", crash)
    else:
        cls = type(provider)
        real_reserve = cls._reserve

        def reserve(self: Any, *args: Any) -> Any:
            res = real_reserve(self, *args)
            if not reached.is_set():
                reached.set()
                deadline = time.monotonic() + 30
                while not closing() and time.monotonic() < deadline:
                    time.sleep(0.001)
                time.sleep(0.05)
            return res

        monkeypatch.setattr(cls, "_reserve", reserve)


@pytest.mark.parametrize("scheme", ["lmdb", "mmap"])
def test_close_during_put_leaves_nothing_in_flight(tmp_path: Path, scheme: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    store = tmp_path / "s"
    p = hk.open(_url(scheme, store))
    key = key_of(f"close-race/{scheme}")
    reached = threading.Event()
    _hold_after_reserve(monkeypatch, scheme, p, reached)
    outcome: list[str] = []

    def writer() -> None:
        try:
            outcome.append("stored" if p.put(key, None, page_bytes(key, PAGE)) else "dedup")
        except ClosedError:
            outcome.append("closed")
        except Exception as exc:  # the old code: errors from a closed environment
            outcome.append(f"{type(exc).__name__}: {exc}")

    t = threading.Thread(target=writer)
    t.start()
    assert reached.wait(30)
    p.close()
    t.join(30)
    monkeypatch.undo()
    assert outcome and outcome[0] in ("stored", "closed"), outcome
    with hk.open(_url(scheme, store)) as fresh:
        assert fresh.in_flight(key) is False
        assert fresh.stats().in_flight == 0
        if outcome[0] == "stored":
            assert fresh.read_bytes(key) == page_bytes(key, PAGE)
        else:
            assert fresh.present([key]) == [False]
            assert fresh.stats().used_bytes == 0
            assert fresh.wait_sealed(key, 0.0) is False
            assert fresh.put(key, None, page_bytes(key, PAGE))  # the key can be written again


@pytest.mark.parametrize("scheme", ["lmdb", "mmap", "pinned"])
def test_abort_racing_a_held_seal_is_refused(tmp_path: Path, scheme: str,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A seal held inside its driver while another thread aborts the same reservation: the
    abort gets ``ReservationError`` (the seal claimed it), the seal completes, the bytes are
    there.  Before the claim, mmap's abort freed the slot under the seal (then a KeyError) and
    lmdb's losing seal marked the sealed entry aborted."""
    url = "pinned://?budget=8MiB&pin=no" if scheme == "pinned" else _url(scheme, tmp_path / "s")
    p = hk.open(url)
    try:
        key = key_of(f"seal-race/{scheme}")
        res = p.reserve(key, None, PAGE)
        assert res is not None
        res.write(0, page_bytes(key, PAGE))
        inside, release = threading.Event(), threading.Event()
        cls = type(p)
        real_seal = cls._seal

        def seal(self: Any, r: Any) -> None:
            inside.set()
            release.wait(30)
            real_seal(self, r)

        monkeypatch.setattr(cls, "_seal", seal)
        errors: list[BaseException] = []

        def sealer() -> None:
            try:
                p.seal(res)
            except BaseException as exc:
                errors.append(exc)

        t = threading.Thread(target=sealer)
        t.start()
        assert inside.wait(30)
        with pytest.raises(ReservationError):
            p.abort(res)
        with pytest.raises(ReservationError):
            p.write(res, 0, b"x")
        with pytest.raises(ReservationError):
            p.seal(res)
        release.set()
        t.join(30)
        monkeypatch.undo()
        assert not errors, errors
        assert res.state == "sealed"
        assert p.read_bytes(key) == page_bytes(key, PAGE)
        p.abort(res)  # after the seal: a no-op
        assert p.present([key]) == [True] and p.stats().in_flight == 0
    finally:
        p.close()


def test_tiered_flush_checks_its_timeout_and_refuses_after_close(tmp_path: Path) -> None:
    """Issue 16 items 13/14: ``tiered.flush(-1)`` raised a bare error and ``flush()`` after
    ``close()`` returned True (claiming a write-back that cannot happen)."""
    t = hk.open(f"tiered://?fast=pinned%3A%2F%2F%3Fbudget%3D4MiB%26pin%3Dno"
                f"&slow=lmdb%3A%2F%2F{str(tmp_path / 's').replace('/', '%2F')}%3Fbudget%3D8MiB%26file_size%3D1MiB")
    key = key_of("tiered-flush")
    assert t.put(key, None, page_bytes(key, 4096))
    for bad in (-1, float("nan"), "1", True):
        with pytest.raises(hk.InvalidArgumentError):
            t.flush(bad)  # type: ignore[attr-defined]
    assert t.flush(30) is True  # type: ignore[attr-defined]
    t.close()
    with pytest.raises(ClosedError):
        t.flush()  # type: ignore[attr-defined]
    with pytest.raises(ClosedError):
        t.prefetch([key])
