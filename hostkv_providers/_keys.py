"""Content keys: a page's key certifies its whole token prefix under a salt.

``key[i] = BLAKE2b-256(key=salt; key[i-1] || payload[i])`` with ``key[-1]`` 32 zero bytes.
``payload[i]`` is a self-delimiting encoding of the page's token ids and, where the model has
them, token types, every positional axis and the SHA-256 of each media item overlapping the page.
The salt folds in everything that changes a page's bytes, so two configurations never share keys,
and one key match certifies the whole prefix.  Nothing here uses Python's ``hash()``: keys are the
same in every process and on every machine.
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, NewType, cast

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
    "MAX_TP_WORLD_SIZE",
    "MediaItem",
    "Salt",
    "SaltTag",
    "as_key",
    "chain_keys",
    "parse_salt_tag",
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

#: The largest tensor-parallel world a salt tag can name: a rank's tag is 8 hex characters of the
#: configuration plus ``r<rank>w<world>``, and tags are at most 16 bytes (the file store keeps
#: them in a fixed 16-byte field).
MAX_TP_WORLD_SIZE = 999

# A rank's tag: the configuration's 8 hex characters (shared by every rank), then the rank and
# the world size.  An unsharded tag is 16 hex characters, so the two forms never collide.
_RANK_TAG = re.compile(r"([0-9a-f]{8})r(0|[1-9][0-9]{0,2})w([1-9][0-9]{0,2})")
_PLAIN_TAG = re.compile(r"[0-9a-f]{16}")


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
        Anything else that changes the bytes (rope scaling, attention sinks ...): a mapping or
        ``(name, value)`` pairs, canonicalized to sorted ``(str, str)`` pairs (a set or mapping
        value is refused: its text is not the same in every process).
    format_version:
        The page/key format (:data:`FORMAT_VERSION`).
    tp_rank, tp_world_size:
        Tensor parallelism: this process's rank in ``[0, tp_world_size)`` and the number of
        ranks (at most :data:`MAX_TP_WORLD_SIZE`).  ``layout`` is the *whole* model's geometry;
        a rank stores only its slice of every layer's KV heads, described by
        :attr:`local_layout`.  Every rank has its own digest, so ranks never read each other's
        pages and one store holds every rank's pages side by side.
    state_format:
        For hybrid models: the format of the recurrent/conv state stored as anchors (e.g.
        ``"qwen3next-gdn/v1:bfloat16"``).  Folded into the digest only when set, and bound into
        every anchor record a hybrid :class:`~hostkv_providers.HostKVCache` writes, so a state
        of another format reads as a miss.
    kv_head_start, kv_head_count:
        The rank's slice of ``layout.num_kv_heads`` heads.  Left ``None`` (both), it is derived
        as engines shard heads: ``num_kv_heads / tp_world_size`` heads from
        ``rank * count`` when the heads divide evenly, or one replicated head
        (``rank * num_kv_heads // tp_world_size``) when the world is a multiple of the heads
        (GQA models on more ranks than KV heads).  Given explicitly, the slice must lie within
        ``layout.num_kv_heads``.  After construction both fields hold the resolved slice.

    The defaults (rank 0 of 1, every head) leave the digest, the keys and the tag exactly as
    they were before tensor parallelism was added: stored pages of unsharded configurations
    stay valid.  A sharded salt folds ``(rank, world, head slice)`` into its digest and gets the
    tag ``<8 hex of the configuration>r<rank>w<world>`` (e.g. ``5f3c9a1br1w2``), which
    :func:`parse_salt_tag` decodes; the 8 hex characters (:attr:`config_tag`) are the same for
    every rank of one configuration, so an operator can list or evict one rank or all of them.
    """

    model_id: str
    layout: KVLayout
    model_revision: str = ""
    quantization: str = "none"
    speculative: str = ""
    namespace: str = ""
    extra: tuple[tuple[str, str], ...] = ()
    format_version: int = FORMAT_VERSION
    tp_rank: int = 0
    tp_world_size: int = 1
    kv_head_start: int | None = None
    kv_head_count: int | None = None
    state_format: str = ""
    digest: bytes = field(init=False, repr=False, compare=False)
    config_digest: bytes = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        for name in ("model_id", "model_revision", "quantization", "speculative", "namespace", "state_format"):
            if not isinstance(getattr(self, name), str):
                raise InvalidArgumentError(f"Salt.{name} must be a str")
        if not self.model_id:
            raise InvalidArgumentError("Salt.model_id must not be empty")
        if not isinstance(self.layout, KVLayout):
            raise InvalidArgumentError("Salt.layout must be a KVLayout")
        if type(self.format_version) is not int or self.format_version < 1:
            raise InvalidArgumentError(f"Salt.format_version must be an int >= 1, got {self.format_version!r}")
        extra = _extra_pairs(self.extra)
        object.__setattr__(self, "extra", extra)
        start, count = self._resolve_heads()
        object.__setattr__(self, "kv_head_start", start)
        object.__setattr__(self, "kv_head_count", count)
        fields: list[list[Any]] = [
            ["format_version", self.format_version],
            ["key_algorithm", KEY_ALGORITHM],
            ["model_id", self.model_id],
            ["model_revision", self.model_revision],
            ["layout", sorted(self.layout.describe().items())],
            ["quantization", self.quantization],
            ["speculative", self.speculative],
            ["namespace", self.namespace],
            ["extra", [list(kv) for kv in extra]],
        ]
        if self.state_format:
            # Only a hybrid model's salt adds the field, so every other digest is unchanged.
            fields.append(["state_format", self.state_format])
        if self.sharded:
            # Only a sharded salt adds fields, so every unsharded digest is what it always was.
            # The configuration digest (shared by the ranks) knows the world, not the rank.
            config = [*fields, ["tensor_parallel", [["world_size", self.tp_world_size]]]]
            rank = [*fields, ["tensor_parallel", [["world_size", self.tp_world_size],
                                                   ["rank", self.tp_rank],
                                                   ["kv_head_start", start],
                                                   ["kv_head_count", count]]]]
            object.__setattr__(self, "digest", _salt_digest(rank))
            object.__setattr__(self, "config_digest", _salt_digest(config))
        else:
            digest = _salt_digest(fields)
            object.__setattr__(self, "digest", digest)
            object.__setattr__(self, "config_digest", digest)

    def _resolve_heads(self) -> tuple[int, int]:
        """Validate the tensor-parallel fields; return the rank's ``(kv_head_start, kv_head_count)``."""
        world, rank = self.tp_world_size, self.tp_rank
        if type(world) is not int or not 1 <= world <= MAX_TP_WORLD_SIZE:
            raise InvalidArgumentError(f"Salt.tp_world_size must be an int in [1, {MAX_TP_WORLD_SIZE}], got {world!r}")
        if type(rank) is not int or not 0 <= rank < world:
            raise InvalidArgumentError(f"Salt.tp_rank must be an int in [0, {world}), got {rank!r}",
                                       hint="the rank is this process's tensor-parallel rank, 0-based")
        heads = self.layout.num_kv_heads
        start, count = self.kv_head_start, self.kv_head_count
        if start is None and count is None:
            if heads % world == 0:
                count = heads // world
                return rank * count, count
            if world % heads == 0:
                return rank * heads // world, 1
            raise InvalidArgumentError(
                f"{heads} KV heads cannot be split evenly over {world} ranks",
                hint="pass kv_head_start= and kv_head_count= for this rank's slice")
        if type(start) is not int or type(count) is not int:
            raise InvalidArgumentError("Salt.kv_head_start and kv_head_count must both be ints (or both None)",
                                       hint="leave both None to derive the slice from the rank")
        if start < 0 or count < 1 or start + count > heads:
            raise InvalidArgumentError(
                f"KV head slice [{start}, {start + count}) is not within the layout's {heads} heads")
        return start, count

    @property
    def sharded(self) -> bool:
        """True when this salt names one rank's slice of the heads (not rank 0 of 1, every head)."""
        return self.tp_world_size != 1 or self.kv_head_count != self.layout.num_kv_heads

    @property
    def kv_heads(self) -> range:
        """The rank's KV heads (indices into the whole model's ``layout.num_kv_heads``)."""
        start, count = cast(int, self.kv_head_start), cast(int, self.kv_head_count)  # resolved in __post_init__
        return range(start, start + count)

    @property
    def local_layout(self) -> KVLayout:
        """The geometry of this rank's pages: ``layout`` with only the rank's KV heads.

        This is what a rank's :class:`~hostkv_providers.HostKVCache` packs and what its pages
        weigh; it is ``layout`` itself for an unsharded salt.
        """
        if self.kv_head_count == self.layout.num_kv_heads:
            return self.layout
        return dataclasses.replace(self.layout, num_kv_heads=len(self.kv_heads))

    def for_rank(self, rank: int) -> Salt:
        """The salt of another rank of this configuration (its derived head slice).

        Raises ``InvalidArgumentError`` for a salt built with an explicit head slice other than
        the derived one: the other ranks' slices are then the engine's to say.
        """
        derived = dataclasses.replace(self, kv_head_start=None, kv_head_count=None)
        if (derived.kv_head_start, derived.kv_head_count) != (self.kv_head_start, self.kv_head_count):
            raise InvalidArgumentError(
                "this salt has an explicit KV head slice; the other ranks' slices are not derivable",
                hint="build each rank's Salt with its own kv_head_start/kv_head_count")
        return dataclasses.replace(self, tp_rank=rank, kv_head_start=None, kv_head_count=None)

    def rank_salts(self) -> tuple[Salt, ...]:
        """Every rank's salt of this configuration, index = rank (``(self,)`` when unsharded)."""
        if not self.sharded:
            return (self,)
        return tuple(self if r == self.tp_rank else self.for_rank(r) for r in range(self.tp_world_size))

    @property
    def config_tag(self) -> str:
        """The part of :attr:`tag` shared by every rank of this configuration (the whole tag
        when unsharded)."""
        if not self.sharded:
            return self.tag
        return self.config_digest[:4].hex()

    @property
    def tag(self) -> str:
        """At most 16 characters identifying this configuration (and rank) in listings: 16 hex
        characters, or ``<config_tag>r<rank>w<world>`` for a sharded salt."""
        if not self.sharded:
            return self.digest[:8].hex()
        return f"{self.config_digest[:4].hex()}r{self.tp_rank}w{self.tp_world_size}"

    @property
    def page_tokens(self) -> int:
        return self.layout.page_tokens

    @property
    def page_nbytes(self) -> int:
        """Bytes of one of this rank's pages (:attr:`local_layout`)."""
        return self.local_layout.page_nbytes

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
            "tensor_parallel": {
                "rank": self.tp_rank,
                "world_size": self.tp_world_size,
                "kv_head_start": self.kv_head_start,
                "kv_head_count": self.kv_head_count,
                "config_tag": self.config_tag,
            },
        }


