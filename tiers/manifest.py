"""The manifest: one step's global index, versioned JSON, never pickled.

A manifest says, for one ``(job, step)``: the world size, every rank's shard
(size in bytes and checksum), and what each rank saved in its shard.

Version 2 (written now) keeps the manifest small and independent of the
model's size: each shard row names the rank's *layout* (its tensor chunks,
stored once under ``<job>/layouts/<digest>.layout``: see :mod:`tiers.layout`)
by digest and carries the rank's small JSON values inline, and the manifest
carries a checksum of its own canonical bytes (``checksum``, last field), so a
byte edited anywhere in it is refused, even one that keeps it parseable.
Version 1 (still read) holds every entry inline; one written before manifests
were sealed has no checksum of its own, and is then held to the version-1
fields. A checksum, where present, is verified whatever version the bytes
claim, so a sealed manifest edited to say version 1 is refused too.

Besides the checksum, parsing refuses what no writer produces: chunks outside
their tensor or their shard, overlapping or misaligned byte ranges (an offset
that is not a multiple of the element size), sizes that disagree with shapes
and dtypes, and values no real checkpoint has (a tensor or shard over
:data:`MAX_BYTES`, non-finite times, malformed checksums).

The entries a rank saved:

* a tensor chunk: ``name``, ``dtype`` (torch dtype name without ``torch.``,
  or ``bytes`` for a ``bytes`` value kept raw in the shard, one-dimensional),
  ``global_shape`` (the whole tensor), ``offsets`` and ``shape`` (this chunk's
  place in it; a replicated tensor has zero offsets and ``shape ==
  global_shape``), ``offset`` and ``nbytes`` (byte range inside the shard);
* a small JSON value (a data loader position, a step counter): ``name`` and
  ``value`` (a tuple written as ``{"tuple": [...]}``, see :func:`encode_value`);

and which node's agent took each shard from its trainer (``node``, the
primary copy; 0 on a single node).

It also carries user metadata and the library version that wrote it. It is
written last in every tier, so its presence commits the step. Parsing is
strict: anything unexpected raises :class:`ManifestError`, so a corrupt or
hostile manifest is refused rather than half-used.
"""

from __future__ import annotations

import collections
import functools
import math
import re
import threading
import time
from dataclasses import dataclass, field
from typing import Any

import xxhash

from . import _sealed
from .errors import InvalidNameError, ManifestError
from .keys import DIGEST_RE, check_digest, check_job, check_step

__all__ = [
    "MANIFEST_FORMAT",
    "MANIFEST_VERSION",
    "DTYPE_SIZES",
    "BYTES_DTYPE",
    "encode_value",
    "VALUES_NAME",
    "SPILL_BYTES",
    "parse_spilled",
    "decode_value",
    "TensorChunk",
    "JsonEntry",
    "ShardInfo",
    "encode_group",
    "decode_group",
    "Manifest",
    "ManifestCache",
    "validate_layout",
    "durable_view",
]

MANIFEST_FORMAT = "tierckpt-manifest"
MANIFEST_VERSION = 2
MAX_MANIFEST_BYTES = 256 * 1024 * 1024
#: bounds past which a value is not a real checkpoint's but damage: bytes of one tensor or shard (1 PiB),
#: dimensions of a tensor, ranks of a job, nodes of a job
MAX_BYTES = 1 << 50
MAX_NDIM = 64
MAX_WORLD = 1 << 24
MAX_NODES = 1 << 24
#: a shard checksum as :mod:`tiers.checksum` spells it
_CHECKSUM_RE = re.compile(r"xxh3_64:[0-9a-f]{16}\Z")
#: the top-level fields of a version-1 manifest (it carries no checksum of its own, so nothing else is taken)
_V1_FIELDS = frozenset({"format", "version", "library", "job", "step", "world", "created", "metadata", "shards",
                        "checksum"})

#: the dtype name of a chunk that holds a ``bytes`` value, not a tensor
BYTES_DTYPE = "bytes"

