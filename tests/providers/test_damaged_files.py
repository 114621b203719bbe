"""Damaged-file trials (issue 16; RELIABILITY.md R1, R11): random damage to every file of a
persistent store — bit flips, zeroed / 0xFF / random 512-byte sectors, truncation, extension —
then a reader, a writer (recovery) and a second reader open it, each in a forked child (a signal
death must be seen, not suffered).  Each trial must show 0 wrong bytes, 0 signal deaths, a typed
error (refused) or a clean miss, and nothing deleted that the first reader could read.

``HOSTKV_DAMAGE_TRIALS`` sets the trials per provider (default 200, sized for CI's 2 cores; the
full reliability run is ``HOSTKV_DAMAGE_TRIALS=1000``); ``HOSTKV_DAMAGE_TALLY`` names a file that
receives the outcome counts as JSON.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import os
import random
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

import hostkv_providers as hk
from hostkv_providers.testing import anchor_bytes, chain, page_bytes, put_chain

TRIALS = int(os.environ.get("HOSTKV_DAMAGE_TRIALS", "200"))
PAGE = 16384
SMALL = 2048  # lmdb keeps these inline in data.mdb
LOCK_FILES = {"lock.mdb", "writer.lock", "hostkv.lock"}

URLS = {
    "mmap": "mmap://{path}?budget=1MiB&slot=16KiB&file_size=1MiB",
    "lmdb": "lmdb://{path}?budget=2MiB&map_size=1MiB&file_size=1MiB&inline_max=4096",
}


def _build(scheme: str, path: Path) -> dict[bytes, bytes]:
    """A small store: two chains of 16 KiB pages, a chain of 2 KiB pages, anchors."""
    expected: dict[bytes, bytes] = {}
    with hk.open(URLS[scheme].format(path=path)) as p:
        for name, n, size in (("a", 12, PAGE), ("b", 6, PAGE), ("c", 8, SMALL)):
            keys = chain(f"damage/{scheme}/{name}", n)
            put_chain(p, keys, size)
            for k in keys:
                expected[bytes(k)] = page_bytes(k, size)
            p.put_anchor(keys[-1], "state", anchor_bytes(keys[-1], "state", 300))
    return expected


def _files(root: Path) -> list[Path]:
    return sorted(f for f in root.rglob("*") if f.is_file())


def _damage(rng: random.Random, root: Path) -> str:
    files = _files(root)
    f = rng.choice(files)
    size = f.stat().st_size
    kind = rng.choice(["flip", "flips", "zero", "ones", "random", "truncate", "extend"])
    with open(f, "r+b") as fh:
        if kind in ("flip", "flips") and size:
            for _ in range(1 if kind == "flip" else rng.randint(2, 16)):
                pos = rng.randrange(size)
                fh.seek(pos)
                b = fh.read(1)[0]
                fh.seek(pos)
                fh.write(bytes([b ^ (1 << rng.randrange(8))]))
        elif kind in ("zero", "ones", "random") and size:
            sector = rng.randrange(max(1, size // 512))
            fh.seek(sector * 512)
            n = min(512, size - sector * 512)
            fh.write(bytes(n) if kind == "zero" else b"\xff" * n if kind == "ones" else rng.randbytes(n))
        elif kind == "truncate":
            fh.truncate(rng.randrange(size) if size else 0)
        else:
            fh.seek(0, os.SEEK_END)
            fh.write(rng.randbytes(rng.choice([1, 100, 512, 4096])))
    return f"{kind} {f.relative_to(root)}"


def _probe(url: str, expected: dict[bytes, bytes], *, readonly: bool, verify: bool,
           read: bool = True) -> dict[str, Any]:
    """Open ``url`` and read every expected key (``read``); the result as a plain dict (for the
    pipe)."""
    out: dict[str, Any] = {"readable": [], "wrong": [], "error": None}
    try:
        p = hk.open(url, readonly="true" if readonly else "false")
    except hk.HostKVError as exc:
        out["error"] = f"typed {type(exc).__name__}"
        return out
    try:
        for k, want in expected.items() if read else ():
            try:
                got = p.read_bytes(k)
            except hk.HostKVError as exc:  # a typed error on a read is allowed (corrupt store)
                out["error"] = out["error"] or f"typed read {type(exc).__name__}"
                continue
            if got is None:
                continue
            if got != want:
                out["wrong"].append(k.hex()[:16])
            else:
                out["readable"].append(k.hex())
        if verify and isinstance(p, hk.providers.SupportsVerify):
            p.verify()
    except hk.HostKVError as exc:
        out["error"] = out["error"] or f"typed {type(exc).__name__}"
    finally:
        with contextlib.suppress(hk.HostKVError):
            p.close()
    return out


def _in_child(fn: Any, timeout: float = 60.0) -> dict[str, Any]:
    """``fn()`` in a forked child; its dict, or ``{"signal": n}`` / ``{"hang": True}`` /
    ``{"untyped": ...}``."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - runs in the child
        os.close(rfd)
        code = 0
        try:
            data = json.dumps(fn()).encode()
        except BaseException as exc:
            data = json.dumps({"untyped": f"{type(exc).__name__}: {exc}"[:300]}).encode()
        try:
            while data:
                data = data[os.write(wfd, data):]
        finally:
            os._exit(code)
    os.close(wfd)
    buf = b""
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        chunk = b""
        try:
            os.set_blocking(rfd, False)
            chunk = os.read(rfd, 1 << 20)
        except BlockingIOError:
            pass
        buf += chunk
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            os.close(rfd)
            return {"hang": True}
        if not chunk:
            time.sleep(0.001)
    os.set_blocking(rfd, True)
    while chunk := os.read(rfd, 1 << 20):
        buf += chunk
    os.close(rfd)
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    result: dict[str, Any] = json.loads(buf or b"{}")
    return result


