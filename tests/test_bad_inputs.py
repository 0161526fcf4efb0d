"""The bad-input catalogue (issue 10): inputs and mistakes users make, each with the clear error
(naming the source, file, field, rank or step) or the recorded handling it must get.

``CASES`` is the catalogue: ``name -> (function, pattern)``. A function sets up one bad input,
runs what a user would run, and returns the error text (or, for inputs that are handled rather
than refused, a description of the handling); the text must match ``pattern``. Cases that need
a service take the session's cluster; everything else runs in this process. Other modules test
more (plans: ``test_plan.py``, files and schemas: ``test_sources.py``); the cases here are the
ones that used to hang, crash with an unrelated message, or pass bad data through silently.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

from overlord_dask import PlanError, ServiceError, SourceError
from overlord_dask.errors import OverlordError
from overlord_dask.plan import plan_from_dict, plan_to_dict
from overlord_dask.snapshots import SnapshotError, SnapshotStore
from overlord_dask.sources import discover_units
from overlord_dask.sources.blocks import SampleBlock
from overlord_dask.worker.loaders import load_block

pytestmark = pytest.mark.integration  # (tests/conftest.py: the quick set is -m 'not integration')

ROOT = Path(__file__).resolve().parents[1]
U = "tests.test_bad_inputs:"  # where the user functions below are imported from


# ---- user code the cases plug in (importable as tests.test_bad_inputs:<name>) ---------------------
def negative_ids(texts):
    return [[5, -2, 7] for _ in texts]


def float_ids(texts):
    return [[1.5, 2.0] for _ in texts]


def two_d_ids(texts):
    return [[[1, 2], [3, 4]] for _ in texts]


def fails_late(step):
    """A weight function that breaks mid-run (after the steps a plan's validation checks)."""
    if step >= 50:
        raise RuntimeError("schedule boom")
    return 1.0


def too_few_docs(texts):
    return [[1, 2]]


def not_utf8(texts):
    raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte")


def two_d_transform(block):
    return SampleBlock(block.source, block.tokens.reshape(-1, 1), block.offsets, block.sample_ids)


def two_d_in_place(block):
    block.tokens = block.tokens.reshape(-1, 1)  # changed after the block checked itself
    return block


class BrokenTokenizer:
    """A tokenizer class whose constructor raises (a missing vocabulary file, say)."""

    def __init__(self, **kwargs):
        raise RuntimeError("tokenizer boom")


# ---- helpers ------------------------------------------------------------------------------------
def _plan(tmp_path, topology=None, loading=None, checkpoint=None, **src):
    d = {
        "sources": [{"name": "s", "weight": 1.0, **src}],
        "topology": {"dp": 1, "micro_batches": 1, "tokens_per_micro_batch": 1024, **(topology or {})},
        "loading": {"unit_rows": 3, "unit_tokens": 50, **(loading or {})},
    }
    if checkpoint:
        d["checkpoint"] = checkpoint
    return plan_from_dict(d, base_dir=tmp_path)


def _load_error(plan) -> str:
    """Load the first unit as a worker would (``load_block``); the error it raises."""

    with pytest.raises(SourceError) as exc:  # indexing may already refuse it (a float zarr array, say)
        unit = discover_units(plan.sources[0], plan)[0]
        load_block(plan.source_plan(plan.sources[0].name), unit.to_dict())
    return str(exc.value)


def _text_source(tmp_path, texts=("hello", "world", "again"), **src):
    pq.write_table(pa.table({"text": list(texts)}), tmp_path / "t.parquet")
    return _plan(tmp_path, format="parquet", url="t.parquet", text_field="text", **src)


def _zarr_source(tmp_path, tokens):
    g = zarr.open_group(str(tmp_path / "z.zarr"), mode="w")
    g.create_array("tokens", shape=tokens.shape, dtype=tokens.dtype)[:] = tokens
    g.create_array("offsets", shape=(3,), dtype="int64")[:] = [0, 2, len(tokens)]
    return _plan(tmp_path, format="zarr", url="z.zarr")


def _run_until_error(plan, cluster, steps=2, timeout=60) -> str:
    """Start the service, take ``steps`` steps on every rank; the error a trainer sees."""
    from overlord_dask import Service, connect

    t0 = time.monotonic()
    with pytest.raises(OverlordError) as exc:
        with Service.start(plan, cluster=cluster) as service:
            streams = [connect(service.address, r, timeout=timeout) for r in range(plan.topology.dp)]
            try:
                for _ in range(steps):
                    for s in streams:
                        s.next_batch()
            finally:
                for s in streams:
                    s.close()
    assert time.monotonic() - t0 < timeout, "told only after the consumer's timeout: that is a hang"
    return str(exc.value)


def _told_within(stream, seconds: float) -> str:
    """The error a trainer gets from ``stream`` (its ServiceError's text), within ``seconds``."""
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as exc:
        for _ in range(1000):
            stream.next_batch()
    assert time.monotonic() - t0 < seconds, "told only after the consumer's timeout"
    return str(exc.value)


def _plan_file(path: Path, plan) -> str:
    """``plan`` (a one-source plan from ``_text_source``) as a file of its own, URL absolute."""
    d = plan_to_dict(plan)
    d["sources"][0]["url"] = str(Path(plan.base_dir) / d["sources"][0]["url"])
    path.write_text(json.dumps(d))
    return str(path)


def _snapshots(tmp_path) -> SnapshotStore:
    store = SnapshotStore(str(tmp_path / "ck"))
    store.write_base(0, {"committed": 4, "topology": {"dp": 1}})
    store.write_delta(1, 0, 6)
    store.write_base(2, {"committed": 8, "topology": {"dp": 1}})
    store.write_delta(3, 2, 9)
    store.write_delta(4, 2, 12)
    return store


# ---- the cases ----------------------------------------------------------------------------------
def case_token_list_null_row(tmp_path, cluster):
    pq.write_table(pa.table({"ids": pa.array([[3, 4], None, [5]], type=pa.list_(pa.int32()))}), tmp_path / "l.parquet")
    plan = _plan(tmp_path, format="parquet", url="l.parquet", tokens_field="ids")
    from overlord_dask.sources import load_unit

    block = load_unit(plan.sources[0], plan, discover_units(plan.sources[0], plan)[0])
    return f"handled: null row loaded as an empty document, lengths {block.lengths().tolist()}"


def _loading_text_with(**src):
    """A case: a text source with a user tokenizer or transform (``src``), loaded as a worker would."""
    return lambda tmp_path, cluster: _load_error(_text_source(tmp_path, **src))


def case_zarr_negative_ids(tmp_path, cluster):
    return _load_error(_zarr_source(tmp_path, np.array([3, -3, 4, 5], dtype=np.int32)))


def case_zarr_float_tokens(tmp_path, cluster):
    return _load_error(_zarr_source(tmp_path, np.array([3.0, 4.5, 4.0, 5.0])))


def case_parquet_negative_token_ids(tmp_path, cluster):
    pq.write_table(pa.table({"ids": pa.array([[3, -1], [5]], type=pa.list_(pa.int64()))}), tmp_path / "l.parquet")
    return _load_error(_plan(tmp_path, format="parquet", url="l.parquet", tokens_field="ids"))


def case_jsonl_text_field_no_record_has(tmp_path, cluster):
    (tmp_path / "x.jsonl").write_text("".join(json.dumps({"text": f"line {i}"}) + "\n" for i in range(300)))
    return _load_error(_plan(tmp_path, format="jsonl", url="x.jsonl", text_field="body"))


def case_weight_function_failing_mid_run(tmp_path, cluster):
    src = {"name": "s", "format": "zarr", "url": "z.zarr", "weight": {"function": f"{U}fails_late"}}
    plan = plan_from_dict({"sources": [src], "topology": {"dp": 1, "tokens_per_micro_batch": 1024}, "steps": 10})
    with pytest.raises(ValueError) as exc:
        plan.declared_weights(60)  # what the planner asks when it plans step 60
    return str(exc.value)


def case_megatron_prefix_without_idx(tmp_path, cluster):
    from overlord_dask.testing.format_corpus import write_megatron

    write_megatron(tmp_path / "corpus_text_document", [np.arange(5), np.arange(7)])
    (tmp_path / "corpus_text_document.idx").unlink()
    return _load_error(_plan(tmp_path, format="megatron", url="corpus_text_document"))


def case_all_empty_documents(tmp_path, cluster):
    plan = _text_source(tmp_path, texts=[""] * 30, topology={"dp": 2})
    return _run_until_error(plan, cluster)


def case_tiny_source(tmp_path, cluster):
    return _run_until_error(_text_source(tmp_path, texts=["hi", "yo"], topology={"dp": 2}), cluster)


def case_micro_batch_far_larger_than_corpus(tmp_path, cluster):
    return _run_until_error(
        _text_source(tmp_path, texts=["some text"] * 50, topology={"tokens_per_micro_batch": 16_000_000}), cluster
    )


def case_newest_base_flipped_bit(tmp_path, cluster):
    store = _snapshots(tmp_path)
    path = tmp_path / "ck" / "base-000000000002.msgpack"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))
    state, seq = store.load()
    return f"handled: damaged base skipped, resumed from base 0 at committed {state['committed']} (seq {seq})"