def _salt_digest(fields: list[list[Any]]) -> bytes:
    canonical = msgpack.packb(fields, use_bin_type=True)
    return hashlib.blake2b(canonical, digest_size=32, person=_SALT_PERSON).digest()


class SaltTag(NamedTuple):
    """A salt tag decoded by :func:`parse_salt_tag`."""

    #: The part shared by every rank of one configuration (:attr:`Salt.config_tag`).
    config: str
    #: The tensor-parallel rank (0 for an unsharded tag).
    tp_rank: int
    #: The tensor-parallel world size (1 for an unsharded tag).
    tp_world_size: int


def parse_salt_tag(tag: str) -> SaltTag | None:
    """Decode a tag written by :attr:`Salt.tag`; ``None`` for a tag in neither form (a caller's
    own label, or ``""``).

    ``"68253e4bcf414ee2"`` -> ``SaltTag("68253e4bcf414ee2", 0, 1)``;
    ``"5f3c9a1br1w2"`` -> ``SaltTag("5f3c9a1b", 1, 2)``.
    """
    if _PLAIN_TAG.fullmatch(tag):
        return SaltTag(tag, 0, 1)
    m = _RANK_TAG.fullmatch(tag)
    if m is None:
        return None
    rank, world = int(m.group(2)), int(m.group(3))
    if rank >= world:
        return None
    return SaltTag(m.group(1), rank, world)


