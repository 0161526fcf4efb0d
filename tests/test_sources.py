"""Sources against real parquet and zarr files: units from metadata, tokens equal to a direct read,
and errors that name the source, file and field."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

from overlord_dask import SourceError
from overlord_dask.plan import plan_from_dict
from overlord_dask.sources import discover_units, load_unit
from overlord_dask.sources.tokenizers import EOS_ID, byte_detokenize, byte_tokenize


def _plan(tmp_path, **src):
    s = {"name": "s", "weight": 1.0, **src}
    return plan_from_dict(
        {
            "sources": [s],
            "topology": {"dp": 1, "tokens_per_micro_batch": 1024},
            "loading": {"unit_rows": 3, "unit_tokens": 50},
        },
        base_dir=tmp_path,
    )


def _write_text(path, texts, row_group=4):
    pq.write_table(pa.table({"text": texts}), path, row_group_size=row_group)


def test_byte_tokenizer_roundtrip_unicode_and_nulls():
    arr = pa.array(["héllo", None, "", "日本"])
    tokens, offsets = byte_tokenize(arr)
    assert list(np.diff(offsets)) == [len("héllo".encode()) + 1, 1, 1, len("日本".encode()) + 1]
    docs = [tokens[offsets[i] : offsets[i + 1]] for i in range(4)]
    assert all(d[-1] == EOS_ID for d in docs)
    assert [byte_detokenize(d) for d in docs] == ["héllo", "", "", "日本"]
    # sliced arrays (non-zero offset) tokenize the slice only
    t2, o2 = byte_tokenize(arr.slice(3, 1))
    assert byte_detokenize(t2) == "日本"


def test_parquet_text_units_and_tokens(tmp_path):
    texts = [f"doc {i} " * (i + 1) for i in range(10)]
    (tmp_path / "d").mkdir()
    _write_text(tmp_path / "d" / "a.parquet", texts[:6])
    _write_text(tmp_path / "d" / "b.parquet", texts[6:])
    plan = _plan(tmp_path, format="parquet", url="d/*.parquet", text_field="text")
    units = discover_units(plan.sources[0], plan)
    # a.parquet: row groups of 4 and 2 rows, cut at unit_rows=3 -> 3+1+2; b.parquet: 4 rows -> 3+1
    assert [u.n_docs for u in units] == [3, 1, 2, 3, 1]
    assert [u.first_id for u in units] == [0, 3, 4, 6, 9]
    got = []
    for u in units:
        block = load_unit(plan.sources[0], plan, u)
        assert list(block.sample_ids) == list(range(u.first_id, u.first_id + u.n_docs))
        got += [byte_detokenize(block.doc(i)) for i in range(len(block))]
    assert got == texts


def test_parquet_token_lists_with_nulls(tmp_path):
    lists = [[5, 6, 7], None, [], [9] * 10]
    pq.write_table(pa.table({"ids": pa.array(lists, pa.list_(pa.int32()))}), tmp_path / "t.parquet")
    plan = _plan(tmp_path, format="parquet", url="t.parquet", tokens_field="ids")
    blocks = [load_unit(plan.sources[0], plan, u) for u in discover_units(plan.sources[0], plan)]
    docs = [list(b.doc(i)) for b in blocks for i in range(len(b))]
    assert docs == [[5, 6, 7], [], [], [9] * 10]


def test_a_load_unit_travels_as_a_plain_dict_and_back():
    """A unit goes to its load task as a dict of its fields (msgpack-friendly) and comes back
    equal, a jsonl byte range and an integrity digest included."""
    from dataclasses import asdict

    from overlord_dask.sources.units import LoadUnit

    for unit in (
        LoadUnit("web", 3, "/d/web-0.parquet", 2, 0, 250, 750),
        LoadUnit("chat", 0, "/d/chat.jsonl.zst", -1, 0, -1, 0, span=(1024, 4096), digest="blake2b:00ff"),
    ):
        d = unit.to_dict()
        assert d == asdict(unit) and type(d) is dict
        assert LoadUnit.from_dict(d) == unit


def test_zarr_units_follow_document_boundaries(tmp_path):
    lens = np.array([10, 40, 5, 70, 3, 30])
    offsets = np.concatenate([[0], np.cumsum(lens)])
    toks = np.arange(offsets[-1], dtype=np.int32)
    g = zarr.open_group(str(tmp_path / "b.zarr"), mode="w")
    g.create_array("tokens", shape=toks.shape, chunks=(32,), dtype="int32")[:] = toks
    g.create_array("offsets", shape=offsets.shape, chunks=(4,), dtype="int64")[:] = offsets
    plan = _plan(tmp_path, format="zarr", url="b.zarr")
    units = discover_units(plan.sources[0], plan)
    assert sum(u.n_docs for u in units) == 6 and len(units) > 1
    docs = []
    for u in units:
        b = load_unit(plan.sources[0], plan, u)
        docs += [b.doc(i) for i in range(len(b))]
    for i, d in enumerate(docs):
        np.testing.assert_array_equal(d, toks[offsets[i] : offsets[i + 1]])


def test_missing_file_and_empty_glob(tmp_path):
    plan = _plan(tmp_path, format="parquet", url="nope.parquet", text_field="text")
    with pytest.raises(SourceError, match=r"source 's': file not found: .*nope.parquet"):
        discover_units(plan.sources[0], plan)
    plan = _plan(tmp_path, format="parquet", url="none/*.parquet", text_field="text")
    with pytest.raises(SourceError, match=r"source 's': no files match .*none/\*\.parquet"):
        discover_units(plan.sources[0], plan)


def test_missing_column_lists_available(tmp_path):
    _write_text(tmp_path / "a.parquet", ["x"])
    plan = _plan(tmp_path, format="parquet", url="a.parquet", text_field="body")
    with pytest.raises(SourceError, match=r"column 'body' not found in .*a.parquet; available columns: \['text'\]"):
        discover_units(plan.sources[0], plan)


def test_schema_mismatch_names_file(tmp_path):
    (tmp_path / "d").mkdir()
    _write_text(tmp_path / "d" / "a.parquet", ["x"])
    pq.write_table(pa.table({"text": pa.array([1], pa.int64())}), tmp_path / "d" / "b.parquet")
    plan = _plan(tmp_path, format="parquet", url="d/*.parquet", text_field="text")
    with pytest.raises(SourceError, match=r"text_field 'text' in .*b.parquet has type int64, expected string"):
        discover_units(plan.sources[0], plan)


def test_corrupt_file_names_file(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"PAR1 this is not parquet")
    plan = _plan(tmp_path, format="parquet", url="bad.parquet", text_field="text")
    with pytest.raises(SourceError, match=r"corrupt or unreadable parquet file .*bad.parquet"):
        discover_units(plan.sources[0], plan)


def test_corrupt_page_is_caught_on_load(tmp_path):
    path = tmp_path / "c.parquet"
    texts = [f"{i:04d}" + "abcdefgh" * 200 for i in range(50)]
    pq.write_table(pa.table({"text": texts}), path, write_page_checksum=True, compression="none", use_dictionary=False)
    raw = bytearray(path.read_bytes())
    mid = len(raw) // 3
    raw[mid : mid + 64] = b"\xff" * 64
    path.write_bytes(bytes(raw))
    plan = _plan(tmp_path, format="parquet", url="c.parquet", text_field="text")
    units = discover_units(plan.sources[0], plan)  # the footer is intact
    with pytest.raises(SourceError, match=r"corrupt data in source 's' unit 0 \(.*c.parquet, row group 0"):
        load_unit(plan.sources[0], plan, units[0])


def test_empty_source(tmp_path):
    pq.write_table(pa.table({"text": pa.array([], pa.string())}), tmp_path / "e.parquet")
    plan = _plan(tmp_path, format="parquet", url="e.parquet", text_field="text")
    with pytest.raises(SourceError, match="source 's' is empty"):
        discover_units(plan.sources[0], plan)


def test_zarr_missing_array_and_bad_offsets(tmp_path):
    g = zarr.open_group(str(tmp_path / "z.zarr"), mode="w")
    g.create_array("tokens", shape=(10,), dtype="int32")[:] = np.arange(10)
    plan = _plan(tmp_path, format="zarr", url="z.zarr")
    with pytest.raises(
        SourceError, match=r"array 'offsets' not found in zarr group .*z.zarr.*available arrays: \['tokens'\]"
    ):
        discover_units(plan.sources[0], plan)
    g.create_array("offsets", shape=(3,), dtype="int64")[:] = [0, 4, 9]
    with pytest.raises(SourceError, match="offsets end at 9 but 'tokens' holds 10 tokens"):
        discover_units(plan.sources[0], plan)


def test_unknown_tokenizer_and_transform(tmp_path):
    _write_text(tmp_path / "a.parquet", ["x"])
    plan = _plan(tmp_path, format="parquet", url="a.parquet", text_field="text", tokenizer="sentencepiece")
    with pytest.raises(
        SourceError, match="source 's': tokenizer file not found: .*sentencepiece.* \\(a tokenizer is `byte`"
    ):
        discover_units(plan.sources[0], plan)
    plan = _plan(tmp_path, format="parquet", url="a.parquet", text_field="text", transform="no_such_module:fn")
    with pytest.raises(SourceError, match="cannot import 'no_such_module:fn': module 'no_such_module'"):
        discover_units(plan.sources[0], plan)


def drop_short(block):
    """A user transform (``tests.test_sources:drop_short``): empty documents shorter than 3 tokens."""
    from overlord_dask.sources.blocks import SampleBlock

    lens = block.lengths()
    keep = np.where(lens >= 3, lens, 0)
    toks = np.concatenate([block.doc(i) if keep[i] else block.doc(i)[:0] for i in range(len(block))])
    return SampleBlock(block.source, toks, np.concatenate([[0], np.cumsum(keep)]), block.sample_ids)


def test_custom_tokenizer_and_transform(tmp_path):
    _write_text(tmp_path / "a.parquet", ["ab", "abcdef", "a"])
    plan = _plan(
        tmp_path, format="parquet", url="a.parquet", text_field="text", transform="tests.test_sources:drop_short"
    )
    blocks = [load_unit(plan.sources[0], plan, u) for u in discover_units(plan.sources[0], plan)]
    assert [len(b.doc(i)) for b in blocks for i in range(len(b))] == [3, 7, 0]


def test_hf_bpe_tokenizer_file(tmp_path):
    """``tokenizer: hf:PATH``: a BPE trained here, named relative to the plan's folder, tokenizes
    on load exactly as the tokenizers library does, each document ended by its ``</s>``."""
    from tokenizers import Tokenizer

    from overlord_dask.service.demo import train_bpe

    texts = [f"the {w} sat on the mat number {i}" for i, w in enumerate(["cat", "dog", "ému", "日本"] * 20)] + [
        None,
        "",
    ]
    train_bpe([t for t in texts if t], tmp_path / "tok", vocab_size=300)
    _write_text(tmp_path / "a.parquet", texts)
    plan = _plan(tmp_path, format="parquet", url="a.parquet", text_field="text", tokenizer="tok")
    blocks = [load_unit(plan.sources[0], plan, u) for u in discover_units(plan.sources[0], plan)]
    got = [list(b.doc(i)) for b in blocks for i in range(len(b))]
    tok = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json"))
    eos = tok.token_to_id("</s>")
    assert eos == EOS_ID
    assert got == [tok.encode(t or "", add_special_tokens=False).ids + [eos] for t in texts]
    assert tok.decode(got[3][:-1]) == texts[3]
    assert max(max(d) for d in got) < 300

    plan = _plan(tmp_path, format="parquet", url="a.parquet", text_field="text", tokenizer="hf:missing.json")
    with pytest.raises(SourceError, match="source 's': tokenizer file not found: .*missing.json"):
        discover_units(plan.sources[0], plan)
    (tmp_path / "bad.json").write_text("{not a tokenizer")
    plan = _plan(tmp_path, format="parquet", url="a.parquet", text_field="text", tokenizer="hf:bad.json")
    with pytest.raises(SourceError, match="source 's': cannot load tokenizer file .*bad.json"):
        discover_units(plan.sources[0], plan)


@pytest.mark.integration
def test_parquet_source_on_s3_indexes_in_parallel_like_a_local_one(tmp_path, s3_server):
    """A parquet source on an S3-compatible server (moto, loopback): its footers are read in
    parallel, and the units (in the sorted file order) and tokens equal the same files' on disk."""
    import s3fs

    from overlord_dask.service.indexing import index_sources
    from overlord_dask.testing.object_store import create_bucket, storage_options

    for f in range(5):
        _write_text(
            tmp_path / f"part-{f}.parquet", [f"file {f} doc {i} " * (i % 4 + 1) for i in range(7 + f)], row_group=3
        )
    opts = storage_options(s3_server)
    create_bucket(s3_server, "corpus-idx")
    fs = s3fs.S3FileSystem(**opts)
    for f in range(5):
        fs.put(str(tmp_path / f"part-{f}.parquet"), f"corpus-idx/web/part-{f}.parquet")
    local = _plan(tmp_path, format="parquet", url="part-*.parquet", text_field="text")
    remote = _plan(
        tmp_path, format="parquet", url="s3://corpus-idx/web/*.parquet", text_field="text", storage_options=opts
    )
    lu = index_sources(local)["s"]
    ru = index_sources(remote)["s"]
    key = lambda u: (u.path.rsplit("/", 1)[1], u.part, u.start, u.stop, u.first_id)  # noqa: E731
    assert [key(u) for u in ru] == [key(u) for u in lu] and len(ru) > 5
    for a, b in zip(lu, ru):
        ba, bb = load_unit(local.sources[0], local, a), load_unit(remote.sources[0], remote, b)
        assert np.array_equal(ba.tokens, bb.tokens) and np.array_equal(ba.sample_ids, bb.sample_ids)


