"""The ``hostkv`` command: inspect, verify, evict, compact, copy and benchmark stores.

Each command opens its store through ``hostkv_providers.open(url)`` and uses only the public
provider API and capability protocols, so it works for every installed provider.  Exit codes
are documented in docs/cli.md and :mod:`hostkv_cli._exits`.
"""

from __future__ import annotations

import os
import signal
import sys
import time
import traceback
from collections import Counter
from collections.abc import Sequence
from typing import Any, NoReturn

import click
import hostkv_providers as hk

from . import __version__
from ._exits import CLIError, ExitCode, exit_code_for
from ._format import (
    emit_json,
    flat_describe,
    fmt_age,
    fmt_size,
    json_option,
    kv_lines,
    parse_duration,
    table,
)
from ._ranks import group_key, rank_label, rank_of, rank_summary, tag_label, tag_matches
from ._store import Forest, open_store, progress_bar, require_iterate, short

__all__ = ["cli", "main"]

DEBUG_ENV = "HOSTKV_DEBUG"



class _Group(click.Group):
    """Turns every exception into a message, a hint and a documented exit code."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            ctx.exit(130)
        except BrokenPipeError:
            # `hostkv ls ... | head`: the reader went away; not an error of ours.
            sys.stderr.close()
            ctx.exit(0)
        except Exception as exc:  # the one place every failure is turned into an exit status
            code = exit_code_for(exc)
            _report(exc, code)
            ctx.exit(int(code))


def _report(exc: BaseException, code: ExitCode) -> None:
    if isinstance(exc, (CLIError, hk.HostKVError)):
        click.echo(f"error: {exc.message}", err=True)
        if exc.hint:
            click.echo(f"hint: {exc.hint}", err=True)
    elif code == ExitCode.INTERNAL:
        click.echo(f"internal error: {type(exc).__name__}: {exc}", err=True)
        click.echo(f"hint: this is a bug or an I/O fault; rerun with {DEBUG_ENV}=1 for a traceback",
                   err=True)
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="hostkv")
def cli() -> None:
    """Inspect and maintain hostkv-providers stores.

    Stores are named by URL, e.g. lmdb:///var/cache/kv, mmap:///nvme/kv?budget=64GiB or
    pinned://?budget=1GiB.  Exit codes: 0 ok, 1 integrity problems found, 2 usage, 3 busy or
    locked, 4 refused as unsafe or foreign, 5 internal.
    """


def _show_warning(message: Warning | str, category: type[Warning], filename: str, lineno: int,
                  file: Any = None, line: str | None = None) -> None:
    """The library's warnings (a budget beyond free disk: ``BudgetWarning``) as one ``warning:``
    line on stderr, like the CLI's errors, not Python's ``file:line: Category: ...`` with code."""
    click.echo(f"warning: {message}", err=True)


def main() -> NoReturn:
    """Console-script entry point."""
    import warnings

    warnings.showwarning = _show_warning
    try:
        cli.main(prog_name="hostkv")
    finally:
        # The command is over (its exit status is set): a Ctrl-C while the interpreter joins the
        # library's worker threads at exit would only print "Exception ignored ... KeyboardInterrupt"
        # from threading._shutdown.  SIGTERM and SIGKILL still end a stuck shutdown.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
    raise SystemExit(0)  # pragma: no cover - click exits itself


# ----------------------------------------------------------------------------------------------
# providers
# ----------------------------------------------------------------------------------------------


@cli.command()
@json_option
def providers(as_json: bool) -> None:
    """List installed providers, their capabilities and distributions."""
    infos = hk.available_providers()
    if as_json:
        emit_json([
            {"name": p.name, "distribution": p.distribution, "version": p.version,
             "builtin": p.builtin, "target": p.target,
             "capabilities": sorted(p.capabilities, key=hk.providers.CAPABILITY_NAMES.index),
             "error": p.error}
            for p in infos
        ])
        return
    # Two lines per provider: name, status and distribution; then its capabilities, indented.
    # (The capability list alone is up to 60 columns: a single-line table cannot fit 80.)
    width = max([len(p.name) for p in infos] + [4])
    table(("NAME".ljust(width), "STATUS", "DISTRIBUTION"), [])
    for p in infos:
        dist = f"{p.distribution} {p.version}" + ("" if p.builtin else " (plugin)")
        click.echo(f"{p.name.ljust(width)}  {'broken' if p.error else 'ok':<6}  {dist}")
        if p.error:
            detail = f"    error: {p.error}"
            click.echo(detail if len(detail) <= 80 else detail[:79] + "…")
            continue
        # capabilities wrapped at 80 columns under their label (never cut: each name matters)
        caps = sorted(p.capabilities, key=hk.providers.CAPABILITY_NAMES.index) or ["-"]
        line = "    capabilities: "
        for i, cap in enumerate(caps):
            piece = cap + ("," if i < len(caps) - 1 else "")
            if len(line) + len(piece) > 80 and line.strip() != "capabilities:":
                click.echo(line.rstrip())
                line = " " * 18
            line += piece
        click.echo(line)
    if not infos:
        click.echo("no providers installed")


# ----------------------------------------------------------------------------------------------
# info / stats / ls
# ----------------------------------------------------------------------------------------------


def _tag_summary(entries: Sequence[hk.EntryInfo]) -> list[dict[str, Any]]:
    pages: Counter[str] = Counter()
    nbytes: Counter[str] = Counter()
    for e in entries:
        pages[e.salt_tag] += 1
        nbytes[e.salt_tag] += e.nbytes
    rows: list[dict[str, Any]] = []
    # largest first, but one tensor-parallel configuration's ranks together, in rank order
    for t in sorted(pages, key=lambda t: -nbytes[t]):
        st = rank_of(t)
        rows.append({"tag": t, "pages": pages[t], "nbytes": nbytes[t],
                     "config": None if st is None else st.config,
                     "tp_rank": None if st is None else st.tp_rank,
                     "tp_world_size": None if st is None else st.tp_world_size})
    first: dict[str, int] = {}
    for i, r in enumerate(rows):
        first.setdefault(group_key(r["tag"])[0], i)
    return sorted(rows, key=lambda r: (first[group_key(r["tag"])[0]], group_key(r["tag"])[1]))


@cli.command()
@click.argument("url")
@json_option
def info(url: str, as_json: bool) -> None:
    """Identity, budget and use, tree shape and salt tags of a store (read-only)."""
    with open_store(url, readonly=True) as p:
        desc = p.describe()
        st = p.stats()
        doc: dict[str, Any] = {
            "url": url,
            "provider": p.name,
            "persistent": p.persistent,
            "multiprocess": p.multiprocess,
            "capabilities": sorted(type(p).capability_names(), key=hk.providers.CAPABILITY_NAMES.index),
            "describe": desc,
            "budget_bytes": p.budget_bytes,
            "used_bytes": st.used_bytes,
            "entries": st.entries,
            "anchors": st.anchors,
            "retained": st.retained,
            "retained_bytes": st.retained_bytes,
        }
        if isinstance(p, hk.providers.SupportsIterate):
            entries = list(p.iter_entries())
            forest = Forest(entries)
            doc.update(
                roots=len(forest.roots),
                leaves=forest.leaves,
                branch_points=forest.branch_points,
                max_depth=forest.max_depth,
                orphans=len(forest.orphans),
                anchor_bytes=sum(sum(e.anchors.values()) for e in entries),
                salt_tags=_tag_summary(entries),
            )
            doc["tensor_parallel"] = rank_summary(doc["salt_tags"])
    if as_json:
        emit_json(doc)
        return
    used_pct = 100.0 * doc["used_bytes"] / doc["budget_bytes"] if doc["budget_bytes"] else 0.0
    pairs: list[tuple[str, Any]] = [
        ("provider", doc["provider"]),
        ("capabilities", "-"),  # filled in below, wrapped to the value column's width
        ("url", url),
    ]
    pairs += [(k, v) for k, v in flat_describe(desc) if k not in ("provider", "budget_bytes", "persistent")]
    pairs += [
        ("budget", fmt_size(doc["budget_bytes"])),
        ("used", f"{fmt_size(doc['used_bytes'])} ({used_pct:.1f}%)"),
        ("entries", doc["entries"]),
        ("anchors", doc["anchors"] if "anchor_bytes" not in doc
         else f"{doc['anchors']} ({fmt_size(doc['anchor_bytes'])})"),
    ]
    if doc["retained"] or "retain" in doc["capabilities"]:
        pairs.append(("retained", f"{doc['retained']} entries, {fmt_size(doc['retained_bytes'])} with ancestors"))
    if "roots" in doc:
        pairs += [
            ("roots / leaves", f"{doc['roots']} / {doc['leaves']}"),
            ("branch points", doc["branch_points"]),
            ("deepest page", "-" if doc["max_depth"] < 0 else f"depth {doc['max_depth']}"),
        ]
        if doc["orphans"]:
            pairs.append(("orphans", f"{doc['orphans']} (entries whose parent is missing)"))
    key_width = min(32, max([18, *(len(str(k)) for k, _ in pairs)]))  # as kv_lines computes it
    caps_lines = _wrapped(doc["capabilities"], 80 - key_width - 2) or ["-"]
    pairs[1:2] = [("capabilities" if i == 0 else "", text) for i, text in enumerate(caps_lines)]
    kv_lines(pairs, key_width=key_width)
    if doc.get("salt_tags"):
        click.echo("")
        if doc["tensor_parallel"]:
            table(("SALT TAG", "RANK", "PAGES", "BYTES"),
                  [(t["tag"] or "(none)", rank_label(t["tag"]), t["pages"], fmt_size(t["nbytes"]))
                   for t in doc["salt_tags"]], right=(2, 3))
            for g in doc["tensor_parallel"]:
                if g["missing_ranks"]:
                    click.echo(f"config {g['config']}: no pages of rank(s) "
                               f"{','.join(map(str, g['missing_ranks']))} of {g['world_size']}; "
                               "its prompts need every rank")
        else:
            table(("SALT TAG", "PAGES", "BYTES"),
                  [(t["tag"] or "(none)", t["pages"], fmt_size(t["nbytes"])) for t in doc["salt_tags"]],
                  right=(1, 2))
    elif "salt_tags" not in doc:
        click.echo(f"(provider {doc['provider']!r} cannot enumerate entries: no tree or salt-tag summary)")


def _wrapped(items: Sequence[str], room: int) -> list[str]:
    """``items`` joined with commas into lines of at most ``room`` characters (never cut)."""
    lines: list[str] = []
    line = ""
    for i, item in enumerate(items):
        piece = item + ("," if i < len(items) - 1 else "")
        if line and len(line) + len(piece) > room:
            lines.append(line)
            line = ""
        line += piece
    return [*lines, line] if line else lines


#: ProviderStats fields that are gauges of the store (read from the medium), not counters.
_GAUGES = ("name", "entries", "used_bytes", "budget_bytes", "anchors", "leased", "in_flight", "retained",
           "retained_bytes")


@cli.command()
@click.argument("url")
@json_option
def stats(url: str, as_json: bool) -> None:
    """Gauges and live counters of a store (read-only).

    Gauges (entries, bytes, anchors, leases) are the store's.  A provider with store-wide
    counters (mmap, lmdb, tiered over either; capability store_counters) counts every process
    that opens the store for writing, so this shows a running engine's hits, misses, writes,
    evictions and checksum failures as they happen (``store_counters`` in ``--json``; a tiered
    store per tier).  pinned:// lives in one process's memory: a new, empty one opens here.
    """
    scheme = hk.providers.parse_url(url)[0]
    with open_store(url, readonly=True) as p:
        st = p.stats()
        persistent = p.persistent
        counters: dict[str, int] | None = None
        if isinstance(p, hk.providers.SupportsStoreCounters):
            counters = p.store_counters()
            if scheme == "tiered" and p.name != "tiered":  # open_store opened its slow tier
                counters = hk.providers.TieredProvider.counters_view(counters)
    d = st.as_dict()
    store_wide = [k for k in d.get("store_wide", []) if k in d]
    scope = None if counters is None else ("store" if persistent else "process")
    if as_json:
        emit_json({**d, "store_wide": store_wide, "persistent": persistent,
                   "store_counters": counters, "store_counters_scope": scope})
        return

    def show(k: str, v: Any) -> Any:
        return fmt_size(v) if k.endswith("_bytes") and isinstance(v, int) and not isinstance(v, bool) else v

    stat_counters = [k for k in d if k not in _GAUGES and k != "store_wide" and isinstance(d[k], int)
                     and not isinstance(d[k], bool) and k in hk.ProviderStats.__slots__]
    other = [k for k in d if k not in _GAUGES and k not in stat_counters and k != "store_wide"
             and k not in store_wide]
    width = min(28, max(map(len, d), default=0) + 2)
    kv_lines(((k, show(k, d[k])) for k in _GAUGES if k in d), key_width=width)
    kv_lines(((k, show(k, d[k])) for k in other), key_width=width)
    if counters is not None:
        click.echo("")
        if scope == "store":
            click.echo("live counters of the store (every process that opened it for writing,")
            click.echo("since its counters began; an engine's traffic shows here as it happens):")
        else:
            click.echo(f"counters, in-process only ({p.name}:// lives in one process's memory, so a")
            click.echo("shell sees a new, empty store; an engine's come from its Prometheus collector):")
        _counter_groups(counters)
        return
    if not persistent:  # this process's provider: every counter is the store's
        kv_lines(((k, show(k, d[k])) for k in stat_counters), key_width=width)
        return
    if store_wide:
        click.echo("")
        click.echo("kept in the store (every process, since it was created):")
        kv_lines(((f"  {k}", show(k, d[k])) for k in store_wide), key_width=width)
    per_process = [k for k in stat_counters if k not in store_wide]
    if per_process:
        click.echo("")
        click.echo("counted per process (this command's own calls, so 0 here; an engine's come")
        click.echo("from its Prometheus collector, see docs/operations.md):")
        for i in range(0, len(per_process), 4):
            click.echo("  " + ", ".join(per_process[i:i + 4]))


#: Headings of a tiered store's counter groups (``store_counters`` key prefixes).
_TIER_GROUPS = (("", "tiered store (what the engine saw)"), ("fast.", "fast tier"), ("slow.", "slow tier"))


def _counter_groups(counters: dict[str, int]) -> None:
    """Counters two to a line; a tiered store's grouped by tier, then its write-back pipeline."""

    def pairs(items: list[tuple[str, int]]) -> None:
        cells = [f"{k:<20}{fmt_size(v) if 'bytes' in k.split('_') else v:>14}" for k, v in items]
        for i in range(0, len(cells), 2):
            click.echo("  " + "    ".join(cells[i:i + 2]))

    if any(k.startswith("tiered.") for k in counters):  # the slow tier of a tiered store
        click.echo(" (this store is the slow tier of a tiered store: its counters per tier)")
        counters = hk.providers.TieredProvider.counters_view(counters)
    if not any(k.startswith("fast.") for k in counters):
        pairs(list(counters.items()))
        return
    base = [k for k in counters if "." not in k and f"slow.{k}" in counters]
    for prefix, title in _TIER_GROUPS:
        click.echo(f" {title}:")
        pairs([(k, counters[prefix + k]) for k in base])
    pipeline = [(k, v) for k, v in counters.items() if "." not in k and k not in base]
    if pipeline:
        click.echo(" write-back pipeline (promotions, write-backs, queue, lag):")
        pairs(pipeline)


