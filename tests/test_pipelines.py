"""The example plans in pipelines/ run through the service on the demo corpus and do what their
comments promise; multimodal sources carry their images to the batch."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import zarr

from overlord_dask import Service, SourceError, connect
from overlord_dask.observe.figures import (
    delivered_identities,
    delivered_record,
    exactly_once,
    planned_identities,
    window_mix_errors,
)
from overlord_dask.plan import plan_from_dict
from overlord_dask.planner.state import PlannerState
from overlord_dask.sources import discover_units, load_unit
from overlord_dask.sources.tokenizers import image_token_id
from overlord_dask.worker.constructors import check_micro_batch, cp_slices

from .harness import example_plan as pipeline
from .harness import run_ranks

ROOT = Path(__file__).resolve().parents[1]


def run(plan, cluster, steps):
    got = {}
    with Service.start(plan, cluster=cluster) as service:

        def consume(rank):
            with connect(service.address, rank, timeout=120) as stream:
                got[rank] = [stream.next_batch() for _ in range(steps)]
                stream.commit()

        run_ranks(consume, range(plan.topology.dp))
        service.wait_for_step(steps, timeout=60)
        ledger, metrics = service.ledger(0, steps), service.metrics(0, steps)
    delivered = [delivered_identities(delivered_record(b)) for bs in got.values() for b in bs]
    assert exactly_once([planned_identities(ledger[s]) for s in range(steps)], delivered) == (0, 0)
    for bs in got.values():
        for b in bs:
            for mb in b["micro_batches"]:
                check_micro_batch(mb, plan.topology.tokens_per_micro_batch)
    return got, ledger, metrics


def longest(metrics, a, b):
    return max(m["longest_piece"] for m in metrics[a:b])


@pytest.mark.integration
def test_curriculum_pipeline(corpus, cluster):
    plan = pipeline("curriculum", corpus)
    steps = 96
    _, ledger, metrics = run(plan, cluster, steps)
    assert [metrics[s]["stage"] for s in (0, 39, 40, 79, 80)] == ["warmup", "warmup", "main", "main", "anneal"]
    tokens = np.array([m["source_tokens"] for m in metrics], dtype=np.float64)
    weights = np.array([m["weights"] for m in metrics])
    assert tokens[74:, 1].sum() < 0.01 * tokens[74:].sum()  # chat left at 70 (a few waiting pieces may follow)
    assert longest(metrics, 80, steps) <= 8192 < longest(metrics, 0, 80)  # the anneal stage's context
    # steps of 64k tokens hold a few long pieces each: over 16 steps the mix is off by at most a
    # few pieces (heavy pieces move in groups of dp), not by a share of the run
    err_tokens = window_mix_errors(tokens, weights, 16) * np.convolve(tokens.sum(axis=1), np.ones(16), "valid")
    assert err_tokens.max() <= 3 * plan.topology.tokens_per_micro_batch


@pytest.mark.integration
def test_long_context_pipeline(corpus, cluster):
    plan = pipeline("long_context", corpus)
    got, ledger, metrics = run(plan, cluster, 60)
    assert longest(metrics, 0, 40) <= 4096 < longest(metrics, 40, 60)
    assert metrics[39]["piece_tokens"] == 4096 and metrics[40]["piece_tokens"] == 32768
    # tokens from documents over 8k: the natural share before, the stage's 40% after
    books = zarr.open_group(str(Path(corpus) / "books.zarr"), mode="r")
    doc_len = np.diff(books["offsets"][:])

    def long_share(a, b):
        lens, total = 0, 0
        for bs in got.values():
            for batch in bs[a:b]:
                for mb in batch["micro_batches"]:
                    n = np.diff(mb["cu_seqlens"])
                    is_long = (mb["source_ids"] == 1) & (doc_len[np.minimum(mb["sample_ids"], len(doc_len) - 1)] > 8192)
                    lens += int(n[is_long].sum())
                    total += int(n.sum())
        return lens / total

    assert long_share(0, 40) < 0.3 and abs(long_share(44, 60) - 0.4) < 0.03


@pytest.mark.integration
def test_multimodal_pipeline_delivers_images_with_their_placeholders(corpus, cluster):
    plan = pipeline("multimodal", corpus)
    got, _, _ = run(plan, cluster, 10)
    g = zarr.open_group(str(Path(corpus) / "captions.zarr"), mode="r")
    images, img_off, img_pos = g["images"][:], g["image_offsets"][:], g["image_positions"][:]
    token_id, P = image_token_id(plan.sources[1], plan), images.shape[1]
    seen = 0
    for bs in got.values():
        for b in bs:
            for mb in b["micro_batches"]:
                assert mb["image_patches"].shape[1:] == images.shape[2:] and mb["image_patches"].dtype == np.uint8
                assert np.all(mb["input_ids"][mb["image_positions"]] == token_id)
                assert int((mb["input_ids"][: mb["num_tokens"]] == token_id).sum()) == len(mb["image_positions"])
                cu = mb["cu_seqlens"]
                for k in np.flatnonzero(mb["source_ids"] == 1):
                    a, z = cu[k], cu[k + 1]
                    sel = (mb["image_positions"] >= a) & (mb["image_positions"] < z)
                    sid = int(mb["sample_ids"][k])
                    start = int(mb["piece_starts"][k])
                    # the patches, in order, are the stored images of this sample from the piece's start on
                    n_img = img_off[sid + 1] - img_off[sid]
                    starts = img_pos[img_off[sid] : img_off[sid + 1]] + np.arange(n_img) * P
                    want = [
                        images[img_off[sid] + i, max(0, start - s0) : max(0, min(P, start + (z - a) - s0))]
                        for i, s0 in enumerate(starts)
                    ]
                    want = np.concatenate(want) if want else np.zeros((0,) + images.shape[2:], np.uint8)
                    np.testing.assert_array_equal(mb["image_patches"][sel], want)
                    seen += int(sel.sum())
    assert seen > 0


def test_multimodal_cp_slices_keep_each_patch_with_its_placeholder(corpus):
    plan = pipeline("multimodal", corpus)
    src = plan.sources[1]
    block = load_unit(src, plan, discover_units(src, plan)[0])
    from overlord_dask.worker.constructors import block_key, pack_micro_batch

    lens = block.lengths()
    mb = pack_micro_batch(
        [[1, 0, 0, d, 0, int(lens[d])] for d in range(6)], {block_key(1, 0, 0): block}, 4096, 4096, multimodal=True
    )
    from overlord_dask.wire import encode
    from overlord_dask.worker.constructors import wire_micro_batch

    wire = wire_micro_batch(
        [[1, 0, 0, d, 0, int(lens[d])] for d in range(6)], {block_key(1, 0, 0): block}, 4096, 4096, multimodal=True
    )
    ref = encode(mb)  # a constructor's stored form, image fields included
    assert set(wire) == set(ref) and all(
        np.array_equal(wire[k], ref[k]) and getattr(wire[k], "dtype", None) == getattr(ref[k], "dtype", None)
        for k in ref
    )
    for sl in cp_slices(mb, 2, 8):
        assert np.all(sl["input_ids"][sl["image_positions"]] == image_token_id(src, plan))
        assert len(sl["image_positions"]) == int(
            (sl["input_ids"][: sl["num_tokens"]] == image_token_id(src, plan)).sum()
        )
    total = sum(len(sl["image_positions"]) for sl in cp_slices(mb, 2, 8))
    assert total == len(mb["image_positions"])


def test_encoder_cost_weighs_image_tokens(corpus):
    plan = pipeline("multimodal", corpus)
    state = PlannerState(plan, {"web": [0], "captions": [0]})
    # the stream's own entry: two 100-token documents are far too little data for the planner (it says so)
    state.streams.by_name("captions").add_lengths(0, 0, np.array([100, 100]), np.array([48, 0]))
    rows = np.array([[1, 0, 0, 0, 0, 100], [1, 0, 0, 1, 0, 100], [1, 0, 0, 0, 50, 100]])
    c = state.costs(rows, 0)
    assert c[0] - c[1] == pytest.approx(48 * plan.cost.encoder)  # same length, 48 image tokens more
    assert c[2] - state.costs(np.array([[1, 0, 0, 1, 0, 50]]), 0)[0] == pytest.approx(
        24 * plan.cost.encoder
    )  # half the document


def test_multimodal_errors_name_the_culprit(corpus, tmp_path):
    plan = pipeline("multimodal", corpus)
    bad = tmp_path / "bad.zarr"
    src = zarr.open_group(str(Path(corpus) / "captions.zarr"), mode="r")
    g = zarr.open_group(str(bad), mode="w")
    for name in ("tokens", "offsets", "images", "image_positions"):
        g.create_array(name, shape=src[name].shape, dtype=src[name].dtype)[:] = src[name][:]
    off = src["image_offsets"][:]
    g.create_array("image_offsets", shape=(len(off) - 1,), dtype="int64")[:] = off[:-1]  # one entry short
    d = plan.model_dump(mode="json")
    d["sources"][1]["url"] = str(bad)
    broken = plan_from_dict(d)
    with pytest.raises(SourceError, match=r"source 'captions': 'image_offsets' must have n_docs \+ 1"):
        discover_units(broken.sources[1], broken)
    with pytest.raises(Exception, match="image_size=30 must be a multiple of patch_size=8"):
        plan_from_dict({**d, "sources": [{**d["sources"][0], "images_field": "images", "image_size": 30}]})


def test_parquet_photos_are_decoded_on_load_and_parts_concat_to_the_whole(corpus):
    import io

    import pyarrow.parquet as pq
    from PIL import Image

    from overlord_dask.sources.blocks import SampleBlock
    from overlord_dask.sources.images import patchify
    from overlord_dask.worker.loaders import load_block

    plan = pipeline("photos", corpus)
    src = plan.source("photos")
    unit = discover_units(src, plan)[0]
    block = load_unit(src, plan, unit)
    row = pq.ParquetFile(unit.path).read_row_group(unit.part).slice(unit.start, 1).to_pylist()[0]
    want = np.asarray(
        Image.open(io.BytesIO(row["images"][0])).convert("RGB").resize((src.image_size,) * 2, Image.BICUBIC)
    )
    P = (src.image_size // src.patch_size) ** 2
    assert (
        block.images.shape[1:] == (src.patch_size**2 * 3,) and block.image_patches[1] == P
    )  # patches of every image back to back
    assert np.array_equal(block.images[:P], patchify(want, src.patch_size))
    doc = block.doc(0)  # each image's placeholders sit at its position in the caption
    starts = block.image_starts[block.image_offsets[0] : block.image_offsets[1]]
    token_id = image_token_id(src, plan)
    assert all(np.all(doc[s : s + P] == token_id) for s in starts)
    assert int((doc == token_id).sum()) == P * len(row["images"])
    # the same unit loaded in three parts (auto-partitioning) is the same block once concatenated
    sp, n = plan.source_plan(src.name), unit.n_docs
    parts = [load_block(sp, unit.to_dict(), part=(a, b)) for a, b in ((0, n // 3), (n // 3, n // 2), (n // 2, n))]
    joined = SampleBlock.concat(parts)
    for f in ("tokens", "offsets", "sample_ids", "images", "image_offsets", "image_starts", "image_patches"):
        assert np.array_equal(getattr(joined, f), getattr(block, f)), f


@pytest.mark.integration
def test_photos_pipeline_runs(corpus, cluster):
    plan = pipeline("photos", corpus, loading={"unit_rows": 50, "prefetch_steps": 8, "autoscale": {"enabled": False}})
    got, _, _ = run(plan, cluster, 6)
    for batches in got.values():
        for b in batches:
            for mb in b["micro_batches"]:
                check_micro_batch(mb, plan.topology.tokens_per_micro_batch)
                assert np.all(mb["input_ids"][mb["image_positions"]] == image_token_id(plan.sources[2], plan))
    assert any(len(mb["image_positions"]) for b in got[0] for mb in b["micro_batches"])
    # the plan's pools ran on workers added to the lent cluster; closing the service took them away
    assert not any(str(name).startswith("overlord-pool-") for name in cluster.worker_spec)
    assert sorted(map(str, cluster.worker_spec)) == ["0", "1"]
