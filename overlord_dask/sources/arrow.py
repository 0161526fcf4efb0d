"""Arrow sources: Arrow IPC files and streams (``.arrow``, ``.arrows``, ``.ipc``), Feather v2
(``.feather``), and Hugging Face ``datasets`` folders written by ``save_to_disk`` (recognised by
their ``state.json``, whose file list gives the order). Records as for parquet (``records.py``).

On a local disk a file is memory-mapped: counting its rows reads only the batches' metadata, and
a load unit (a row range of at most ``loading.unit_rows`` rows, across record batches) maps only
the pages it touches. On an object store the same row ranges are found by walking the message
headers (``arrow_messages.py``: one small read per record batch, in parallel across files, the
index cached between starts by ``index_cache.py``), and a unit is one ranged read of its batches;
a file with dictionary-encoded columns is read whole by each of its units (its dictionaries
come first and may be replaced along the file).
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import pyarrow.ipc as ipc

from ..errors import SourceError
from ..plan import Source, SourcePlan
from . import arrow_messages
from .formats import Format
from .fs import is_local, list_files, per_file, source_fs
from .index_cache import cached
from .records import check_schema
from .units import LoadUnit

FILE_MAGIC = b"ARROW1"
INDEX_VERSION = 1


def _open(handle):
    """An IPC file or stream reader over ``handle`` (a memory map or a file object)."""
    handle.seek(0)
    head = handle.read(6)
    handle.seek(0)
    return ipc.open_file(handle) if head == FILE_MAGIC else ipc.open_stream(handle)


def _rows(reader) -> int:
    if isinstance(reader, ipc.RecordBatchFileReader):
        return sum(reader.get_batch(i).num_rows for i in range(reader.num_record_batches))
    return sum(b.num_rows for b in reader)


class ArrowFormat(Format):
    name = "arrow"
    suffixes = (".arrow", ".arrows", ".ipc", ".feather")

    def _files(self, source: Source, plan: SourcePlan) -> tuple[object, list[str]]:
        fs, path = source_fs(source, plan.base_dir)
        if fs.isdir(path):
            if fs.exists(f"{path}/dataset_dict.json"):
                splits = json.loads(fs.cat(f"{path}/dataset_dict.json")).get("splits", [])
                base = source.url.rstrip("/")
                raise SourceError(
                    f"source {source.name!r}: {source.url!r} is a datasets DatasetDict folder; point url at one of its "
                    f"splits ({', '.join(f'{base}/{s}' for s in splits)})"
                )
            if fs.exists(f"{path}/state.json"):
                try:
                    names = [d["filename"] for d in json.loads(fs.cat(f"{path}/state.json"))["_data_files"]]
                except (ValueError, KeyError, TypeError) as err:
                    raise SourceError(
                        f"source {source.name!r}: unreadable datasets state.json in {path!r}: {err}"
                    ) from None
                files = [f"{path}/{n}" for n in names]
                missing = [f for f in files if not fs.exists(f)]
                if missing:
                    raise SourceError(
                        f"source {source.name!r}: {missing[0]} is listed in {path}/state.json but does not exist"
                    )
                return fs, files
        return list_files(source, plan.base_dir, self.suffixes)

    def discover(self, source: Source, plan: SourcePlan) -> list[LoadUnit]:
        fs, files = self._files(source, plan)
        local = is_local(source, plan.base_dir)
        index = (lambda p: _local_rows(p, source)) if local else (lambda p: _remote_layout(fs, p, source))
        units, first_id, step = [], 0, plan.loading.unit_rows
        for path, layout in zip(files, per_file(index, files, not local)):
            firsts = None if local else np.cumsum([0] + [r for *_, r in layout.batches])  # each batch's first row
            rows = layout if local else int(firsts[-1])
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                span = None if local else _span(layout, firsts, start, stop)
                units.append(LoadUnit(source.name, len(units), path, -1, start, stop, first_id + start, span))
            first_id += rows
        return units

    def regions(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> list[tuple[str, int, int | None]]:
        if unit.span is None:
            return [(unit.path, 0, None)]
        lo, hi, _, schema_lo, schema_hi = unit.span
        return [(unit.path, schema_lo, schema_hi), (unit.path, lo, hi)]

    def read(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> pa.Table:
        cols = self.columns(source)
        try:
            if unit.span is not None:
                table = _read_span(source, plan, unit)
            elif is_local(source, plan.base_dir):  # the table's buffers keep the map alive: only its pages are read
                table = _reader(pa.memory_map(unit.path), unit.path, source).read_all().slice(unit.start, unit.n_docs)
            else:  # dictionary-encoded columns: the whole file, this unit's rows of it
                fs, _ = source_fs(source, plan.base_dir)
                with fs.open(unit.path, "rb") as f:
                    table = _reader(f, unit.path, source).read_all().slice(unit.start, unit.n_docs)
        except FileNotFoundError:
            raise SourceError(f"{unit.describe()}: file not found") from None
        except (pa.ArrowInvalid, OSError) as err:
            raise SourceError(f"corrupt data in {unit.describe()}: {err}") from None
        if not source.prepare:
            check_schema(source, unit.path, table.schema)
        return table.select(cols) if cols else table


def _local_rows(path: str, source: Source) -> int:
    reader = _reader(pa.memory_map(path), path, source)
    if not source.prepare:
        check_schema(source, path, reader.schema)
    return _rows(reader)


def _remote_layout(fs, path: str, source: Source) -> arrow_messages.Layout:
    """A remote file's message layout (cached: ``index_cache.py``), its schema checked."""
    if not source.prepare:
        with fs.open(path, "rb") as f:
            check_schema(source, path, _reader(f, path, source).schema)
    size = fs.size(path)

    def build() -> list:
        with fs.open(path, "rb", block_size=arrow_messages.READ_AHEAD) as f:
            try:
                return arrow_messages.walk(f, size).to_json()
            except ValueError as err:
                raise SourceError(f"source {source.name!r}: {path}: {err}") from None

    return arrow_messages.Layout.from_json(cached(fs, path, size, "arrow-index", [INDEX_VERSION], build))