def _anchor_text(entries: dict[bytes, hk.EntryInfo], keys: Sequence[bytes], depth0: int) -> str:
    """``name@d255,d511`` per anchor name of a run; ``name@d255..d2047(x8)`` when many."""
    by_name: dict[str, list[int]] = {}
    for i, k in enumerate(keys):
        for name in entries[k].anchors:
            by_name.setdefault(name, []).append(depth0 + i)
    parts = []
    for name, depths in sorted(by_name.items()):
        if len(depths) <= 3:
            parts.append(f"{name}@" + ",".join(f"d{d}" for d in depths))
        else:
            parts.append(f"{name}@d{depths[0]}..d{depths[-1]}(x{len(depths)})")
    return " ".join(parts)


@cli.command(name="ls")
@click.argument("url")
@click.option("--tree", is_flag=True, help="Draw chains as a tree (linear runs collapsed).")
@click.option("--salt", "salt_tag", metavar="TAG",
              help="Only entries of this salt tag (a tensor-parallel config's 8 hex: all its ranks).")
@click.option("--rank", "tp_rank", type=click.IntRange(min=0), metavar="R",
              help="Only entries of tensor-parallel rank R.")
@click.option("--limit", type=click.IntRange(min=1), metavar="N",
              help="Show at most N entries (N runs with --tree).")