def case_delta_committed_altered(tmp_path, cluster):
    import msgpack

    store = _snapshots(tmp_path)
    path = tmp_path / "ck" / "delta-000000000004.msgpack"
    outer = msgpack.unpackb(path.read_bytes(), raw=False)
    body = msgpack.unpackb(outer["body"], raw=False)
    body["committed"] = 44  # a hand edit: the checksum no longer matches
    outer["body"] = msgpack.packb(body, use_bin_type=True)
    path.write_bytes(msgpack.packb(outer, use_bin_type=True))
    state, seq = store.load()
    return f"handled: altered delta rejected, committed {state['committed']} (seq {seq})"


def case_newest_base_truncated(tmp_path, cluster):
    store = _snapshots(tmp_path)
    path = tmp_path / "ck" / "base-000000000002.msgpack"
    path.write_bytes(path.read_bytes()[:20])
    state, seq = store.load()
    return f"handled: truncated base skipped, resumed from base 0 at committed {state['committed']} (seq {seq})"


def case_snapshot_from_a_newer_version(tmp_path, cluster):
    import msgpack

    store = _snapshots(tmp_path)
    (tmp_path / "ck" / "base-000000000005.msgpack").write_bytes(msgpack.packb({"version": 99, "body": b""}))
    with pytest.raises(SnapshotError) as exc:
        store.load()
    return str(exc.value)


