"""Helper process for the subprocess tests: ``python -m tests._child COMMAND URL [ARGS]``.

fill URL PAGES      store the conftest chains (page bytes derived from keys), print their keys
hold URL            open URL for writing, print "ready", keep it open until stdin closes
"""

from __future__ import annotations

import json
import sys

import hostkv_providers as hk


def main(argv: list[str]) -> int:
    cmd, url = argv[0], argv[1]
    if cmd == "fill":
        from .conftest import fill

        with hk.open(url) as p:
            f = fill(p, pages=int(argv[2]))
        print(json.dumps({name: [k.hex() for k in keys] for name, keys in f.chains.items()}))
        return 0
    if cmd == "hold":
        with hk.open(url):
            print("ready", flush=True)
            sys.stdin.read()  # until the parent closes our stdin (or kills us)
        return 0
    raise SystemExit(f"unknown command {cmd!r}")


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
