"""Flip one byte of a demo page on the medium (a docs helper): python3 flip.py STORE_DIR DEPTH"""

import pathlib
import sys

import hostkv_providers as hk

from hostkv_cli._demo import DemoPlan
from hostkv_cli._synth import page_bytes

root, depth = pathlib.Path(sys.argv[1]), int(sys.argv[2])
plan = DemoPlan(url="", tokens=32768, fork_tokens=24576)
key = hk.chain_keys(plan.salt, plan.prompts()[0])[depth]
needle = page_bytes(key, plan.salt.page_nbytes)[:4096]  # the page's bytes are derived from its key
for f in sorted(root.glob("*.slots")) + sorted(root.glob("slots/*.slots")):
    data = bytearray(f.read_bytes())
    at = data.find(needle)
    if at >= 0:
        data[at + 1000] ^= 0xFF
        f.write_bytes(data)
        print(f"flipped byte {at + 1000} of {f.name}: page {key.hex()[:16]} at depth {depth}")
        break
else:
    sys.exit("page not found")
