"""Parquet sources: a text column (tokenized on the worker) or a list<int> column of token ids.

Units come from the footers: each row group, cut into ranges of at most ``loading.unit_rows`` rows.

Multimodal rows (``images_field``) also carry a ``list<binary>`` of encoded images and a
``list<int>`` of the text positions they go to; the worker decodes and patches them
(``images.py``), which is the costly part of such a source's loading.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from ..errors import SourceError
from ..plan.models import Plan, Source
from .blocks import SampleBlock, check_tokens
from .images import decode_images, with_image_tokens
from .fs import is_local, list_files, source_fs
from .tokenizers import resolve_tokenizer
from .units import LoadUnit


def _field(source: Source) -> str:
    return source.text_field or source.tokens_field  # the plan guarantees exactly one


def _columns(source: Source) -> list[str]:
    return [_field(source)] + ([source.images_field, source.image_positions_field] if source.images_field else [])


def _check_schema(source: Source, path: str, schema: pa.Schema) -> None:
    for col in _columns(source):
        if col not in schema.names:
            raise SourceError(f"source {source.name!r}: column {col!r} not found in {path}; available columns: {schema.names}")
    if source.images_field:
        typ = schema.field(source.images_field).type
        if not ((pa.types.is_list(typ) or pa.types.is_large_list(typ)) and (pa.types.is_binary(typ.value_type) or pa.types.is_large_binary(typ.value_type))):
            raise SourceError(f"source {source.name!r}: images_field {source.images_field!r} in {path} has type {typ}, expected list<binary> of encoded images")
        typ = schema.field(source.image_positions_field).type
        if not ((pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_integer(typ.value_type)):
            raise SourceError(f"source {source.name!r}: image_positions_field {source.image_positions_field!r} in {path} has type {typ}, expected list<int>")
    name = _field(source)
    typ = schema.field(name).type
    if source.text_field:
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ)):
            raise SourceError(f"source {source.name!r}: text_field {name!r} in {path} has type {typ}, expected string")
    else:
        ok = (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_integer(typ.value_type)
        if not ok:
            raise SourceError(
                f"source {source.name!r}: tokens_field {name!r} in {path} has type {typ}, expected list<int32|int64>"
            )


def _open(fs, path: str, source: Source) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(fs.open(path, "rb"), page_checksum_verification=True)
    except FileNotFoundError:
        raise SourceError(f"source {source.name!r}: file not found: {path}") from None
    except (pa.ArrowInvalid, OSError) as err:
        raise SourceError(f"source {source.name!r}: corrupt or unreadable parquet file {path}: {err}") from None


FOOTER_THREADS = 8  # footers read at once per source on remote storage, where each is a round trip


def _row_groups(fs, path: str, source: Source) -> list[int]:
    """Rows per row group of one file, from its footer (and its schema checked)."""
    pf = _open(fs, path, source)
    _check_schema(source, path, pf.schema_arrow)
    md = pf.metadata
    return [md.row_group(rg).num_rows for rg in range(md.num_row_groups)]


def discover(source: Source, plan: Plan) -> list[LoadUnit]:
    """Units from the files' footers only (no data pages); the order is the sorted file order
    whatever the timing. On remote storage the footers are read in parallel (each is a request);
    on a local disk one after the other: a footer there is a little CPU, and threads only contend
    for the GIL (``benchmarks/corpus_scale.py`` compares both)."""
    fs, files = list_files(source, plan.base_dir)
    if len(files) > 1 and not is_local(source, plan.base_dir):
        from concurrent.futures import ThreadPoolExecutor

        with ThreadPoolExecutor(min(FOOTER_THREADS, len(files)), thread_name_prefix="overlord-footers") as pool:
            groups = list(pool.map(lambda p: _row_groups(fs, p, source), files))
    else:
        groups = [_row_groups(fs, p, source) for p in files]
    units: list[LoadUnit] = []
    first_id = 0
    step = plan.loading.unit_rows
    for path, rows_per_group in zip(files, groups):
        for rg, rows in enumerate(rows_per_group):
            for start in range(0, rows, step):
                stop = min(rows, start + step)
                units.append(LoadUnit(source.name, len(units), path, rg, start, stop, first_id + start))
            first_id += rows
    return units


def load(source: Source, plan: Plan, unit: LoadUnit) -> SampleBlock:
    fs, _ = source_fs(source, plan.base_dir)
    pf = _open(fs, unit.path, source)
    _check_schema(source, unit.path, pf.schema_arrow)
    try:
        table = pf.read_row_group(unit.part, columns=_columns(source))
    except (pa.ArrowInvalid, OSError) as err:
        raise SourceError(f"corrupt data in {unit.describe()}: {err}") from None
    table = table.slice(unit.start, unit.n_docs)
    col = table.column(0).combine_chunks()
    if source.text_field:
        tokens, offsets = resolve_tokenizer(source.tokenizer, plan.base_dir)(col)
    else:
        if col.null_count:
            col = pc.fill_null(col, pa.scalar([], type=col.type))  # a null row is an empty document
        offsets = np.asarray(col.offsets, dtype=np.int64)
        values = col.values.to_numpy(zero_copy_only=False)
        tokens = values[offsets[0] : offsets[-1]]
        offsets = offsets - offsets[0]
    ids = np.arange(unit.first_id, unit.first_id + unit.n_docs, dtype=np.int64)
    if not source.images_field:
        return SampleBlock(source.name, tokens, offsets, ids)  # checks the ids (integers in [0, 2^31))
    return _with_images(source, unit, table, check_tokens(source.name, tokens), np.asarray(offsets, np.int64), ids)


def _list_parts(col: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Row offsets and flat values of a list column (a null row: no entries)."""
    if col.null_count:
        col = pc.fill_null(col, pa.scalar([], type=col.type))
    offs = np.asarray(col.offsets, dtype=np.int64)
    return offs - offs[0], col.values.slice(int(offs[0]), int(offs[-1] - offs[0]))


def _with_images(source: Source, unit: LoadUnit, table: pa.Table, tokens, offsets, ids) -> SampleBlock:
    img_off, encoded = _list_parts(table.column(1).combine_chunks())
    pos_off, positions = _list_parts(table.column(2).combine_chunks())
    if not np.array_equal(img_off, pos_off):
        bad = int(np.flatnonzero(np.diff(img_off) != np.diff(pos_off))[0])
        raise SourceError(f"{unit.describe()}: row {unit.start + bad} (sample id {ids[bad]}) has {img_off[bad + 1] - img_off[bad]} images "
                          f"but {pos_off[bad + 1] - pos_off[bad]} image positions")
    doc_of = np.repeat(np.arange(len(ids)), np.diff(img_off))
    images = decode_images(encoded.to_pylist(), source.image_size, source.patch_size,
                           lambda i: f"{unit.describe()}: image {int(i - img_off[doc_of[i]])} of sample id {ids[doc_of[i]]}")
    return with_image_tokens(source, unit.describe(), tokens, offsets, ids, images, img_off,
                             positions.to_numpy(zero_copy_only=False).astype(np.int64))