def case_checkpoint_location_unusable(tmp_path, cluster):
    from overlord_dask import Service

    (tmp_path / "file").write_text("not a folder")
    plan = _text_source(tmp_path, checkpoint={"url": str(tmp_path / "file" / "ck")})
    with pytest.raises(SnapshotError) as exc:
        Service.start(plan, cluster=cluster)
    return str(exc.value)


def case_s3_checkpoint_without_server(tmp_path, cluster):
    t0 = time.monotonic()
    with pytest.raises(SnapshotError) as exc:
        SnapshotStore(
            "s3://overlord-ck/run",
            {
                "key": "k",
                "secret": "s",
                "client_kwargs": {"endpoint_url": "http://127.0.0.1:9"},
                "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2},
            },
        )
    assert time.monotonic() - t0 < 30
    return str(exc.value)


def case_attach_to_a_plain_scheduler(tmp_path, cluster):
    from overlord_dask import Service

    with pytest.raises(ServiceError) as exc:
        Service.attach(cluster.scheduler_address)
    return str(exc.value)


def case_attach_where_nothing_listens(tmp_path, cluster):
    import socket

    from overlord_dask import Service

    with socket.socket() as sock:  # a port nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(ServiceError) as exc:
        Service.attach(f"tcp://127.0.0.1:{port}", timeout=3)
    assert time.monotonic() - t0 < 10
    return str(exc.value)


