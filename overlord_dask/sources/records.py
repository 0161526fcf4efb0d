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

from ..errors import SourceError
from ..logs import event
from ..plan import Source, SourcePlan
from ..plan.base import import_callable
from . import arrow_views
from .blocks import SampleBlock, check_tokens
from .documents import Bad, chat_documents, emptied, placeholder_pattern, take_placeholders, token_documents
from .images import decode_images, processor_of, with_image_tokens
from .tokenizers import TokenizerError, add_boundaries, image_token_id, load_tokenizer
from .units import LoadUnit

ROW = "_row"  # the column a batch prepare step keeps: each row's position in the unit


def fields(source: Source) -> list[str]:
    """The columns a record source's plan reads: its text, chat or tokens (and labels or mask), and
    its images and their positions."""
    main = [source.text_field or source.tokens_field or source.messages_field]
    main += [f for f in (source.labels_field, source.loss_mask_field) if f]
    if source.images_field:
        main += [source.images_field] + ([] if source.image_placeholders else [source.image_positions_field])
    return main


def _is_list(typ, value) -> bool:
    return (pa.types.is_list(typ) or pa.types.is_large_list(typ)) and value(typ.value_type)


def check_schema(source: Source, where: str, schema: pa.Schema) -> None:
    """SourceError naming the source, ``where`` (a file) and the field, for a missing column or a
    column of the wrong type."""
    for col in fields(source):
        if col not in schema.names:
            raise SourceError(
                f"source {source.name!r}: column {col!r} not found in {where}; available columns: {schema.names}"
            )
    if source.images_field:
        typ = schema.field(source.images_field).type
        if not _is_list(typ, lambda t: pa.types.is_binary(t) or pa.types.is_large_binary(t)):
            raise SourceError(
                f"source {source.name!r}: images_field {source.images_field!r} in {where} has type {typ}, expected "
                "list<binary> of encoded images"
            )
        if not source.image_placeholders:
            typ = schema.field(source.image_positions_field).type
            if not _is_list(typ, pa.types.is_integer):
                raise SourceError(
                    f"source {source.name!r}: image_positions_field {source.image_positions_field!r} in {where} has "
                    f"type {typ}, expected list<int>"
                )
    if source.messages_field:
        typ = schema.field(source.messages_field).type
        if not (_is_list(typ, pa.types.is_struct) or pa.types.is_null(typ)):
            raise SourceError(
                f"source {source.name!r}: messages_field {source.messages_field!r} in {where} has type {typ}, "
                "expected a list of {role, content} messages"
            )
        return
    ints = lambda t: pa.types.is_integer(t) or pa.types.is_null(t) or pa.types.is_boolean(t)  # noqa: E731
    for name in [f for f in (source.labels_field, source.loss_mask_field) if f]:
        typ = schema.field(name).type
        if not (_is_list(typ, ints) or pa.types.is_null(typ)):
            raise SourceError(f"source {source.name!r}: {name!r} in {where} has type {typ}, expected list<int>")
    name = source.text_field or source.tokens_field
    typ = schema.field(name).type
    if source.text_field:
        if not (pa.types.is_string(typ) or pa.types.is_large_string(typ) or pa.types.is_null(typ)):
            raise SourceError(f"source {source.name!r}: text_field {name!r} in {where} has type {typ}, expected string")
    elif not (_is_list(typ, lambda t: pa.types.is_integer(t) or pa.types.is_null(t)) or pa.types.is_null(typ)):
        raise SourceError(
            f"source {source.name!r}: tokens_field {name!r} in {where} has type {typ}, expected list<int32|int64>"
        )


def to_block(source: Source, plan: SourcePlan, unit: LoadUnit, table: pa.Table) -> tuple[SampleBlock, int]:
    """The unit's block from its records (``table``, in file order), and how many records its
    prepare steps dropped or were dropped as bad (``on_bad_record: drop``)."""
    try:
        return _to_block(source, plan, unit, table)
    except TokenizerError as err:
        raise SourceError(f"source {source.name!r}: {err}") from None