#: bytes per element of every dtype a shard may hold
DTYPE_SIZES: dict[str, int] = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2,
    "complex128": 16, "complex64": 8, "complex32": 4,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1,
    "uint16": 2, "uint32": 4, "uint64": 8, "bool": 1,
    "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e4m3fnuz": 1, "float8_e5m2fnuz": 1,
    # not a torch dtype: a ``bytes`` value the state held, kept raw in the shard (one-dimensional)
    BYTES_DTYPE: 1,
}


def _need(obj: dict, name: str, kind: type | tuple[type, ...], where: str) -> Any:
    if not isinstance(obj, dict) or name not in obj:
        raise ManifestError(f"malformed manifest: {where} has no field {name!r}")
    value = obj[name]
    if isinstance(value, bool) and kind is not bool and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ManifestError(f"malformed manifest: {where}.{name} must be {kind}, not bool")
    if not isinstance(value, kind):
        raise ManifestError(f"malformed manifest: {where}.{name} must be {kind}, got {type(value).__name__}")
    return value


def _int_list(obj: dict, name: str, where: str) -> tuple[int, ...]:
    value = _need(obj, name, list, where)
    if not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in value):
        raise ManifestError(f"malformed manifest: {where}.{name} must be a list of ints >= 0")
    return tuple(value)


@dataclass(frozen=True)
class TensorChunk:
    """One rank's piece of one tensor, and where its bytes are in the shard."""

    name: str
    dtype: str
    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_json(self) -> dict:
        return {
            "kind": "tensor", "name": self.name, "dtype": self.dtype,
            "global_shape": list(self.global_shape), "offsets": list(self.offsets),
            "shape": list(self.shape), "offset": self.offset, "nbytes": self.nbytes,
        }

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "TensorChunk":
        chunk = cls(
            name=_need(obj, "name", str, where),
            dtype=_need(obj, "dtype", str, where),
            global_shape=_int_list(obj, "global_shape", where),
            offsets=_int_list(obj, "offsets", where),
            shape=_int_list(obj, "shape", where),
            offset=_need(obj, "offset", int, where),
            nbytes=_need(obj, "nbytes", int, where),
        )
        chunk.check(where)
        return chunk

    def check(self, where: str) -> None:
        """Raise ManifestError unless the chunk is possible: a known dtype, shapes of one rank that fit in
        each other, a byte range of the size shape and dtype give, aligned to the element size, and no
        value past what a real tensor could have (:data:`MAX_BYTES`, :data:`MAX_NDIM`)."""
        if not self.name:
            raise ManifestError(f"malformed manifest: {where} has an empty name")
        if self.dtype not in DTYPE_SIZES:
            raise ManifestError(f"malformed manifest: {where} has unknown dtype {self.dtype!r}")
        if self.dtype == BYTES_DTYPE and not (len(self.shape) == 1 and self.shape == self.global_shape
                                              and self.offsets == (0,)):
            raise ManifestError(f"malformed manifest: {where} is a bytes value with a shape or offsets: damaged")
        if not (len(self.global_shape) == len(self.offsets) == len(self.shape)):
            raise ManifestError(f"malformed manifest: {where} shape, offsets and global_shape differ in rank")
        if len(self.global_shape) > MAX_NDIM:
            raise ManifestError(f"malformed manifest: {where} has {len(self.global_shape)} dimensions "
                                f"(at most {MAX_NDIM})")
        item = DTYPE_SIZES[self.dtype]
        if math.prod(self.global_shape) * item > MAX_BYTES or any(g > MAX_BYTES for g in self.global_shape):
            raise ManifestError(f"malformed manifest: {where} names a tensor of {list(self.global_shape)} "
                                f"{self.dtype}, over {MAX_BYTES} bytes: damaged")
        for o, s, g in zip(self.offsets, self.shape, self.global_shape):
            if o + s > g:
                raise ManifestError(f"malformed manifest: {where} chunk lies outside its tensor")
        if isinstance(self.offset, bool) or isinstance(self.nbytes, bool) or self.offset < 0 \
                or self.offset > MAX_BYTES or self.nbytes != math.prod(self.shape) * item:
            raise ManifestError(f"malformed manifest: {where} byte range does not match shape and dtype")
        if self.nbytes and self.offset % item:
            raise ManifestError(f"malformed manifest: {where} byte offset {self.offset} is not a multiple of the "
                                f"{item}-byte {self.dtype} element: damaged")


