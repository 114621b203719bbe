"""``hostkv demo``: the README's main job, an engine-like session on the embedded default store.

1. A toy model's KV layout and salt; a long synthetic prompt keyed into a chain of pages.
2. Save its pages (reserve -> write -> seal), with a recurrent-state anchor every 256 pages and
   at the end (what a hybrid model needs to resume there).
3. A forked branch sharing the first 3/4 of the prompt: only its new pages are written (dedup).
4. Close the store (the "restart"), then reopen it in a fresh process, look both chains up with
   ``longest_prefix`` under a lease, read every page back and compare every byte with the bytes
   recomputed from the key; check the anchors and ``deepest_anchor``.
5. Print what was saved and how fast.

The page bytes are a PRNG stream seeded by the page key, so the fresh process needs no copy of
what was written to check it.  Exit status 0 only when every byte matched.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.parse
from dataclasses import asdict, dataclass
from typing import Any

import click
import hostkv_providers as hk
import numpy as np

from ._exits import CLIError, ExitCode
from ._format import emit_json, fmt_size, json_option
from ._store import progress_bar
from ._synth import page_bytes

__all__ = ["DemoPlan", "register"]

ANCHOR = "ssm_state"
ANCHOR_EVERY = 256
ANCHOR_NBYTES = 16 * 1024
DEFAULT_PATH = "./.hostkv-demo"
DEFAULT_BUDGET = "256MiB"
_PROGRESS_ENV = "HOSTKV_DEMO_PROGRESS"


@dataclass(frozen=True)
class DemoPlan:
    """Everything both processes need to recompute the chains and their bytes."""

    url: str
    tokens: int
    fork_tokens: int
    num_layers: int = 4
    num_kv_heads: int = 2
    head_dim: int = 64
    page_tokens: int = 32
    dtype: str = "bfloat16"
    vocab: int = 128_256
    seed: int = 20251129

    @property
    def layout(self) -> hk.KVLayout:
        return hk.KVLayout(self.num_layers, self.num_kv_heads, self.head_dim, self.page_tokens,
                           dtype=self.dtype)

    @property
    def salt(self) -> hk.Salt:
        return hk.Salt("hostkv-demo/toy-4-layer", self.layout, model_revision="synthetic-v1",
                       namespace="hostkv demo")

    def prompts(self) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
        """Prompt A, and the fork B: A's first ``fork_tokens`` tokens, then new ones."""
        rng = np.random.default_rng(self.seed)
        a = rng.integers(0, self.vocab, size=self.tokens, dtype=np.int64)
        tail = rng.integers(0, self.vocab, size=self.tokens - self.fork_tokens, dtype=np.int64)
        return a, np.concatenate([a[: self.fork_tokens], tail])


def _anchor_bytes(key: bytes) -> bytes:
    return page_bytes(bytes(reversed(key)), ANCHOR_NBYTES)


def _anchor_positions(n_pages: int) -> list[int]:
    """Page indices carrying the recurrent-state anchor: every 256th page and the last one."""
    pos = list(range(ANCHOR_EVERY - 1, n_pages, ANCHOR_EVERY))
    if n_pages and (not pos or pos[-1] != n_pages - 1):
        pos.append(n_pages - 1)
    return pos