def _span(layout: arrow_messages.Layout, firsts: np.ndarray, start: int, stop: int) -> tuple | None:
    """Rows ``[start, stop)`` of a file (``firsts``: each batch's first row, then the rows) as the
    byte range of the batches that hold them, the first one's row, and the schema message's range
    (None: the file has dictionaries; read it whole)."""
    if layout.dictionaries:
        return None
    a = int(np.searchsorted(firsts, start, side="right")) - 1
    b = int(np.searchsorted(firsts, stop, side="left")) - 1
    (lo, _, _), (off, length, _) = layout.batches[a], layout.batches[b]
    return (lo, off + length, int(firsts[a]), *layout.schema)


def _read_span(source: Source, plan: SourcePlan, unit: LoadUnit) -> pa.Table:
    """A unit's rows from one ranged read: its batches behind the schema message, as a stream."""
    lo, hi, row0, schema_lo, schema_hi = unit.span
    fs, _ = source_fs(source, plan.base_dir)
    with fs.open(unit.path, "rb") as f:
        f.seek(schema_lo)
        schema = f.read(schema_hi - schema_lo)
        f.seek(lo)
        body = f.read(hi - lo)
    if len(body) != hi - lo:
        raise SourceError(f"{unit.describe()}: the file ends before byte {hi:,} (changed since it was indexed?)")
    table = ipc.open_stream(pa.BufferReader(schema + body + arrow_messages.EOS)).read_all()
    return table.slice(unit.start - row0, unit.n_docs)


def _reader(handle, path: str, source: Source):
    try:
        return _open(handle)
    except (pa.ArrowInvalid, OSError) as err:
        raise SourceError(f"source {source.name!r}: not an Arrow IPC file or stream: {path}: {err}") from None