def case_state_with_a_negative_step(tmp_path, cluster):
    from overlord_dask import Service, connect

    plan = _text_source(tmp_path, texts=["some text here"] * 300, topology={"dp": 1})
    with Service.start(plan, cluster=cluster) as service, connect(service.address, 0, timeout=60) as stream:
        state = stream.state_dict()
        with pytest.raises(ValueError) as exc:
            stream.load_state_dict({**state, "next_step": -1})
    return str(exc.value)


def case_dp_mismatch(tmp_path, cluster):
    from overlord_dask import Service, connect

    plan = _text_source(tmp_path, texts=["some text"] * 300, topology={"dp": 2})
    with Service.start(plan, cluster=cluster) as service:
        with pytest.raises(OverlordError) as exc:
            connect(service.address, 0, dp=8).next_batch()  # no checkpoint re-planned the run for dp=8
    return str(exc.value)


def case_two_consumers_on_one_rank(tmp_path, cluster):
    from overlord_dask import Service, connect

    plan = _text_source(tmp_path, texts=["some text here"] * 3000, topology={"dp": 1}, loading={"unit_rows": 1000})
    with Service.start(plan, cluster=cluster) as service:
        first = connect(service.address, 0, timeout=60, prefetch_steps=1)
        first.next_batch()
        second = connect(service.address, 0, timeout=60)
        second.next_batch()  # the newest consumer of the rank gets the stream
        text = _told_within(first, 30)
        first.close()
        second.close()
    return text


def case_service_killed_for_good(tmp_path, cluster):
    import signal

    from overlord_dask import connect

    plan = _text_source(tmp_path, texts=["some text here"] * 3000, loading={"unit_rows": 1000})
    proc = subprocess.Popen(
        [sys.executable, "-m", "overlord_dask", "serve", _plan_file(tmp_path / "p.yaml", plan)],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
        start_new_session=True,
    )
    try:
        stream = connect(json.loads(proc.stdout.readline())["address"], 0, timeout=60, reconnect_timeout=3)
        stream.next_batch()
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    text = _told_within(stream, 30)
    stream.close()
    return text


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "overlord_dask", *args],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


def case_cli_demo_zero_workers(tmp_path, cluster):
    out = _cli("demo", "--workers", "0", "--data", str(tmp_path / "d"))
    assert out.returncode == 2
    return out.stderr.strip().splitlines()[-1]


def case_cli_validate_many_plans(tmp_path, cluster):
    good = _plan_file(tmp_path / "good.yaml", _text_source(tmp_path))
    (tmp_path / "bad.yaml").write_text("sources: []\n")
    out = _cli("validate", good, str(tmp_path / "bad.yaml"))
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert out.returncode == 2 and [x["ok"] for x in lines] == [True, False]
    return lines[1]["error"]


def _reporting_rank():
    """A rank's reporting side (``trainer/reporting.py``) of a run of sources web and books, handed steps 0 and 1."""
    from overlord_dask.trainer.reporting import Reporting

    class Rank(Reporting):
        info = {"sources": ["web", "books"]}

    r = Rank()
    r._init_reports()
    for step in (0, 1):
        r._handed(step)
    return r


def _report_error(*args, **kwargs):
    """A case: ``report(*args, **kwargs)`` on a rank handed steps 0 and 1; the error it raises."""

    def case(tmp_path, cluster):
        with pytest.raises(ValueError) as exc:
            _reporting_rank().report(*args, **kwargs)
        return str(exc.value)

    return case


def case_report_takes_tensors(tmp_path, cluster):
    import torch

    r = _reporting_rank()
    r.report(1, {"web": (torch.tensor(6.0), 3), 1: np.float32(2.5)}, loss=torch.tensor(2.0))
    return f"handled: {r._reports[-1]}"