@dataclass(frozen=True)
class JsonEntry:
    """A small JSON-able value one rank saved (kept in the manifest, not the shard)."""

    name: str
    value: Any

    def to_json(self) -> dict:
        return {"kind": "json", "name": self.name, "value": self.value}

    @classmethod
    def from_json(cls, obj: dict, where: str) -> "JsonEntry":
        if "value" not in obj:
            raise ManifestError(f"malformed manifest: {where} has no field 'value'")
        return cls(name=_need(obj, "name", str, where), value=obj["value"])


Entry = TensorChunk | JsonEntry


def encode_value(v: Any) -> Any:
    """A JSON value for the manifest: tuples become ``{"tuple": [...]}`` (a value that is a dict is otherwise
    only ever ``{}``), so they come back as tuples."""
    if isinstance(v, tuple):
        return {"tuple": [encode_value(x) for x in v]}
    if isinstance(v, list):
        return [encode_value(x) for x in v]
    return v


def decode_value(v: Any) -> Any:
    """The value :func:`encode_value` encoded."""
    if isinstance(v, dict) and len(v) == 1 and isinstance(v.get("tuple"), list):
        return tuple(decode_value(x) for x in v["tuple"])
    if isinstance(v, list):
        return [decode_value(x) for x in v]
    return v


#: the name of the bytes chunk that holds a rank's JSON values when they are too many for the manifest (no
#: leaf name can be it: a ``~`` in a saved name is always escaped)
VALUES_NAME = "~values"
#: a rank's JSON values above this many bytes go into its shard (:data:`VALUES_NAME`), not the manifest,
#: so the manifest every node receives stays small whatever the state holds (an optimizer container that
#: saves each parameter's hyperparameters as values has thousands)
SPILL_BYTES = 4096