@json_option
def ls_cmd(url: str, tree: bool, salt_tag: str | None, tp_rank: int | None, limit: int | None,
           as_json: bool) -> None:
    """List entries, or draw the chains as a tree (read-only).

    With --tree each line is a run of pages where the chain does not branch: its first key,
    depth range, page count, bytes and anchors (name@dDEPTH).  Branch points start new lines.
    Entries of tensor-parallel ranks are listed grouped by configuration and rank.
    """
    with open_store(url, readonly=True) as p:
        it = require_iterate(p, "ls")
        every = list(it.iter_entries())
    entries = [e for e in every
               if (salt_tag is None or tag_matches(e.salt_tag, salt_tag))
               and (tp_rank is None or ((st := rank_of(e.salt_tag)) is not None and st.tp_rank == tp_rank))]
    if salt_tag is not None and not any(tag_matches(e.salt_tag, salt_tag) for e in every):
        _nothing_matched(f"no entry has salt tag {salt_tag!r}", every)
    forest = Forest(entries)
    if tree:
        _print_tree(forest, limit, as_json)
        return
    # group whole trees by their root's tag (ranks' chains are disjoint trees); the stable sort
    # keeps parents before children
    tree_of: dict[bytes, tuple[str, int]] = {}
    for k in forest.order:
        parent = forest.entries[k].parent
        up = None if parent is None else tree_of.get(bytes(parent))
        tree_of[k] = up if up is not None else group_key(forest.entries[k].salt_tag)
    ranked = sorted(forest.order, key=tree_of.__getitem__)
    keys = ranked[:limit] if limit else ranked
    if as_json:
        emit_json({
            "entries": [
                {"key": k.hex(), "parent": None if (e := forest.entries[k]).parent is None
                 else bytes(e.parent).hex(), "depth": forest.depth[k], "nbytes": e.nbytes,
                 "salt_tag": e.salt_tag, "tp_rank": None if (st := rank_of(e.salt_tag)) is None else st.tp_rank,
                 "tp_world_size": None if st is None else st.tp_world_size,
                 "checksum": e.checksum, "created": e.created,
                 "last_used": e.last_used, "anchors": dict(e.anchors), "retained": e.retained}
                for k in keys
            ],
            "total": len(forest.entries),
            "shown": len(keys),
        })
        return
    now = time.time()
    rows = []
    ranks = any(rank_label(forest.entries[k].salt_tag) != "-" for k in keys)
    marks = any(forest.entries[k].retained for k in keys)  # a column only when something is retained
    for k in keys:
        e = forest.entries[k]
        anchors = ",".join(sorted(e.anchors))
        rank = (rank_label(e.salt_tag),) if ranks else ()
        mark = ("R" if e.retained else "",) if marks else ()
        rows.append((short(k), forest.depth[k], fmt_size(e.nbytes), e.salt_tag or "-", *rank, *mark,
                     fmt_age(e.last_used, now), anchors[:14]))
    table(("KEY", "DEPTH", "SIZE", "SALT TAG", *(("RANK",) if ranks else ()), *(("RET",) if marks else ()),
           "USED", "ANCHORS"), rows, right=(1, 2))
    if marks:
        click.echo("RET: R = retained (never evicted for room, nor its ancestors; `hostkv unretain`)")
    if len(keys) < len(forest.entries):
        click.echo(f"... {len(forest.entries) - len(keys)} more (of {len(forest.entries)}); "
                   "raise --limit or use --json")