def test_zarr_loads_open_the_group_once_per_plan(tmp_path, monkeypatch):
    """A worker's loads of one plan version share the opened group (its metadata is read once,
    a few requests on S3, not per unit); another plan object opens it again; chunks are read
    at every load, so the tokens are the file's."""
    from overlord_dask.sources import zarr_source

    lens = [7, 20, 33, 12, 40, 25, 9, 30]
    offsets = np.concatenate([[0], np.cumsum(lens)])
    g = zarr.open_group(str(tmp_path / "z.zarr"), mode="w")
    g.create_array("tokens", shape=(offsets[-1],), chunks=(16,), dtype="int32")[:] = np.arange(offsets[-1])
    g.create_array("offsets", shape=offsets.shape, dtype="int64")[:] = offsets
    opened = []
    real = zarr_source._open_group
    monkeypatch.setattr(zarr_source, "_open_group", lambda s, p: opened.append(p) or real(s, p))
    plan = _plan(tmp_path, format="zarr", url="z.zarr")
    units = discover_units(plan.sources[0], plan)
    assert len(units) > 2  # unit_tokens 50: several units
    opened.clear()
    blocks = [load_unit(plan.sources[0], plan, u) for u in units]
    assert len(opened) == 1
    np.testing.assert_array_equal(np.concatenate([b.tokens for b in blocks]), np.arange(offsets[-1]))
    again = _plan(tmp_path, format="zarr", url="z.zarr")
    load_unit(again.sources[0], again, units[0])
    assert len(opened) == 2