def parse_spilled(data: bytes | memoryview, where: str = "values") -> list[JsonEntry]:
    """The JSON values a :data:`VALUES_NAME` chunk holds (``[[name, value], ...]``, distinct names; the JSON
    may be followed by spaces: room the writer left for the values to grow into).

    Raises ManifestError when the bytes are not that.
    """
    import json

    try:
        rows = json.loads(bytes(data).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise ManifestError(f"malformed {where}: not JSON ({e}): damaged") from None
    return _values(rows, where)


def validate_layout(entries: list[dict], size: int | None = None, where: str = "layout") -> list[Entry]:
    """Parse one rank's entries (JSON objects); check ranges fit ``size`` bytes.

    Raises ManifestError on anything malformed, overlapping or out of range.
    """
    if not isinstance(entries, list):
        raise ManifestError(f"malformed manifest: {where} must be a list")
    out: list[Entry] = []
    names: set[str] = set()
    spans: list[tuple[int, int]] = []
    for i, obj in enumerate(entries):
        w = f"{where}[{i}]"
        kind = _need(obj, "kind", str, w)
        if kind == "tensor":
            e: Entry = TensorChunk.from_json(obj, w)
            if size is not None and e.offset + e.nbytes > size:
                raise ManifestError(f"malformed manifest: {w} byte range ends past the shard ({size} bytes)")
            if e.nbytes:
                spans.append((e.offset, e.offset + e.nbytes))
        elif kind == "json":
            e = JsonEntry.from_json(obj, w)
        else:
            raise ManifestError(f"malformed manifest: {w} has unknown kind {kind!r}")
        if e.name in names:
            raise ManifestError(f"malformed manifest: {w} repeats the name {e.name!r}")
        names.add(e.name)
        out.append(e)
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        if start < end:
            raise ManifestError(f"malformed manifest: {where} has overlapping byte ranges")
    return out


@dataclass(frozen=True)
class ShardInfo:
    """One rank's shard: its size in bytes, its checksum, what it holds, and the node that saved it.

    ``layout`` is the digest of the rank's layout object (its tensor chunks);
    ``entries`` then holds only the rank's JSON values. A version-1 manifest
    has no layout digest (``""``) and every entry inline.
    """

    rank: int
    size: int
    checksum: str
    entries: tuple[Entry, ...] = ()
    node: int = 0
    layout: str = ""
    #: the shard's first bytes that hold every chunk this rank writes to the shared tier (S3) for the ranks
    #: holding identical copies (:mod:`ckpt._replicas`): ``(bytes, their checksum, the digest of the layout of
    #: the chunks in them)``; None when the rank writes its whole shard there (it holds no other rank's copy)
    durable: tuple[int, str, str] | None = None
    #: the shard's first bytes that hold what no other rank holds a copy of (its own chunks and its values);
    #: every chunk after them is held, byte for byte, by the other ranks of one of ``groups`` (the data-parallel
    #: replicas of a DTensor, :mod:`ckpt._replicas`): ``(bytes, their checksum, groups)``, each group the
    #: global ranks holding a set of those chunks, this rank among them. None when no chunk is held elsewhere
    unique: tuple[int, str, tuple[tuple[int, ...], ...]] | None = None

    def to_json(self) -> dict:
        if not self.layout:
            return {"rank": self.rank, "size": self.size, "checksum": self.checksum, "node": self.node,
                    "entries": [e.to_json() for e in self.entries]}
        out = {"rank": self.rank, "size": self.size, "checksum": self.checksum, "node": self.node,
               "layout": self.layout}
        values = [[e.name, e.value] for e in self.entries if isinstance(e, JsonEntry)]
        if values:
            out["values"] = values
        if self.durable is not None:
            out["durable"] = list(self.durable)
        if self.unique is not None:
            out["unique"] = [self.unique[0], self.unique[1], [encode_group(g) for g in self.unique[2]]]
        return out


@dataclass(frozen=True)
class Manifest:
    """One step's global index. See the module docstring for the fields."""

    job: str
    step: int
    world: int
    shards: tuple[ShardInfo, ...]
    metadata: dict = field(default_factory=dict)
    created: float = field(default_factory=time.time)
    library: str = "tierckpt"
    #: the format version: 2 when every shard names a layout, else 1 (entries inline); derived when 0
    version: int = 0
    #: ``xxh3_64:<hex>``: the checksum a version-2 manifest carries of itself, or that of a version-1
    #: manifest's bytes; set by ``from_bytes`` and ``to_bytes`` (a step index names the manifest by it)
    checksum: str = field(default="", compare=False, repr=False)

    def __post_init__(self) -> None:
        if not self.version:
            object.__setattr__(self, "version", MANIFEST_VERSION if all(s.layout for s in self.shards) else 1)

    @property
    def total_bytes(self) -> int:
        """Sum of all shard sizes, in bytes."""
        return sum(s.size for s in self.shards)

    def shard(self, rank: int) -> ShardInfo:
        return self.shards[rank]

    @property
    def layouts(self) -> set[str]:
        """Digests of the layout objects this manifest names, the durable parts' too (empty for version 1)."""
        return {s.layout for s in self.shards if s.layout} | {s.durable[2] for s in self.shards if s.durable}

    def to_json(self) -> dict:
        return {
            "format": MANIFEST_FORMAT, "version": self.version, "library": self.library,
            "job": self.job, "step": self.step, "world": self.world, "created": self.created,
            "metadata": self.metadata, "shards": [s.to_json() for s in self.shards],
        }

    def to_bytes(self) -> bytes:
        """Serialise to UTF-8 JSON ending with its own checksum (version 1, entries inline, too)."""
        body = _sealed.dumps(self.to_json())
        sealed, checksum = _sealed.seal(body)
        object.__setattr__(self, "checksum", checksum)
        return sealed

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, *, job: str | None = None, step: int | None = None) -> "Manifest":
        """Parse and validate; if ``job``/``step`` are given they must match.

        Raises ManifestError for anything malformed, of another format or of a
        newer version than this library reads.
        """
        obj = _sealed.loads(data, MAX_MANIFEST_BYTES, ManifestError, "malformed manifest")
        claimed = None
        # A checksum is verified wherever one is present, whatever version the bytes claim: a sealed manifest
        # edited to say version 1 is refused as any other edit is. Only a version-1 manifest written before
        # manifests were sealed goes without one (and is held to the version-1 fields, nothing else).
        version = obj.get("version") if isinstance(obj, dict) else None
        newer = type(version) is int and version > MANIFEST_VERSION  # from_json says to upgrade
        if isinstance(obj, dict) and obj.get("format") == MANIFEST_FORMAT \
                and ("checksum" in obj or (version != 1 and not newer)):
            claimed = obj.pop("checksum", None)
            if not isinstance(claimed, str):
                raise ManifestError("malformed manifest: no checksum of its own (damaged, or not a manifest "
                                    "this library wrote); read the step from another tier")
            if not _sealed.verify(data, obj, claimed, ManifestError, "malformed manifest"):
                raise ManifestError("manifest checksum mismatch: its bytes were changed after it was written "
                                    "(damaged or edited); read the step from another tier")
        elif isinstance(obj, dict) and version == 1 and not set(obj) <= _V1_FIELDS:
            raise ManifestError(f"malformed manifest: unknown field(s) {sorted(set(obj) - _V1_FIELDS)[:3]}")
        m = cls.from_json(obj, job=job, step=step)
        object.__setattr__(m, "checksum", claimed or _sealed.checksum_of(bytes(data)))
        return m

    @classmethod
    def from_json(cls, obj: Any, *, job: str | None = None, step: int | None = None) -> "Manifest":
        if not isinstance(obj, dict) or obj.get("format") != MANIFEST_FORMAT:
            raise ManifestError("malformed manifest: not a tierckpt manifest (missing 'format')")
        version = _need(obj, "version", int, "manifest")
        if version > MANIFEST_VERSION or version < 1:
            raise ManifestError(
                f"manifest version {version} is not supported by this library (reads <= {MANIFEST_VERSION}); "
                "upgrade tierckpt"
            )
        m_job = _need(obj, "job", str, "manifest")
        m_step = _need(obj, "step", int, "manifest")
        try:
            check_job(m_job)
            check_step(m_step)
        except ValueError as e:
            raise ManifestError(f"malformed manifest: {e}") from e
        if job is not None and m_job != job:
            raise ManifestError(f"manifest names job {m_job!r} but was stored under {job!r}")
        if step is not None and m_step != step:
            raise ManifestError(f"manifest names step {m_step} but was stored under step {step}")
        world = _need(obj, "world", int, "manifest")
        shards_obj = _need(obj, "shards", list, "manifest")
        if not 1 <= world <= MAX_WORLD or len(shards_obj) != world:
            raise ManifestError(f"malformed manifest: world {world} but {len(shards_obj)} shards listed")
        shards = []
        for r, s in enumerate(shards_obj):
            if version >= 2:
                fast = _v2_row(s, r)
                if fast is not None:
                    shards.append(fast)
                    continue
            where = f"shards[{r}]"
            rank = _need(s, "rank", int, where)
            size = _need(s, "size", int, where)
            checksum = _need(s, "checksum", str, where)
            if rank != r or not 0 <= size <= MAX_BYTES:
                raise ManifestError(f"malformed manifest: {where} has rank {rank} / size {size}")
            if not _CHECKSUM_RE.match(checksum):
                raise ManifestError(f"malformed manifest: {where}.checksum {checksum[:40]!r} is not xxh3_64:<16 hex>")
            if version == 1:
                entries = validate_layout(_need(s, "entries", list, where), size, f"{where}.entries")
                layout = ""
            else:
                layout = _need(s, "layout", str, where)
                try:
                    check_digest(layout)
                except InvalidNameError as e:
                    raise ManifestError(f"malformed manifest: {where}: {e}") from e
                entries = _values(s.get("values", []), where)
            node = s.get("node", 0)
            if isinstance(node, bool) or not isinstance(node, int) or not 0 <= node < MAX_NODES:
                raise ManifestError(f"malformed manifest: {where}.node must be an int >= 0")
            durable = _durable(s.get("durable"), size, where) if version >= 2 else None
            unique = _unique(s.get("unique"), rank, world, size, durable, where) if version >= 2 else None
            shards.append(ShardInfo(rank, size, checksum, tuple(entries), node, layout, durable, unique))
        metadata = obj.get("metadata", {})
        if not isinstance(metadata, dict):
            raise ManifestError("malformed manifest: metadata must be an object")
        created = obj.get("created", 0.0)
        if not isinstance(created, (int, float)) or isinstance(created, bool) or not math.isfinite(created) \
                or not 0 <= created < 1e11:
            raise ManifestError("malformed manifest: created must be a time in seconds since 1970")
        return cls(m_job, m_step, world, tuple(shards), metadata, float(created),
                   str(obj.get("library", "")), version)