def _save(p: hk.Provider, salt: hk.Salt, keys: list[hk.Key], label: str,
          quiet: bool) -> dict[str, Any]:
    """Save a chain's pages the way an engine does; time only the store calls."""
    nbytes = salt.page_nbytes
    written = dedup = 0
    store_s = compute_s = 0.0
    parent: bytes | None = None
    with progress_bar(label, enabled=not quiet) as bar:
        for i, k in enumerate(keys):
            t0 = time.perf_counter()
            data = page_bytes(k, nbytes)  # the "GPU page" (a PRNG stands in for prefill)
            compute_s += time.perf_counter() - t0
            t0 = time.perf_counter()
            res = p.reserve(k, parent, nbytes, salt_tag=salt.tag)
            if res is None:
                dedup += 1
            else:
                with res:
                    res.write(0, data)
                written += 1
            store_s += time.perf_counter() - t0
            parent = k
            bar(i + 1, len(keys))
        anchors = 0
        t0 = time.perf_counter()
        for i in _anchor_positions(len(keys)):
            if ANCHOR not in p.list_anchors(keys[i]):
                p.put_anchor(keys[i], ANCHOR, _anchor_bytes(keys[i]))
                anchors += 1
        anchor_s = time.perf_counter() - t0
    return {"pages": len(keys), "written": written, "dedup": dedup,
            "written_bytes": written * nbytes, "seconds": store_s, "compute_seconds": compute_s,
            "ms_per_page": store_s / max(written, 1) * 1e3,
            "MB_per_s": written * nbytes / store_s / 1e6 if store_s > 0 and written else 0.0,
            "anchors_put": anchors, "anchor_seconds": anchor_s}


def restore(plan: DemoPlan, provider: hk.Provider | None = None, *, progress: bool = False) -> dict[str, Any]:
    """Open the store (or use ``provider``), look both chains up, read every page and check
    every byte (with a progress bar on stderr when ``progress``)."""
    salt = plan.salt
    a, b = plan.prompts()
    with progress_bar("restoring + verifying", enabled=progress) as bar:
        return _restore(plan, provider, salt, a, b, bar)


def _restore(plan: DemoPlan, provider: hk.Provider | None, salt: hk.Salt, a: np.ndarray[Any, Any],
             b: np.ndarray[Any, Any], bar: Any) -> dict[str, Any]:
    total = 2 * len(hk.chain_keys(salt, a))
    done = 0
    out: dict[str, Any] = {"pid": os.getpid(), "chains": []}
    t0 = time.perf_counter()
    p = hk.open(plan.url) if provider is None else provider
    out["open_ms"] = (time.perf_counter() - t0) * 1e3
    try:
        for name, tokens in (("A", a), ("B", b)):
            keys = hk.chain_keys(salt, tokens)
            t0 = time.perf_counter()
            hit = p.longest_prefix(keys)
            lookup_ms = (time.perf_counter() - t0) * 1e3
            anchored = p.deepest_anchor(keys, ANCHOR)
            buf = bytearray(salt.page_nbytes)
            read_s = 0.0
            wrong = missing = 0
            with p.lease(keys[:hit]) as lease:
                for k in lease.keys:
                    t1 = time.perf_counter()
                    ok = p.read(k, buf)
                    read_s += time.perf_counter() - t1
                    if not ok:
                        missing += 1
                    elif buf != page_bytes(k, salt.page_nbytes):
                        wrong += 1
                    done += 1
                    bar(done, total)
                leased = len(lease.keys)
            anchors_ok = all(p.get_anchor(keys[i], ANCHOR) == _anchor_bytes(keys[i])
                             for i in _anchor_positions(len(keys)) if i < hit)
            out["chains"].append({
                "name": name, "pages": len(keys), "hit": hit, "leased": leased,
                "lookup_ms": lookup_ms, "read_seconds": read_s,
                "read_bytes": (leased - missing) * salt.page_nbytes,
                "MB_per_s": (leased - missing) * salt.page_nbytes / read_s / 1e6 if read_s else 0.0,
                "wrong_pages": wrong, "missing_pages": missing,
                "deepest_anchor": anchored, "anchors_ok": anchors_ok,
            })
        st = p.stats()
        out["store"] = {"entries": st.entries, "used_bytes": st.used_bytes,
                        "budget_bytes": p.budget_bytes, "anchors": st.anchors}
    finally:
        if provider is None:
            p.close()
    return out