def _print_tree(forest: Forest, limit: int | None, as_json: bool) -> None:
    runs = forest.runs()
    shown = runs[:limit] if limit else runs
    if as_json:
        emit_json({
            "roots": len(forest.roots), "leaves": forest.leaves, "entries": len(forest.entries),
            "branch_points": forest.branch_points,
            "runs": [
                {"id": r.index, "parent_run": r.parent_run, "first": r.keys[0].hex(),
                 "last": r.keys[-1].hex(), "depth_start": r.depth_start, "depth_end": r.depth_end,
                 "pages": len(r.keys), "nbytes": r.nbytes,
                 "salt_tags": sorted({forest.entries[k].salt_tag for k in r.keys}),
                 "retained": sum(1 for k in r.keys if forest.entries[k].retained),
                 "anchors": [{"key": k.hex(), "depth": r.depth_start + i, "name": n, "nbytes": nb}
                             for i, k in enumerate(r.keys) for n, nb in forest.entries[k].anchors.items()],
                 "children": r.children}
                for r in shown
            ],
            "shown_runs": len(shown), "total_runs": len(runs),
        })
        return
    click.echo(f"{len(forest.entries)} pages in {len(forest.roots)} tree(s), {forest.leaves} leaves, "
               f"{forest.branch_points} branch points")
    # the salt tag is shown per run only when the listing mixes several
    many_tags = len({e.salt_tag for e in forest.entries.values()}) > 1
    # prefix per run: built from the parent's prefix + whether the run is its parent's last child
    prefix: dict[int, str] = {}
    for r in shown:
        if r.parent_run is None:
            lead, prefix[r.index] = "", ""
        else:
            siblings = runs[r.parent_run].children
            last = siblings[-1] == r.index
            base = prefix.get(r.parent_run, "")
            lead = base + ("└─ " if last else "├─ ")
            prefix[r.index] = base + ("   " if last else "│  ")
        depth = f"d{r.depth_start}" if len(r.keys) == 1 else f"d{r.depth_start}-{r.depth_end}"
        text = f"{lead}{short(r.keys[0], 12)} {depth} {len(r.keys)}p {fmt_size(r.nbytes)}"
        held = sum(1 for k in r.keys if forest.entries[k].retained)
        if held:
            text += f" R{held}" if held < len(r.keys) else " R"
        if many_tags:
            text += " " + ",".join(tag_label(t) for t in sorted({forest.entries[k].salt_tag for k in r.keys}))
        if r.children:
            text += f" ({len(r.children)} branches)"
        anchors = _anchor_text(forest.entries, r.keys, r.depth_start)
        if anchors and len(text) + len(anchors) + 3 <= 80:
            click.echo(f"{text} [{anchors}]")
            continue
        click.echo(text if len(text) <= 80 else text[:79] + "…")
        if anchors:  # too long for one line: the anchors go under the run
            more = prefix[r.index] + ("│  " if r.children else "   ") + f"[{anchors}]"
            click.echo(more if len(more) <= 80 else more[:79] + "…")
    if len(shown) < len(runs):
        click.echo(f"... {len(runs) - len(shown)} more runs; raise --limit or use --json")


