"""``hostkv copy``: migrate every entry (and its anchors) from one store to another.

Parents are copied before children (the destination refuses an entry whose parent is not
sealed), keys already in the destination are deduplicated by ``reserve`` returning ``None``, and
the bytes come from the source's ``read`` (which never returns wrong bytes: a checksum failure is
a miss, and that entry's subtree is skipped and counted).
"""

from __future__ import annotations

import sys
import time
from typing import Any

import click
import hostkv_providers as hk

from ._exits import CLIError, ExitCode
from ._format import emit_json, fmt_size, json_option
from ._store import Forest, open_store, progress_bar, require_iterate

__all__ = ["copy_store", "register"]

_WAIT_IN_FLIGHT_S = 30.0


def copy_store(src: hk.Provider, dst: hk.Provider, progress: Any = None) -> dict[str, Any]:
    """Copy every entry of ``src`` into ``dst``, parents first.  Returns counters."""
    forest = Forest(list(require_iterate(src, "copy").iter_entries()))
    total = len(forest.order)
    # Pages the destination already has cost nothing (dedup); the rest must fit its budget.
    have = dst.present(forest.order) if forest.order else []
    need = sum(forest.entries[k].nbytes for k, ok in zip(forest.order, have, strict=False) if not ok)
    largest = max((forest.entries[k].nbytes for k, ok in zip(forest.order, have, strict=False) if not ok),
                  default=0)
    if largest > dst.budget_bytes:
        raise CLIError(f"the source has an entry of {fmt_size(largest)}, more than the destination's "
                       f"whole budget of {fmt_size(dst.budget_bytes)}", ExitCode.USAGE,
                       hint="open the destination with a larger budget (e.g. ?budget=...)")
    if need > dst.budget_bytes:
        raise CLIError(
            f"the source holds {fmt_size(need)} the destination lacks, more than its whole "
            f"budget of {fmt_size(dst.budget_bytes)}",
            ExitCode.USAGE,
            hint="open the destination with a larger budget (e.g. ?budget=...) or evict first",
        )
    copied = dedup = anchors = lost = 0
    copied_bytes = 0
    skipped: set[bytes] = set()  # keys whose parent could not be copied
    lost_keys: list[str] = []
    buf = bytearray()
    for i, k in enumerate(forest.order):
        e = forest.entries[k]
        parent = None if e.parent is None or bytes(e.parent) == bytes(hk.ZERO_KEY) else bytes(e.parent)
        if parent is not None and parent in skipped:
            skipped.add(k)
            lost += 1
            if progress is not None:
                progress(i + 1, total)
            continue
        if k in forest.orphans:
            parent_ok = parent is not None and dst.present([parent])[0]
            if not parent_ok:
                skipped.add(k)
                lost += 1
                lost_keys.append(k.hex())
                if progress is not None:
                    progress(i + 1, total)
                continue
        if len(buf) != e.nbytes:
            buf = bytearray(e.nbytes)
        if not src.read(k, buf):
            # Corrupt (checksum failure) or evicted meanwhile: never copy it, nor its subtree.
            skipped.add(k)
            lost += 1
            lost_keys.append(k.hex())
        else:
            try:
                try:
                    res = dst.reserve(k, parent, e.nbytes, salt_tag=e.salt_tag)
                except hk.errors.InFlightError:
                    # Another writer is storing the same page right now: wait for its seal.
                    if not dst.wait_sealed(k, _WAIT_IN_FLIGHT_S):
                        raise
                    res = None
                if res is None:
                    dedup += 1
                else:
                    with res:
                        res.write(0, buf)
                    copied += 1
                    copied_bytes += e.nbytes
            except hk.HostKVError as exc:
                # Say where it stopped and that what came before is in place (each copied entry
                # was sealed whole), instead of the destination's bare message.
                exc.message = (f"the destination refused entry {i + 1} of {total} ({k.hex()[:16]}…, "
                               f"{fmt_size(e.nbytes)}) after {copied} copied: {exc.message}")
                raise
            dst_anchors = dst.list_anchors(k)
            for name, nbytes in e.anchors.items():
                if dst_anchors.get(name) == nbytes:
                    continue
                blob = src.get_anchor(k, name)
                if blob is not None:
                    dst.put_anchor(k, name, blob)
                    anchors += 1
        if progress is not None:
            progress(i + 1, total)
    return {"entries": total, "copied": copied, "copied_bytes": copied_bytes, "dedup": dedup,
            "anchors": anchors, "lost": lost, "lost_keys": lost_keys}


def refuse_ephemeral(dst: hk.Provider, allowed: bool, command: str) -> None:
    """A non-persistent destination lives in this process's memory: writing into it from the CLI
    keeps nothing once the command exits, so it is refused unless asked for."""
    if not dst.persistent and not allowed:
        raise CLIError(f"{dst.name}:// is not persistent: it lives in this command's memory, so the "
                       f"{command} would be gone when hostkv exits", ExitCode.USAGE,
                       hint=f"{command} into a persistent store (lmdb://, mmap://, a plugin's); "
                            "--allow-ephemeral to do it anyway (tests, benchmarks)")


def register(group: click.Group) -> None:
    @group.command(name="copy")
    @click.argument("src_url", metavar="SRC_URL")
    @click.argument("dst_url", metavar="DST_URL")
    @click.option("--allow-ephemeral", is_flag=True,
                  help="Copy into a non-persistent store (pinned://) although it is gone when hostkv exits.")
    @json_option
    def copy_cmd(src_url: str, dst_url: str, allow_ephemeral: bool, as_json: bool) -> None:
        """Copy every entry and anchor of SRC_URL into DST_URL (created if needed).

        Parents go first, keys already in the destination are skipped (dedup), and entries the
        source cannot read back intact are not copied (exit 1).  SRC_URL is opened read-only.
        """
        if src_url == dst_url:
            raise CLIError("source and destination are the same store")
        with (
            open_store(src_url, readonly=True) as src,
            open_store(dst_url, readonly=False, must_exist=False, create=True) as dst,
            progress_bar("copying", enabled=not as_json or sys.stderr.isatty(), interrupt_here=True) as bar,
        ):
            refuse_ephemeral(dst, allow_ephemeral, "copy")
            t0 = time.perf_counter()  # the copy itself, not opening (creating) the stores
            doc = copy_store(src, dst, bar)
            seconds = time.perf_counter() - t0
        doc.update(src=src_url, dst=dst_url, seconds=round(seconds, 3))
        if as_json:
            emit_json(doc)
        else:
            rate = doc["copied_bytes"] / seconds / 1e6 if seconds > 0 else 0.0
            click.echo(f"copied {doc['copied']} entries ({fmt_size(doc['copied_bytes'])}, "
                       f"{rate:.0f} MB/s), {doc['dedup']} already present, {doc['anchors']} anchors")
            if doc["lost"]:
                click.echo(f"NOT copied: {doc['lost']} entries (unreadable or corrupt in the source, "
                           "or below such an entry)")
        if doc["lost"]:
            click.get_current_context().exit(int(ExitCode.INTEGRITY))
