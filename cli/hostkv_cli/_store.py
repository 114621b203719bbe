"""Opening stores for the CLI, progress bars, and whole-store views built from ``iter_entries``.

Everything here goes through the library's public API only (``hostkv_providers`` top-level
names), so the CLI works for any provider, third-party plugins included.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import click
import hostkv_providers as hk

from ._exits import CLIError, ExitCode

__all__ = [
    "READONLY_OPTION",
    "Forest",
    "Progress",
    "open_store",
    "progress_bar",
    "require_iterate",
    "short",
]

#: The URL option the CLI adds when a command must not modify the store (``info``, ``ls``,
#: ``stats``, ``verify`` without ``--repair``, the source of ``copy``).  Providers that do not
#: know it are opened normally when they are not persistent (nothing on a medium to modify).
READONLY_OPTION = "readonly"

Progress = Callable[[int, int], None]


def short(key: bytes, n: int = 16) -> str:
    """The first ``n`` hex digits of a key (what listings show)."""
    return key.hex()[:n]


def _is_path(scheme: str, cls: type[hk.Provider], location: str) -> bool:
    """Whether ``location`` names a filesystem path: explicitly (``/``, ``./``, ``~``), or any
    location of the core's own persistent providers (mmap, lmdb, tiered take directories), so
    ``lmdb://typo`` is reported instead of created.  Plugins' locations (``redis://host/0``)
    are theirs to interpret unless they are explicit paths."""
    if location.startswith(("/", "./", "../", "~")) or location in (".", ".."):
        return True
    if not location or not cls.persistent:
        return False
    return any(i.name == scheme and i.builtin for i in hk.available_providers())


def open_store(url: str, *, readonly: bool, must_exist: bool = True, create: bool = False) -> hk.Provider:
    """Open ``url`` through ``hk.open``.

    ``readonly`` asks a persistent provider not to modify the store (the ``readonly=true`` URL
    option); one that does not know the option is opened normally, with a note on stderr.
    ``tiered://`` has no read-only mode of its own: a read-only command opens its slow tier (which
    holds every entry) read-only instead, saying so on stderr.
    ``must_exist`` refuses a filesystem location that does not exist yet, so that ``info`` on a
    typo'd path reports the typo instead of creating an empty store there.  A writable open
    without ``create`` (``evict``, ``compact``, ``verify --repair``) first opens the store
    read-only, so a directory that holds no store — empty or unrelated files — is refused
    instead of being turned into one; only ``copy``, ``import``, ``bench`` and ``demo`` pass ``create``.
    """
    scheme, location, options = hk.providers.parse_url(url)
    cls = _provider_class(scheme)
    if must_exist and _is_path(scheme, cls, location):
        path = os.path.expanduser(location)
        if not os.path.lexists(path):
            raise CLIError(
                f"no store at {path}",
                ExitCode.USAGE,
                hint="check the path; only `hostkv copy`, `import`, `bench` and `demo` create stores",
            )
    if readonly and scheme == "tiered" and cls.persistent and options.get("slow"):
        slow = options["slow"]
        click.echo(f"note: tiered:// has no read-only mode; reading its slow tier {slow} read-only "
                   "(it holds every entry)", err=True)
        return open_store(slow, readonly=True, must_exist=must_exist)
    if not readonly and not create and cls.persistent and _is_path(scheme, cls, location):
        # prove there is a store before opening for writing: a writable open would create one
        # (the probe carries no options: write options such as budget= are for the real open)
        probe = _open_readonly(f"{scheme}://{location}", scheme, {}, quiet=True)
        if probe is not None:
            probe.close()
    if not readonly or not cls.persistent:
        return hk.open(url)
    opened = _open_readonly(url, scheme, options, quiet=False)
    return opened if opened is not None else hk.open(url)


def _provider_class(scheme: str) -> type[hk.Provider]:
    try:
        return hk.providers.provider_class(scheme)
    except hk.HostKVError:
        raise
    except Exception as exc:  # a broken plugin: say which, never a traceback
        raise CLIError(
            f"provider {scheme!r} failed to load: {type(exc).__name__}: {exc}",
            ExitCode.USAGE,
            hint="run `hostkv providers`; reinstall the distribution that provides it",
        ) from None


def _open_readonly(url: str, scheme: str, options: dict[str, str], *, quiet: bool) -> hk.Provider | None:
    """``url`` opened with ``readonly=true``; ``None`` if the provider has no read-only mode."""
    if READONLY_OPTION in options and options[READONLY_OPTION].lower() in ("0", "false", "no", "off"):
        raise CLIError(f"this command opens stores read-only; drop {READONLY_OPTION}= from the URL")
    try:
        return hk.open(url, **{READONLY_OPTION: "true"})
    except hk.InvalidArgumentError as exc:
        text = f"{exc.message} {exc.hint}".lower()
        unknown = _unknown_options(exc.message)
        if unknown and READONLY_OPTION not in unknown:
            raise  # a mistyped option of the URL: the error lists the accepted ones
        if READONLY_OPTION not in text and "read-only" not in text:
            raise  # a genuine bad option of the URL
        if READONLY_OPTION not in unknown:
            # The provider has a read-only mode but refuses it with this URL (lmdb: a read-only
            # open cannot set budget=).  Never fall back to a writable open here.
            raise CLIError(
                f"cannot open the store read-only: {exc.message}",
                ExitCode.USAGE,
                hint="this command never modifies a store; drop write options such as budget= from the URL",
            ) from None
    # The provider has no read-only mode at all (e.g. a network store whose opening writes
    # nothing).  Say so rather than refuse: the operator decides whether that matters.
    if not quiet:
        click.echo(f"note: provider {scheme!r} has no {READONLY_OPTION}=true option; opened normally",
                   err=True)
    return None


def _unknown_options(message: str) -> list[str]:
    """The option names an ``unknown option(s) a, b`` message of ``hk.providers.Options`` lists."""
    marker = "unknown option(s) "
    if marker not in message:
        return []
    return [name.strip() for name in message.split(marker, 1)[1].split(",")]


def require_iterate(provider: hk.Provider, what: str) -> hk.providers.SupportsIterate:
    """The provider as ``SupportsIterate``, or a usage error naming the command."""
    if not isinstance(provider, hk.providers.SupportsIterate):
        raise CLIError(
            f"provider {provider.name!r} cannot enumerate its entries, which {what} needs",
            ExitCode.USAGE,
            hint="run `hostkv providers` to see which providers have the iterate capability",
        )
    return provider


@contextmanager
def progress_bar(label: str, *, enabled: bool = True, interrupt_here: bool = False) -> Iterator[Progress]:
    """A ``progress(done, total)`` callback drawing a click progress bar on stderr.

    The bar is created on the first call, when the total is known.  When stderr is not a
    terminal click prints only the label, so logs stay clean.

    ``interrupt_here`` (for loops that call the provider between progress calls: copy, bench):
    a Ctrl-C is held until the next progress call and raised there, between two provider calls,
    never inside one — a KeyboardInterrupt inside a provider's commit left lmdb's gate taken, so
    close() hung (issue 16 item 5), or a reservation/lease alive, so bench could not evict its
    scratch chain (item 6).  A second Ctrl-C interrupts at once.
    """
    state: dict[str, Any] = {"bar": None, "done": 0}
    pending = {"sigint": False}
    previous: Any = None
    if interrupt_here and threading.current_thread() is threading.main_thread():
        def on_sigint(signum: int, frame: Any) -> None:
            if pending["sigint"]:
                raise KeyboardInterrupt  # asked twice: now
            pending["sigint"] = True

        previous = signal.signal(signal.SIGINT, on_sigint)

    def update(done: int, total: int) -> None:
        if pending["sigint"]:
            raise KeyboardInterrupt
        if not enabled:
            return
        bar = state["bar"]
        if bar is None:
            bar = click.progressbar(length=max(total, 1), label=label, file=sys.stderr, width=30)
            bar.__enter__()
            state["bar"] = bar
        step = done - state["done"]
        if step > 0:
            bar.update(step)
            state["done"] = done

    try:
        yield update
        if pending["sigint"]:
            raise KeyboardInterrupt  # arrived after the last progress call
    finally:
        if previous is not None:
            signal.signal(signal.SIGINT, previous)
        if state["bar"] is not None:
            state["bar"].__exit__(None, None, None)


@dataclass
class Run:
    """A maximal linear stretch of a chain: ``keys[0]`` is a root or a branch's first page and
    every key but the last has exactly one child."""

    index: int
    parent_run: int | None
    keys: list[bytes] = field(default_factory=list)
    depth_start: int = 0
    nbytes: int = 0
    children: list[int] = field(default_factory=list)

    @property
    def depth_end(self) -> int:
        return self.depth_start + len(self.keys) - 1


class Forest:
    """The stored tree (or a salt tag's part of it), computed from ``iter_entries``.

    Iterative throughout: a chain of a million pages must not hit Python's recursion limit.
    """

    def __init__(self, entries: Sequence[hk.EntryInfo]) -> None:
        self.entries: dict[bytes, hk.EntryInfo] = {bytes(e.key): e for e in entries}
        self.children: dict[bytes, list[bytes]] = {}
        self.roots: list[bytes] = []
        #: entries whose parent is not among ``entries`` although they name one (filtered views,
        #: or a broken prefix-closure in the store).
        self.orphans: list[bytes] = []
        for key, e in self.entries.items():
            parent = None if e.parent is None else bytes(e.parent)
            if parent is None or parent == bytes(hk.ZERO_KEY):
                self.roots.append(key)
            elif parent in self.entries:
                self.children.setdefault(parent, []).append(key)
            else:
                self.roots.append(key)
                self.orphans.append(key)
        # Stable, readable order: oldest first, then by key.
        def order(k: bytes) -> tuple[float, bytes]:
            return (self.entries[k].created, k)

        self.roots.sort(key=order)
        for kids in self.children.values():
            kids.sort(key=order)
        self.depth: dict[bytes, int] = {}
        self.order: list[bytes] = []  # parents before children (depth-first, pre-order)
        stack = list(reversed(self.roots))
        for r in self.roots:
            self.depth[r] = 0
        while stack:
            k = stack.pop()
            self.order.append(k)
            kids = self.children.get(k, [])
            for c in kids:
                self.depth[c] = self.depth[k] + 1
            stack.extend(reversed(kids))

    @property
    def leaves(self) -> int:
        return sum(1 for k in self.entries if k not in self.children)

    @property
    def branch_points(self) -> int:
        return sum(1 for kids in self.children.values() if len(kids) > 1)

    @property
    def max_depth(self) -> int:
        return max(self.depth.values(), default=-1)

    def runs(self) -> list[Run]:
        """The tree with linear stretches collapsed, in display (pre-)order."""
        out: list[Run] = []
        stack: list[tuple[bytes, int | None]] = [(r, None) for r in reversed(self.roots)]
        while stack:
            start, parent_run = stack.pop()
            run = Run(len(out), parent_run, depth_start=self.depth[start])
            out.append(run)
            if parent_run is not None:
                out[parent_run].children.append(run.index)
            k = start
            while True:
                run.keys.append(k)
                run.nbytes += self.entries[k].nbytes
                kids = self.children.get(k, [])
                if len(kids) == 1:
                    k = kids[0]
                    continue
                stack.extend((c, run.index) for c in reversed(kids))
                break
        return out

    def subtree_newest(self) -> dict[bytes, float]:
        """For each key, the newest ``last_used`` in its subtree (itself included)."""
        newest = {k: e.last_used for k, e in self.entries.items()}
        for k in reversed(self.order):  # children before parents
            e = self.entries[k]
            parent = None if e.parent is None else bytes(e.parent)
            if parent is not None and parent in newest and k not in self.orphans:
                newest[parent] = max(newest[parent], newest[k])
        return newest

    def subtree_keys(self, key: bytes) -> list[bytes]:
        out: list[bytes] = []
        stack = [key]
        while stack:
            k = stack.pop()
            out.append(k)
            stack.extend(self.children.get(k, ()))
        return out
