"""``read_many`` into output buffers that overlap: lmdb reported a stored page as a miss (a copy
into the shared buffer failed the other page's check; the write-transaction confirmation kept
the entry) where every other batch provider refuses the call as misuse. Now the same typed
refusal, nothing dropped (fails before)."""

from __future__ import annotations

from pathlib import Path

import pytest

import hostkv_providers as hk
from hostkv_providers.testing import chain, page_bytes

PAGE = 4096


def test_overlapping_outputs_are_refused_and_nothing_is_dropped(tmp_path: Path) -> None:
    p = hk.open(f"lmdb://{tmp_path / 'l'}?budget=1MiB")
    try:
        ks = chain("alias", 3)
        assert p.put_many([(k, ks[i - 1] if i else None, page_bytes(k, PAGE)) for i, k in enumerate(ks)]) == [True] * 3
        buf = bytearray(PAGE)
        with pytest.raises(hk.InvalidArgumentError, match="overlap"):
            p.read_many(ks[1:], [buf, buf])
        assert p.stats().checksum_failures == 0
        outs = [bytearray(PAGE), bytearray(PAGE)]
        assert p.read_many(ks[1:], outs) == [True, True]
        assert outs == [page_bytes(k, PAGE) for k in ks[1:]]
    finally:
        p.close()
