"""From a unit's records to its sample block, for every record format (parquet, jsonl, arrow,
webdataset and registered ones): the source's ``prepare`` steps, then ``text_field`` tokenized or
``tokens_field`` taken as ids, then the images of multimodal records.

A record a prepare step drops stays in its place as an empty document, so the other documents
keep their sample ids and their order whatever the steps drop; the count of dropped records goes
to the planner with the unit's lengths.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from ..errors import SourceError
from ..plan.base import import_callable
from ..plan.models import Plan, Source
from .blocks import SampleBlock, check_tokens
from .images import decode_images, with_image_tokens
from .tokenizers import resolve_tokenizer
from .units import LoadUnit

ROW = "_row"  # the column a batch prepare step keeps: each row's position in the unit


def fields(source: Source) -> list[str]:
    """The columns a record source's plan reads: its text or tokens, and its images and their positions."""
    return [source.text_field or source.tokens_field] + ([source.images_field, source.image_positions_field] if source.images_field else [])


def check_schema(source: Source, where: str, schema: pa.Schema) -> None:
    """SourceError naming the source, ``where`` (a file) and the field, for a missing column or a
    column of the wrong type."""
    for col in fields(source):
        if col not in schema.names:
            raise SourceError(f"source {source.name!r}: column {col!r} not found in {where}; available columns: {schema.names}")
    if source.images_field:
        typ = schema.field(source.images_field).type
        if not ((pa.types.is_list(typ) or pa.types.is_large_list(typ)) and (pa.types.is_binary(typ.value_type) or pa.types.is_large_binary(typ.value_type))):
            raise SourceError(f"source {source.name!r}: images_field {source.images_field!r} in {where} has type {typ}, expected list<binary> of encoded images")
        typ = schema.field(source.image_positions_field).type
        if not ((pa.types.is_list(typ) or pa.types.is_large_list(typ)) and pa.types.is_integer(typ.value_type)):
            raise SourceError(f"source {source.name!r}: image_positions_field {source.image_positions_field!r} in {where} has type {typ}, expected list<int>")
    name = source.text_field or source.tokens_field
    typ = schema.field(name).type
    if source.text_field:
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)):
            raise SourceError(f"source {source.name!r}: text_field {name!r} in {where} has type {typ}, expected string")
    elif not ((pa.types.is_list(typ) or pa.types.is_large_list(typ)) and (pa.types.is_integer(typ.value_type) or pa.types.is_null(typ.value_type))
              or pa.types.is_null(typ)):
        raise SourceError(f"source {source.name!r}: tokens_field {name!r} in {where} has type {typ}, expected list<int32|int64>")


def to_block(source: Source, plan: Plan, unit: LoadUnit, table: pa.Table) -> tuple[SampleBlock, int]:
    """The unit's block from its records (``table``, in file order), and how many records its
    prepare steps dropped."""
    n = table.num_rows
    kept = np.arange(n)
    if source.prepare:
        table, kept = prepare(source, table, unit)
    check_schema(source, unit.describe(), table.schema)
    col = table.column(source.text_field or source.tokens_field).combine_chunks()
    if source.text_field:
        if pa.types.is_null(col.type):
            col = col.cast(pa.string())
        tokens, offsets = resolve_tokenizer(source.tokenizer, plan.base_dir)(col)
    else:
        offsets, values = _list_parts(col)
        tokens = values.to_numpy(zero_copy_only=False) if len(values) else np.zeros(0, np.int64)
    offsets = _in_place(np.asarray(offsets, dtype=np.int64), kept, n)
    ids = np.arange(unit.first_id, unit.first_id + n, dtype=np.int64)
    dropped = n - len(kept)
    if not source.images_field:
        return SampleBlock(source.name, tokens, offsets, ids), dropped
    return _with_images(source, unit, table, kept, n, check_tokens(source.name, tokens), offsets, ids), dropped


def _in_place(offsets: np.ndarray, kept: np.ndarray, n: int) -> np.ndarray:
    """Offsets of ``n`` documents where only rows ``kept`` hold the documents of ``offsets``
    (the others are empty)."""
    if len(kept) == n:
        return offsets
    lens = np.zeros(n, dtype=np.int64)
    lens[kept] = np.diff(offsets)
    return np.concatenate([[0], np.cumsum(lens)])