def _pick_url(path: str) -> tuple[str, str | None]:
    """The embedded default store (lmdb) under ``path``; mmap only if lmdb is unavailable."""
    infos = {i.name: i for i in hk.available_providers()}
    note = None
    for scheme in ("lmdb", "mmap"):
        info = infos.get(scheme)
        if info is not None and info.error is None:
            if scheme != "lmdb":
                why = infos["lmdb"].error if "lmdb" in infos else "not installed"
                note = f"the lmdb provider is not available ({why}); using mmap:// instead"
            return f"{scheme}://{os.path.abspath(path)}?budget={DEFAULT_BUDGET}", note
    raise CLIError("neither the lmdb nor the mmap provider is available",
                   ExitCode.USAGE,
                   hint="reinstall hostkv-providers, or pass --url for another persistent store")


def run_demo(plan: DemoPlan, *, quiet: bool, fresh_process: bool = True) -> dict[str, Any]:
    salt = plan.salt
    a, b = plan.prompts()
    t0 = time.perf_counter()
    keys_a = hk.chain_keys(salt, a)
    keys_b = hk.chain_keys(salt, b)
    key_ms = (time.perf_counter() - t0) * 1e3
    if not keys_a:
        raise CLIError(f"--tokens must be at least one page ({plan.page_tokens} tokens)")
    doc: dict[str, Any] = {"plan": asdict(plan), "salt_tag": salt.tag,
                           "page_nbytes": salt.page_nbytes, "keying_ms": key_ms}
    t0 = time.perf_counter()
    p = hk.open(plan.url)
    doc["open_ms"] = (time.perf_counter() - t0) * 1e3
    try:
        persistent = p.persistent
        # A previous demo run left its pages: evict its chains so this session starts cold.
        # (Only the demo's own chains: the roots are recomputed, nothing else is touched.)
        roots = [k for k, ok in zip([keys_a[0], keys_b[0]], p.present([keys_a[0], keys_b[0]]), strict=False)
                 if ok]
        doc["evicted_previous"] = p.evict(roots).entries if roots else 0
        need = (len(keys_a) + len(keys_b)) * salt.page_nbytes
        if need > p.budget_bytes:
            raise CLIError(f"the demo needs {fmt_size(need)} but the store's budget is "
                           f"{fmt_size(p.budget_bytes)}", hint="use fewer --tokens or a larger budget")
        t0 = time.perf_counter()
        doc["cold_hit"] = p.longest_prefix(keys_a)  # what an engine finds before anything is saved
        doc["cold_lookup_ms"] = (time.perf_counter() - t0) * 1e3
        doc["save_a"] = _save(p, salt, keys_a, "computing + saving prompt A", quiet)
        shared = p.longest_prefix(keys_b)
        doc["fork_shared_pages"] = shared
        doc["save_b"] = _save(p, salt, keys_b, "saving fork B (dedup)", quiet)
        doc["provider"] = p.name
        doc["describe"] = p.describe()
        if not persistent:
            # Nothing survives a restart of a memory provider: restore from the same instance.
            doc["restore"] = restore(plan, p, progress=not quiet)
            doc["restore"]["restart"] = "none: the provider is not persistent"
    finally:
        if persistent and not quiet:  # the restart phase says so too (it has no bar: < 1 s)
            click.echo("restarting: closing the store; a fresh process reopens it", err=True)
        t0 = time.perf_counter()
        p.close()
        close_ms = (time.perf_counter() - t0) * 1e3
    doc["close_ms"] = close_ms
    if persistent and fresh_process:
        # The child draws its progress bar on our stderr (inherited) when we draw ours.
        proc = subprocess.run(
            [sys.executable, "-m", "hostkv_cli._demo", json.dumps(asdict(plan))],
            stdout=subprocess.PIPE, stderr=None if not quiet else subprocess.PIPE, text=True, check=False,
            env={**os.environ, _PROGRESS_ENV: "0" if quiet else "1"},
        )
        if proc.returncode != 0:
            why = (proc.stderr or "").strip()[-800:] or "see its messages above"
            raise CLIError(f"the restore process failed (exit {proc.returncode}): {why}", ExitCode.INTERNAL)
        doc["restore"] = json.loads(proc.stdout)
        doc["restore"]["restart"] = "fresh process"
    elif persistent:
        doc["restore"] = restore(plan, progress=not quiet)
        doc["restore"]["restart"] = "fresh provider instance in this process"
    return doc


