"""Reading the data users already have: jsonl (plain, gzip, zstd), Arrow (IPC, Feather, HF
``save_to_disk`` folders), webdataset shards, Megatron ``.bin/.idx``, and formats users register.

Every file here is written by the library its users write it with (``overlord_dask/testing/format_corpus.py``)
and the delivered documents are compared byte for byte with a reading that shares no code with
the readers (``tests/reference.py``: ``json``/``gzip``/``zstandard``, HF ``datasets``, the
``webdataset`` library, megatron-core's ``IndexedDataset``)."""

from __future__ import annotations

import gzip
import json
import os
import struct
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pytest

from overlord_dask import Service, connect
from overlord_dask.errors import PlanError, SourceError
from overlord_dask.observe.figures import exactly_once, planned_identities
from overlord_dask.plan import plan_from_dict
from overlord_dask.sources import UNKNOWN_BASE, Format, discover_units, load_unit, read_unit
from overlord_dask.sources.blocks import SampleBlock
from overlord_dask.sources.units import LoadUnit
from overlord_dask.testing.format_corpus import make_records, source_for, write, write_megatron
from overlord_dask.worker.loaders import load_block

from . import reference as ref
from .harness import assert_same_stream, consume, run_ranks

N_RECORDS, FILES = 240, 3
SERVED = ("jsonl", "jsonl.gz", "jsonl.zst", "arrow", "webdataset", "megatron")


@pytest.fixture(scope="session")
def fc(tmp_path_factory):
    """The format corpus: the same records as parquet, jsonl, jsonl.gz, jsonl.zst (frames of 4 kB,
    cut inside lines), an HF Arrow folder, webdataset shards and Megatron pairs."""
    os.environ["OVERLORD_CACHE_DIR"] = str(tmp_path_factory.mktemp("cache"))
    root = tmp_path_factory.mktemp("formats")
    records = make_records(N_RECORDS, seed=3, mean_words=25)
    urls = {
        fmt: write(root, records, fmt, files=FILES, frame_bytes=4000, row_group=50)
        for fmt in ("parquet", "jsonl", "jsonl.gz", "jsonl.zst", "arrow", "webdataset", "megatron")
    }
    return root, records, urls


def make_plan(root, *sources, topology=None, loading=None, **extra) -> object:
    data = {
        "name": "formats",
        "base_dir": str(root),
        "sources": list(sources),
        "seed": 11,
        "topology": {"dp": 2, "micro_batches": 1, "tokens_per_micro_batch": 2048, **(topology or {})},
        "loading": {"prefetch_steps": 3, **(loading or {})},
        "balance": {"window": 4},
        **extra,
    }
    return plan_from_dict(data, where="<test plan>")


def reference_docs(root: Path, fmt: str, url: str) -> list[np.ndarray]:
    """Every document of a written format in file order, read independently of the readers."""
    if fmt.startswith("jsonl"):
        texts = [r["text"] for p in sorted((root / url).iterdir()) for _, r in ref.jsonl_records(str(p))]
    elif fmt == "arrow":
        import datasets

        texts = datasets.load_from_disk(str(root / url))["text"]
    elif fmt == "webdataset":
        shards = sorted((root / "wds").glob("shard-*.tar"))
        texts = [m["txt"].decode() for shard in ref.webdataset_samples([str(p) for p in shards]) for _, m in shard]
    elif fmt == "megatron":
        return [d for p in sorted((root / url).glob("*.idx")) for d in ref.megatron_docs(str(p)[:-4])]
    else:
        import pyarrow.parquet as pq

        texts = [t for p in sorted((root / url).glob("*.parquet")) for t in pq.read_table(p).column("text").to_pylist()]
    return ref.tokens_of(texts)


def _units_in_order(plan) -> tuple[list, list[np.ndarray], list[int]]:
    src = plan.sources[0]
    units = discover_units(src, plan)
    docs, ids = [], []
    for u in units:
        b = load_unit(src, plan, u)
        docs += [b.doc(i) for i in range(len(b))]
        ids += b.sample_ids.tolist()
    return units, docs, ids