def _to_block(source: Source, plan: SourcePlan, unit: LoadUnit, table: pa.Table) -> tuple[SampleBlock, int]:
    n = table.num_rows
    kept = np.arange(n)
    if source.prepare:
        table, kept = prepare(source, table, unit)
    check_schema(source, unit.describe(), table.schema)
    ids = np.arange(unit.first_id, unit.first_id + n, dtype=np.int64)
    bad = Bad()
    patches = None
    if source.images_field:
        img_off, encoded = _list_parts(table.column(source.images_field).combine_chunks())
        doc_of = np.repeat(np.arange(len(kept)), np.diff(img_off))
        patches, errors = decode_images(
            encoded.to_pylist(),
            processor_of(source, plan.base_dir),
            lambda i: f"image {int(i - img_off[doc_of[i]])} of the record",
        )
        for i, msg in errors.items():
            bad.setdefault(int(doc_of[i]), msg)
    mask = None
    text = source.text_field or source.messages_field
    loaded = load_tokenizer(plan.tokenizer_of(source), plan.base_dir) if text or source.image_placeholders else None
    if text:
        col = table.column(source.text_field or source.messages_field).combine_chunks()
        if source.text_field:
            _missing_text(source, unit, col)
            tokens, offsets = loaded.tok.encode_array(col.cast(pa.string()) if pa.types.is_null(col.type) else col)
        else:
            tokens, offsets, mask = chat_documents(source, loaded, plan.base_dir, col, bad)
    else:
        try:
            tokens, offsets, mask = token_documents(source, table, _list_parts)
        except ValueError as err:
            raise SourceError(f"source {source.name!r}: {unit.describe()}: {err}") from None
    tokens = check_tokens(source.name, tokens, narrow=False)
    positions = None
    if source.images_field:
        if source.image_placeholders:
            tokens, offsets, mask, per_doc, positions = take_placeholders(
                tokens, offsets, mask, placeholder_pattern(loaded, source.name)
            )
            pos_doc = np.repeat(np.arange(len(kept)), per_doc)
            for row in np.flatnonzero(per_doc != np.diff(img_off)).tolist():
                bad.setdefault(
                    row,
                    f"the record has {int(np.diff(img_off)[row])} images but {int(per_doc[row])} "
                    f"{loaded.spec.image_token!r} placeholders",
                )
        else:
            pos_off, pos = _list_parts(table.column(source.image_positions_field).combine_chunks())
            positions = arrow_views.values(pos).astype(np.int64)
            pos_doc = np.repeat(np.arange(len(kept)), np.diff(pos_off))
            for row in np.flatnonzero(np.diff(img_off) != np.diff(pos_off)).tolist():
                raise SourceError(
                    f"{unit.describe()}: row {unit.start + kept[row]} (sample id {ids[kept[row]]}) has "
                    f"{img_off[row + 1] - img_off[row]} "
                    f"images but {pos_off[row + 1] - pos_off[row]} image positions"
                )
    if text:
        bos, eos = loaded.document_boundaries(source.add_bos, source.add_eos, bool(source.messages_field), source.name)
        tokens, offsets, mask, positions = add_boundaries(tokens, offsets, bos, eos, mask, positions)
    if bad:
        _bad_records(source, plan, unit, bad, kept, ids)
        tokens, offsets, mask = emptied(tokens, offsets, mask, sorted(bad))
    dropped = n - len(kept) + len(bad)
    offsets = _in_place(np.asarray(offsets, dtype=np.int64), kept, n)
    if not source.images_field:
        return SampleBlock(source.name, tokens, offsets, ids, loss_mask=mask), dropped
    good = np.isin(np.arange(len(kept)), list(bad), invert=True)  # a bad record's images go with it
    keep_img = np.repeat(good, np.diff(img_off))
    img_off = _in_place(np.concatenate([[0], np.cumsum(np.diff(img_off) * good)]).astype(np.int64), kept, n)
    return with_image_tokens(
        source.name,
        image_token_id(source, plan),
        unit.describe(),
        tokens,
        offsets,
        ids,
        [p for p, k in zip(patches, keep_img) if k],
        img_off,
        positions[good[pos_doc]],
        mask,
    ), dropped


