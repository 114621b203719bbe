"""The conformance suite's base: the interface a provider's test class implements (factory,
reopen, backdoors), the fixtures, and the helpers every family uses."""

from __future__ import annotations

import os
import signal
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ClassVar, NoReturn

import pytest

from hostkv_providers._errors import HostKVError
from hostkv_providers._keys import Key
from hostkv_providers._provider import Provider

ProviderFactory = Callable[..., Provider]


class SuiteBase:
    """Base class of a provider's conformance tests (not collected itself: no ``Test`` prefix).

    Subclasses implement :meth:`make_provider` and, for persistent providers, set
    ``supports_reopen = True`` and implement :meth:`reopen`.  The optional backdoors
    :meth:`backdoor_read` / :meth:`backdoor_corrupt` reach the medium without the provider's read
    path, so the suite can check the provider against an independent path; without them the tests
    that need them are skipped.
    """

    #: Entry sizes used by the suite are multiples of this.
    page_nbytes: ClassVar[int] = 4096
    #: Budget of the ``provider`` fixture, in pages.
    default_budget_pages: ClassVar[int] = 64
    #: Persistent providers set this and implement :meth:`reopen`.
    supports_reopen: ClassVar[bool] = False
    #: Threads per role in the thread-safety test (writers and readers each).
    thread_count: ClassVar[int] = 4
    #: Operations per thread in the thread-safety test.
    thread_ops: ClassVar[int] = 150
    #: Hypothesis budget of the stateful test.
    stateful_examples: ClassVar[int] = 30
    stateful_steps: ClassVar[int] = 50
    #: Extra ``hypothesis.settings`` for the stateful test (e.g. ``{"phases": [Phase.generate]}``).
    stateful_settings: ClassVar[dict[str, Any]] = {}
    #: The backdoors are required for a persistent provider (its medium is what must hold the
    #: sealed bytes): without them its checksum and backdoor tests fail.  A composite whose media
    #: are checked by their own suites (tiered) gives the reason here, and they are skipped.
    backdoors_exempt: ClassVar[str] = ""

    # -- the interface a provider's test class implements --------------------------------------
    def make_provider(self, tmp_path: Path, budget_bytes: int) -> Provider:
        """Build a fresh, empty provider whose store lives under ``tmp_path`` (an empty dir)."""
        raise NotImplementedError("subclasses of ProviderTests implement make_provider()")

    def reopen(self, provider: Provider) -> Provider:
        """Close ``provider`` and open the same store again; return the new instance."""
        raise NotImplementedError("set supports_reopen = True and implement reopen()")

    def backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        """The sealed bytes of ``key`` straight from the medium, or ``None`` if not stored."""
        raise NotImplementedError

    def backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        """Flip at least one byte of ``key``'s page on the medium (bypassing the provider)."""
        raise NotImplementedError

    # -- fixtures ------------------------------------------------------------------------------
    @pytest.fixture
    def provider_factory(self, tmp_path: Path) -> Iterator[ProviderFactory]:
        """``make(budget_pages=64) -> Provider`` in a fresh directory; all closed at teardown."""
        made: list[Provider] = []
        counter = [0]

        def make(budget_pages: int | None = None) -> Provider:
            pages = self.default_budget_pages if budget_pages is None else budget_pages
            counter[0] += 1
            where = tmp_path / f"provider{counter[0]}"
            where.mkdir()
            p = self.make_provider(where, pages * self.page_nbytes)
            made.append(p)
            return p

        yield make
        for p in made:
            _close_quietly(p)

    @pytest.fixture
    def provider(self, provider_factory: ProviderFactory) -> Provider:
        """A fresh provider with a budget of ``default_budget_pages`` pages."""
        return provider_factory()

    # -- helpers -------------------------------------------------------------------------------
    def _reopen_tracked(self, provider: Provider, request: pytest.FixtureRequest) -> Provider:
        if not self.supports_reopen:
            pytest.skip("provider does not survive close/reopen (supports_reopen = False)")
        fresh = self.reopen(provider)
        request.addfinalizer(lambda: _close_quietly(fresh))
        return fresh

    def _backdoor_read(self, provider: Provider, key: Key) -> bytes | None:
        try:
            return self.backdoor_read(provider, key)
        except NotImplementedError:
            self._no_backdoor(provider, "backdoor_read")

    def _backdoor_corrupt(self, provider: Provider, key: Key) -> None:
        try:
            self.backdoor_corrupt(provider, key)
        except NotImplementedError:
            self._no_backdoor(provider, "backdoor_corrupt")

    def _no_backdoor(self, provider: Provider, name: str) -> NoReturn:
        if provider.persistent and not self.backdoors_exempt:
            pytest.fail(f"{type(self).__name__} tests a persistent provider: implement {name} (it reaches the "
                        "medium without the provider's read path), or set backdoors_exempt to the reason")
        pytest.skip(f"no {name} for this provider" + (f" ({self.backdoors_exempt})" if self.backdoors_exempt else ""))

    def _pages(self, n: int) -> int:
        return n * self.page_nbytes

    # -- private -------------------------------------------------------------------------------
    def _has_backdoor_read(self) -> bool:
        return type(self).backdoor_read is not SuiteBase.backdoor_read


def _close_quietly(p: Provider) -> None:
    try:
        p.close()
    except HostKVError as exc:  # teardown must not mask the test's own failure
        warnings.warn(f"closing {type(p).__name__} failed: {exc!r}", stacklevel=2)


def _check_budget(p: Provider) -> None:
    st = p.stats()
    assert 0 <= st.used_bytes <= st.budget_bytes, f"used {st.used_bytes} > budget {st.budget_bytes}"


def _check_closure(p: Provider, parents: dict[Key, Key | None]) -> None:
    keys = list(parents)
    hits = dict(zip(keys, p.present(keys), strict=True))
    for k, parent in parents.items():
        if hits[k] and parent is not None:
            assert hits[parent], f"{k.hex()[:12]} is present but its parent {parent.hex()[:12]} is not"


def _wait_child(pid: int, timeout: float) -> int:
    """Exit code of a forked child; SIGKILL it (and report a hang) after ``timeout`` seconds.

    A provider that takes a lock before its fork check can hang forever in the child when another
    thread held that lock at fork time; the suite must fail, not hang, on that.
    """
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return -999
        time.sleep(0.005)


def _fork_failure(code: int, ncalls: int) -> str:
    if 10 <= code < 10 + ncalls:
        return f"call #{code - 10} succeeded in a forked child (expected UsedAfterForkError)"
    if 50 <= code < 50 + ncalls:
        return f"call #{code - 50} raised the wrong error in a forked child"
    if code == -999:
        return "the forked child hung (a lock taken before the fork check?) and was killed"
    return f"child exited with {code}"