def prepare(source: Source, table: pa.Table, unit: LoadUnit) -> tuple[pa.Table, np.ndarray]:
    """Apply the source's prepare steps in order: the records kept (in order) and their rows."""
    cur = table.append_column(ROW, pa.array(np.arange(table.num_rows, dtype=np.int64)))
    for step in source.prepare:
        fn = import_callable(step.function)
        cur = _record_step(source, unit, cur, fn, step) if step.record else _batch_step(source, unit, cur, fn, step)
    rows = cur.column(ROW).to_numpy()
    if len(rows) > 1 and np.any(np.diff(rows) <= 0):
        raise SourceError(f"source {source.name!r}: prepare steps must keep the records in their order, once each ({unit.describe()})")
    return cur.drop_columns([ROW]), rows


def _call(source: Source, step, fn, arg, what: str, columns: list[str]):
    """``fn(arg, **kwargs)``; its errors name the step, ``what`` it ran on and the columns there."""
    try:
        return fn(arg, **step.kwargs)
    except KeyError as err:
        raise SourceError(f"source {source.name!r}: prepare {step.function} asks for column {err} that {what} does not have "
                          f"(columns: {columns})") from None
    except Exception as err:
        raise SourceError(f"source {source.name!r}: prepare {step.function} failed on {what}: {type(err).__name__}: {err}") from None


def _record_step(source: Source, unit: LoadUnit, table: pa.Table, fn, step) -> pa.Table:
    out = []
    for rec in table.to_pylist():
        row = rec.pop(ROW)
        what = f"record {row} of {unit.describe()}"
        res = _call(source, step, fn, rec, what, sorted(rec))
        if res is None:
            continue
        if not isinstance(res, dict):
            raise SourceError(f"source {source.name!r}: prepare {step.record} returned {type(res).__name__} for {what}: expected a dict or None")
        out.append({**res, ROW: row})
    if not out:
        return table.schema.empty_table()
    return pa.Table.from_pylist(out)


def _batch_step(source: Source, unit: LoadUnit, table: pa.Table, fn, step) -> pa.Table:
    res = _call(source, step, fn, table, unit.describe(), [c for c in table.column_names if c != ROW])
    if not isinstance(res, pa.Table) or ROW not in res.column_names:
        raise SourceError(f"source {source.name!r}: prepare {step.batch} must return a pyarrow.Table that keeps the {ROW!r} "
                          f"column it was given (got {type(res).__name__})")
    return res


def _list_parts(col: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Row offsets and flat values of a list column (a null row: no entries)."""
    if pa.types.is_null(col.type):
        return np.zeros(len(col) + 1, np.int64), pa.array([], pa.int64())
    if col.null_count:
        col = pc.fill_null(col, pa.scalar([], type=col.type))
    offs = np.asarray(col.offsets, dtype=np.int64)
    return offs - offs[0], col.values.slice(int(offs[0]), int(offs[-1] - offs[0]))


def _with_images(source: Source, unit: LoadUnit, table: pa.Table, kept, n, tokens, offsets, ids) -> SampleBlock:
    img_off, encoded = _list_parts(table.column(source.images_field).combine_chunks())
    pos_off, positions = _list_parts(table.column(source.image_positions_field).combine_chunks())
    if not np.array_equal(img_off, pos_off):
        bad = int(np.flatnonzero(np.diff(img_off) != np.diff(pos_off))[0])
        raise SourceError(f"{unit.describe()}: row {unit.start + kept[bad]} (sample id {ids[kept[bad]]}) has {img_off[bad + 1] - img_off[bad]} "
                          f"images but {pos_off[bad + 1] - pos_off[bad]} image positions")
    img_off = _in_place(img_off, kept, n)
    doc_of = np.repeat(np.arange(n), np.diff(img_off))
    images = decode_images(encoded.to_pylist(), source.image_size, source.patch_size,
                           lambda i: f"{unit.describe()}: image {int(i - img_off[doc_of[i]])} of sample id {ids[doc_of[i]]}")
    return with_image_tokens(source, unit.describe(), tokens, offsets, ids, images, img_off,
                             positions.to_numpy(zero_copy_only=False).astype(np.int64))