# ----------------------------------------------------------------------------------------------
# verify / evict / compact
# ----------------------------------------------------------------------------------------------


def _require_verify(p: hk.Provider) -> hk.providers.SupportsVerify:
    if not isinstance(p, hk.providers.SupportsVerify):
        raise CLIError(f"provider {p.name!r} has no verify capability",
                       hint="run `hostkv providers` to see each provider's capabilities")
    return p


def _verify_doc(rep: hk.providers.VerifyReport) -> dict[str, Any]:
    return {"checked": rep.checked, "corrupt": [bytes(k).hex() for k in rep.corrupt],
            "dropped": rep.dropped, "problems": list(rep.problems), "ok": rep.ok}


@cli.command()
@click.argument("url")
@click.option("--repair", is_flag=True,
              help="After reporting, drop corrupt entries with their subtrees (opens for writing).")
@json_option
def verify(url: str, repair: bool, as_json: bool) -> None:
    """Check every stored checksum; report, and with --repair fix.

    Exits 1 when problems were found (also when --repair fixed them; a second run exits 0).
    Without --repair the store is opened read-only and never modified.
    """
    with open_store(url, readonly=not repair) as p:
        v = _require_verify(p)
        with progress_bar("verifying", enabled=not as_json or sys.stderr.isatty()) as bar:
            found = v.verify(repair=False, progress=bar)
        doc: dict[str, Any] = {"url": url, "found": _verify_doc(found)}
        if not as_json:
            _print_verify(found)
        if repair and not found.ok:
            if not as_json:
                click.echo(f"repairing: dropping {len(found.corrupt)} corrupt entries with their subtrees")
            with progress_bar("repairing", enabled=not as_json or sys.stderr.isatty()) as bar:
                fixed = v.verify(repair=True, progress=bar)
            doc["repair"] = _verify_doc(fixed)
            if not as_json:
                click.echo(f"repaired: dropped {fixed.dropped} entries "
                           f"({len(fixed.corrupt)} corrupt + their descendants)")
                for problem in fixed.problems:
                    click.echo(f"  still: {problem}")
    if as_json:
        emit_json(doc)
    if not found.ok:
        click.get_current_context().exit(int(ExitCode.INTEGRITY))


