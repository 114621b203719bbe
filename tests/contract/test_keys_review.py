"""Review mends of key derivation (reproduced, each failed before): token types out of int32
wrapped (7 and 7 + 2**32 shared a key); Salt(extra=) given a dict was read as key strings
(values dropped: different configurations shared a salt) and a set value's text followed the hash
seed (every restart missed); KVLayout(kinds=("kv")) became ("k", "v"); media spans, ragged arrays
and short inputs raised untyped errors or went unchecked.  No key of an accepted input changes
(tests/contract/test_keys.py's vectors)."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys

import numpy as np
import pytest

import hostkv_providers as hk

SALT = hk.Salt("m", hk.KVLayout(2, 4, 8, 4))
TOKENS = [1, 2, 3, 4]


@pytest.mark.parametrize("other", [2**32, 2**33, -(2**32)])
def test_distinct_token_types_never_share_a_key(other: int) -> None:
    plain = [7, 0, 0, 0]
    wide = [7 + other, 0, 0, 0]  # a different type id for token 0 ...
    try:
        k_wide = hk.chain_keys(SALT, TOKENS, token_types=wide)
    except hk.InvalidArgumentError:
        return  # refusing a type id that does not fit the encoding is fine
    # ... must not be keyed like [7, 0, 0, 0]
    assert k_wide != hk.chain_keys(SALT, TOKENS, token_types=plain)


def test_int64_array_beyond_int32_refused_like_uint_array() -> None:
    # the unsigned path is range-checked ...
    with pytest.raises(hk.InvalidArgumentError):
        hk.chain_keys(SALT, TOKENS, token_types=np.array([2**31, 0, 0, 0], dtype=np.uint64))
    # ... the signed one is not: 2**31 wraps to -2**31
    with pytest.raises(hk.InvalidArgumentError):
        hk.chain_keys(SALT, TOKENS, token_types=np.array([2**31, 0, 0, 0], dtype=np.int64))


L = hk.KVLayout(2, 4, 8, 4)


def test_extra_values_of_a_dict_separate_salts() -> None:
    try:
        a = hk.Salt("m", L, extra={"tp": "1"})
        b = hk.Salt("m", L, extra={"tp": "8"})
    except hk.InvalidArgumentError:
        return  # refusing a dict is fine
    assert a.digest != b.digest, f"extra={{'tp': ...}} became {a.extra!r}; values ignored"


@pytest.mark.parametrize("extra", [{"rope": "yarn"}, (("a", "b", "c"),), ("ab", "cd")])
def test_malformed_extra_raises_typed_error_or_is_kept(extra: object) -> None:
    try:
        s = hk.Salt("m", L, extra=extra)  # type: ignore[arg-type]
    except hk.InvalidArgumentError:
        return
    except Exception as e:
        pytest.fail(f"untyped {type(e).__name__}: {e}")
    # accepted: then it must not have been silently reinterpreted
    assert s.extra not in ((("a", "b"), ("c", "d")),), f"'ab','cd' read as pairs: {s.extra!r}"


CODE = (
    "import json, hostkv_providers as hk;"
    "s=hk.Salt('m', hk.KVLayout(2,4,8,4), extra=(('sink_layers', frozenset({'l0','l1','l2','l3','l4'})),));"
    "print(json.dumps(s.digest.hex()))"
)


def test_salt_with_set_extra_is_the_same_in_every_process() -> None:
    seen = set()
    for seed in ("0", "1", "2", "3"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        try:
            out = subprocess.run([sys.executable, "-c", CODE], env=env, capture_output=True, text=True, check=True)
        except subprocess.CalledProcessError as e:
            assert "InvalidArgumentError" in e.stderr  # refusing a non-scalar value is fine
            return
        seen.add(json.loads(out.stdout))
    assert len(seen) == 1, f"{len(seen)} different salts for one configuration: {sorted(seen)}"


def test_kinds_given_as_a_string_is_refused_or_kept_whole() -> None:
    try:
        lay = hk.KVLayout(61, 1, 576, 64, kinds=("kv"))
    except hk.InvalidArgumentError:
        return
    assert lay.kinds == ("kv",), f"kinds='kv' became {lay.kinds!r}"


SHA = hashlib.sha256(b"img").digest()


@pytest.mark.parametrize("start,end", [(1.5, 3.0), (0, 2**64), ("0", "3"), (0, None)])
def test_bad_media_span_is_a_typed_error(start: object, end: object) -> None:
    with pytest.raises(hk.InvalidArgumentError):
        item = hk.MediaItem(SHA, start, end)  # type: ignore[arg-type]
        hk.chain_keys(SALT, [1, 2, 3, 4], media=[item])


@pytest.mark.parametrize("kwargs", [
    {"tokens": [1, [2, 3], 3, 4]},
    {"tokens": [1, 2, 3, 4], "positions": [[0, 1, 2, 3], [0, 1]]},
    {"tokens": [1, 2, 3, 4], "token_types": [0, 0, [1], 0]},
])
def test_ragged_inputs_are_typed_errors(kwargs: dict[str, object]) -> None:
    with pytest.raises(hk.InvalidArgumentError):
        hk.chain_keys(SALT, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize("kwargs", [
    {"token_types": [0] * 99},             # wrong length
    {"positions": np.zeros((2, 5), int)},  # wrong shape
    {"token_types": [0.5, 0.5, 0.5]},      # not integers
])
def test_short_inputs_are_validated_like_long_ones(kwargs: dict[str, object]) -> None:
    # the same arguments with 4 tokens raise InvalidArgumentError; with 3 (no full page) they pass
    with pytest.raises(hk.InvalidArgumentError):
        hk.chain_keys(SALT, [1, 2, 3], **kwargs)  # type: ignore[arg-type]
