"""A reservation used as a context manager whose block raised after its provider was closed:
the abort in its cleanup raised ClosedError and warned "abort during exception cleanup failed"
(seen in every CI log). The close let the reservation go already: no warning, the block's own
error propagates. Any other cleanup failure still warns."""

from __future__ import annotations

import warnings

import pytest

from hostkv_providers import PinnedProvider
from hostkv_providers.device import OrdinaryAllocator
from hostkv_providers.testing import key_of


def test_no_warning_when_the_provider_closed_under_the_block() -> None:
    p = PinnedProvider(16 * 4096, block=4096, allocator=OrdinaryAllocator())
    res = p.reserve(key_of("closed-under"), None, 4096)
    assert res is not None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with pytest.raises(ValueError, match="the block's own"), res:
            p.close()
            raise ValueError("the block's own error")