#: a canonical manifest's job and step, where it begins (see :meth:`Manifest.peek`)
_PEEK_RE = re.compile(rb'^\{"format":"tierckpt-manifest","version":\d+,"library":"(?:[^"\\]|\\.)*",'
                      rb'"job":"([A-Za-z0-9._-]{1,128})","step":(0|[1-9][0-9]{0,17}),')


def peek(data: bytes | memoryview) -> tuple[str, int] | None:
    """The job and step a manifest's bytes name, read from their first bytes without parsing the rest;
    None when they do not begin as this library writes a manifest. A hint only (to skip a manifest
    already held): nothing is checked, :meth:`Manifest.from_bytes` decides."""
    m = _PEEK_RE.match(bytes(data[:512]))
    return (m.group(1).decode(), int(m.group(2))) if m else None


class ManifestCache:
    """Manifests parsed once: by the digest of their bytes, the ``size`` most recently used.

    An agent reads the same few manifests again and again (each retained step's, every few seconds, to
    heal replicas; each step's once per drain): a parse costs O(world) (3 ms at 512 ranks, 0.1 s at
    16,384). The bytes are still read and hashed each time (xxh3, about 20 GB/s), so a manifest that
    changed is parsed again. A hit is the very object an earlier parse returned: callers must not change
    it (its ``metadata`` is a dict). Safe to share between threads.
    """

    def __init__(self, size: int = 64) -> None:
        self.size = size
        self.hits = 0
        self.misses = 0
        self._parsed: collections.OrderedDict[str, Manifest] = collections.OrderedDict()
        self._lock = threading.Lock()

    def remember(self, data: bytes, m: "Manifest") -> None:
        """``m`` is what ``data`` parses to (its writer serialised it)."""
        with self._lock:
            self._parsed[xxhash.xxh3_128_hexdigest(data)] = m
            while len(self._parsed) > self.size:
                self._parsed.popitem(last=False)

    def parse(self, data: bytes | memoryview, *, job: str | None = None, step: int | None = None) -> "Manifest":
        """:meth:`Manifest.from_bytes`, from the cache when these bytes were parsed before."""
        digest = xxhash.xxh3_128_hexdigest(data)
        with self._lock:
            m = self._parsed.get(digest)
            if m is not None and (job is None or m.job == job) and (step is None or m.step == step):
                self._parsed.move_to_end(digest)
                self.hits += 1
                return m
        m = Manifest.from_bytes(data, job=job, step=step)
        with self._lock:
            self.misses += 1
            self._parsed[digest] = m
            while len(self._parsed) > self.size:
                self._parsed.popitem(last=False)
        return m


