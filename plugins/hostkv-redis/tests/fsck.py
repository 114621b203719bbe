"""An independent check of a store's server-side state (written without the provider's code).

It reads every key of a namespace with plain redis commands and recomputes what the Lua scripts
maintain incrementally: accounting, child counts, the LRU set of evictable leaves, the lease
counts, prefix closure, and every page's trailer and checksum.
"""

from __future__ import annotations

import struct
from typing import Any

import xxhash


def fsck(client: Any, namespace: str, *, quiescent: bool = True) -> list[str]:
    """Problems found in store ``namespace`` (empty when consistent).

    ``quiescent``: no client is mid-operation, so live reservations and leases are exactly what
    the flight/lease records say.
    """
    p = f"hkv:{{{namespace}}}:"
    problems: list[str] = []
    meta = {k.decode(): v.decode() for k, v in client.hgetall(p + "m").items()}
    if not meta:
        return ["no store metadata"]
    def hashes(pattern: str) -> dict[str, dict[str, str]]:
        names = list(client.scan_iter(match=p + pattern, count=1000))
        pipe = client.pipeline(transaction=False)
        for name in names:
            pipe.hgetall(name)
        rows = pipe.execute() if names else []
        return {n.decode()[len(p) + 2 :]: {k.decode(): v.decode() for k, v in r.items()}
                for n, r in zip(names, rows, strict=True)}

    entries = hashes("e:*")
    flights = hashes("f:*")
    lease_counts: dict[str, int] = {}
    for name in client.scan_iter(match=p + "l:*", count=1000):
        items = [x.decode() for x in client.lrange(name, 1, -1)]
        for i in range(0, len(items), 2):
            h, gen = items[i], items[i + 1]
            if h in entries and entries[h]["r"] == gen:
                lease_counts[h] = lease_counts.get(h, 0) + 1

    sealed = sum(int(e["c"]) for e in entries.values())
    in_flight = sum(int(f["c"]) for f in flights.values())
    if int(meta["entries"]) != len(entries):
        problems.append(f"meta entries {meta['entries']} != {len(entries)}")
    if int(meta["sealed"]) != sealed:
        problems.append(f"meta sealed {meta['sealed']} != {sealed}")
    if quiescent and int(meta["used"]) != sealed + in_flight:
        problems.append(f"meta used {meta['used']} != sealed {sealed} + in flight {in_flight}")
    if int(meta["used"]) > int(meta["budget"]):
        problems.append(f"used {meta['used']} > budget {meta['budget']}")
    if int(meta["anchors"]) != sum(int(e["na"]) for e in entries.values()):
        problems.append("meta anchors disagree with the entries")

    children: dict[str, set[str]] = {h: set() for h in entries}
    for h, e in entries.items():
        if e["p"]:
            if e["p"] not in entries:
                problems.append(f"{h[:12]} present without its parent {e['p'][:12]}")
            else:
                children[e["p"]].add(h)
    fchildren: dict[str, int] = {}
    for f in flights.values():
        if f["p"] and f["p"] in entries and entries[f["p"]]["r"] == f["pg"]:
            fchildren[f["p"]] = fchildren.get(f["p"], 0) + 1
    lru = {m.decode(): s for m, s in client.zrange(p + "lru", 0, -1, withscores=True)}
    order = list(entries)
    pipe = client.pipeline(transaction=False)
    for h in order:
        pipe.smembers(p + "c:" + h)
        pipe.hgetall(p + "a:" + h)
        pipe.get(p + "d:" + h)
        pipe.hlen(p + "x:" + h)
    fetched = pipe.execute() if order else []
    leased = 0
    for i, h in enumerate(order):
        e = entries[h]
        stored_children, anchors, value, pins = fetched[4 * i : 4 * i + 4]
        # pins of child groups in other shards (sharded stores): counted exactly, hold the entry
        if int(e.get("xc", "0")) != pins:
            problems.append(f"{h[:12]} xc {e.get('xc', '0')} != {pins} pins")
        if int(e["ch"]) != len(children[h]):
            problems.append(f"{h[:12]} ch {e['ch']} != {len(children[h])}")
        if {x.decode() for x in stored_children} != children[h]:
            problems.append(f"{h[:12]} child set disagrees")
        if quiescent and int(e["lc"]) != lease_counts.get(h, 0):
            problems.append(f"{h[:12]} lc {e['lc']} != {lease_counts.get(h, 0)}")
        if quiescent and int(e["fc"]) != fchildren.get(h, 0):
            problems.append(f"{h[:12]} fc {e['fc']} != {fchildren.get(h, 0)}")
        leased += int(e["lc"]) > 0
        evictable = (e["ch"] == "0" and e["lc"] == "0" and e["fc"] == "0" and e.get("xc", "0") == "0"
                     and e.get("rt") != "1")
        # the retain refcount: the mark plus the children with a count (child groups in other
        # shards add theirs on top: exact only without pins)
        ra = int(e.get("ra", "0"))
        want = (e.get("rt") == "1") + sum(int(entries[c].get("ra", "0")) > 0 for c in children[h])
        if ra != want and not (int(e.get("xc", "0")) and ra > want):
            problems.append(f"{h[:12]} ra {ra} != {want}")
        if evictable != (h in lru):
            problems.append(f"{h[:12]} evictable={evictable} but in LRU={h in lru}")
        if int(e["c"]) != int(e["n"]) + sum(len(v) for v in anchors.values()):
            problems.append(f"{h[:12]} cost {e['c']} != nbytes + anchors")
        if value is None:
            problems.append(f"{h[:12]} has no bytes")
            continue
        echo, digest, nbytes, magic = struct.unpack_from("<32sQQ8s", value, len(value) - 56)
        if (magic != b"HKVPAGE1" or echo.hex() != h or nbytes != int(e["n"])
                or xxhash.xxh3_64_intdigest(value[:-56]) != digest or str(digest) != e["k"]):
            problems.append(f"{h[:12]} bytes do not match their trailer/checksum")
    retained = sum(e.get("rt") == "1" for e in entries.values())
    if int(meta.get("retained", "0")) != retained:
        problems.append(f"meta retained {meta.get('retained', '0')} != {retained}")
    retained_bytes = sum(int(e["c"]) for e in entries.values() if int(e.get("ra", "0")) > 0)
    if int(meta.get("retained_bytes", "0")) != retained_bytes:
        problems.append(f"meta retained_bytes {meta.get('retained_bytes', '0')} != {retained_bytes}")
    if set(lru) - set(entries):
        problems.append(f"LRU holds {len(set(lru) - set(entries))} keys that are not entries")
    if quiescent and int(meta["leased"]) != leased:
        problems.append(f"meta leased {meta['leased']} != {leased}")
    for name in client.scan_iter(match=p + "d:*", count=1000):
        if name.decode()[len(p) + 2 :] not in entries:
            problems.append(f"orphan bytes {name.decode()[len(p) + 2:][:12]}")
    return problems
