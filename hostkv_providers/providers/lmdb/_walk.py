"""LMDB's B-trees walked end to end: what ``check_tree`` runs in a child process.

``verify`` runs it as a script, by its path (``python3 _walk.py STORE DB_NAME...``), so the fresh
interpreter imports ``lmdb`` alone and not this package: importing the package (numpy and the
rest) cost the child about a second per ``verify`` of an lmdb store.  Nothing here may import
from the package.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

import lmdb


def walk_tree(path: str, names: Sequence[str]) -> None:
    """Touch every page of the named databases' B-trees (every key, every value but the inline
    page bytes of ``pages``): what an assertion on a damaged page would kill, it kills here."""
    env = lmdb.open(path, subdir=True, readonly=True, lock=False, max_dbs=len(names) + 2, create=False)
    try:
        with env.begin() as txn:
            for name in names:
                db = env.open_db(name.encode(), txn=txn, create=False)
                with txn.cursor(db) as cur:
                    if name == "pages":
                        for _ in cur.iternext(keys=True, values=False):
                            pass
                    else:
                        for _ in cur.iternext(keys=True, values=True):
                            pass
    finally:
        env.close()


if __name__ == "__main__":  # pragma: no cover - runs in the child
    walk_tree(sys.argv[1], sys.argv[2:])
