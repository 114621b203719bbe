"""Content keys: spec conformance, golden vectors, determinism across processes, validation."""

from __future__ import annotations

import hashlib
import json
import os
import struct
import subprocess
import sys

import numpy as np
import pytest

import hostkv_providers as hk

LAYOUT = hk.KVLayout(4, 2, 64, 16)
SALT = hk.Salt("golden/model", LAYOUT, model_revision="r1")

# Committed golden vectors: a change here is a format change (bump FORMAT_VERSION).
GOLDEN_SALT = "68253e4bcf414ee286375269661cb271a18715806739a990c223210b22d6a346"
GOLDEN_PLAIN = [
    "e9806fe5222f924d01bd0e1b39051a9b7f2453f4aac0fd0533691f2d821e3cdb",
    "3a8af2819b7de7eb41be5ac3c3118b4047b979e2fe16eebf32ff7baca6bc4963",
    "515152f77671b538e554e3c3cd7bf3b22bec01ed1ae2943f091785b367b1ded6",
    "e18553996e623bee4db67b743cdc2a3ee975785b8887e6976fce6ce27e23752e",
]
GOLDEN_RICH = [
    "3bc97733b9587c136e6fcaec7ddda443a807abf0087db33c4f7e97c71b9570eb",
    "d6e32910dbf73ca53179f3ace669fdb9550a2a3604cff22046166fa323ccc474",
    "1910bd81d6acbc0cedd52765000e74a38cb342df181b26eb4a9e982b607953fe",
]


def _rich_keys() -> list[hk.Key]:
    return hk.chain_keys(
        SALT,
        list(range(48)),
        token_types=[0] * 48,
        positions=np.stack([np.arange(48)] * 3),
        media=[hk.MediaItem(hashlib.sha256(b"img").digest(), 5, 20)],
    )


def _reference_keys(salt: hk.Salt, tokens: list[int]) -> list[bytes]:
    """The documented derivation, written out by hand (independent of the vectorized code)."""
    page = salt.layout.page_tokens
    prev = bytes(32)
    out = []
    for start in range(0, len(tokens) - page + 1, page):
        payload = b"\x01" + b"".join(struct.pack("<q", t) for t in tokens[start : start + page])
        prev = hashlib.blake2b(prev + payload, digest_size=32, key=salt.digest, person=b"hostkv-page").digest()
        out.append(prev)
    return out


def test_golden_vectors() -> None:
    assert SALT.digest.hex() == GOLDEN_SALT
    assert SALT.tag == GOLDEN_SALT[:16]
    assert [k.hex() for k in hk.chain_keys(SALT, list(range(64)))] == GOLDEN_PLAIN
    assert [k.hex() for k in _rich_keys()] == GOLDEN_RICH


def test_matches_reference_derivation() -> None:
    tokens = [int(t) for t in np.random.default_rng(7).integers(0, 150_000, 16 * 37 + 5)]
    assert hk.chain_keys(SALT, tokens) == _reference_keys(SALT, tokens)


def test_only_full_pages_and_prefix_property() -> None:
    tokens = list(range(100))
    keys = hk.chain_keys(SALT, tokens)
    assert len(keys) == 6
    assert hk.chain_keys(SALT, tokens[:64]) == keys[:4]
    assert hk.chain_keys(SALT, tokens[:15]) == []
    # a change in page 0 changes every later key (the key certifies the whole prefix)
    changed = hk.chain_keys(SALT, [1, *tokens[1:]])
    assert all(a != b for a, b in zip(keys, changed, strict=True))


def test_continuation_equals_full_chain() -> None:
    tokens = list(range(16 * 10))
    full = hk.chain_keys(SALT, tokens)
    tail = hk.chain_keys(SALT, tokens[64:], parent=full[3], start_token=64)
    assert full[4:] == tail
    with pytest.raises(hk.InvalidArgumentError):
        hk.chain_keys(SALT, tokens, start_token=3)


@pytest.mark.parametrize(
    "other",
    [
        hk.Salt("golden/model", LAYOUT, model_revision="r2"),
        hk.Salt("golden/model2", LAYOUT, model_revision="r1"),
        hk.Salt("golden/model", hk.KVLayout(4, 2, 64, 16, dtype="float16"), model_revision="r1"),
        hk.Salt("golden/model", hk.KVLayout(4, 2, 64, 16, dtype="int8", scale_dtype="float16"), model_revision="r1"),
        hk.Salt("golden/model", hk.KVLayout(4, 4, 64, 16), model_revision="r1"),
        hk.Salt("golden/model", LAYOUT, model_revision="r1", quantization="fp8"),
        hk.Salt("golden/model", LAYOUT, model_revision="r1", speculative="mtp1"),
        hk.Salt("golden/model", LAYOUT, model_revision="r1", namespace="tenant-b"),
        hk.Salt("golden/model", LAYOUT, model_revision="r1", format_version=hk.FORMAT_VERSION + 1),
        hk.Salt("golden/model", LAYOUT, model_revision="r1", extra=(("rope", "yarn"),)),
    ],
)
def test_every_salt_field_separates_keys(other: hk.Salt) -> None:
    assert other.digest != SALT.digest and other.tag != SALT.tag
    assert set(hk.chain_keys(other, list(range(64)))).isdisjoint(hk.chain_keys(SALT, list(range(64))))


