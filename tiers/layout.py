"""Layouts: one rank's chunk list, stored once by content digest and shared by every step that uses it.

A rank's layout (which tensor chunks its shard holds, and where) is the same
from one save to the next, and it is most of what a step's index weighs: about
600 KB of JSON per rank for a 70B model sharded over 1,024 ranks. So it is
never part of a step's manifest or of a commit record. Instead:

* the trainer sends it to its node agent once (and again only when it
  changes); every later commit names it by digest;
* the agent stores it once per tier, under ``<job>/layouts/<digest>.layout``,
  before any manifest that names it (so a committed manifest's layouts are
  always there: the manifest is still the commit point);
* the manifest names each rank's layout by digest, and a same-world restore
  reads only its own rank's layout.

The digest is ``xxh3_128`` of the layout's canonical JSON (below), so it does
not depend on how the object is stored, and a reader checks it on every read:
a damaged or swapped layout object is refused, never used.

The stored form is Parquet (pyarrow): one row per chunk, dictionary-encoded
and compressed. pyarrow is imported only when a layout object is written or
read.
"""

from __future__ import annotations

import io
import json
from dataclasses import dataclass
from functools import cached_property

import xxhash

from .errors import ManifestError
from .manifest import TensorChunk, validate_layout

__all__ = ["Layout", "MAX_LAYOUT_BYTES", "chunk_table_bytes", "read_chunk_table"]

#: the largest layout object a reader accepts, in bytes
MAX_LAYOUT_BYTES = 256 * 1024 * 1024
_COLUMNS = ("name", "dtype", "global_shape", "offsets", "shape", "offset", "nbytes")
#: how layouts are written. Names are unique within a rank, so a dictionary only adds a copy of them;
#: byte offsets and sizes grow steadily, which delta encoding stores in a few bits; statistics and the
#: Arrow schema would be a third of a small object and no reader uses them. For a 70B-like rank of
#: 2,169 chunks this is 4.8 KB instead of 16 KB (zstd level 15; writing is once per layout).
_WRITE = {"compression": "zstd", "compression_level": 15, "write_statistics": False, "store_schema": False,
          "use_dictionary": ["dtype"],
          "column_encoding": {"offset": "DELTA_BINARY_PACKED", "nbytes": "DELTA_BINARY_PACKED"}}


def _canonical(chunks: tuple[TensorChunk, ...]) -> bytes:
    rows = [[c.name, c.dtype, list(c.global_shape), list(c.offsets), list(c.shape), c.offset, c.nbytes]
            for c in chunks]
    return json.dumps(rows, separators=(",", ":"), ensure_ascii=True).encode()


@dataclass(frozen=True)
class Layout:
    """One rank's tensor chunks, in the order the rank saved them. ``digest`` names it (32 hex digits)."""

    chunks: tuple[TensorChunk, ...]

    @cached_property
    def digest(self) -> str:
        return xxhash.xxh3_128_hexdigest(_canonical(self.chunks))

    @cached_property
    def end(self) -> int:
        """Bytes a shard needs to hold every chunk (the end of the last byte range)."""
        return max((c.offset + c.nbytes for c in self.chunks), default=0)

    @classmethod
    def from_json(cls, entries: list, size: int | None = None, where: str = "layout") -> "Layout":
        """From tensor entries as JSON objects (``TensorChunk.to_json``); checked as a manifest is.

        Raises ManifestError for anything malformed, overlapping or past ``size`` bytes.
        """
        parsed = validate_layout(entries, size, where)
        chunks = tuple(e for e in parsed if isinstance(e, TensorChunk))
        if len(chunks) != len(parsed):
            raise ManifestError(f"malformed layout: {where} holds a JSON value; a layout holds tensor chunks only")
        return cls(chunks)

    def check_fits(self, size: int, where: str) -> None:
        """Raise ManifestError if a chunk's byte range ends past a shard of ``size`` bytes."""
        if self.end > size:
            raise ManifestError(f"malformed manifest: {where}'s layout ends at byte {self.end}, "
                                f"past the {size}-byte shard")

    def to_json(self) -> list[dict]:
        return [c.to_json() for c in self.chunks]

    def to_bytes(self) -> bytes:
        """The stored form: Parquet, one row per chunk."""
        import pyarrow.parquet as pq

        table = _table({"name": [c.name for c in self.chunks], "dtype": [c.dtype for c in self.chunks],
                        "global_shape": [list(c.global_shape) for c in self.chunks],
                        "offsets": [list(c.offsets) for c in self.chunks],
                        "shape": [list(c.shape) for c in self.chunks],
                        "offset": [c.offset for c in self.chunks], "nbytes": [c.nbytes for c in self.chunks]})
        sink = io.BytesIO()
        pq.write_table(table, sink, **_WRITE)
        return sink.getvalue()

    @classmethod
    def from_bytes(cls, data: bytes | memoryview, digest: str | None = None) -> "Layout":
        """Parse a stored layout; with ``digest``, refuse one whose content does not match it.

        Raises ManifestError for anything that is not a valid layout object.
        """
        if len(data) > MAX_LAYOUT_BYTES:
            raise ManifestError(f"malformed layout: {len(data)} bytes is over the {MAX_LAYOUT_BYTES} limit")
        cols = _read_columns(data, None)
        entries = [{"kind": "tensor", **{k: cols[k][i] for k in _COLUMNS}} for i in range(len(cols["name"]))]
        layout = cls.from_json(entries)
        if digest is not None and layout.digest != digest:
            raise ManifestError(f"layout object {digest} holds a layout whose digest is {layout.digest}: "
                                "damaged or replaced; read another copy")
        return layout