def _print_verify(rep: hk.providers.VerifyReport) -> None:
    click.echo(f"checked {rep.checked} entries: "
               + ("ok" if rep.ok else f"{len(rep.corrupt)} corrupt, {len(rep.problems)} other problems"))
    for k in rep.corrupt[:20]:
        click.echo(f"  corrupt  {bytes(k).hex()}")
    if len(rep.corrupt) > 20:
        click.echo(f"  ... {len(rep.corrupt) - 20} more (use --json for all)")
    for problem in rep.problems:
        click.echo(f"  problem  {problem}")


def _resolve_keys(p: hk.Provider, texts: Sequence[str]) -> list[bytes]:
    """Full 64-hex keys, or unique prefixes (>= 8 hex digits) resolved through iter_entries."""
    out: list[bytes] = []
    all_keys: list[bytes] | None = None
    for text in texts:
        t = text.strip().lower()
        if len(t) < 8 or len(t) > 64 or any(c not in "0123456789abcdef" for c in t):
            raise CLIError(f"not a key: {text!r}",
                           hint="give the 64 hex digits of a key, or a unique prefix of at least 8")
        if len(t) == 64:
            out.append(bytes.fromhex(t))
            continue
        if all_keys is None:
            all_keys = [bytes(e.key) for e in require_iterate(p, "a key prefix").iter_entries()]
        matches = [k for k in all_keys if k.hex().startswith(t)]
        if len(matches) != 1:
            raise CLIError(f"key prefix {text!r} matches {len(matches)} entries",
                           hint="give more hex digits (see `hostkv ls`)")
        out.append(matches[0])
    return out


