"""``hostkv export`` / ``import`` archives: compression ratio and GB/s on real-looking KV.

    python3 benchmarks/bench_archive.py [--mib 128] [--levels 1,3] [--shuffles 1,2]

The pages are a Llama-3-8B-like layout (32 layers, K and V, 8 KV heads, head dim 128, 16-token
pages) filled with KV that has the statistics of real caches rather than white noise: keys with
per-channel scales (log-normal, a few outlier channels 10x larger, as measured in KIVI/KVQuant)
and a per-channel offset, rotated by RoPE at their token positions (theta 500,000); values
Gaussian with smaller per-channel scales.  Two encodings: bf16 (rounded to nearest even from
float32) and int8 codes with a float32 scale per (token, head) appended as extra planes (as
``bench_cache.py`` stores them).  White noise (the demo's PRNG pages) is the floor: ratio 1.0.

Each row exports every page of a pinned store through ``export_archive`` into memory (the
archive's reads, shuffle, zstd and digests) and imports it into a second pinned store through
``import_archive`` (bounded reads, decompression, digests, reserve/write/seal).  GB/s are of the
raw (uncompressed) page bytes, one thread, per second of the process's CPU time (robust on a
shared machine: it does not count time the process waited for a core) and, after them, per
second of wall time.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from typing import Any

import numpy as np

import hostkv_providers as hk
from hostkv_cli._archive import export_archive, import_archive, select_keys

LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 32, 8, 128, 16


def _kv_float(rng: np.random.Generator, tokens: int, pos0: int) -> tuple[np.ndarray[Any, Any], np.ndarray[Any, Any]]:
    """float32 K and V of shape [layers, heads, tokens, head_dim] with real-cache statistics."""
    shape = (LAYERS, HEADS, 1, HEAD_DIM)
    k_scale = rng.lognormal(0.0, 0.6, shape).astype(np.float32)
    outliers = rng.random(shape) < 0.03
    k_scale[outliers] *= 10.0
    k_mean = rng.normal(0.0, 0.5, shape).astype(np.float32) * k_scale
    k = rng.standard_normal((LAYERS, HEADS, tokens, HEAD_DIM), dtype=np.float32) * k_scale + k_mean
    # RoPE (rotate-half convention) at the tokens' positions
    half = HEAD_DIM // 2
    inv_freq = 500_000.0 ** (-np.arange(half, dtype=np.float32) / half)
    ang = np.arange(pos0, pos0 + tokens, dtype=np.float32)[:, None] * inv_freq[None, :]
    cos, sin = np.cos(ang), np.sin(ang)
    k1, k2 = k[..., :half].copy(), k[..., half:].copy()
    k[..., :half] = k1 * cos - k2 * sin
    k[..., half:] = k2 * cos + k1 * sin
    v_scale = rng.lognormal(-1.0, 0.4, shape).astype(np.float32)
    v = rng.standard_normal((LAYERS, HEADS, tokens, HEAD_DIM), dtype=np.float32) * v_scale
    return k, v


def _bf16(x: np.ndarray[Any, Any]) -> bytes:
    u = x.astype(np.float32).view(np.uint32)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16  # round to nearest even
    return bytes(rounded.astype(np.uint16).tobytes())


def _int8(x: np.ndarray[Any, Any]) -> tuple[bytes, bytes]:
    scale = np.maximum(np.abs(x).max(axis=-1, keepdims=True), 1e-8) / 127.0
    q = np.clip(np.rint(x / scale), -127, 127).astype(np.int8)
    return bytes(q.tobytes()), bytes(scale.astype(np.float32).tobytes())


def pages(encoding: str, total_bytes: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    out: list[bytes] = []
    pos = 0
    while sum(map(len, out)) < total_bytes:
        if encoding == "noise":
            out.append(rng.bytes(LAYERS * 2 * HEADS * PAGE_TOKENS * HEAD_DIM * 2))
            continue
        k, v = _kv_float(rng, PAGE_TOKENS, pos)
        pos += PAGE_TOKENS
        if encoding == "bf16":
            out.append(_bf16(k) + _bf16(v))
        else:
            (kq, ks), (vq, vs) = _int8(k), _int8(v)
            out.append(kq + vq + ks + vs)
    return out


def run(encoding: str, mib: int, level: int, shuffle: int) -> dict[str, Any]:
    data = pages(encoding, mib << 20)
    nbytes = len(data[0])
    budget = len(data) * nbytes + (64 << 20)
    url = f"pinned://?budget={budget}&block={nbytes}"
    with hk.open(url) as src, hk.open(url) as dst:
        parent = None
        keys = []
        for i, page in enumerate(data):
            key = hk.Key(i.to_bytes(4, "big") * 8)
            src.put(key, parent, page, salt_tag=encoding)
            keys.append(key)
            parent = key
        sel = select_keys(src, salt_tags=[encoding])
        buf = io.BytesIO()
        t0, c0 = time.perf_counter(), time.process_time()
        rep = export_archive(src, buf, sel, level=level, shuffle=shuffle)
        export_s, export_cpu = time.perf_counter() - t0, time.process_time() - c0
        archive = buf.getvalue()
        t0, c0 = time.perf_counter(), time.process_time()
        imp = import_archive(dst, io.BytesIO(archive))
        import_s, import_cpu = time.perf_counter() - t0, time.process_time() - c0
        assert imp["imported"] == len(keys)
        assert dst.read_bytes(keys[-1]) == data[-1]
    raw = len(data) * nbytes
    return {"encoding": encoding, "page_nbytes": nbytes, "pages": len(data), "raw_bytes": raw,
            "level": level, "shuffle": shuffle, "archive_bytes": rep["archive_bytes"],
            "ratio": raw / rep["archive_bytes"], "export_GBps": raw / export_s / 1e9,
            "import_GBps": raw / import_s / 1e9, "export_GBps_cpu": raw / export_cpu / 1e9,
            "import_GBps_cpu": raw / import_cpu / 1e9}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=128, help="raw KV bytes per row")
    ap.add_argument("--levels", default="1,3")
    ap.add_argument("--shuffles", default="1,2")
    ap.add_argument("--encodings", default="bf16,int8,noise")
    ap.add_argument("--json", action="store_true")
    a = ap.parse_args(argv)
    rows = []
    for enc in a.encodings.split(","):
        for level in map(int, a.levels.split(",")):
            for shuffle in map(int, a.shuffles.split(",")):
                if enc == "noise" and (shuffle != 1 or level != 1):
                    continue
                rows.append(run(enc, a.mib, level, shuffle))
                r = rows[-1]
                print(f"| {enc} | {r['page_nbytes']:,} | {level} | {shuffle} | {r['ratio']:.2f} | "
                      f"{r['export_GBps_cpu']:.2f} | {r['import_GBps_cpu']:.2f} | "
                      f"{r['export_GBps']:.2f} | {r['import_GBps']:.2f} |", flush=True)
    if a.json:
        json.dump(rows, sys.stdout, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