def _v2_row(s: Any, r: int) -> ShardInfo | None:
    """A version-2 shard row that passes every check below, or None: the row then goes through the
    field-by-field checks, which say what is wrong. The same checks, made cheap for the common case (a
    manifest of 16,384 ranks is parsed at every node once per step)."""
    if type(s) is not dict:
        return None
    if "durable" in s or "unique" in s:
        return None  # checked field by field below
    rank, size, checksum, layout = s.get("rank"), s.get("size"), s.get("checksum"), s.get("layout")
    node = s.get("node", 0)
    if not (type(rank) is int and rank == r and type(size) is int and 0 <= size <= MAX_BYTES
            and type(checksum) is str and _CHECKSUM_RE.match(checksum)
            and type(layout) is str and DIGEST_RE.match(layout) and type(node) is int and 0 <= node < MAX_NODES):
        return None
    rows = s.get("values", ())
    if type(rows) is not list and rows != ():
        return None
    entries = []
    for row in rows:
        if not (type(row) is list and len(row) == 2 and type(row[0]) is str):
            return None
        entries.append(JsonEntry(row[0], row[1]))
    if len(entries) > 1 and len({e.name for e in entries}) != len(entries):
        return None
    return ShardInfo(rank, size, checksum, tuple(entries), node, layout)


