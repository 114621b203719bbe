"""URL option parsing shared by the providers: sizes, booleans, choices, unknown-option errors."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from hostkv_providers._errors import InvalidArgumentError

__all__ = ["Option", "OptionSet", "Options", "format_size", "parse_size"]

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3, "t": 1000**4, "tb": 1000**4,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """``"8GiB"`` → 8589934592; ``"1.5MB"`` → 1500000; plain ints are bytes."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text < 0:
            raise InvalidArgumentError(f"size must be >= 0, got {text}")
        return text
    if not isinstance(text, str):
        raise InvalidArgumentError(f"size must be a str or int, got {type(text).__name__}")
    m = _SIZE.match(text)
    if not m or m.group(2).lower() not in _UNITS:
        raise InvalidArgumentError(f"not a size: {text!r}", hint="write sizes like 512MiB, 8GiB, 1.5GB or 4096")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


def format_size(nbytes: int) -> str:
    """Human-readable binary size (``1.5 GiB``)."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{nbytes} B"


class Options:
    """Typed access to a provider URL's query options; ``finish()`` rejects unknown ones."""

    def __init__(self, provider: str, options: Mapping[str, str]) -> None:
        self._provider = provider
        self._left = dict(options)
        self._known: list[str] = []

    def _take(self, name: str) -> str | None:
        self._known.append(name)
        return self._left.pop(name, None)

    def size(self, name: str, default: int) -> int:
        raw = self._take(name)
        return default if raw is None else parse_size(raw)

    def integer(self, name: str, default: int) -> int:
        raw = self._take(name)
        if raw is None:
            return default
        try:
            return int(raw)
        except ValueError:
            raise InvalidArgumentError(f"{self._provider}: option {name} must be an integer, got {raw!r}") from None

    def number(self, name: str, default: float) -> float:
        raw = self._take(name)
        if raw is None:
            return default
        try:
            return float(raw)
        except ValueError:
            raise InvalidArgumentError(f"{self._provider}: option {name} must be a number, got {raw!r}") from None

    def boolean(self, name: str, default: bool) -> bool:
        raw = self._take(name)
        if raw is None:
            return default
        low = raw.lower()
        if low in ("1", "true", "yes", "on"):
            return True
        if low in ("0", "false", "no", "off"):
            return False
        raise InvalidArgumentError(f"{self._provider}: option {name} must be true/false, got {raw!r}")

    def choice(self, name: str, default: str, choices: tuple[str, ...]) -> str:
        raw = self._take(name)
        if raw is None:
            return default
        if raw not in choices:
            raise InvalidArgumentError(
                f"{self._provider}: option {name} must be one of {', '.join(choices)}, got {raw!r}"
            )
        return raw

    def text(self, name: str, default: str | None = None) -> str | None:
        raw = self._take(name)
        return default if raw is None else raw

    def finish(self) -> None:
        if self._left:
            raise InvalidArgumentError(
                f"{self._provider}: unknown option(s) {', '.join(sorted(self._left))}",
                hint=f"accepted options: {', '.join(self._known)}",
            )


# --------------------------------------------------------------------------------------------
# Declarations: one per option, the single source of parsing, describe() and the docs' tables
# --------------------------------------------------------------------------------------------

_KINDS = ("size", "int", "number", "bool", "choice", "text")


@dataclass(frozen=True)
class Option:
    """One URL option of a provider: its name, kind, parsed default and how the docs show it.

    ``kind`` is ``size`` (``8GiB``), ``int``, ``number``, ``bool``, ``choice`` (one of
    ``choices``) or ``text``.  ``default`` is the parsed value used when the URL omits the
    option (``None``: the provider decides, e.g. from the store); ``shown`` is the default
    column of the provider's options table in ``docs/providers/<name>.md`` (the test
    ``tests/test_options_docs.py`` compares the two).  ``attr`` names the instance attribute
    (or property) holding the value in effect, as the URL would spell it parsed (default
    ``_<name>``): ``describe()`` reports it under the option's name — as ``"***"`` when
    ``secret`` (a password or token must not reach ``hostkv info`` output or logs).
    """

    name: str
    kind: str
    default: Any
    shown: str
    choices: tuple[str, ...] = ()
    attr: str = ""
    secret: bool = False

    def __post_init__(self) -> None:
        if self.kind not in _KINDS:
            raise ValueError(f"option {self.name}: unknown kind {self.kind!r}")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(f"option {self.name}: choices go with kind='choice'")


class OptionSet:
    """The options of one provider, declared once: ``parse`` is its ``from_url`` parsing,
    ``names``/``defaults`` what ``describe()`` and the docs' options table show."""

    def __init__(self, provider: str, *options: Option) -> None:
        self.provider = provider
        self.options: tuple[Option, ...] = options
        names = [o.name for o in options]
        if len(set(names)) != len(names):
            raise ValueError(f"{provider}: an option is declared twice")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(o.name for o in self.options)

    def values(self, obj: object) -> dict[str, Any]:
        """``{name: value in effect}`` of ``obj`` (a provider), in declaration order; an option
        whose attribute the instance lacks (e.g. a composite's tier URLs) is left out."""
        missing = object()
        out: dict[str, Any] = {}
        for o in self.options:
            value = getattr(obj, o.attr or f"_{o.name}", missing)
            if value is not missing:
                out[o.name] = "***" if o.secret and value is not None else value
        return out

    def shown_defaults(self) -> dict[str, str]:
        """``{name: default as the docs table shows it}``, in declaration order."""
        return {o.name: o.shown for o in self.options}

    def parse(self, options: Mapping[str, str]) -> dict[str, Any]:
        """The parsed value of every declared option (its default where the URL omits it);
        unknown options raise ``InvalidArgumentError`` naming the accepted ones."""
        opts = Options(self.provider, options)
        out: dict[str, Any] = {}
        late: dict[str, str | None] = {}
        for o in self.options:
            if o.kind == "size" and o.default is None:
                late[o.name] = opts.text(o.name)  # parsed after the unknown-option check
            elif o.kind == "size":
                out[o.name] = opts.size(o.name, o.default)
            elif o.kind == "int":
                out[o.name] = opts.integer(o.name, o.default)
            elif o.kind == "number":
                out[o.name] = opts.number(o.name, o.default)
            elif o.kind == "bool":
                out[o.name] = opts.boolean(o.name, o.default)
            elif o.kind == "choice":
                out[o.name] = opts.choice(o.name, o.default, o.choices)
            else:
                out[o.name] = opts.text(o.name, o.default)
        opts.finish()
        for name, raw in late.items():
            out[name] = None if raw is None else parse_size(raw)
        return {o.name: out[o.name] for o in self.options}