@cli.command()
@click.argument("url")
@click.option("--to", "to_size", metavar="SIZE", help="Evict LRU leaves until at most SIZE is used.")
@click.option("--salt", "salt_tag", metavar="TAG",
              help="Evict every entry of this salt tag (a tensor-parallel config's 8 hex: all its ranks).")
@click.option("--older-than", metavar="DURATION",
              help="Evict subtrees not used for DURATION (e.g. 7d, 12h, 30m).")
@click.option("--key", "key_hex", multiple=True, metavar="HEX",
              help="Evict this key (64 hex digits or a unique prefix) with its subtree; repeatable.")
@click.option("--dry-run", is_flag=True, help="Only report what would be evicted.")
@json_option
def evict(url: str, to_size: str | None, salt_tag: str | None, older_than: str | None,
          key_hex: tuple[str, ...], dry_run: bool, as_json: bool) -> None:
    """Evict entries by size, salt tag, age or key.  Subtrees go with their roots, so
    chains stay prefix-closed; leased and in-flight entries are skipped."""
    given = [x for x in (to_size, salt_tag, older_than, key_hex or None) if x is not None]
    if len(given) != 1:
        raise click.UsageError("give exactly one of --to, --salt, --older-than, --key")
    with open_store(url, readonly=dry_run) as p:
        doc: dict[str, Any] = {"url": url, "dry_run": dry_run}
        if to_size is not None:
            target = hk.providers.parse_size(to_size)
            used = p.stats().used_bytes
            need = max(0, used - target)
            doc.update(policy="to", target_bytes=target, used_before=used, requested_bytes=need)
            if need and not dry_run:
                rep = p.evict(nbytes=need)
                doc.update(entries=rep.entries, nbytes=rep.nbytes, skipped=rep.skipped)
            else:
                doc.update(entries=0, nbytes=0, skipped=0)
            doc["used_after"] = p.stats().used_bytes
        else:
            if key_hex:
                roots = _resolve_keys(p, key_hex)
                doc["policy"] = "key"
                present = p.present(roots)
                missing = [k.hex() for k, ok in zip(roots, present, strict=False) if not ok]
                if missing:
                    doc["not_stored"] = missing
                roots = [k for k, ok in zip(roots, present, strict=False) if ok]
                forest = Forest(list(require_iterate(p, "evict").iter_entries())) \
                    if isinstance(p, hk.providers.SupportsIterate) else None
            else:
                forest = Forest(list(require_iterate(p, "evict --salt/--older-than").iter_entries()))
                roots = _select(forest, salt_tag, older_than)
                doc["policy"] = "salt" if salt_tag is not None else "older_than"
                if salt_tag is not None and not roots:
                    _nothing_matched(f"nothing to evict: no entry has salt tag {salt_tag!r}",
                                     list(forest.entries.values()))
            selected = ({k for r in roots for k in forest.subtree_keys(r)} if forest is not None
                        else set(roots))
            doc.update(selected_roots=len(roots), selected_entries=len(selected),
                       selected_bytes=(sum(forest.entries[k].nbytes for k in selected)
                                       if forest is not None else None))
            if roots and not dry_run:
                rep = p.evict(roots)
                doc.update(entries=rep.entries, nbytes=rep.nbytes, skipped=rep.skipped)
            else:
                doc.update(entries=0, nbytes=0, skipped=0)
    if as_json:
        emit_json(doc)
        return
    if dry_run:
        if doc["policy"] == "to":
            click.echo(f"would evict at least {fmt_size(doc['requested_bytes'])} of LRU leaves "
                       f"(used {fmt_size(doc['used_before'])}, target {fmt_size(doc['target_bytes'])})")
        else:
            nbytes = doc["selected_bytes"]
            click.echo(f"would evict {doc['selected_entries']} entries in {doc['selected_roots']} "
                       f"subtree(s)" + (f", {fmt_size(nbytes)}" if nbytes is not None else ""))
        return
    click.echo(f"evicted {doc['entries']} entries, {fmt_size(doc['nbytes'])}"
               + (f"; skipped {doc['skipped']} (leased or in flight)" if doc["skipped"] else ""))
    for k in doc.get("not_stored", []):
        click.echo(f"not stored: {k}")
    if "used_after" in doc:
        click.echo(f"used now {fmt_size(doc['used_after'])}")