def case_cli_validate_catches_what_start_catches(tmp_path, cluster):
    """Plans that passed ``validate`` and failed at start: one error line each, no traceback."""
    good = json.loads(Path(_plan_file(tmp_path / "good.yaml", _text_source(tmp_path))).read_text())
    variants = {
        "tokenizer": {"tokenizer": {"path": f"{U}BrokenTokenizer"}},
        "controller": {"mixing": {"controller": f"{U}Nope"}},
        "holdout": {"sources": [{**good["sources"][0], "holdout": ["*nothing*"]}]},
    }
    files = []
    for name, change in variants.items():
        (tmp_path / f"{name}.yaml").write_text(json.dumps({**good, **change}))
        files.append(str(tmp_path / f"{name}.yaml"))
    out = _cli("validate", *files)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert out.returncode == 2 and "Traceback" not in out.stderr and [x["ok"] for x in lines] == [False] * 3
    return " | ".join(x["error"] for x in lines)


def case_cli_validate_unreachable_store(tmp_path, cluster):
    out = _cli("validate", str(ROOT / "pipelines" / "pretrain_s3.yaml"))
    assert out.returncode == 2 and "Traceback" not in out.stderr
    return out.stderr.strip().splitlines()[-1]


def _photo_source(tmp_path, images, positions, **src):
    pq.write_table(
        pa.table({"text": ["a caption", "another one", "third"], "images": images, "image_positions": positions}),
        tmp_path / "p.parquet",
    )
    return _plan(
        tmp_path,
        format="parquet",
        url="p.parquet",
        text_field="text",
        images_field="images",
        image_size=8,
        patch_size=4,
        **src,
    )


def _png(size=8) -> bytes:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (size, size), (200, 10, 10)).save(buf, format="PNG")
    return buf.getvalue()


def case_photo_not_an_image(tmp_path, cluster):
    return _load_error(_photo_source(tmp_path, [[_png()], [_png(), b"not an image"], []], [[0], [1, 2], []]))


def case_photo_positions_missing(tmp_path, cluster):
    return _load_error(_photo_source(tmp_path, [[_png()], [_png(), _png()], []], [[0], [1], []]))


def case_photo_column_of_strings(tmp_path, cluster):
    pq.write_table(pa.table({"text": ["a"], "images": ["x"], "image_positions": [[0]]}), tmp_path / "p.parquet")
    plan = _plan(tmp_path, format="parquet", url="p.parquet", text_field="text", images_field="images")
    with pytest.raises(SourceError) as exc:
        discover_units(plan.sources[0], plan)
    return str(exc.value)


def case_float_patches_through_torch(tmp_path, cluster):
    """A multimodal zarr source with float32 image patches, taken as torch tensors (as_torch): the
    patches stay float32 with their values (once, every field not listed became int32)."""
    from overlord_dask import Service, connect

    g = zarr.open_group(str(tmp_path / "m.zarr"), mode="w")
    n = 200
    lens = np.full(n, 40, dtype=np.int64)
    g.create_array("tokens", shape=(int(lens.sum()),), dtype="int32")[:] = 7
    g.create_array("offsets", shape=(n + 1,), dtype="int64")[:] = np.concatenate([[0], np.cumsum(lens)])
    images = np.random.default_rng(0).random((n, 4, 6), dtype=np.float32) - 0.5
    g.create_array("images", shape=images.shape, dtype="float32")[:] = images
    g.create_array("image_offsets", shape=(n + 1,), dtype="int64")[:] = np.arange(n + 1)
    g.create_array("image_positions", shape=(n,), dtype="int64")[:] = 5
    plan = _plan(tmp_path, topology={"tokens_per_micro_batch": 512}, format="zarr", url="m.zarr", images_field="images")
    with (
        Service.start(plan, cluster=cluster) as service,
        connect(service.address, 0, as_torch=True, timeout=60) as stream,
    ):
        mb = stream.next_batch()["micro_batches"][0]
    patches = mb["image_patches"]
    ids = mb["sample_ids"].numpy()
    assert patches.dtype == __import__("torch").float32 and patches.min() < 0
    assert np.allclose(patches.numpy()[:4], images[ids[0]]), "the first sample's patches, values kept"
    return f"handled: image_patches {patches.dtype}, min {float(patches.min()):.2f}"