def test_optional_axes_separate_keys() -> None:
    tokens = list(range(32))
    plain = hk.chain_keys(SALT, tokens)
    typed = hk.chain_keys(SALT, tokens, token_types=[1] * 32)
    pos1 = hk.chain_keys(SALT, tokens, positions=np.arange(32))
    pos3 = hk.chain_keys(SALT, tokens, positions=np.stack([np.arange(32)] * 3))
    pos3b = hk.chain_keys(SALT, tokens, positions=np.stack([np.arange(32), np.arange(32), np.arange(32) + 1]))
    img_a = hk.chain_keys(SALT, tokens, media=[hk.MediaItem(hashlib.sha256(b"a").digest(), 20, 24)])
    img_b = hk.chain_keys(SALT, tokens, media=[hk.MediaItem(hashlib.sha256(b"b").digest(), 20, 24)])
    firsts = {plain[0], typed[0], pos1[0], pos3[0], pos3b[0]}
    assert len(firsts) == 5
    # media only affects the pages it overlaps (page 1 = tokens 16..31), and all after
    assert img_a[0] == plain[0] and img_a[1] != plain[1] and img_a[1] != img_b[1]


def test_keys_deterministic_across_processes_and_hash_seeds() -> None:
    code = (
        "import json, hashlib, numpy as np, hostkv_providers as hk;"
        "s=hk.Salt('golden/model', hk.KVLayout(4,2,64,16), model_revision='r1');"
        "r=hk.chain_keys(s, list(range(48)), token_types=[0]*48, positions=np.stack([np.arange(48)]*3),"
        " media=[hk.MediaItem(hashlib.sha256(b'img').digest(), 5, 20)]);"
        "print(json.dumps([s.digest.hex()]+[k.hex() for k in r]))"
    )
    for seed in ("0", "1", "12345", "random"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        assert json.loads(out.stdout) == [GOLDEN_SALT, *GOLDEN_RICH]


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tokens": [[1, 2]] * 16}, "1-D"),
        ({"tokens": [0.5] * 16}, "integers"),
        ({"tokens": list(range(16)), "token_types": [0] * 3}, "same length"),
        ({"tokens": list(range(16)), "positions": np.zeros((2, 3), dtype=int)}, "shape"),
        ({"tokens": list(range(16)), "parent": b"short"}, "32 bytes"),
        ({"tokens": list(range(16)), "media": ["not media"]}, "MediaItem"),
    ],
)
def test_bad_inputs_raise_typed_errors(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(hk.InvalidArgumentError, match=match):
        hk.chain_keys(SALT, **kwargs)  # type: ignore[arg-type]


def test_salt_and_layout_validation() -> None:
    with pytest.raises(hk.InvalidArgumentError):
        hk.Salt("", LAYOUT)
    with pytest.raises(hk.InvalidArgumentError):
        hk.KVLayout(0, 2, 64, 16)
    with pytest.raises(hk.InvalidArgumentError):
        hk.KVLayout(1, 2, 64, 16, dtype="float13")
    with pytest.raises(hk.InvalidArgumentError):
        hk.MediaItem(b"x" * 31, 0, 1)
    with pytest.raises(hk.InvalidArgumentError):
        hk.MediaItem(b"x" * 32, 5, 5)


def test_layout_planes_cover_the_page_exactly() -> None:
    layout = hk.KVLayout(3, 2, 8, 4, dtype="int8", scale_dtype="float16")
    covered = 0
    for p in layout.planes:
        assert p.offset == covered
        covered += p.nbytes
    assert covered == layout.page_nbytes
    assert [p.kind for p in layout.planes[:4]] == ["k", "k_scale", "v", "v_scale"]
    llama = hk.KVLayout(32, 8, 128, 16)
    assert llama.page_nbytes == 2 * 1024 * 1024 and llama.plane_nbytes == 32 * 1024


def test_as_key() -> None:
    k = hk.as_key(bytearray(32))
    assert type(k) is bytes and k == bytes(32)
    with pytest.raises(hk.InvalidArgumentError):
        hk.as_key(b"x" * 33)
    with pytest.raises(hk.InvalidArgumentError):
        hk.as_key("x" * 32)


# --- tensor parallelism: every rank its own digest, a decodable tag, the defaults unchanged ---

TP_LAYOUT = hk.KVLayout(4, 8, 64, 16)


def test_unsharded_defaults_keep_digest_and_tag() -> None:
    explicit = hk.Salt("golden/model", LAYOUT, model_revision="r1", tp_rank=0, tp_world_size=1,
                       kv_head_start=0, kv_head_count=2)
    assert explicit == SALT and explicit.digest.hex() == GOLDEN_SALT and explicit.tag == GOLDEN_SALT[:16]
    assert not SALT.sharded and SALT.local_layout is LAYOUT and SALT.kv_heads == range(0, 2)
    assert SALT.config_tag == SALT.tag and SALT.config_digest == SALT.digest
    assert hk.providers.parse_salt_tag(SALT.tag) == (SALT.tag, 0, 1)
    assert SALT.describe()["tensor_parallel"] == {"rank": 0, "world_size": 1, "kv_head_start": 0,
                                                   "kv_head_count": 2, "config_tag": SALT.tag}


def test_ranks_have_disjoint_keys_and_their_head_slices() -> None:
    ranks = [hk.Salt("m", TP_LAYOUT, tp_rank=r, tp_world_size=4) for r in range(4)]
    whole = hk.Salt("m", TP_LAYOUT)
    assert [s.kv_heads for s in ranks] == [range(0, 2), range(2, 4), range(4, 6), range(6, 8)]
    assert all(s.local_layout == hk.KVLayout(4, 2, 64, 16) for s in ranks)
    assert all(s.page_nbytes == TP_LAYOUT.page_nbytes // 4 for s in ranks)
    digests = {s.digest for s in [*ranks, whole]}
    assert len(digests) == 5
    chains = [set(hk.chain_keys(s, list(range(64)))) for s in [*ranks, whole]]
    assert sum(len(c) for c in chains) == len(set().union(*chains)) == 20
    # one configuration tag for all ranks, one tag per rank, both decodable
    assert len({s.config_tag for s in ranks}) == 1 and ranks[0].config_tag != whole.config_tag[:8]
    for s in ranks:
        assert len(s.tag) <= 16 and s.tag == f"{s.config_tag}r{s.tp_rank}w4"
        assert hk.providers.parse_salt_tag(s.tag) == hk.providers.SaltTag(s.config_tag, s.tp_rank, 4)
    # the same rank of another world size is another configuration
    two = hk.Salt("m", TP_LAYOUT, tp_rank=0, tp_world_size=2)
    assert two.config_tag != ranks[0].config_tag and two.digest != ranks[0].digest
    assert two.kv_heads == range(0, 4)


def test_derived_and_explicit_slices_agree_and_replication() -> None:
    derived = hk.Salt("m", TP_LAYOUT, tp_rank=1, tp_world_size=2)
    explicit = hk.Salt("m", TP_LAYOUT, tp_rank=1, tp_world_size=2, kv_head_start=4, kv_head_count=4)
    assert derived == explicit and derived.digest == explicit.digest
    other = hk.Salt("m", TP_LAYOUT, tp_rank=1, tp_world_size=2, kv_head_start=3, kv_head_count=5)
    assert other.digest != derived.digest and other.local_layout.num_kv_heads == 5
    # more ranks than KV heads (GQA): each rank holds one replicated head, still its own pages
    gqa = [hk.Salt("m", hk.KVLayout(2, 2, 64, 16), tp_rank=r, tp_world_size=4) for r in range(4)]
    assert [s.kv_heads for s in gqa] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert len({s.digest for s in gqa}) == 4
    # one rank of one: a partial slice is sharded too
    part = hk.Salt("m", TP_LAYOUT, kv_head_start=0, kv_head_count=4)
    assert part.sharded and part.digest != hk.Salt("m", TP_LAYOUT).digest and part.tag.endswith("r0w1")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"tp_world_size": 0}, "tp_world_size"),
        ({"tp_world_size": 1000}, "tp_world_size"),
        ({"tp_world_size": True}, "tp_world_size"),
        ({"tp_world_size": 2, "tp_rank": 2}, "tp_rank"),
        ({"tp_world_size": 2, "tp_rank": -1}, "tp_rank"),
        ({"tp_world_size": 2, "tp_rank": 1.0}, "tp_rank"),
        ({"tp_world_size": 3}, "split evenly"),
        ({"tp_world_size": 2, "kv_head_start": 0}, "both"),
        ({"tp_world_size": 2, "kv_head_start": 6, "kv_head_count": 3}, "within"),
        ({"tp_world_size": 2, "kv_head_start": -1, "kv_head_count": 3}, "within"),
        ({"tp_world_size": 2, "kv_head_start": 0, "kv_head_count": 0}, "within"),
    ],
)
def test_tensor_parallel_validation(kwargs: dict[str, object], match: str) -> None:
    with pytest.raises(hk.InvalidArgumentError, match=match):
        hk.Salt("m", TP_LAYOUT, **kwargs)  # type: ignore[arg-type]


def test_parse_salt_tag_rejects_other_labels() -> None:
    parse = hk.providers.parse_salt_tag
    for tag in ("", "mine", "5f3c9a1br2w2", "5f3c9a1br01w2", "5f3c9a1bR1w2", "5F3C9A1BR1W2", "68253e4bcf414ee"):
        assert parse(tag) is None
    assert parse("5f3c9a1br998w999") == ("5f3c9a1b", 998, 999)
    big = hk.Salt("m", hk.KVLayout(1, 1, 8, 4), tp_rank=998, tp_world_size=999)
    assert len(big.tag.encode()) == 16 and parse(big.tag) == (big.config_tag, 998, 999)
