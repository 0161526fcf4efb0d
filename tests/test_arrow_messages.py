"""The Arrow IPC message walk (``sources/arrow_messages.py``): every record batch's byte range and
rows from the headers alone, for files and streams as pyarrow and ``datasets`` write them, and a
unit read from its batches' bytes alone; bytes that are not a whole IPC stream are refused."""

from __future__ import annotations

import io

import pyarrow as pa
import pyarrow.ipc as ipc
import pytest

from overlord_dask.sources import arrow_messages as am

TABLE = pa.table(
    {
        "text": [f"document {i} " * (i % 40) for i in range(5000)],
        "ids": [list(range(i % 7)) for i in range(5000)],
        "score": [i / 3 for i in range(5000)],
    }
)


def _write(kind: str, table=TABLE, chunk=613, **options) -> bytes:
    sink = io.BytesIO()
    opts = ipc.IpcWriteOptions(**options)
    w = (
        ipc.new_file(sink, table.schema, options=opts)
        if kind == "file"
        else ipc.new_stream(sink, table.schema, options=opts)
    )
    for b in table.to_batches(max_chunksize=chunk):
        w.write_batch(b)
    w.close()
    return sink.getvalue()


@pytest.mark.parametrize("kind", ["file", "stream"])
@pytest.mark.parametrize("compression", [None, "zstd"])
def test_the_walk_finds_every_batch_and_its_rows(kind, compression):
    raw = _write(kind, compression=compression)
    layout = am.walk(io.BytesIO(raw), len(raw))
    assert [rows for *_, rows in layout.batches] == [b.num_rows for b in TABLE.to_batches(max_chunksize=613)]
    assert not layout.dictionaries and layout.schema[0] == (8 if kind == "file" else 0)
    first = 0
    for off, length, rows in layout.batches:  # each batch alone, behind the schema message, reads as its rows
        data = raw[slice(*layout.schema)] + raw[off : off + length] + am.EOS
        assert ipc.open_stream(pa.BufferReader(data)).read_all().equals(TABLE.slice(first, rows))
        first += rows
    assert am.Layout.from_json(layout.to_json()) == layout


def test_a_datasets_shard_is_walked(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"text": TABLE.column("text").to_pylist()}).save_to_disk(str(tmp_path / "hf"))
    (path,) = sorted((tmp_path / "hf").glob("*.arrow"))
    raw = path.read_bytes()
    layout = am.walk(io.BytesIO(raw), len(raw))
    assert sum(rows for *_, rows in layout.batches) == 5000 and len(layout.batches) > 1


def test_dictionary_batches_are_flagged():
    table = pa.table({"lang": pa.array(["en", "de"] * 50).dictionary_encode(), "text": ["x"] * 100})
    raw = _write("stream", table, chunk=30)
    layout = am.walk(io.BytesIO(raw), len(raw))
    assert layout.dictionaries and sum(rows for *_, rows in layout.batches) == 100


def test_bytes_that_are_not_a_whole_stream_are_refused():
    raw = _write("stream")
    with pytest.raises(ValueError, match=r"truncated Arrow IPC (stream|message)"):
        am.walk(io.BytesIO(raw[: len(raw) // 2]), len(raw) // 2)
    junk = b"PAR1" + bytes(range(200))
    with pytest.raises(ValueError, match=r"no Arrow IPC message at byte 0"):
        am.walk(io.BytesIO(junk), len(junk))
