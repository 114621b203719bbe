"""``hostkv retain`` / ``hostkv unretain``: mark prefixes an operator wants kept against eviction
(system prompts, tool schemas, shared documents), by key, by subtree or by salt tag."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import click
import hostkv_providers as hk

from ._exits import CLIError, ExitCode
from ._format import emit_json, fmt_size, json_option
from ._ranks import tag_matches
from ._store import Forest, open_store, require_iterate


def _select(p: hk.Provider, keys_hex: Sequence[str], prefix_hex: str | None, salt_tag: str | None) -> list[bytes]:
    """The entries a retain/unretain selection names (missing ones are a usage error)."""
    from ._main import _nothing_matched, _resolve_keys  # the same key syntax as evict --key

    given = [x for x in (keys_hex or None, prefix_hex, salt_tag) if x is not None]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --key, --prefix, --salt")
    if keys_hex:
        keys = _resolve_keys(p, keys_hex)
        missing = [k.hex() for k, ok in zip(keys, p.present(keys), strict=True) if not ok]
        if missing:
            raise CLIError(f"not stored: {', '.join(m[:16] for m in missing)}", ExitCode.USAGE,
                           hint="retain stored entries only (see `hostkv ls`)")
        return keys
    forest = Forest(list(require_iterate(p, "retain --prefix/--salt").iter_entries()))
    if prefix_hex is not None:
        (root,) = _resolve_keys(p, [prefix_hex])
        if root not in forest.entries:
            raise CLIError(f"not stored: {root.hex()[:16]}", ExitCode.USAGE, hint="see `hostkv ls`")
        return list(forest.subtree_keys(root))
    assert salt_tag is not None
    keys = [k for k in forest.order if tag_matches(forest.entries[k].salt_tag, salt_tag)]
    if not keys:
        _nothing_matched(f"no entry has salt tag {salt_tag!r}", list(forest.entries.values()))
    return keys


def _supports(p: hk.Provider) -> hk.providers.SupportsRetain:
    if not isinstance(p, hk.providers.SupportsRetain):
        raise CLIError(f"provider {p.name!r} has no retain capability",
                       hint="run `hostkv providers` to see each provider's capabilities")
    return p


def _selectors(fn: Any) -> Any:
    fn = click.option("--salt", "salt_tag", metavar="TAG",
                      help="Every entry of this salt tag (a tensor-parallel config's 8 hex: all its ranks).")(fn)
    fn = click.option("--prefix", "prefix_hex", metavar="HEX",
                      help="This entry and its whole subtree (every stored continuation of the prefix).")(fn)
    fn = click.option("--key", "keys_hex", multiple=True, metavar="HEX",
                      help="This entry (64 hex digits or a unique prefix); its ancestors are kept too. "
                           "Repeatable.")(fn)
    return fn


def _run(url: str, keys_hex: Sequence[str], prefix_hex: str | None, salt_tag: str | None, on: bool,
         as_json: bool) -> None:
    with open_store(url, readonly=False) as p:
        r = _supports(p)
        keys = _select(p, keys_hex, prefix_hex, salt_tag)
        changed = r.retain(keys) if on else r.unretain(keys)
        st = p.stats()
    doc = {"url": url, "selected": len(keys), "marked" if on else "cleared": changed,
           "retained": st.retained, "retained_bytes": st.retained_bytes, "budget_bytes": st.budget_bytes}
    if as_json:
        emit_json(doc)
        return
    verb = "retained" if on else "unretained"
    click.echo(f"{verb} {changed} of {len(keys)} selected entries "
               f"({len(keys) - changed} {'already retained' if on else 'not retained'})")
    click.echo(f"retained now: {st.retained} entries, {fmt_size(st.retained_bytes)} with their ancestors "
               f"(budget {fmt_size(st.budget_bytes)})")


@click.command()
@click.argument("url")
@_selectors
@json_option
def retain(url: str, keys_hex: tuple[str, ...], prefix_hex: str | None, salt_tag: str | None, as_json: bool) -> None:
    """Retain entries: never evicted for room while marked (nor their ancestors).

    All or nothing: a key that is not stored, or more retained bytes than the store's
    retain_share of its budget, marks nothing.  `hostkv unretain` clears the marks.
    """
    _run(url, keys_hex, prefix_hex, salt_tag, True, as_json)


@click.command()
@click.argument("url")
@_selectors
@json_option
def unretain(url: str, keys_hex: tuple[str, ...], prefix_hex: str | None, salt_tag: str | None,
             as_json: bool) -> None:
    """Clear retain marks (entries not marked are left as they are)."""
    _run(url, keys_hex, prefix_hex, salt_tag, False, as_json)


def register(cli: click.Group) -> None:
    cli.add_command(retain)
    cli.add_command(unretain)