def _ok(doc: dict[str, Any]) -> bool:
    r = doc["restore"]
    return all(c["hit"] == c["pages"] and c["wrong_pages"] == 0 and c["missing_pages"] == 0
               and c["anchors_ok"] for c in r["chains"])


def _read_url(url: str) -> str:
    """The store's URL for the read-only commands suggested after the demo: every option kept
    (a plugin's namespace=, a host, TLS settings) but the write-only ``budget``, which a
    read-only open refuses."""
    base, _, query = url.partition("?")
    pairs = [(k, v) for k, v in urllib.parse.parse_qsl(query, keep_blank_values=True) if k != "budget"]
    if not pairs:
        return base
    return base + "?" + urllib.parse.urlencode(pairs, safe="/:%")


def _rate(nbytes: int, seconds: float) -> str:
    return f"{nbytes / seconds / 1e6:,.0f} MB/s" if seconds > 0 and nbytes else "-"


def _print(doc: dict[str, Any], note: str | None) -> None:
    plan = doc["plan"]
    pn = doc["page_nbytes"]
    sa, sb = doc["save_a"], doc["save_b"]
    r = doc["restore"]
    ca, cb = r["chains"]
    e = click.echo
    e(click.style("hostkv demo", bold=True) + f": an engine's KV cache across a restart ({doc['provider']})")
    e(f"  store  {plan['url']}")
    if note:
        e(f"  note   {note}")
    e(f"  model  toy {plan['num_layers']}x{plan['num_kv_heads']}x{plan['head_dim']} {plan['dtype']}, "
      f"{plan['page_tokens']}-token pages of {fmt_size(pn)}, salt {doc['salt_tag']}")
    if doc["evicted_previous"]:
        e(f"  (cleared {doc['evicted_previous']} pages left by an earlier demo run)")
    e("")
    rows: list[tuple[str, str, str, str, str]] = [
        (f"1 cold lookup A, {plan['tokens']} tok", f"{doc['cold_hit']}/{sa['pages']}", "-",
         f"{doc['cold_lookup_ms']:.1f} ms", "all to prefill"),
        ("  compute A (PRNG: prefill)", str(sa["pages"]), fmt_size(sa["pages"] * pn),
         f"{sa['compute_seconds']:.2f} s", _rate(sa["pages"] * pn, sa["compute_seconds"])),
        ("  save A", str(sa["written"]), fmt_size(sa["written_bytes"]), f"{sa['seconds']:.2f} s",
         _rate(sa["written_bytes"], sa["seconds"])),
        ("2 save fork B", f"{sb['written']} new", fmt_size(sb["written_bytes"]), f"{sb['seconds']:.2f} s",
         f"{sb['dedup']} shared: dedup"),
    ]
    if r["restart"].startswith("none"):
        rows.append(("3 no restart (not persistent)", "-", "-", "-", "same instance"))
    else:
        where = "fresh process" if r["restart"] == "fresh process" else "fresh instance"
        rows.append((f"3 restart ({where})", "-", "-",
                     f"{(doc['close_ms'] + r['open_ms']) / 1e3:.2f} s", f"pid {r['pid']}"))
    for c in (ca, cb):
        rows.append((f"4 lookup + restore {c['name']}", f"{c['hit']}/{c['pages']}",
                     fmt_size(c["read_bytes"]), f"{c['read_seconds'] + c['lookup_ms'] / 1e3:.2f} s",
                     _rate(c["read_bytes"], c["read_seconds"])))
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    head = ("phase", "pages", "bytes", "time", "")
    widths = [max(w, len(h)) for w, h in zip(widths, head, strict=True)]
    right = {1, 2, 3}
    for row in [head, *rows]:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(row)]
        e("  " + "  ".join(cells).rstrip())
    e("")
    total = sum(c["read_bytes"] for c in r["chains"])
    wrong = sum(c["wrong_pages"] for c in r["chains"])
    missing = sum(c["missing_pages"] for c in r["chains"])
    anchors = "ok" if all(c["anchors_ok"] for c in r["chains"]) else "WRONG"
    verdict = (click.style("every byte matched", fg="green", bold=True) if _ok(doc)
               else click.style("MISMATCH", fg="red", bold=True))
    e(f"  5 checked {fmt_size(total)} against pages rebuilt from their keys: {verdict}")
    e(f"    {wrong} wrong, {missing} missing pages; '{ANCHOR}' anchors {anchors} "
      f"(deepest at page {ca['deepest_anchor']}/{ca['pages']})")
    cold = sa["compute_seconds"] + sa["seconds"]
    warm = ca["read_seconds"] + ca["lookup_ms"] / 1e3
    speed = f" ({cold / warm:.1f}x)" if warm > 0 else ""
    e(f"  cold A {cold:.2f} s (compute+save) -> restored {warm:.2f} s{speed}; "
      f"fork: {sb['written']}/{sb['pages']} pages")
    st = r["store"]
    e(f"  store  {st['entries']} pages, {fmt_size(st['used_bytes'])} of {fmt_size(st['budget_bytes'])}, "
      f"{st['anchors']} anchors")
    if r["restart"].startswith("none"):
        return
    url = _read_url(plan["url"])
    e(f"  next   hostkv info '{url}'")
    e(f"         hostkv ls --tree '{url}'")
    e(f"         hostkv verify '{url}'")