def case_autoscale_without_a_cluster(tmp_path, cluster):
    from overlord_dask import Service

    plan = _text_source(tmp_path, texts=["hello world"] * 300, loading={"autoscale": {"enabled": True}})
    with pytest.raises(ServiceError) as exc:
        Service.start(plan, address=cluster.scheduler_address)
    return str(exc.value)


def _plan_error(**top) -> str:
    """The PlanError of a two-source plan (``web`` holds 10 % out) with the top-level ``top``."""
    with pytest.raises(PlanError) as exc:
        plan_from_dict(
            {
                "sources": [
                    {"name": "web", "format": "zarr", "url": "a.zarr", "holdout": 0.1},
                    {"name": "books", "format": "zarr", "url": "b.zarr"},
                ],
                "topology": {"dp": 1, "tokens_per_micro_batch": 1024},
                **top,
            }
        )
    return str(exc.value)


def case_pool_declared_twice(tmp_path, cluster):
    with pytest.raises(PlanError) as exc:
        plan_from_dict(
            {
                "sources": [
                    {"name": "a", "format": "zarr", "url": "a.zarr", "pool": {"name": "p", "cores": 2}},
                    {"name": "b", "format": "zarr", "url": "b.zarr", "pool": {"name": "p", "cores": 4}},
                ],
                "topology": {"dp": 1, "tokens_per_micro_batch": 1024},
            }
        )
    return str(exc.value)


def case_plan_key_given_twice(tmp_path, cluster):
    from overlord_dask.plan import load_plan

    f = tmp_path / "plan.yaml"
    f.write_text(
        "sources:\n  - {name: web, format: zarr, url: a.zarr}\ntopology: {dp: 1, tokens_per_micro_batch: 1024}\n"
        "sources:\n  - {name: books, format: zarr, url: b.zarr}\n"
    )
    with pytest.raises(PlanError) as exc:
        load_plan(f)
    return str(exc.value)