def _missing_text(source: Source, unit: LoadUnit, col: pa.Array) -> None:
    """A unit where no record has the ``text_field`` (absent, or null everywhere) is an error
    naming the field: a misspelt ``text_field`` would otherwise deliver nothing but boundary
    tokens. A record here and there without it is an empty text, as an empty string is."""
    if col.null_count and col.null_count == len(col):
        raise SourceError(
            f"source {source.name!r}: no record of {unit.describe()} has text_field {source.text_field!r} "
            f"({len(col)} records read; is the field name right?)"
        )


def _bad_records(source: Source, plan: SourcePlan, unit: LoadUnit, bad: Bad, kept, ids) -> None:
    """Stop at the first bad record (``on_bad_record: error``), naming it; else log them."""
    row = min(bad)
    what = f"{unit.describe()}: record {unit.start + int(kept[row])} (sample id {int(ids[kept[row]])}): {bad[row]}"
    if source.on_bad_record == "error":
        raise SourceError(what + " (on_bad_record: drop keeps it as an empty document instead)")
    event("bad_records", plan.name, source=source.name, unit=unit.describe(), count=len(bad), first=what)


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
    cur = table.append_column(ROW, arrow_views.from_numpy(np.arange(table.num_rows, dtype=np.int64)))
    for step in source.prepare:
        fn = import_callable(step.function)
        cur = _record_step(source, unit, cur, fn, step) if step.record else _batch_step(source, unit, cur, fn, step)
    rows = arrow_views.values(cur.column(ROW))
    if len(rows) > 1 and np.any(np.diff(rows) <= 0):
        raise SourceError(
            f"source {source.name!r}: prepare steps must keep the records in their order, once each ({unit.describe()})"
        )
    return cur.drop_columns([ROW]), rows


def _call(source: Source, step, fn, arg, what: str, columns: list[str]):
    """``fn(arg, **kwargs)``; its errors name the step, ``what`` it ran on and the columns there."""
    try:
        return fn(arg, **step.kwargs)
    except KeyError as err:
        raise SourceError(
            f"source {source.name!r}: prepare {step.function} asks for column {err} that {what} does not have "
            f"(columns: {columns})"
        ) from None
    except Exception as err:
        raise SourceError(
            f"source {source.name!r}: prepare {step.function} failed on {what}: {type(err).__name__}: {err}"
        ) from None


def _record_step(source: Source, unit: LoadUnit, table: pa.Table, fn, step) -> pa.Table:
    out = []
    for rec in table.to_pylist():
        row = rec.pop(ROW)
        what = f"record {row} of {unit.describe()}"
        res = _call(source, step, fn, rec, what, sorted(rec))
        if res is None:
            continue
        if not isinstance(res, dict):
            raise SourceError(
                f"source {source.name!r}: prepare {step.record} returned {type(res).__name__} for {what}: expected a "
                "dict or None"
            )
        out.append({**res, ROW: row})
    if not out:
        return table.schema.empty_table()
    return pa.Table.from_pylist(out)


def _batch_step(source: Source, unit: LoadUnit, table: pa.Table, fn, step) -> pa.Table:
    res = _call(source, step, fn, table, unit.describe(), [c for c in table.column_names if c != ROW])
    if not isinstance(res, pa.Table) or ROW not in res.column_names:
        raise SourceError(
            f"source {source.name!r}: prepare {step.batch} must return a pyarrow.Table that keeps the {ROW!r} "
            f"column it was given (got {type(res).__name__})"
        )
    return res


def _list_parts(col: pa.Array) -> tuple[np.ndarray, pa.Array]:
    """Row offsets and flat values of a list column (a null row: no entries)."""
    if pa.types.is_null(col.type):
        return np.zeros(len(col) + 1, np.int64), arrow_views.from_numpy(np.zeros(0, np.int64))
    offs = arrow_views.values(col.offsets).astype(np.int64)
    values = col.values.slice(int(offs[0]), int(offs[-1] - offs[0]))
    offs -= offs[0]
    if col.null_count:
        return arrow_views.nulls_emptied(offs, values, arrow_views.validity(col))
    return offs, values