def _table(columns: dict):
    import pyarrow as pa

    schema = pa.schema([(k, t) for k, t in _schema_types(pa, "rank" in columns).items()])
    return pa.table({k: columns[k] for k in schema.names}, schema=schema)


def _schema_types(pa, with_rank: bool) -> dict:
    types = {"rank": pa.int32()} if with_rank else {}
    types.update({"name": pa.string(), "dtype": pa.dictionary(pa.int8(), pa.string()),
                  "global_shape": pa.list_(pa.int64()), "offsets": pa.list_(pa.int64()),
                  "shape": pa.list_(pa.int64()), "offset": pa.int64(), "nbytes": pa.int64()})
    return types


def _read_columns(data: bytes | memoryview, filters) -> dict[str, list]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        # in the calling thread, no pre-buffering: a layout is small, and a process that exits right after a
        # read (a CLI command refusing its arguments) while Arrow's pool threads are still up aborts in their
        # teardown ("terminate called without an active exception", apache/arrow#34314)
        src = pa.BufferReader(bytes(data))
        if filters is None:
            table = pq.ParquetFile(src, pre_buffer=False).read(use_threads=False)
        else:
            table = pq.read_table(src, filters=filters, use_threads=False, pre_buffer=False)
        want = ("rank",) + _COLUMNS if "rank" in table.column_names else _COLUMNS
        missing = [c for c in want if c not in table.column_names]
        if missing:
            raise ManifestError(f"malformed layout: no column {missing[0]!r}")
        return {c: table.column(c).to_pylist() for c in want}
    except ManifestError:
        raise
    except (pa.ArrowException, ValueError, TypeError, OSError) as e:
        raise ManifestError(f"malformed layout: not a readable Parquet chunk table ({' '.join(str(e).split())})") from e


def chunk_table_bytes(layouts: dict[int, Layout]) -> bytes:
    """Every rank's chunks in one Parquet table (a ``rank`` column first, rows sorted by rank).

    One file for a whole step's layouts: dictionary encoding shares the names,
    dtypes and shapes that every rank repeats, and a reader of one rank's rows
    (or of one tensor's) reads only the row groups it needs.
    """
    import pyarrow.parquet as pq

    cols: dict[str, list] = {k: [] for k in ("rank",) + _COLUMNS}
    for rank in sorted(layouts):
        for c in layouts[rank].chunks:
            cols["rank"].append(rank)
            for k in _COLUMNS:
                v = getattr(c, k)
                cols[k].append(list(v) if isinstance(v, tuple) else v)
    sink = io.BytesIO()
    # here names repeat across ranks, so the dictionary pays; statistics let a reader skip row groups
    pq.write_table(_table(cols), sink, row_group_size=64 * 1024, compression="zstd", compression_level=15,
                   use_dictionary=["rank", "name", "dtype"], column_encoding=_WRITE["column_encoding"])
    return sink.getvalue()


def read_chunk_table(data: bytes | memoryview, ranks: list[int] | None = None,
                     names: list[str] | None = None) -> dict[int, Layout]:
    """Read a table written by :func:`chunk_table_bytes`: the given ranks' (and/or tensors') rows only."""
    filters = []
    if ranks is not None:
        filters.append(("rank", "in", list(ranks)))
    if names is not None:
        filters.append(("name", "in", list(names)))
    cols = _read_columns(data, filters or None)
    by_rank: dict[int, list[dict]] = {}
    for i, r in enumerate(cols["rank"]):
        by_rank.setdefault(r, []).append({"kind": "tensor", **{k: cols[k][i] for k in _COLUMNS}})
    return {r: Layout.from_json(e, where=f"rank {r} layout") for r, e in by_rank.items()}
