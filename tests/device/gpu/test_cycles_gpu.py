"""Saves and restores through the CUDA copy engine leave no reference cycles (see
``tests/cache/test_no_cycles.py`` for why: cycles reach the oldest generation and set off full
collections of the engine's process, ~100 ms decode stalls).  Every engine mode, with the
engine's own ordering calls (``after=``, ``before=``, ``wait_layer_on``) and a verified restore."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest

import hostkv_providers as hk
from hostkv_providers.cache import HostKVCache
from hostkv_providers.device import cuda_available
from hostkv_providers.testing import cache_settled, cycles_left_by

torch = pytest.importorskip("torch")
if not cuda_available() or not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

pytestmark = pytest.mark.gpu

from ._pool import Pool, engine_for  # noqa: E402  (after the skips: it imports torch)

LAYOUT = hk.KVLayout(num_layers=8, num_kv_heads=8, head_dim=128, page_tokens=16, dtype="bfloat16")  # 512 KiB
PAGE = LAYOUT.page_nbytes
N = 40


@pytest.mark.parametrize("mode", ["batch", "never", "auto", "shared-split"])
@pytest.mark.parametrize("verify", ["never", "read"])
def test_saves_and_restores_leave_no_cycles(mode: str, verify: str) -> None:
    pool = Pool(LAYOUT, 4 * N)
    src, dst = list(range(N)), list(range(2 * N, 3 * N))
    pool.fill_random(src, seed=5)
    stream = torch.cuda.Stream()
    chains = iter(range(1, 10_000))
    with engine_for(mode) as engine, hk.open(f"pinned://?budget=256MiB&block={PAGE}&background=false"
                                             f"&verify={verify}") as provider:
        cache = HostKVCache(provider, hk.Salt("test/gpu-cycles", LAYOUT), engine)
        try:
            def new_chain() -> list[bytes]:
                return list(cache.keys(np.arange(N * LAYOUT.page_tokens) + 100_000 * next(chains)))

            stored = new_chain()
            assert cache.save(stored, pool.planes, src).wait().stored == N

            def save_new() -> None:
                h = cache.save(new_chain(), pool.planes, src, after=stream)
                h.wait_on(stream)
                assert h.wait().stored == N

            def save_stored() -> None:
                assert cache.save(stored, pool.planes, src).wait().dedup == N

            def restore(**kw: object) -> Callable[[], None]:
                def run() -> None:
                    hit = cache.lookup(stored)
                    assert hit.num_pages == N
                    h = cache.restore(hit, pool.planes, dst, release=True, **kw)
                    if kw.get("layerwise"):
                        h.wait_layer_on(0, stream)
                    else:
                        h.wait_on(stream)
                    assert h.wait().pages == N
                    stream.synchronize()
                return run

            cases = {"save": save_new, "save of a stored chain": save_stored, "restore": restore(),
                     "restore before a stream": restore(before=stream),
                     "layer-wise restore": restore(layerwise=True)}
            for op in cases.values():  # warm: threads, pools, staging and events made once
                op()
            found = {name: cycles_left_by(op, settle=lambda: cache_settled(cache)) for name, op in cases.items()}
            assert all(not g for g in found.values()), {k: v.most_common(8) for k, v in found.items() if v}
        finally:
            cache.close()
    assert int(pool.mismatches(dst, pool.gather(src))) == 0
