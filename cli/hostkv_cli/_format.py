"""Human-output helpers: sizes, durations, ages, JSON, two-column tables that fit 80 columns."""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import click
import hostkv_providers as hk

from ._exits import CLIError

__all__ = [
    "emit_json",
    "flat_describe",
    "fmt_age",
    "fmt_size",
    "json_option",
    "kv_lines",
    "parse_duration",
    "table",
]

WIDTH = 80

json_option = click.option("--json", "as_json", is_flag=True, help="Print one JSON document on stdout.")

_DURATION = re.compile(r"(\d+(?:\.\d+)?)\s*(ms|w|d|h|m|s)")
_UNIT_S = {"w": 604800.0, "d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}


def parse_duration(text: str) -> float:
    """``"90s"``, ``"15m"``, ``"2h"``, ``"7d"``, ``"1w"``, ``"1h30m"`` → seconds."""
    s = text.strip().lower()
    pos, total = 0, 0.0
    for m in _DURATION.finditer(s):
        if m.start() != pos:
            break
        total += float(m.group(1)) * _UNIT_S[m.group(2)]
        pos = m.end()
    if not s or pos != len(s):
        raise CLIError(f"not a duration: {text!r}", hint="write durations like 90s, 15m, 2h, 7d or 1h30m")
    return total


def fmt_size(nbytes: int) -> str:
    return hk.providers.format_size(int(nbytes))


def fmt_age(seconds_since_epoch: float, now: float | None = None) -> str:
    """``"3m ago"``-style age of a timestamp."""
    now = time.time() if now is None else now
    d = max(0.0, now - seconds_since_epoch)
    for unit, span in (("d", 86400.0), ("h", 3600.0), ("m", 60.0)):
        if d >= span:
            return f"{int(d // span)}{unit} ago"
    return f"{int(d)}s ago"


def emit_json(obj: Any) -> None:
    """One JSON document on stdout (bytes as hex, unknown types as str)."""

    def default(o: Any) -> Any:
        if isinstance(o, (bytes, bytearray, memoryview)):
            return bytes(o).hex()
        if isinstance(o, (set, frozenset)):
            return sorted(o)
        return str(o)

    click.echo(json.dumps(obj, indent=2, sort_keys=False, default=default))


def kv_lines(pairs: Iterable[tuple[str, Any]], key_width: int | None = None) -> None:
    """``key ........ value`` lines, the value truncated to fit the terminal width.  The key
    column is as wide as the longest key (at least 18, at most 32), so long keys
    (``last_recovery.by_pid``) keep the values aligned."""
    items = list(pairs)
    if key_width is None:
        key_width = min(32, max([18, *(len(str(k)) for k, _ in items)]))
    for k, v in items:
        text = str(v)
        room = WIDTH - key_width - 2
        if len(text) > room:
            text = text[: room - 1] + "…"
        click.echo(f"{k:<{key_width}}  {text}")


def table(headers: Sequence[str], rows: Sequence[Sequence[Any]], right: Iterable[int] = ()) -> None:
    """A plain aligned table; columns listed in ``right`` are right-aligned."""
    right_set = set(right)
    cells = [[str(c) for c in row] for row in rows]
    widths = [len(h) for h in headers]
    for row in cells:
        for i, c in enumerate(row):
            widths[i] = max(widths[i], len(c))

    def line(row: Sequence[str]) -> str:
        parts = [c.rjust(widths[i]) if i in right_set else c.ljust(widths[i]) for i, c in enumerate(row)]
        return "  ".join(parts).rstrip()

    click.echo(line(list(headers)))
    for row in cells:
        click.echo(line(row))


def flat_describe(d: Mapping[str, Any], prefix: str = "") -> list[tuple[str, Any]]:
    """Nested ``describe()`` dicts as dotted ``key: value`` pairs."""
    out: list[tuple[str, Any]] = []
    for k, v in d.items():
        name = f"{prefix}{k}"
        if isinstance(v, Mapping) and v:
            out.extend(flat_describe(v, name + "."))
        else:
            out.append((name, v))
    return out
