"""Review mend (reproduced, failed before): paged_planes and HFCacheMap shaped scale planes per
token whatever the layout's scale_group / scale_block_tokens said."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hostkv_providers import InvalidArgumentError, KVLayout  # noqa: E402
from hostkv_providers.cache._kvmap import HFCacheMap, paged_planes  # noqa: E402
from hostkv_providers.device._copy import KVPlanes  # noqa: E402

# one scale per 4 of head_dim's 8 elements: scale plane [4 tokens, 2 heads, 2 groups]
GROUPED = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, page_tokens=4, dtype="int8",
                   scale_dtype="float32", scale_group=4)
# ... and per 2 tokens: [2, 2, 2] -- same byte count as per-token [4, 2]
SAME_BYTES = KVLayout(num_layers=1, num_kv_heads=2, head_dim=8, page_tokens=4, dtype="int8",
                      scale_dtype="float32", scale_group=4, scale_block_tokens=2)


def test_paged_planes_takes_scales_of_the_layouts_shape() -> None:
    codes = [torch.zeros(5, 4, 2, 8, dtype=torch.int8)]
    scales = [torch.zeros(5, *GROUPED.scale_shape)]  # [5, 4, 2, 2]: what the layout documents
    planes = paged_planes(GROUPED, codes, codes, key_scales=scales, value_scales=scales)
    KVPlanes.from_torch(GROUPED, planes)


def test_paged_planes_refuses_per_token_scales_for_a_grouped_layout() -> None:
    """[blocks, 4, 2] per-token scales happen to have the grouped plane's byte count: accepted
    and stored under a salt that says [2, 2, 2] group scales."""
    codes = [torch.zeros(5, 4, 2, 8, dtype=torch.int8)]
    per_token = [torch.zeros(5, 4, 2)]
    with pytest.raises(InvalidArgumentError):
        KVPlanes.from_torch(SAME_BYTES, paged_planes(SAME_BYTES, codes, codes, key_scales=per_token,
                                                     value_scales=per_token))


@pytest.mark.parametrize("layout", [GROUPED, SAME_BYTES], ids=["grouped", "same-bytes"])
def test_hf_cache_map_planes_match_the_layout(layout: KVLayout) -> None:
    """HFCacheMap accepts the layout, but pack()/empty_planes() build per-token scale planes:
    GROUPED -> KVPlanes.from_torch refuses them; SAME_BYTES -> accepted with the wrong meaning."""
    try:
        m = HFCacheMap(layout)
    except InvalidArgumentError:
        return  # refusing an unsupported layout is fine
    cache = [(torch.randn(1, 2, 8, 8), torch.randn(1, 2, 8, 8))]
    for planes in (m.pack(cache), m.empty_planes(2)):
        for spec, p in zip(layout.planes, planes, strict=True):
            want = layout.scale_shape if spec.is_scale else (4, 2, 8)
            assert tuple(p.shape[1:]) == want, f"{spec.kind}: {tuple(p.shape[1:])} vs layout {want}"