def _extra_pairs(extra: object) -> tuple[tuple[str, str], ...]:
    """``Salt.extra`` as sorted ``(str, str)`` pairs: a mapping, or an iterable of pairs.

    A value whose ``str()`` is not the same in every process (a set's order follows the hash
    seed, a dict's its insertion order) is refused: the salt must name one configuration
    everywhere, or every restart misses the whole store."""
    items = extra.items() if isinstance(extra, Mapping) else extra
    if isinstance(items, (str, bytes)) or not isinstance(items, Iterable):
        raise InvalidArgumentError(f"Salt.extra must be a mapping or (name, value) pairs, got {extra!r}")
    out = []
    for item in items:
        if isinstance(item, (str, bytes)) or not isinstance(item, (tuple, list)) or len(item) != 2:
            raise InvalidArgumentError(f"Salt.extra: {item!r} is not a (name, value) pair")
        k, v = item
        if isinstance(v, (set, frozenset, Mapping)):
            raise InvalidArgumentError(f"Salt.extra[{k!r}]: a {type(v).__name__} has no canonical text",
                                       hint="pass a str (e.g. sorted and joined)")
        out.append((str(k), str(v)))
    return tuple(sorted(out))


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
        for name in ("start", "end"):  # (numpy ints too; packed as int64 into the page's key)
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not 0 <= int(v) < 2**63:
                raise InvalidArgumentError(f"MediaItem.{name} must be a token index (an int >= 0), got {v!r}")
            object.__setattr__(self, name, int(v))
        if not (0 <= self.start < self.end):
            raise InvalidArgumentError(f"MediaItem span [{self.start}, {self.end}) is empty or negative")