def _nothing_matched(message: str, entries: Sequence[hk.EntryInfo]) -> NoReturn:
    """A selection that names nothing is a usage error (exit 2): usually a mistyped tag."""
    tags = sorted({e.salt_tag or "(none)" for e in entries})
    shown = ", ".join(tags[:6]) + (f" and {len(tags) - 6} more" if len(tags) > 6 else "")
    raise CLIError(message, ExitCode.USAGE,
                   hint=f"the store's salt tags: {shown}" if tags else "the store is empty")


def _select(forest: Forest, salt_tag: str | None, older_than: str | None) -> list[bytes]:
    """Topmost keys whose whole subtree matches the selection (so evicting them removes only
    matching entries: a chain's newer continuation is never dropped with its old prefix)."""
    if salt_tag is not None:
        ok = {k for k, e in forest.entries.items() if tag_matches(e.salt_tag, salt_tag)}
        # a subtree qualifies if every entry in it has the tag: compute bottom-up
        full: dict[bytes, bool] = {}
        for k in reversed(forest.order):
            full[k] = k in ok and all(full[c] for c in forest.children.get(k, ()))
    else:
        assert older_than is not None
        cutoff = time.time() - parse_duration(older_than)
        newest = forest.subtree_newest()
        full = {k: newest[k] < cutoff for k in forest.entries}
    roots = []
    for k in forest.order:
        e = forest.entries[k]
        parent = None if e.parent is None else bytes(e.parent)
        if full[k] and not (parent is not None and parent in forest.entries and full[parent]):
            roots.append(k)
    return roots


@cli.command()
@click.argument("url")
@json_option
def compact(url: str, as_json: bool) -> None:
    """Rewrite the store densely (the provider's crash-safe copy-then-swap).

    Refuses with exit 3 while another process holds the store's writer lock.
    """
    with open_store(url, readonly=False) as p:
        if not isinstance(p, hk.providers.SupportsCompact):
            raise CLIError(f"provider {p.name!r} has no compact capability",
                           hint="run `hostkv providers` to see each provider's capabilities")
        t0 = time.perf_counter()
        with progress_bar("compacting", enabled=not as_json or sys.stderr.isatty()) as bar:
            rep = p.compact(progress=bar)
        seconds = time.perf_counter() - t0
    doc = {"url": url, "entries": rep.entries, "bytes_before": rep.bytes_before,
           "bytes_after": rep.bytes_after, "seconds": round(seconds, 3)}
    if as_json:
        emit_json(doc)
        return
    click.echo(f"compacted {rep.entries} entries: {fmt_size(rep.bytes_before)} -> "
               f"{fmt_size(rep.bytes_after)} in {seconds:.2f} s")


# ----------------------------------------------------------------------------------------------
# copy / bench / demo live in their own modules, which register their commands here
# ----------------------------------------------------------------------------------------------

from ._archive import register as _register_archive  # noqa: E402 - after cli exists
from ._bench import register as _register_bench  # noqa: E402
from ._copy import register as _register_copy  # noqa: E402
from ._demo import register as _register_demo  # noqa: E402
from ._retain import register as _register_retain  # noqa: E402

_register_copy(cli)
_register_archive(cli)
_register_bench(cli)
_register_demo(cli)
_register_retain(cli)