CASES = {
    "a plan key given twice (YAML keeps the last)": (
        case_plan_key_given_twice,
        r"plan\.yaml:4:1: not valid YAML: key 'sources' given twice \(first at line 1\)",
    ),
    "token list column with a null row": (
        case_token_list_null_row,
        r"handled: null row loaded as an empty document, lengths \[2, 0, 1\]",
    ),
    "jsonl text_field that no record has": (
        case_jsonl_text_field_no_record_has,
        r"source 's': no record of .*x\.jsonl.* has text_field 'body' \(300 records read",
    ),
    "tokenizer yields negative ids": (
        _loading_text_with(tokenizer=U + "negative_ids", add_eos=False),
        r"unit 0 \(.*t\.parquet.*source 's': token ids must lie in \[0, \d+\], got min -2",
    ),
    "tokenizer yields floats": (
        _loading_text_with(tokenizer=U + "float_ids", add_eos=False),
        r"tokenizer tests\.test_bad_inputs:float_ids returned float64 values for document 0",
    ),
    "tokenizer yields a 2-D array": (
        _loading_text_with(tokenizer=U + "two_d_ids", add_eos=False),
        r"tokenizer tests\.test_bad_inputs:two_d_ids returned a 2-D array",
    ),
    "tokenizer returns fewer documents than texts": (
        _loading_text_with(tokenizer=U + "too_few_docs", add_eos=False),
        r"returned 1 documents for 3 texts",
    ),
    "tokenizer raises on undecodable bytes": (
        _loading_text_with(tokenizer=U + "not_utf8", add_eos=False),
        r"loading source 's' unit 0 .*UnicodeDecodeError: 'utf-8' codec can't decode",
    ),
    "transform returns 2-D tokens": (
        _loading_text_with(transform=U + "two_d_transform"),
        r"source 's': tokens must be a 1-D array of ids, got shape \(\d+, 1\)",
    ),
    "transform makes its block's tokens 2-D": (
        _loading_text_with(transform=U + "two_d_in_place"),
        r"source 's': transform tests\.test_bad_inputs:two_d_in_place returned a bad block: tokens must be a 1-D array "
        r"of ids, got shape \(\d+, 1\)",
    ),
    "zarr token array with negative ids": (
        case_zarr_negative_ids,
        r"z\.zarr.*token ids must lie in \[0, \d+\], got min -3",
    ),
    "zarr token array of floats": (
        case_zarr_float_tokens,
        r"source 's': 'tokens' has dtype float64, expected integers",
    ),
    "parquet token column with negative ids": (case_parquet_negative_token_ids, r"l\.parquet.*got min -1"),
    "weight function that raises mid-run": (
        case_weight_function_failing_mid_run,
        r"source 's': weight function 'tests\.test_bad_inputs:fails_late' failed at step 60: RuntimeError: "
        r"schedule boom",
    ),
    "megatron prefix whose .idx is missing": (
        case_megatron_prefix_without_idx,
        r"source 's': .*corpus_text_document\.bin has no .*corpus_text_document\.idx beside it",
    ),
    "text source of empty documents": (
        case_all_empty_documents,
        r"source 's' holds only 30 tokens in a whole pass over its files",
    ),
    "source of two tiny documents": (
        case_tiny_source,
        r"source 's' holds only \d+ tokens .* passes: every document would repeat",
    ),
    "micro-batch far larger than the corpus": (
        case_micro_batch_far_larger_than_corpus,
        r"tokens_per_micro_batch=16,000,000",
    ),
    "newest base with a flipped bit": (
        case_newest_base_flipped_bit,
        r"handled: damaged base skipped, resumed from base 0 at committed 6 \(seq 1\)",
    ),
    "delta with an altered committed step": (
        case_delta_committed_altered,
        r"handled: altered delta rejected, committed 9 \(seq 3\)",
    ),
    "truncated newest base": (
        case_newest_base_truncated,
        r"handled: truncated base skipped, resumed from base 0 at committed 6 \(seq 1\)",
    ),
    "snapshot from a newer version": (
        case_snapshot_from_a_newer_version,
        r"base-000000000005\.msgpack: snapshot version 99 is newer",
    ),
    "checkpoint location that cannot be written": (
        case_checkpoint_location_unusable,
        r"checkpoint location .*file/ck cannot be used",
    ),
    "s3 checkpoint with no server": (
        case_s3_checkpoint_without_server,
        r"checkpoint location s3://overlord-ck/run cannot be used: \w+",
    ),
    "Service.attach to a plain Dask scheduler": (
        case_attach_to_a_plain_scheduler,
        r"the scheduler there runs no overlord planner",
    ),
    "Service.attach where nothing listens": (
        case_attach_where_nothing_listens,
        r"no overlord service at tcp://127\.0\.0\.1:\d+: nothing answered within 3s \(is the service running\? a "
        r"scheduler file",
    ),
    "trainer state with a negative step": (
        case_state_with_a_negative_step,
        r"consumer state next_step must be a step number >= 0, got -1",
    ),
    "consumer with the wrong dp": (case_dp_mismatch, r"consumer asked for dp=8, but the service at .* runs dp=2"),
    "two consumers on one rank": (case_two_consumers_on_one_rank, r"another consumer attached as rank 0"),
    "service killed and not restarted": (
        case_service_killed_for_good,
        r"rank 0: lost the overlord service at tcp://.* did not come back within 3s",
    ),
    "parquet photo that is not an image": (
        case_photo_not_an_image,
        r"source 's' unit 0 .*p\.parquet.*record 1 \(sample id 1\): image 1 of the record: cannot decode image",
    ),
    "parquet photos without their positions": (
        case_photo_positions_missing,
        r"row 1 \(sample id 1\) has 2 images but 1 image positions",
    ),
    "parquet images column of strings": (
        case_photo_column_of_strings,
        r"images_field 'images' in .*p\.parquet has type string, expected list<binary>",
    ),
    "float image patches through torch": (
        case_float_patches_through_torch,
        r"handled: image_patches torch\.float32, min -0\.\d+",
    ),
    "autoscaling with only a scheduler address": (
        case_autoscale_without_a_cluster,
        r"loading\.autoscale needs a cluster object .*--resources overlord-pool-<pool>",
    ),
    "evaluation weights with a misspelt source": (
        lambda tmp_path, cluster: _plan_error(evaluation={"weights": {"nope": 1.0}}),
        r"evaluation weights name unknown sources \['nope'\]; sources: \['books', 'web'\]",
    ),
    "evaluation weights for a source without a holdout": (
        lambda tmp_path, cluster: _plan_error(evaluation={"weights": {"web": 1.0, "books": 1.0}}),
        r"evaluation weights name sources without a holdout \['books'\].*with a holdout: \['web'\]",
    ),
    "evaluation weights all zero": (
        lambda tmp_path, cluster: _plan_error(evaluation={"weights": {"web": 0.0}}),
        r"evaluation weights must be finite, >= 0, and one of them > 0",
    ),
    "evaluation without any holdout": (
        lambda tmp_path, cluster: _plan_error(
            sources=[{"name": "web", "format": "zarr", "url": "a.zarr"}], evaluation={"tokens": 1000}
        ),
        r"evaluation is set, but no source has a holdout",
    ),
    "one pool declared two ways": (
        case_pool_declared_twice,
        r"sources 'a' and 'b' share pool 'p' but declare it differently",
    ),
    "overlord demo --workers 0": (case_cli_demo_zero_workers, r"argument --workers: must be at least 1, got 0"),
    "overlord validate with several plans": (case_cli_validate_many_plans, r"bad\.yaml"),
    "report of a step far ahead of the stream": (
        _report_error(10**9, {"web": 1.0}),
        r"report: step must be a step this rank was handed \(steps 0\.\.1\), got 1000000000",
    ),
    "report of a negative step": (_report_error(-1, {"web": 1.0}), r"step must be a step this rank was handed"),
    "report of a loss sum over no tokens": (
        _report_error(1, {"web": (1.0, 0)}),
        r"loss of source 'web': tokens must be a whole number >= 0, and a loss sum needs tokens",
    ),
    "report of a 3-tuple loss": (_report_error(1, {"web": (1.0, 2, 3)}), r"must be a mean or \(sum, tokens\)"),
    "report of a loss for an unknown source": (
        _report_error(1, {"nope": 1.0}),
        r"unknown source 'nope'; the run's sources are \['web', 'books'\]",
    ),
    "report of a metric that is a whole tensor": (
        lambda tmp_path, cluster: _report_error(1, loss=__import__("torch").ones(3))(tmp_path, cluster),
        r"metric 'loss' must be a finite number",
    ),
    "report with 0-d tensors and numpy numbers": (
        case_report_takes_tensors,
        r"handled: \{'s': 1, 'loss': \{'web': \[6\.0, 3\.0\], 'books': \[2\.5, 1\.0\]\}, 'extra': \{'loss': 2\.0\}\}",
    ),
    "overlord validate: tokenizer, controller, holdout": (
        case_cli_validate_catches_what_start_catches,
        r"source 's': tokenizer 'tests\.test_bad_inputs:BrokenTokenizer' could not be built: RuntimeError: "
        r"tokenizer boom \| "
        r"mixing controller 'tests\.test_bad_inputs:Nope' .*cannot import .* \| "
        r"source 's': holdout patterns \['\*nothing\*'\] match none of its files",
    ),
    "overlord validate on an unreachable store": (
        case_cli_validate_unreachable_store,
        r"overlord: error: source 'web': cannot read 's3://",
    ),
}


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_a_clear_answer(name, tmp_path, cluster, monkeypatch):
    fn, pattern = CASES[name]
    monkeypatch.syspath_prepend(str(ROOT))  # the user functions above, as workers import them
    text = fn(tmp_path, cluster)
    assert text and __import__("re").search(pattern, text), f"{name}: {text!r} does not match {pattern!r}"
