"""Arrow sources: Arrow IPC files and streams (``.arrow``, ``.arrows``, ``.ipc``), Feather v2
(``.feather``), and Hugging Face ``datasets`` folders written by ``save_to_disk`` (recognised by
their ``state.json``, whose file list gives the order). Records as for parquet (``records.py``).

On a local disk a file is memory-mapped: counting its rows reads only the batches' metadata, and
a load unit (a row range of at most ``loading.unit_rows`` rows, across record batches) maps only
the pages it touches. On an object store an Arrow file has no row counts to read without fetching
its batches, so each file is one unit whose documents are counted when it is loaded (sample ids
``i * 2**32 + k``); parquet is the format for object stores.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.ipc as ipc

from ..errors import SourceError
from ..plan import Source, SourcePlan
from .formats import UNKNOWN_BASE, Format
from .fs import is_local, list_files, source_fs
from .records import check_schema
from .units import LoadUnit

FILE_MAGIC = b"ARROW1"


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
        if not is_local(source, plan.base_dir):
            if not source.prepare:
                for path in files:
                    with fs.open(path, "rb") as f:
                        check_schema(source, path, _reader(f, path, source).schema)
            return [LoadUnit(source.name, i, path, -1, 0, -1, i * UNKNOWN_BASE) for i, path in enumerate(files)]
        units, first_id, step = [], 0, plan.loading.unit_rows
        for path in files:
            reader = _reader(pa.memory_map(path), path, source)
            if not source.prepare:
                check_schema(source, path, reader.schema)
            rows = _rows(reader)
            for start in range(0, rows, step):
                units.append(
                    LoadUnit(source.name, len(units), path, -1, start, min(rows, start + step), first_id + start)
                )
            first_id += rows
        return units

    def read(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> pa.Table:
        cols = self.columns(source)
        try:
            if unit.stop < 0:
                fs, _ = source_fs(source, plan.base_dir)
                with fs.open(unit.path, "rb") as f:
                    table = _reader(f, unit.path, source).read_all()
            else:  # the table's buffers keep the map alive; only the pages the unit touches are read
                table = _reader(pa.memory_map(unit.path), unit.path, source).read_all().slice(unit.start, unit.n_docs)
        except FileNotFoundError:
            raise SourceError(f"{unit.describe()}: file not found") from None
        except (pa.ArrowInvalid, OSError) as err:
            raise SourceError(f"corrupt data in {unit.describe()}: {err}") from None
        if not source.prepare:
            check_schema(source, unit.path, table.schema)
        return table.select(cols) if cols else table


def _reader(handle, path: str, source: Source):
    try:
        return _open(handle)
    except (pa.ArrowInvalid, OSError) as err:
        raise SourceError(f"source {source.name!r}: not an Arrow IPC file or stream: {path}: {err}") from None