def _durable(v: Any, size: int, where: str) -> tuple[int, str, str] | None:
    """A version-2 shard row's ``durable``: ``[bytes below the shard's size, checksum, layout digest]``."""
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 3 and type(v[0]) is int and isinstance(v[1], str)
            and isinstance(v[2], str)):
        raise ManifestError(f"malformed manifest: {where}.durable must be [bytes, checksum, layout digest]")
    n, checksum, layout = v
    if not 0 <= n < size:
        raise ManifestError(f"malformed manifest: {where}.durable holds {n} of the shard's {size} bytes: damaged")
    if not _CHECKSUM_RE.match(checksum):
        raise ManifestError(f"malformed manifest: {where}.durable checksum {checksum[:40]!r} is not xxh3_64:<16 hex>")
    try:
        check_digest(layout)
    except InvalidNameError as e:
        raise ManifestError(f"malformed manifest: {where}.durable: {e}") from e
    return n, checksum, layout


#: a group of more ranks than this, evenly spaced, is written as ``{"first", "step", "count"}`` instead of a list
_RANGE_FROM = 3


def encode_group(g: tuple[int, ...]) -> list[int] | dict[str, int]:
    """A holder group as a manifest (or a commit row) writes it: evenly spaced ranks in ascending order (a DDP
    world, an HSDP replica group, a stage's data-parallel replicas) as ``{"first": a, "step": d, "count": k}``,
    the same size at any world; any other group as its list of ranks. Every rank of a DDP job names the whole
    world, so a list would make the manifest grow with the square of the world (80 MB at 4,096 ranks).
    Remembered per group object, so the rows of one manifest that share one decoded group cost one look."""
    got = _encoded.get(id(g))
    if got is not None and got[0] is g:
        return got[1]
    n = len(g)
    d = g[1] - g[0] if n >= 2 else 0
    if n > _RANGE_FROM and d >= 1 and all(g[i + 1] - g[i] == d for i in range(n - 1)):
        out: list[int] | dict[str, int] = {"first": g[0], "step": d, "count": n}
    else:
        out = list(g)
    if n > _RANGE_FROM:
        if len(_encoded) >= 256:
            _encoded.clear()
        _encoded[id(g)] = (g, out)
    return out


#: id(group) -> (the group, kept alive so the id is not reused while cached; its encoding)
_encoded: dict[int, tuple[tuple[int, ...], Any]] = {}