STAGES = ("reader", "writer open", "reader after the writer", "writer's reads")


def _snapshot(root: Path) -> dict[str, bytes]:
    return {str(f.relative_to(root)): f.read_bytes() for f in _files(root) if f.name not in LOCK_FILES}


def _trial(url: str, plain: str, root: Path, expected: dict[bytes, bytes], verify: bool) -> dict[str, Any]:
    """The four stages of a trial, in one child: a reader reads every page; a writer opens (its
    recovery) and closes without reading; a reader reads again (it must see every page the first
    one saw); a writer reads every page (a checksum failure may drop a page with its subtree)."""
    stages = [_probe(plain, expected, readonly=True, verify=verify)]
    before = _snapshot(root)
    w = _probe(url, expected, readonly=False, verify=verify, read=False)
    if w["error"]:  # the writer refused the store: it must not have changed a byte of it
        now = _snapshot(root)
        w["changed"] = sorted(k for k in set(now) | set(before) if now.get(k) != before.get(k))
    stages.append(w)
    stages.append(_probe(plain, expected, readonly=True, verify=False))
    stages.append(_probe(url, expected, readonly=False, verify=False))
    return {"stages": stages}


@pytest.mark.parametrize("scheme", ["mmap", "lmdb"])
def test_random_damage_to_every_file(tmp_path: Path, scheme: str) -> None:
    base = tmp_path / "base"
    expected = _build(scheme, base)
    rng = random.Random(20261201 + (scheme == "lmdb"))
    tally: collections.Counter[str] = collections.Counter()
    failures: list[str] = []
    trial_dir = tmp_path / "trial"
    for trial in range(TRIALS):
        shutil.rmtree(trial_dir, ignore_errors=True)
        shutil.copytree(base, trial_dir)
        what = _damage(rng, trial_dir)
        url = URLS[scheme].format(path=trial_dir)
        plain = f"{scheme}://{trial_dir}"
        verify = trial % 50 == 0  # (lmdb: a fresh interpreter per verify, ~1 s on a busy machine)
        res = _in_child(functools.partial(_trial, url, plain, trial_dir, expected, verify))
        problems = []
        stages = res.get("stages", [])
        if "signal" in res or res.get("hang") or "untyped" in res:
            where = "the trial's child"  # (its stages report at the end: which one is not known)
            why = (f"died by signal {res['signal']}" if "signal" in res else "hung" if res.get("hang")
                   else f"untyped {res['untyped']}")
            problems.append(f"{where}: {why}")
        for name, r in zip(STAGES, stages, strict=False):
            if r["wrong"]:
                problems.append(f"{name}: wrong bytes for {r['wrong'][:3]}")
            if r.get("changed"):
                problems.append(f"a refusing writer changed {r['changed'][:3]}")
        if not problems:
            first, after = stages[0], stages[2]
            lost = set(first["readable"]) - set(after["readable"])
            if lost and not after.get("error"):
                problems.append(f"{len(lost)} pages the first reader read are gone after the writer")
        if problems:
            failures.append(f"trial {trial} ({what}): {'; '.join(problems)}")
            tally["FAILED"] += 1
            continue
        first = stages[0]
        if first.get("error"):
            outcome = "refused (typed error)"
        elif len(first["readable"]) == len(expected):
            outcome = "intact"
        else:
            outcome = "clean miss"
        tally[outcome] += 1
    path = os.environ.get("HOSTKV_DAMAGE_TALLY")
    if path:
        with open(path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps({"provider": scheme, "trials": TRIALS, **tally}) + "\n")
    assert not failures, f"{len(failures)} of {TRIALS} trials failed: {failures[:5]}"
    assert sum(tally.values()) == TRIALS