def register(group: click.Group) -> None:
    @group.command()
    @click.option("--path", default=DEFAULT_PATH, show_default=True, type=click.Path(file_okay=False),
                  help="Folder of the demo store (created if needed).")
    @click.option("--url", help="Run on this store URL instead (any provider; overrides --path).")
    @click.option("--tokens", type=click.IntRange(min=64, max=1 << 24), default=32768, show_default=True,
                  help="Length of the synthetic prompt.")
    @click.option("--same-process", is_flag=True,
                  help="Reopen in this process (a fresh provider instance) instead of a new one.")
    @json_option
    def demo(path: str, url: str | None, tokens: int, same_process: bool, as_json: bool) -> None:
        """Save a long prompt's KV pages and a forked branch, restart, restore, verify every byte."""
        note = None
        if url is None:
            url, note = _pick_url(path)
        page_tokens = DemoPlan.page_tokens
        fork = (tokens * 3 // 4) // page_tokens * page_tokens
        plan = DemoPlan(url=url, tokens=tokens, fork_tokens=fork)
        if note and not as_json:
            click.echo(f"note: {note}", err=True)
        doc = run_demo(plan, quiet=as_json and not sys.stderr.isatty(), fresh_process=not same_process)
        doc["ok"] = _ok(doc)
        if note:
            doc["note"] = note
        if as_json:
            emit_json(doc)
        else:
            _print(doc, None)
        if not doc["ok"]:
            click.get_current_context().exit(int(ExitCode.INTEGRITY))


def _child(argv: list[str]) -> int:
    """``python -m hostkv_cli._demo PLAN_JSON``: the restore half, in a fresh process."""
    plan = DemoPlan(**json.loads(argv[0]))
    print(json.dumps(restore(plan, progress=os.environ.get(_PROGRESS_ENV) == "1"), default=str))
    return 0


if __name__ == "__main__":
    raise SystemExit(_child(sys.argv[1:]))