def test_blocks_keep_ids_in_the_narrowest_dtype_and_packing_widens_them():
    """A block keeps uint16 ids where every id fits (half the memory on its worker and half the
    bytes to every worker that builds from it), int32 otherwise; an image placeholder id past
    uint16 inserted into narrowed text is kept whole; packed micro-batches carry int32 ids."""

    from overlord_dask.protocol import block_key
    from overlord_dask.sources.blocks import SampleBlock
    from overlord_dask.sources.images import with_image_tokens
    from overlord_dask.worker.constructors import pack_micro_batch

    small = SampleBlock("s", np.array([5, 65535, 7], np.int64), np.array([0, 2, 3]), np.array([0, 1]))
    wide = SampleBlock("w", np.array([70000, 3], np.int64), np.array([0, 2]), np.array([0]))
    assert small.tokens.dtype == np.uint16 and wide.tokens.dtype == np.int32
    assert small.doc(0).tolist() == [5, 65535] and wide.doc(0).tolist() == [70000, 3]
    with pytest.raises(ValueError, match="source 's'"):
        SampleBlock("s", np.array([-1, 4]), np.array([0, 2]), np.array([0]))
    mm = with_image_tokens(
        "mm",
        100_000,
        "unit",
        small.tokens,
        small.offsets,
        small.sample_ids,
        [np.zeros((2, 3), np.uint8)],
        np.array([0, 1, 1]),
        np.array([1]),
    )
    assert mm.tokens.dtype == np.int32 and mm.doc(0).tolist() == [5, 100_000, 100_000, 65535]
    blocks = {block_key(0, 0, 0): small, block_key(1, 0, 0): wide}
    pieces = np.array([[0, 0, 0, 0, 0, 2], [1, 0, 0, 0, 0, 2], [0, 0, 0, 1, 0, 1]])
    mb = pack_micro_batch(pieces, blocks, capacity=8, piece_tokens=8)
    assert mb["input_ids"].dtype == np.int32 and mb["input_ids"][:5].tolist() == [5, 65535, 70000, 3, 7]
    assert mb["labels"][:5].tolist() == [65535, -100, 3, -100, -100]  # each piece ends its document


