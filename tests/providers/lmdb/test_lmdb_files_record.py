"""A damaged record in the ``files`` database (a slot file's size/count/high-water mark):
verify(), verify(repair=True) and compact() raise struct.error instead of a typed error."""
from __future__ import annotations

from pathlib import Path

import pytest

from hostkv_providers._errors import HostKVError
from hostkv_providers.providers.lmdb._provider import LmdbProvider
from hostkv_providers.testing import chain, put_chain

PAGE = 8192


def _damaged(tmp_path: Path) -> LmdbProvider:
    p = LmdbProvider(str(tmp_path / "s"), budget_bytes=64 * PAGE, inline_max=0)
    put_chain(p, chain("c", 3), PAGE)
    s = p._s
    with s.env.begin(write=True) as txn:  # a truncated record, as a torn or damaged write leaves it
        (k, v), = list(txn.cursor(db=s.dbs["files"]))
        txn.put(bytes(k), bytes(v)[:10], db=s.dbs["files"])
    return p


@pytest.mark.parametrize("call", ["verify", "repair", "compact"])
def test_damaged_files_record_is_a_typed_error_or_a_finding(tmp_path: Path, call: str) -> None:
    p = _damaged(tmp_path)
    try:
        if call == "verify":
            report = p.verify()
            assert not report.ok
        elif call == "repair":
            p.verify(repair=True)
        else:
            p.compact()
    except HostKVError:
        pass  # a typed error is fine
    finally:
        p.close()