def decode_group(v: Any, rank: int, world: int) -> tuple[int, ...]:
    """A holder group as :func:`encode_group` wrote it, checked: two or more distinct ranks of the world,
    ``rank`` among them (ValueError saying what is wrong). An evenly spaced group is checked in constant time
    and decoded once for every row naming it (the same tuple object), so a DDP world's manifest parses in time
    and memory linear in the world."""
    if isinstance(v, dict):
        if set(v) != {"first", "step", "count"} or not all(type(x) is int for x in v.values()):
            raise ValueError(f"a group must be a list of ranks or {{first, step, count}}; got {str(v)[:80]}")
        a, d, k = v["first"], v["step"], v["count"]
        if not (k >= 2 and d >= 1 and 0 <= a and a + d * (k - 1) < world):
            raise ValueError(f"a group must be 2 or more distinct ranks of the world of {world}; got {str(v)[:80]}")
        if not (a <= rank <= a + d * (k - 1) and (rank - a) % d == 0):
            raise ValueError(f"a group must hold the rank it is given for ({rank}); got {str(v)[:80]}")
        return _spaced(a, d, k)
    if not (isinstance(v, list) and 2 <= len(v) <= world and all(type(r) is int and 0 <= r < world for r in v)
            and len(set(v)) == len(v) and rank in v):
        raise ValueError(f"a group must be 2 or more distinct ranks of the world, rank {rank} among them; got "
                         f"{str(v)[:80]}")
    return tuple(v)


@functools.lru_cache(maxsize=256)
def _spaced(first: int, step: int, count: int) -> tuple[int, ...]:
    return tuple(range(first, first + step * count, step))


def _unique(v: Any, rank: int, world: int, size: int, durable: tuple | None, where: str
            ) -> tuple[int, str, tuple[tuple[int, ...], ...]] | None:
    """A version-2 shard row's ``unique``: ``[bytes up to the shard's size (and within its durable part),
    checksum, [group, ...]]``, each group two or more distinct ranks of the world, this one among them, as
    :func:`encode_group` writes it (a list of global ranks, or ``{first, step, count}``)."""
    if v is None:
        return None
    if not (isinstance(v, list) and len(v) == 3 and type(v[0]) is int and isinstance(v[1], str)
            and isinstance(v[2], list) and v[2]):
        raise ManifestError(f"malformed manifest: {where}.unique must be [bytes, checksum, [group, ...]]")
    n, checksum, groups = v
    if not 0 <= n <= size or (durable is not None and n > durable[0]):
        raise ManifestError(f"malformed manifest: {where}.unique holds {n} of the shard's {size} bytes: damaged")
    if not _CHECKSUM_RE.match(checksum):
        raise ManifestError(f"malformed manifest: {where}.unique checksum {checksum[:40]!r} is not xxh3_64:<16 hex>")
    out = []
    for g in groups:
        try:
            out.append(decode_group(g, rank, world))
        except ValueError as e:
            raise ManifestError(f"malformed manifest: {where}.unique: {e}") from None
    return n, checksum, tuple(out)


def durable_view(m: Manifest) -> Manifest:
    """The manifest of ``m``'s step as the shared tier (S3) holds it when ranks hold copies of each other's
    chunks: each such rank's shard is its ``durable`` part (the chunks it writes for all the ranks holding
    them, and its values), so every chunk is there once. The same bytes from every node that builds it
    (it is derived from ``m`` alone): ``metadata["durable_of"]`` names ``m`` by checksum. ``m`` itself when
    no rank holds a copy of another's.

    A restore planned by this manifest reads each chunk from the shard of the rank that wrote it, as a
    restore at another world size does."""
    if all(s.durable is None for s in m.shards):
        return m
    if not m.checksum:
        m.to_bytes()  # sets it
    shards = tuple(s if s.durable is None else
                   ShardInfo(s.rank, s.durable[0], s.durable[1], s.entries, s.node, s.durable[2], None, s.unique)
                   for s in m.shards)
    return Manifest(m.job, m.step, m.world, shards, {**m.metadata, "durable_of": m.checksum}, m.created,
                    m.library, m.version)


def _values(rows: Any, where: str) -> list[JsonEntry]:
    """A version-2 shard row's ``values``: ``[[name, value], ...]`` with distinct names."""
    if not isinstance(rows, list):
        raise ManifestError(f"malformed manifest: {where}.values must be a list")
    out, names = [], set()
    for i, row in enumerate(rows):
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)):
            raise ManifestError(f"malformed manifest: {where}.values[{i}] must be [name, value]")
        if row[0] in names:
            raise ManifestError(f"malformed manifest: {where}.values repeats the name {row[0]!r}")
        names.add(row[0])
        out.append(JsonEntry(row[0], row[1]))
    return out