# ---- numpy views of Arrow arrays (sources/arrow_views.py) ----------------------------------------
def test_arrow_views_equal_pyarrows_own_conversions():
    """What the loaders read through the buffers is what pyarrow's conversions give: every
    fixed-width type, sliced arrays, several chunks, nulls (through pyarrow), built arrays."""
    import pyarrow.compute as pc

    from overlord_dask.sources import arrow_views as V
    from overlord_dask.sources.records import _list_parts

    rng = np.random.default_rng(0)
    for dt in (
        np.int8,
        np.uint8,
        np.int16,
        np.uint16,
        np.int32,
        np.uint32,
        np.int64,
        np.uint64,
        np.float32,
        np.float64,
    ):
        a = (rng.random(50) * 100).astype(dt)
        arr = pa.array(a)
        for part in (arr, arr.slice(7), arr.slice(3, 20), arr.slice(50)):
            got = V.values(part)
            assert got.dtype == part.to_numpy().dtype and np.array_equal(got, part.to_numpy())
        assert np.array_equal(V.values(pa.chunked_array([arr.slice(0, 10), arr.slice(10)])), a)
        back = V.from_numpy(a)
        assert back.type == arr.type and back.equals(arr)
    with_nulls = pa.array([1, None, 3], pa.int32())
    assert np.array_equal(V.values(with_nulls), with_nulls.to_numpy(zero_copy_only=False), equal_nan=True)
    with pytest.raises(TypeError, match="bool"):
        V.from_numpy(np.zeros(3, bool))

    for items, typ in [
        (["a", None, "héllo", ""], pa.string()),
        ([b"x", None, b"\x00\x01"], pa.binary()),
        ([[1, 2], None, [], [3]], pa.list_(pa.int64())),
        ([], pa.string()),
        ([None, None], pa.list_(pa.int64())),
        ([{"role": "user"}], pa.struct([("role", pa.string())])),  # (any other type: pa.array)
    ]:
        built = V.from_items(items, typ)
        built.validate(full=True)
        assert built.type == typ and built.to_pylist() == items

    # a list column whose null rows span values (Arrow allows it): they read as empty lists
    offsets = pa.array(np.array([0, 2, 5, 5, 7, 9], np.int32))
    for flat in (pa.array(np.arange(9, dtype=np.int32)), pa.array([str(i) for i in range(9)])):
        col = pa.ListArray.from_arrays(offsets, flat, mask=pa.array([False, True, True, False, False]))
        for part in (col, col.slice(1), col.slice(1, 3), col.slice(3)):
            got_offsets, got_values = _list_parts(part)
            want = pc.fill_null(part, pa.scalar([], type=part.type))
            assert got_offsets.tolist() == [0, *np.cumsum([len(x) for x in want.to_pylist()]).tolist()]
            assert got_values.to_pylist() == [v for x in want.to_pylist() for v in x]
