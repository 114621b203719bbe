"""Content keys: a page's key certifies its whole token prefix under a salt.

``key[i] = BLAKE2b-256(key=salt; key[i-1] || payload[i])`` with ``key[-1]`` 32 zero bytes.
``payload[i]`` is a self-delimiting encoding of the page's token ids and, where the model has
them, token types, every positional axis and the SHA-256 of each media item overlapping the page.
The salt folds in everything that changes a page's bytes, so two configurations never share keys,
and one key match certifies the whole prefix.  Nothing here uses Python's ``hash()``: keys are the
same in every process and on every machine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NewType

import msgpack
import numpy as np
import numpy.typing as npt

from hostkv_providers._errors import InvalidArgumentError
from hostkv_providers._layout import KVLayout

__all__ = [
    "FORMAT_VERSION",
    "KEY_ALGORITHM",
    "KEY_NBYTES",
    "ZERO_KEY",
    "Key",
    "MediaItem",
    "Salt",
    "as_key",
    "chain_keys",
]

#: Bumped whenever the page packing, key derivation or a store format changes incompatibly.
FORMAT_VERSION = 1
#: Recorded in every persistent store's manifest (identity check on open).
KEY_ALGORITHM = "blake2b-256-keyed/payload-v1"
KEY_NBYTES = 32

Key = NewType("Key", bytes)
"""32 bytes naming a page by its content and its whole prefix."""

#: ``key[-1]``: the virtual parent of a chain's first page.
ZERO_KEY = Key(bytes(KEY_NBYTES))

_PAGE_PERSON = b"hostkv-page"
_SALT_PERSON = b"hostkv-salt"


def as_key(value: object, what: str = "key") -> Key:
    """Validate ``value`` as a key (32 bytes) and return it typed; raise ``InvalidArgumentError``."""
    if type(value) is bytes and len(value) == KEY_NBYTES:
        return Key(value)
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        if len(raw) == KEY_NBYTES:
            return Key(raw)
        raise InvalidArgumentError(
            f"{what} must be {KEY_NBYTES} bytes, got {len(raw)}",
            hint="compute keys with Salt/chain_keys; never truncate them",
        )
    raise InvalidArgumentError(f"{what} must be bytes, got {type(value).__name__}")


@dataclass(frozen=True)
class Salt:
    """Everything that changes the bytes of a page, hashed into 32 bytes.

    Two salts are equal exactly when every field is equal.  ``tag`` is a short, stable label
    recorded with every stored entry so operators can list and evict one configuration's pages.

    Parameters
    ----------
    model_id, model_revision:
        The weights: a hub id or path, and a revision/commit/checksum of the weights.
    layout:
        The KV page geometry and packing.
    quantization:
        How KV codes are quantized (``"none"``, ``"int8-per-token-head"``, ``"fp8-e4m3"`` ...).
    speculative:
        The speculative-decoding configuration (drafter/MTP), ``""`` if none.
    namespace:
        A user namespace (tenant isolation, experiment name).
    extra:
        Anything else that changes the bytes (rope scaling, attention sinks ...), canonicalized.
    """

    model_id: str
    layout: KVLayout
    model_revision: str = ""
    quantization: str = "none"
    speculative: str = ""
    namespace: str = ""
    extra: tuple[tuple[str, str], ...] = ()
    format_version: int = FORMAT_VERSION
    digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model_id", "model_revision", "quantization", "speculative", "namespace"):
            if not isinstance(getattr(self, name), str):
                raise InvalidArgumentError(f"Salt.{name} must be a str")
        if not self.model_id:
            raise InvalidArgumentError("Salt.model_id must not be empty")
        if not isinstance(self.layout, KVLayout):
            raise InvalidArgumentError("Salt.layout must be a KVLayout")
        extra = tuple(sorted((str(k), str(v)) for k, v in self.extra))
        object.__setattr__(self, "extra", extra)
        canonical = msgpack.packb(
            [
                ["format_version", self.format_version],
                ["key_algorithm", KEY_ALGORITHM],
                ["model_id", self.model_id],
                ["model_revision", self.model_revision],
                ["layout", sorted(self.layout.describe().items())],
                ["quantization", self.quantization],
                ["speculative", self.speculative],
                ["namespace", self.namespace],
                ["extra", [list(kv) for kv in extra]],
            ],
            use_bin_type=True,
        )
        digest = hashlib.blake2b(canonical, digest_size=32, person=_SALT_PERSON).digest()
        object.__setattr__(self, "digest", digest)

    @property
    def tag(self) -> str:
        """16 hex characters identifying this configuration in listings."""
        return self.digest[:8].hex()

    @property
    def page_tokens(self) -> int:
        return self.layout.page_tokens

    @property
    def page_nbytes(self) -> int:
        return self.layout.page_nbytes

    def describe(self) -> dict[str, Any]:
        """Human-readable fields (what ``hostkv info`` shows next to the tag)."""
        return {
            "tag": self.tag,
            "model_id": self.model_id,
            "model_revision": self.model_revision,
            "quantization": self.quantization,
            "speculative": self.speculative,
            "namespace": self.namespace,
            "format_version": self.format_version,
            "layout": self.layout.describe(),
        }


@dataclass(frozen=True, slots=True)
class MediaItem:
    """A media input (image, audio clip) occupying token positions ``[start, end)``.

    ``sha256`` is the digest of the item's canonical bytes; every page that overlaps the item's
    tokens folds it into its key, so a different image behind the same placeholder tokens never
    hits.
    """

    sha256: bytes
    start: int
    end: int

    def __post_init__(self) -> None:
        if not isinstance(self.sha256, bytes) or len(self.sha256) != 32:
            raise InvalidArgumentError("MediaItem.sha256 must be 32 bytes")
        if not (0 <= self.start < self.end):
            raise InvalidArgumentError(f"MediaItem span [{self.start}, {self.end}) is empty or negative")


def _int_array(name: str, values: object, dtype: type[np.signedinteger[Any]]) -> npt.NDArray[Any]:
    arr = np.asarray(values)
    if arr.dtype.kind not in "iu" and not (arr.size == 0):
        raise InvalidArgumentError(f"{name} must be integers, got dtype {arr.dtype}")
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(dtype).max:
        raise InvalidArgumentError(f"{name} has values beyond {np.dtype(dtype).name}")
    return np.ascontiguousarray(arr, dtype=np.dtype(dtype).newbyteorder("<"))


def chain_keys(
    salt: Salt,
    tokens: Sequence[int] | npt.NDArray[Any],
    *,
    token_types: Sequence[int] | npt.NDArray[Any] | None = None,
    positions: Sequence[Sequence[int]] | npt.NDArray[Any] | None = None,
    media: Sequence[MediaItem] = (),
    parent: bytes = ZERO_KEY,
    start_token: int = 0,
) -> list[Key]:
    """Key every *full* page of ``tokens``, root first.

    Parameters
    ----------
    salt:
        The configuration; its ``layout.page_tokens`` sets the page size.
    tokens:
        Token ids (1-D ints).  A trailing partial page is not keyed.
    token_types:
        Optional per-token type ids (same length as ``tokens``).
    positions:
        Optional positional ids, shape ``(axes, len(tokens))`` (e.g. 3 MRoPE axes) or
        ``(len(tokens),)`` for one axis.
    media:
        Media items; positions are absolute token indices (``start_token`` included).
    parent, start_token:
        Continue an existing chain: ``parent`` is the key of the page ending at ``start_token``
        and ``tokens`` start there.  ``start_token`` must be a multiple of ``page_tokens``.

    Returns
    -------
    list of Key
        ``len(tokens) // page_tokens`` keys.
    """
    page = salt.layout.page_tokens
    prev = bytes(as_key(parent, "parent"))
    if start_token % page:
        raise InvalidArgumentError(f"start_token {start_token} is not a multiple of page_tokens {page}")
    tok = _int_array("tokens", tokens, np.int64)
    if tok.ndim != 1:
        raise InvalidArgumentError(f"tokens must be 1-D, got shape {tok.shape}")
    n_pages = tok.shape[0] // page
    n = n_pages * page
    if n_pages == 0:
        return []
    # Per-page payload rows, built vectorized: [tag 0x01][page int64 tokens][tag 0x02 ...]...
    parts: list[npt.NDArray[np.uint8]] = []
    parts.append(_tagged_rows(0x01, tok[:n].view(np.uint8).reshape(n_pages, page * 8)))
    if token_types is not None:
        types = _int_array("token_types", token_types, np.int32)
        if types.shape != tok.shape:
            raise InvalidArgumentError("token_types must have the same length as tokens")
        parts.append(_tagged_rows(0x02, types[:n].view(np.uint8).reshape(n_pages, page * 4)))
    if positions is not None:
        pos = _int_array("positions", positions, np.int64)
        if pos.ndim == 1:
            pos = pos.reshape(1, -1)
        if pos.ndim != 2 or pos.shape[1] != tok.shape[0] or not 1 <= pos.shape[0] <= 255:
            raise InvalidArgumentError(
                f"positions must have shape (axes, {tok.shape[0]}) with 1..255 axes, got {pos.shape}"
            )
        axes = pos.shape[0]
        # page-major: for each page, axis 0's positions, then axis 1's ...
        per_page = np.ascontiguousarray(pos[:, :n].reshape(axes, n_pages, page).transpose(1, 0, 2))
        rows = per_page.view(np.uint8).reshape(n_pages, axes * page * 8)
        header = np.full((n_pages, 1), axes, dtype=np.uint8)
        parts.append(_tagged_rows(0x03, np.concatenate([header, rows], axis=1)))
    payload = np.ascontiguousarray(np.concatenate(parts, axis=1)) if len(parts) > 1 else parts[0]
    media_rows = _media_rows(media, n_pages, page, start_token)
    row_bytes = payload.shape[1]
    flat = memoryview(payload.reshape(-1).tobytes())
    base = hashlib.blake2b(digest_size=32, key=salt.digest, person=_PAGE_PERSON)
    keys: list[Key] = []
    append = keys.append
    for i in range(n_pages):
        h = base.copy()
        h.update(prev)
        h.update(flat[i * row_bytes : (i + 1) * row_bytes])
        extra = media_rows.get(i)
        if extra is not None:
            h.update(extra)
        prev = h.digest()
        append(Key(prev))
    return keys


def _tagged_rows(tag: int, rows: npt.NDArray[np.uint8]) -> npt.NDArray[np.uint8]:
    col = np.full((rows.shape[0], 1), tag, dtype=np.uint8)
    return np.concatenate([col, rows], axis=1)


def _media_rows(media: Sequence[MediaItem], n_pages: int, page: int, start_token: int) -> dict[int, bytes]:
    per_page: dict[int, list[MediaItem]] = {}
    for item in media:
        if not isinstance(item, MediaItem):
            raise InvalidArgumentError("media must be MediaItem instances")
        first = max((item.start - start_token) // page, 0)
        last = min((item.end - 1 - start_token) // page, n_pages - 1)
        for p in range(first, last + 1):
            per_page.setdefault(p, []).append(item)
    out: dict[int, bytes] = {}
    for p, items in per_page.items():
        items.sort(key=lambda m: (m.start, m.end, m.sha256))
        chunks = [b"\x04", struct.pack("<I", len(items))]
        for m in items:
            chunks.append(m.sha256)
            chunks.append(struct.pack("<qq", m.start, m.end))
        out[p] = b"".join(chunks)
    return out