# ---- every unit, every format: the documents of the files, in order, with stable ids ------------------------
@pytest.mark.parametrize("fmt", ["parquet", "jsonl", "jsonl.gz", "jsonl.zst", "arrow", "webdataset", "megatron"])
@pytest.mark.parametrize("small", [True, False], ids=["small units", "default units"])
def test_units_read_every_document_once_in_file_order(fc, fmt, small):
    root, records, urls = fc
    loading = {"unit_bytes": 3000, "unit_rows": 17, "unit_tokens": 2000} if small else {}
    plan = make_plan(root, source_for(fmt, urls[fmt]), loading=loading)
    want = reference_docs(root, fmt, urls[fmt])
    assert len(want) == N_RECORDS and all(
        np.array_equal(a, b) for a, b in zip(want, ref.tokens_of([r["text"] for r in records]))
    )
    units, docs, ids = _units_in_order(plan)
    assert len(docs) == len(want) and all(np.array_equal(np.asarray(a), b) for a, b in zip(docs, want))
    if all(u.n_docs is not None for u in units):  # counted at indexing: dense ids, file order
        assert ids == list(range(N_RECORDS))
    else:  # counted when loaded: unit i's k-th document
        assert all(u.first_id == u.index * UNKNOWN_BASE for u in units)
        assert len(set(ids)) == len(ids) and all(i // UNKNOWN_BASE < len(units) for i in ids)
    if small and fmt != "webdataset":
        assert len(units) > 2 * FILES  # a file is cut into several units


_READ_IN_A_FRESH_PROCESS = """
import json, sys
from overlord_dask.plan import plan_from_dict
from overlord_dask.sources import discover_units, load_unit
plan = plan_from_dict(json.loads(sys.argv[1]), where="<test plan>")
for u in discover_units(plan.sources[0], plan):
    load_unit(plan.sources[0], plan, u)
print(json.dumps(sorted(m for m in ("pandas", "pyarrow.compute") if m in sys.modules)))
"""


@pytest.mark.parametrize("fmt", ["parquet", "parquet tokens", "jsonl.zst", "arrow", "webdataset", "megatron"])
def test_reading_a_format_imports_neither_pandas_nor_arrows_compute_kernels(fc, tmp_path, fmt):
    """A loader process holds what it reads and little else: pyarrow's numpy conversions
    (``to_numpy``, ``np.asarray(array)``, ``pa.array``) import pandas where it is installed
    (beside Dask's dashboard it is), tens of MB in every worker that never uses it
    (``sources/arrow_views.py`` reads and writes the buffers instead)."""
    import subprocess

    import pyarrow.parquet as pq

    root, records, urls = fc
    if fmt == "parquet tokens":  # pre-tokenized lists, one of them null
        toks = ref.tokens_of([r["text"] for r in records[:40]])
        lists = pa.array([t.tolist() for t in toks[:-1]] + [None], pa.list_(pa.int32()))
        (tmp_path / "tok").mkdir()
        pq.write_table(pa.table({"input_ids": lists}), tmp_path / "tok" / "part-0.parquet", row_group_size=16)
        source = {"name": "tok", "format": "parquet", "url": str(tmp_path / "tok"), "tokens_field": "input_ids"}
    else:
        source = source_for(fmt, str(root / urls[fmt]))
    data = {
        "name": "fresh",
        "seed": 1,
        "sources": [source],
        "topology": {"dp": 1, "micro_batches": 1, "tokens_per_micro_batch": 2048},
    }
    out = subprocess.run(
        [sys.executable, "-c", _READ_IN_A_FRESH_PROCESS, json.dumps(data)], capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == [], fmt


def test_jsonl_units_follow_the_file(fc):
    """How jsonl files are cut: plain files by byte ranges (counted when loaded), multi-frame zstd by
    runs of frames, gzip by its cached one-pass line index (counted: dense ids)."""
    root, _, urls = fc
    loading = {"unit_bytes": 3000}
    plain = discover_units(*_src(make_plan(root, source_for("jsonl", urls["jsonl"]), loading=loading)))
    assert all(u.n_docs is None and u.span[1] - u.span[0] <= 3000 for u in plain)
    zst = discover_units(*_src(make_plan(root, source_for("jsonl.zst", urls["jsonl.zst"]), loading=loading)))
    assert all(u.n_docs is None and len(u.span) == 3 for u in zst)
    gz_plan = make_plan(root, source_for("jsonl.gz", urls["jsonl.gz"]), loading=loading)
    gz = discover_units(*_src(gz_plan))
    assert all(u.n_docs is not None for u in gz) and sum(u.n_docs for u in gz) == N_RECORDS
    cached = list(Path(os.environ["OVERLORD_CACHE_DIR"]).glob("jsonl-index/*.json"))
    assert len(cached) >= FILES
    assert discover_units(*_src(gz_plan)) == gz  # from the cache


def _src(plan):
    return plan.sources[0], plan


def test_zstd_seek_table_and_single_frames(fc, tmp_path):
    """A seekable-format zstd file (seek table at its end) is cut from the table; a one-frame file
    through the line index; both read every line."""
    import zstandard

    _, records, _ = fc
    raw = "".join(json.dumps(r) + "\n" for r in records).encode()
    c = zstandard.ZstdCompressor()
    frames = [(raw[a : a + 5000], c.compress(raw[a : a + 5000])) for a in range(0, len(raw), 5000)]
    table = b"".join(struct.pack("<II", len(z), len(d)) for d, z in frames) + struct.pack(
        "<IBI", len(frames), 0, 0x8F92EAB1
    )
    (tmp_path / "seekable.jsonl.zst").write_bytes(
        b"".join(z for _, z in frames) + struct.pack("<II", 0x184D2A5E, len(table)) + table
    )
    (tmp_path / "one.jsonl.zst").write_bytes(c.compress(raw))
    want = ref.tokens_of([r["text"] for r in records])
    for name, counted in (("seekable.jsonl.zst", False), ("one.jsonl.zst", True)):
        plan = make_plan(
            tmp_path, {"name": "z", "format": "jsonl", "url": name, "text_field": "text"}, loading={"unit_bytes": 12000}
        )
        units, docs, _ = _units_in_order(plan)
        assert len(units) > 3 and all((u.n_docs is not None) == counted for u in units)
        assert len(docs) == len(want) and all(np.array_equal(np.asarray(a), b) for a, b in zip(docs, want)), name


def test_a_counted_unit_read_in_parts_equals_the_whole(fc):
    """Auto-partitioning reads a unit as document ranges: for every counted format, the parts
    concatenated are the whole (the gzip index's units too)."""
    root, _, urls = fc
    for fmt in ("jsonl.gz", "arrow", "megatron", "parquet"):
        plan = make_plan(
            root, source_for(fmt, urls[fmt]), loading={"unit_bytes": 6000, "unit_rows": 40, "unit_tokens": 4000}
        )
        sp = plan.source_plan(plan.sources[0].name)
        for u in discover_units(*_src(plan))[:3]:
            whole = load_block(sp, u.to_dict())
            n = u.n_docs
            parts = [load_block(sp, u.to_dict(), part=(a, b)) for a, b in ((0, n // 3), (n // 3, n - 1), (n - 1, n))]
            joined = SampleBlock.concat(parts)
            assert np.array_equal(joined.tokens, whole.tokens) and np.array_equal(
                joined.sample_ids, whole.sample_ids
            ), fmt


def test_units_round_trip_through_the_wire():
    u = LoadUnit("s", 3, "/x.jsonl.zst", -1, 0, -1, 3 * UNKNOWN_BASE, (10, 20, 5))
    assert LoadUnit.from_dict(u.to_dict()) == u and u.n_docs is None and "bytes 10:20" in u.describe()


def test_partition_reads_an_uncounted_unit_with_one_task():
    from overlord_dask.loading.partition import partition

    tasks = partition([["s", 0, 0], ["s", 0, 1]], lambda s, u: None if u == 0 else 1000, {"s": 0.01}, 0.5)
    assert tasks[0].parts is None and tasks[0].units == [(0, 0)] and tasks[1].parts


# ---- through the service: exactly once, the files' bytes, any worker count, resume --------------------------
def _id_map(root: Path, fmt: str, url: str, plan) -> dict[int, np.ndarray]:
    """Sample id -> document, computed from the files with the format's id rule (not the readers)."""
    docs = reference_docs(root, fmt, url)
    if fmt in ("jsonl.gz", "arrow", "megatron", "parquet"):
        return dict(enumerate(docs))
    if fmt == "webdataset":
        shards = sorted((root / "wds").glob("shard-*.tar"))
        sizes = [n for p in shards for n in ref.webdataset_unit_sizes(str(p), plan.loading.unit_bytes)]
        keys = [(i, k) for i, n in enumerate(sizes) for k in range(n)]
        return {i * UNKNOWN_BASE + k: d for (i, k), d in zip(keys, docs, strict=True)}
    # plain jsonl: unit = the file's units before it + the line's byte offset // unit_bytes; the k-th line starting
    # there
    # jsonl.zst with one unit per file (unit_bytes above the file size): unit = the file
    step = plan.loading.unit_bytes
    out, base, it = {}, 0, iter(docs)
    for p in sorted((root / url).iterdir()):
        counts: dict[int, int] = {}
        size = len(p.read_bytes()) if fmt == "jsonl" else None
        for off, _ in ref.jsonl_records(str(p)):
            unit = base + (off // step if fmt == "jsonl" else 0)
            k = counts.get(unit, 0)
            counts[unit] = k + 1
            out[unit * UNKNOWN_BASE + k] = next(it)
        base += -(-size // step) if fmt == "jsonl" else 1
    return out


def _serve_and_check(plan, root, fmt, url, cluster, steps: int) -> set:
    """Run ``steps`` steps on every rank (exactly once: ``test_pipelines.run``) and check every
    piece against the files; the epochs delivered."""
    from tests.test_pipelines import run

    docs = _id_map(root, fmt, url, plan)
    got, _, _ = run(plan, cluster, steps)
    epochs = set()
    for batches in got.values():
        for b in batches:
            for mb in b["micro_batches"]:
                cu = mb["cu_seqlens"]
                for k in range(len(mb["sample_ids"])):
                    doc = docs[int(mb["sample_ids"][k])]
                    start = int(mb["piece_starts"][k])
                    np.testing.assert_array_equal(
                        mb["input_ids"][cu[k] : cu[k + 1]], doc[start : start + cu[k + 1] - cu[k]]
                    )
                epochs.update(mb["epochs"].tolist())
    return epochs


@pytest.mark.integration
@pytest.mark.parametrize("fmt", SERVED)
def test_the_service_delivers_each_format_exactly_once_as_in_the_files(fc, cluster, fmt):
    root, _, urls = fc
    loading = (
        {"unit_bytes": 1 << 30} if fmt == "jsonl.zst" else {"unit_bytes": 5000, "unit_rows": 30, "unit_tokens": 3000}
    )
    plan = make_plan(root, source_for(fmt, urls[fmt]), loading=loading)
    assert _serve_and_check(plan, root, fmt, urls[fmt], cluster, steps=14) == {0, 1}  # past the end of the first pass


@pytest.mark.integration
def test_the_stream_does_not_depend_on_the_worker_count(fc, cluster):
    """Units counted only when loaded (plain jsonl byte ranges, webdataset shards): the same
    plan on 2 and on 1 worker processes plans the same pieces, step by step."""
    root, _, urls = fc
    plan = make_plan(
        root,
        source_for("jsonl", urls["jsonl"]),
        source_for("webdataset", urls["webdataset"], weight=0.5),
        loading={"unit_bytes": 4000},
    )
    steps = 10
    ledgers = []
    for where in ({"cluster": cluster}, {"n_workers": 1}):
        with Service.start(plan, **where) as service:

            def consume(rank):
                with connect(service.address, rank, timeout=120) as s:
                    for _ in range(steps):
                        s.next_batch()
                    s.commit()

            run_ranks(consume, range(2))
            ledgers.append(service.ledger(0, steps))
    for s in range(steps):
        assert np.array_equal(planned_identities(ledgers[0][s]), planned_identities(ledgers[1][s])), s


@pytest.mark.integration
def test_a_job_back_with_another_dp_on_webdataset_is_exactly_once(fc, cluster):

    root, _, urls = fc
    plan = make_plan(root, source_for("webdataset", urls["webdataset"]), topology={"dp": 3})
    with Service.start(plan, cluster=cluster) as service:
        three = consume(service.address, range(3), until=12, dp=3, save_at=(5,), save_final=False)
        two = consume(service.address, range(2), until=15, dp=2, states={r: three.saved[(r, 5)] for r in range(2)})

        ledger = service.ledger(0, 15)
    delivered = three.delivered(before=5) + two.delivered()
    assert exactly_once([planned_identities(ledger[s]) for s in range(15)], delivered) == (0, 0)


@pytest.mark.integration
def test_a_restarted_service_resumes_a_jsonl_run_exactly(fc, cluster, tmp_path):
    """Snapshot, stop, start again: units counted only when loaded are counted again, and the
    resumed stream is the uninterrupted one."""

    root, _, urls = fc
    src = source_for("jsonl", urls["jsonl"])
    plain = make_plan(root, src, loading={"unit_bytes": 4000})
    with Service.start(plain, cluster=cluster) as service:
        want = consume(service.address, range(2), until=16).digests
    ck = make_plan(
        root, src, loading={"unit_bytes": 4000}, checkpoint={"url": str(tmp_path / "ck"), "base_every_steps": 3}
    )
    with Service.start(ck, cluster=cluster) as service:
        first = consume(service.address, range(2), until=7, save_at=(7,), save_final=False)
        service.wait_for_step(7, timeout=60)
    with Service.start(ck, cluster=cluster) as service:
        rest = consume(service.address, range(2), until=16, states={r: first.saved[(r, 7)] for r in range(2)})
    assert_same_stream({**first.digests, **rest.digests}, want)


# ---- preparing records before tokenizing ----------------------------------------------------------------------
def keep_english(record: dict, min_quality: float = 0.5):
    """A record filter and map (``tests.test_formats:keep_english``)."""
    if record["lang"] != "en" or record["quality"] <= min_quality:
        return None
    return {**record, "text": record["text"].replace('"quoted"', "").strip()}


def keep_english_batch(table: pa.Table, min_quality: float = 0.5) -> pa.Table:
    """The same as a batch step (``tests.test_formats:keep_english_batch``)."""
    kept = table.filter(pc.and_(pc.equal(table["lang"], "en"), pc.greater(table["quality"], min_quality)))
    text = pc.utf8_trim_whitespace(pc.replace_substring(kept["text"], '"quoted"', ""))
    return kept.set_column(kept.column_names.index("text"), "text", text)


def needs_topic(record: dict):
    return record if record["topic"] == "science" else None


RECORD, BATCH, WDS = (
    {"record": "tests.test_formats:keep_english"},
    {"batch": "tests.test_formats:keep_english_batch"},
    {"record": "tests.test_formats:keep_english_wds"},
)


@pytest.mark.parametrize(
    "fmt,step",
    [
        ("jsonl", RECORD),
        ("jsonl", BATCH),
        ("parquet", RECORD),
        ("parquet", BATCH),
        ("arrow", RECORD),
        ("arrow", BATCH),
        ("webdataset", WDS),
    ],
    ids=lambda v: v if isinstance(v, str) else next(iter(v)),
)
def test_prepare_filters_and_maps_records_with_every_column(fc, fmt, step):
    """Dropped records stay in place as empty documents (ids unchanged) and are counted (the
    webdataset samples' metadata is their ``json`` member: a record step reads it)."""
    root, records, urls = fc
    plan = make_plan(
        root, source_for(fmt, urls[fmt], prepare=[{**step, "kwargs": {"min_quality": 0.4}}]), loading={"unit_rows": 50}
    )
    src = plan.sources[0]
    docs, dropped = [], 0
    for u in discover_units(src, plan):
        loaded = read_unit(src, plan, u)
        docs += [loaded.block.doc(i) for i in range(len(loaded.block))]
        dropped += loaded.dropped
    kept = [keep_english(dict(r), 0.4) for r in records]
    assert dropped == sum(k is None for k in kept) > 0
    want = ref.tokens_of([k["text"] if k else None for k in kept])
    for k, got, w in zip(kept, docs, want):
        if k is None:
            assert len(got) == 0
        else:
            np.testing.assert_array_equal(got, w)


def keep_english_wds(record: dict, min_quality: float = 0.5):
    """``keep_english`` for webdataset samples, whose metadata is their ``json`` member."""
    kept = keep_english({"text": record["txt"], **json.loads(record["json"])}, min_quality)
    return None if kept is None else {**record, "txt": kept["text"]}


@pytest.mark.integration
def test_dropped_records_are_counted_in_status_and_the_dashboard(fc, cluster):
    root, records, urls = fc
    plan = make_plan(
        root,
        source_for("jsonl", urls["jsonl"], prepare=[{"record": "tests.test_formats:keep_english"}]),
        loading={"unit_bytes": 1 << 30},
    )  # one unit per file: every record read by step 14
    kept = [keep_english(dict(r)) for r in records]
    steps = 6
    with Service.start(plan, cluster=cluster) as service:

        def consume(rank):
            with connect(service.address, rank, timeout=120) as s:
                for _ in range(steps):
                    b = s.next_batch()
                    for mb in b["micro_batches"]:
                        assert all(
                            kept[int(i) % UNKNOWN_BASE + _file_base(records, int(i) // UNKNOWN_BASE)] is not None
                            for i in mb["sample_ids"]
                        )
                s.commit()

        run_ranks(consume, range(2))
        service.wait_for_step(steps, timeout=60)
        status = service.status()
        per = status["records"]["jsonl"]
        assert per["read"] == N_RECORDS and per["dropped"] == sum(k is None for k in kept)
        deadline = time.monotonic() + 30
        while True:  # the dashboard's view is refreshed by the planner thread every few seconds
            page = service.client.run_on_scheduler(
                lambda dask_scheduler: dask_scheduler.plugins["overlord-planner"].observed
            )
            row = next(s for s in page["sources"] if s["source"] == "jsonl")
            if row["records_dropped"] == per["dropped"] or time.monotonic() > deadline:
                break
            time.sleep(0.5)
    assert row["records_dropped"] == per["dropped"] and row["records_read"] == N_RECORDS


def _file_base(records, file_index: int) -> int:
    sizes = [len(p) for p in np.array_split(np.arange(len(records)), FILES)]
    return int(sum(sizes[:file_index]))


def test_a_prepare_step_that_asks_for_a_missing_column_names_it(fc):
    root, _, urls = fc
    plan = make_plan(root, source_for("jsonl", urls["jsonl"], prepare=[{"record": "tests.test_formats:needs_topic"}]))
    src = plan.sources[0]
    with pytest.raises(
        SourceError,
        match=r"prepare tests.test_formats:needs_topic asks for column 'topic' that record 0 of source "
        r"'jsonl' unit 0 \(.*part-000.jsonl.*\) does not have \(columns: \['id', 'lang', 'quality', 'text'\]\)",
    ):
        read_unit(src, plan, discover_units(src, plan)[0])


def test_prepare_is_refused_for_token_formats(fc):
    root, _, urls = fc
    with pytest.raises(
        PlanError, match="megatron source 'megatron' stores token ids, not records: prepare is not allowed"
    ):
        make_plan(
            root, source_for("megatron", urls["megatron"], prepare=[{"record": "tests.test_formats:keep_english"}])
        )


# ---- a changed prepare function is noticed on resume ---------------------------------------------------------
@pytest.mark.integration
def test_resuming_with_changed_prepare_code_is_refused_or_accepted_and_logged(fc, tmp_path, monkeypatch, caplog):
    import linecache
    import logging

    from overlord_dask.plan.code import identity

    root, _, urls = fc
    mod = tmp_path / "mods"
    mod.mkdir()
    monkeypatch.syspath_prepend(str(mod))
    monkeypatch.setenv(
        "PYTHONPATH", f"{mod}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"
    )  # the workers started below import it

    def write_filter(threshold: float) -> None:  # as a user edits the file between two runs (each a new process)
        (mod / "my_filters.py").write_text(
            f"def keep(record):\n    return record if record['quality'] > {threshold} else None\n"
        )
        sys.modules.pop("my_filters", None)
        identity.cache_clear()
        linecache.checkcache()

    def plan(**ck):
        return make_plan(
            root,
            source_for("jsonl", urls["jsonl"], prepare=[{"record": "my_filters:keep"}]),
            topology={"dp": 1},
            checkpoint={"url": str(tmp_path / "ck"), "base_every_steps": 1, **ck},
        )

    def consume(service, steps):
        with connect(service.address, 0, timeout=120) as s:
            for _ in range(steps):
                s.next_batch()
            s.commit()
        service.wait_for_step(steps, timeout=60)

    write_filter(0.2)
    with Service.start(plan(), n_workers=1) as service:
        consume(service, 3)
    write_filter(0.3)
    with pytest.raises(
        PlanError,
        match=r"the code of jsonl: my_filters:keep changed since the snapshot of step \d+: resuming would "
        r"yield other documents .* set checkpoint.on_code_change: accept",
    ):
        Service.start(plan(), n_workers=1)
    caplog.set_level(logging.INFO, logger="overlord_dask.events")
    with Service.start(plan(on_code_change="accept"), n_workers=1) as service:
        consume(service, 2)
    assert any("event=code_changed" in r.getMessage() and "my_filters:keep" in r.getMessage() for r in caplog.records)
    write_filter(0.3)  # unchanged since the last snapshot: resumes without a word
    with Service.start(plan(), n_workers=1) as service:
        consume(service, 1)


# ---- bad input names its culprit -----------------------------------------------------------------------------
def _read_all(plan):
    src = plan.sources[0]
    for u in discover_units(src, plan):
        load_unit(src, plan, u)


def test_a_malformed_json_line_is_named_by_file_and_line(tmp_path):
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(500)]
    lines[321] = '{"text": "no end'
    raw = ("\n".join(lines) + "\n").encode()
    (tmp_path / "a.jsonl").write_bytes(raw)
    (tmp_path / "b.jsonl.gz").write_bytes(gzip.compress(raw))
    import zstandard

    c = zstandard.ZstdCompressor()
    (tmp_path / "c.jsonl.zst").write_bytes(b"".join(c.compress(raw[a : a + 1500]) for a in range(0, len(raw), 1500)))
    for name in ("a.jsonl", "b.jsonl.gz", "c.jsonl.zst"):
        plan = make_plan(
            tmp_path, {"name": "j", "format": "jsonl", "url": name, "text_field": "text"}, loading={"unit_bytes": 2000}
        )
        with pytest.raises(SourceError, match=rf"malformed JSON in .*{name}, line 322: Unterminated string"):
            _read_all(plan)


def test_a_value_of_another_type_is_named_by_line(tmp_path):
    lines = [json.dumps({"text": f"doc {i}"}) for i in range(50)]
    lines[7] = json.dumps({"text": 17})
    (tmp_path / "a.jsonl").write_text("\n".join(lines) + "\n")
    plan = make_plan(tmp_path, {"name": "j", "format": "jsonl", "url": "a.jsonl", "text_field": "text"})
    with pytest.raises(SourceError, match=r"a.jsonl, line 8: .*changed from string to number"):
        _read_all(plan)


@pytest.mark.parametrize("suffix", ["gz", "zst"])
def test_a_truncated_compressed_file_is_named(tmp_path, suffix):
    import zstandard

    raw = "".join(json.dumps({"text": f"doc {i} " * 30}) + "\n" for i in range(400)).encode()
    data = gzip.compress(raw) if suffix == "gz" else zstandard.ZstdCompressor().compress(raw)
    (tmp_path / f"t.jsonl.{suffix}").write_bytes(data[: len(data) * 2 // 3])
    plan = make_plan(tmp_path, {"name": "j", "format": "jsonl", "url": f"t.jsonl.{suffix}", "text_field": "text"})
    with pytest.raises(SourceError, match=rf"truncated {'gzip' if suffix == 'gz' else 'zstd'} file .*t.jsonl.{suffix}"):
        _read_all(plan)


def test_a_tar_sample_without_its_text_member_names_shard_and_key(tmp_path):
    import webdataset as wds

    with wds.TarWriter(str(tmp_path / "s-000.tar")) as w:
        w.write({"__key__": "a", "txt": "one"})
        w.write({"__key__": "b", "json": "{}"})
    plan = make_plan(tmp_path, {"name": "w", "format": "webdataset", "url": "s-000.tar", "text_field": "txt"})
    with pytest.raises(SourceError, match=r"s-000.tar.*sample 'b' has no 'txt' member \(members: \['json'\]\)"):
        _read_all(plan)
    (tmp_path / "s-001.tar").write_bytes((tmp_path / "s-000.tar").read_bytes()[:700])
    plan = make_plan(tmp_path, {"name": "w", "format": "webdataset", "url": "s-001.tar", "text_field": "txt"})
    with pytest.raises(SourceError, match=r"s-001.tar.*corrupt or truncated tar shard"):
        _read_all(plan)


def test_an_idx_that_does_not_match_its_bin_is_named(tmp_path):
    docs = [np.arange(i * 10, i * 10 + 50, dtype=np.uint16) for i in range(20)]
    write_megatron(tmp_path / "c_text_document", docs)
    bin_path = tmp_path / "c_text_document.bin"
    bin_path.write_bytes(bin_path.read_bytes()[:-6])
    plan = make_plan(tmp_path, {"name": "m", "format": "megatron", "url": "c_text_document"})
    with pytest.raises(
        SourceError,
        match=r"c_text_document.idx does not match .*c_text_document.bin: the index describes 2,000 bytes "
        r"of uint16 tokens, the .bin holds 1,994",
    ):
        _read_all(plan)
    (tmp_path / "d_text_document.idx").write_bytes(b"not an index at all, no")
    (tmp_path / "d_text_document.bin").write_bytes(b"")
    plan = make_plan(tmp_path, {"name": "m", "format": "megatron", "url": "d_text_document"})
    with pytest.raises(SourceError, match="d_text_document.idx is not a Megatron index"):
        _read_all(plan)


def test_a_datasetdict_folder_points_at_its_splits(tmp_path):
    import datasets

    datasets.DatasetDict(
        {"train": datasets.Dataset.from_dict({"text": ["a"]}), "test": datasets.Dataset.from_dict({"text": ["b"]})}
    ).save_to_disk(str(tmp_path / "dd"))
    plan = make_plan(tmp_path, {"name": "a", "format": "arrow", "url": "dd", "text_field": "text"})
    with pytest.raises(
        SourceError, match=r"is a datasets DatasetDict folder; point url at one of its splits \(dd/train, dd/test\)"
    ):
        _read_all(plan)
    plan = make_plan(tmp_path, {"name": "a", "format": "arrow", "url": "dd/train", "text_field": "text"})
    _read_all(plan)


# ---- quarantine: retry, then record, never skip silently -------------------------------------------------------
@pytest.mark.integration
def test_a_corrupt_unit_is_quarantined_and_recorded_or_fails_the_run(fc, cluster, tmp_path):
    root, _, urls = fc
    bad = tmp_path / "bad"
    bad.mkdir()
    files = sorted((root / urls["jsonl"]).iterdir())
    for p in files:
        (bad / p.name).write_bytes(p.read_bytes())
    text = (bad / files[1].name).read_text().splitlines()
    text[5] = text[5][:-3]  # one damaged line in the second file
    (bad / files[1].name).write_text("\n".join(text) + "\n")
    src = {"name": "web", "format": "jsonl", "url": str(bad), "text_field": "text"}
    plan = make_plan(tmp_path, src, loading={"unit_bytes": 1 << 30, "on_corrupt": "quarantine", "retries": 1})
    with Service.start(plan, cluster=cluster) as service:

        def consume(rank):
            with connect(service.address, rank, timeout=120) as s:
                for _ in range(12):
                    b = s.next_batch()
                    for mb in b["micro_batches"]:
                        assert not np.any(mb["sample_ids"] // UNKNOWN_BASE == 1)  # nothing of the quarantined file
                s.commit()

        run_ranks(consume, range(2))
        status = service.status()
    assert status["failure"] is None and status["quarantined_units"] == 1
    q = status["quarantined"][0]
    assert q["source"] == "web" and q["unit"] == 1 and files[1].name in q["reason"] and "line 6" in q["reason"]

    plan = make_plan(tmp_path, src, loading={"unit_bytes": 1 << 30, "retries": 0})
    with Service.start(plan, cluster=cluster) as service:
        with connect(service.address, 0, timeout=120) as s:
            with pytest.raises(Exception, match=rf"{files[1].name}, line 6: "):
                for _ in range(20):
                    s.next_batch()


# ---- formats users add ----------------------------------------------------------------------------------------
class TsvFormat(Format):
    """A user's format (``tests.test_formats:TsvFormat``): one document per line of ``*.tsv``
    files, its text in the column the plan's ``text_field`` names by number."""

    name = "tsv"
    suffixes = (".tsv",)

    def discover(self, source, plan):
        from overlord_dask.sources.fs import list_files

        fs, files = list_files(source, plan.base_dir, self.suffixes)
        units, first = [], 0
        for path in files:
            n = sum(1 for _ in fs.open(path, "rt"))
            units.append(LoadUnit(source.name, len(units), path, -1, 0, n, first))
            first += n
        return units

    def read(self, source, plan, unit):
        with open(unit.path, encoding="utf-8") as f:
            rows = [line.rstrip("\n").split("\t") for line in f]
        return pa.table({source.text_field: [r[1] for r in rows]})


def test_a_format_named_as_module_class_or_registered_by_entry_point(tmp_path, monkeypatch):
    from overlord_dask.plan import formats

    (tmp_path / "a.tsv").write_text("1\thello\n2\tworld\n")
    with pytest.raises(
        PlanError,
        match=r"unknown format 'tsv': registered formats are \['arrow', 'jsonl', 'megatron', 'parquet', "
        r"'webdataset', 'zarr'\], or name a reader class as 'module:Class'",
    ):
        make_plan(tmp_path, {"name": "t", "format": "tsv", "url": "a.tsv", "text_field": "text"})
    plan = make_plan(
        tmp_path, {"name": "t", "format": "tests.test_formats:keep_english", "url": "a.tsv", "text_field": "text"}
    )
    with pytest.raises(SourceError, match="is not a subclass of overlord_dask.sources.formats.Format"):
        discover_units(plan.sources[0], plan)
    dist = tmp_path / "site" / "my_formats-1.0.dist-info"  # an installed package that registers 'tsv'
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: my-formats\nVersion: 1.0\n")
    (dist / "entry_points.txt").write_text("[overlord_dask.formats]\ntsv = tests.test_formats:TsvFormat\n")
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    formats.registered.cache_clear()
    try:
        for name in ("tests.test_formats:TsvFormat", "tsv"):
            plan = make_plan(tmp_path, {"name": "t", "format": name, "url": "a.tsv", "text_field": "text"})
            _, docs, _ = _units_in_order(plan)
            assert [np.asarray(d).tolist() for d in docs] == [t.tolist() for t in ref.tokens_of(["hello", "world"])]
    finally:
        formats.registered.cache_clear()


def test_object_store_extras_are_declared_and_named_when_missing():
    import tomllib

    extras = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    assert any(d.startswith("s3fs") for d in extras["s3"]) and any(d.startswith("gcsfs") for d in extras["gcs"])
    assert any(d.startswith("adlfs") for d in extras["azure"]) and any(
        d.startswith("huggingface_hub") for d in extras["hf"]
    )
    try:
        import gcsfs  # noqa: F401
    except ImportError:
        plan = make_plan("/tmp", {"name": "g", "format": "jsonl", "url": "gs://bucket/x/*.jsonl", "text_field": "text"})
        with pytest.raises(SourceError, match=r"install overlord-dask\[gcs\]"):
            discover_units(plan.sources[0], plan)


def test_hf_urls_resolve_through_fsspec():
    from fsspec.core import url_to_fs

    fs, path = url_to_fs("hf://datasets/HuggingFaceFW/fineweb/sample/10BT")
    assert type(fs).__name__ == "HfFileSystem" and path.startswith("datasets/HuggingFaceFW/fineweb")


@pytest.mark.integration
def test_jsonl_on_s3(fc, s3_server):
    """Plain and multi-frame zstd jsonl on an S3-compatible server: the same documents as the files."""
    import s3fs

    from overlord_dask.testing.object_store import STORAGE_OPTIONS

    root, _, urls = fc
    opts = {**STORAGE_OPTIONS, "client_kwargs": {**STORAGE_OPTIONS["client_kwargs"], "endpoint_url": s3_server}}
    fs = s3fs.S3FileSystem(**opts)
    for fmt in ("jsonl", "jsonl.zst", "webdataset", "megatron", "arrow"):
        local = root / (urls[fmt].split("/")[0])
        fs.put(str(local), f"overlord/formats/{local.name}", recursive=True)
        url = f"s3://overlord/formats/{urls[fmt]}"
        plan = make_plan(
            root, source_for(fmt, url, storage_options=opts), loading={"unit_bytes": 5000, "unit_tokens": 3000}
        )
        _, docs, _ = _units_in_order(plan)
        want = reference_docs(root, fmt, urls[fmt])
        assert len(docs) == len(want) and all(np.array_equal(np.asarray(a), b) for a, b in zip(docs, want)), fmt


@pytest.mark.integration
def test_arrow_on_s3_is_cut_into_the_row_ranges_of_a_local_copy(fc, s3_server, tmp_path, monkeypatch):
    """A remote Arrow folder: the units (rows, ids) of its local copy from the message headers,
    each read with ranged requests; the walk is cached for the next start; a file with a
    dictionary-encoded column is read whole by each of its units, with the same documents."""
    import s3fs

    from overlord_dask.sources import arrow_messages
    from overlord_dask.testing.object_store import STORAGE_OPTIONS

    monkeypatch.setenv("OVERLORD_CACHE_DIR", str(tmp_path / "cache"))
    root, _, urls = fc
    opts = {**STORAGE_OPTIONS, "client_kwargs": {**STORAGE_OPTIONS["client_kwargs"], "endpoint_url": s3_server}}
    fs = s3fs.S3FileSystem(**opts)
    local = root / urls["arrow"].split("/")[0]
    fs.put(str(local), "overlord/arrow-cut/", recursive=True)
    loading = {"unit_rows": 17}
    here = make_plan(root, source_for("arrow", urls["arrow"]), loading=loading)
    there = make_plan(
        root, source_for("arrow", f"s3://overlord/arrow-cut/{local.name}", storage_options=opts), loading=loading
    )
    units_here, docs_here, ids_here = _units_in_order(here)
    units_there, docs_there, ids_there = _units_in_order(there)
    assert [(u.start, u.stop, u.first_id) for u in units_there] == [(u.start, u.stop, u.first_id) for u in units_here]
    assert all(u.span is not None for u in units_there) and ids_there == ids_here == list(range(len(ids_here)))
    assert all(np.array_equal(a, b) for a, b in zip(docs_there, docs_here, strict=True))

    def no_walk(*_):
        raise AssertionError("walked again")

    monkeypatch.setattr(arrow_messages, "walk", no_walk)
    assert discover_units(there.sources[0], there) == units_there  # the cached walk
    monkeypatch.undo()

    table = pa.table(
        {"lang": pa.array(["en", "de", "fr"] * 40).dictionary_encode(), "text": [f"t{i}" * i for i in range(120)]}
    )
    with fs.open("overlord/dict/d.arrow", "wb") as f, pa.ipc.new_stream(f, table.schema) as w:
        w.write_table(table, max_chunksize=25)
    plan = make_plan(
        root,
        {
            "name": "d",
            "format": "arrow",
            "url": "s3://overlord/dict/d.arrow",
            "text_field": "text",
            "storage_options": opts,
        },
        loading=loading,
    )
    units, docs, _ = _units_in_order(plan)
    assert len(units) == 8 and all(u.span is None for u in units)
    want = ref.tokens_of(table.column("text").to_pylist())
    assert all(np.array_equal(a, b) for a, b in zip(docs, want, strict=True))


def test_token_id_fields_of_jsonl_and_webdataset(tmp_path):
    """Pre-tokenized records: a JSON list of ids (jsonl), a JSON or .npy member (webdataset)."""
    import webdataset as wds

    docs = [list(range(i, i + i % 7)) for i in range(60)]
    (tmp_path / "t.jsonl").write_text("".join(json.dumps({"ids": d, "other": {"nested": [1, 2]}}) + "\n" for d in docs))
    for ext, encode in (("ids.json", json.dumps), ("ids.npy", lambda d: np.array(d, np.int64))):
        with wds.TarWriter(str(tmp_path / f"{ext}.tar")) as w:
            for i, d in enumerate(docs):
                w.write({"__key__": f"{i:04d}", ext: encode(d)})
    sources = [{"name": "j", "format": "jsonl", "url": "t.jsonl", "tokens_field": "ids"}]
    sources += [
        {"name": "w", "format": "webdataset", "url": f"{ext}.tar", "tokens_field": ext}
        for ext in ("ids.json", "ids.npy")
    ]
    for src in sources:
        _, got, _ = _units_in_order(make_plan(tmp_path, src, loading={"unit_bytes": 500}))
        assert [np.asarray(g).tolist() for g in got] == docs, src["url"]