def _int_array(name: str, values: object, dtype: type[np.signedinteger[Any]]) -> npt.NDArray[Any]:
    try:
        arr = np.asarray(values)
    except (ValueError, TypeError) as exc:  # ragged rows
        raise InvalidArgumentError(f"{name} must be an array of integers: {exc}") from exc
    if arr.dtype.kind not in "iu" and not (arr.size == 0):
        raise InvalidArgumentError(f"{name} must be integers, got dtype {arr.dtype}")
    # Out of range values would wrap in the cast below: 7 and 7 + 2**32 token types would share
    # a key.  (In-range values cast exactly, so no key of an accepted input changes.)
    info = np.iinfo(dtype)
    if arr.size and (int(arr.max()) > info.max or int(arr.min()) < info.min):
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
    if type(start_token) is not int or start_token < 0:
        raise InvalidArgumentError(f"start_token must be an int >= 0, got {start_token!r}")
    if start_token % page:
        raise InvalidArgumentError(f"start_token {start_token} is not a multiple of page_tokens {page}")
    tok = _int_array("tokens", tokens, np.int64)
    if tok.ndim != 1:
        raise InvalidArgumentError(f"tokens must be 1-D, got shape {tok.shape}")
    n_pages = tok.shape[0] // page
    n = n_pages * page
    # (checked before the early return: the same arguments are refused with or without a full page)
    types = None
    if token_types is not None:
        types = _int_array("token_types", token_types, np.int32)
        if types.shape != tok.shape:
            raise InvalidArgumentError("token_types must have the same length as tokens")
    pos = None
    if positions is not None:
        pos = _int_array("positions", positions, np.int64)
        if pos.ndim == 1:
            pos = pos.reshape(1, -1)
        if pos.ndim != 2 or pos.shape[1] != tok.shape[0] or not 1 <= pos.shape[0] <= 255:
            raise InvalidArgumentError(
                f"positions must have shape (axes, {tok.shape[0]}) with 1..255 axes, got {pos.shape}"
            )
    if n_pages == 0:
        return []
    # Per-page payload rows, built vectorized: [tag 0x01][page int64 tokens][tag 0x02 ...]...
    parts: list[npt.NDArray[np.uint8]] = []
    parts.append(_tagged_rows(0x01, tok[:n].view(np.uint8).reshape(n_pages, page * 8)))
    if types is not None:
        parts.append(_tagged_rows(0x02, types[:n].view(np.uint8).reshape(n_pages, page * 4)))
    if pos is not None:
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
