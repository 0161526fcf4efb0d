"""A source's slice of the plan (``plan.SourcePlan``): what every load task carries, held once per
process however many tasks name it (on the scheduler, which keeps the tasks' arguments, and on
each worker)."""

from __future__ import annotations

import pickle

import pytest

from overlord_dask.plan import source_plan as sp_module
from overlord_dask.service.demo import demo_plan


def _slices(tmp_path, seed=1):
    plan = demo_plan(tmp_path, seed=seed)
    return {s.name: plan.source_plan(s.name) for s in plan.sources}


def test_a_slice_unpickles_equal_and_as_one_object_per_content(tmp_path):
    slices = _slices(tmp_path)
    web = slices["web"]
    blob = pickle.dumps(web, protocol=5)
    a, b = pickle.loads(blob), pickle.loads(pickle.dumps(web))  # (any protocol)
    assert a == web and a.model_dump() == web.model_dump() and a.source("web") == web.source("web")
    assert a is b  # one copy in this process
    assert pickle.loads(pickle.dumps(slices["books"])) is not a  # another source: another slice
    other_seed = _slices(tmp_path, seed=2)["web"]
    assert pickle.loads(pickle.dumps(other_seed)) == other_seed != a  # another plan: its own slice


def test_the_copies_kept_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(sp_module, "SHARED_MAX", 2)
    monkeypatch.setattr(sp_module, "_SHARED", {})
    blobs = [pickle.dumps(_slices(tmp_path, seed=s)["web"]) for s in range(4)]
    got = [pickle.loads(b) for b in blobs]
    assert len(sp_module._SHARED) == 2 and [g.seed for g in got] == [0, 1, 2, 3]
    assert pickle.loads(blobs[3]) is got[3]  # the newest are kept
    assert pickle.loads(blobs[0]) == got[0]  # an evicted one comes back equal


def _held_slice(plan, unit):
    """(on a worker) Keep the slice a task received, as a load task's block is kept."""
    from distributed import get_worker

    w = get_worker()
    w.overlord_test_slices = [*getattr(w, "overlord_test_slices", []), plan]
    return len({id(p) for p in w.overlord_test_slices})


def test_load_tasks_share_one_slice_on_the_scheduler_and_on_each_worker(tmp_path, cluster):
    from distributed import Client

    web = _slices(tmp_path)["web"]
    with Client(cluster) as client:
        worker = sorted(client.scheduler_info()["workers"])[0]
        futs = [client.submit(_held_slice, web, i, workers=[worker], pure=False) for i in range(8)]
        distinct_on_worker = client.gather(futs)
        assert max(distinct_on_worker) == 1, distinct_on_worker  # one slice however many tasks named it
        held = [cluster.scheduler.tasks[f.key].run_spec.args[0] for f in futs]
        assert all(h is held[0] for h in held) and held[0] == web  # the scheduler holds one copy too
        client.run(lambda dask_worker: dask_worker.__dict__.pop("overlord_test_slices", None))


def _write_zarr(path, docs: list[list[int]]) -> None:
    import numpy as np
    import zarr

    offsets = np.concatenate([[0], np.cumsum([len(d) for d in docs])]).astype(np.int64)
    g = zarr.open_group(str(path), mode="w")
    g.create_array("tokens", shape=(int(offsets[-1]),), chunks=(64,), dtype="int32")[:] = np.concatenate(docs)
    g.create_array("offsets", shape=offsets.shape, chunks=(64,), dtype="int64")[:] = offsets
    zarr.consolidate_metadata(str(path))  # (as xarray writes them: a group opened reads every array's shape once)


@pytest.mark.filterwarnings("ignore:Consolidated metadata:UserWarning")  # (zarr 3 on its format 3 stores)
def test_a_run_started_after_a_zarr_source_was_rewritten_reads_it_anew(tmp_path):
    """A process keeps one slice per source, plan version and run, and one opened zarr group per
    slice. A notebook (or a long-lived cluster's worker) that runs the plan again after the
    store was rewritten with more documents reads the new ones, not through the first run's
    group (whose arrays still had the old shapes)."""
    import numpy as np

    from overlord_dask.plan import plan_from_dict
    from overlord_dask.sources import discover_units
    from overlord_dask.worker.loaders import load_block

    spec = {
        "name": "rewritten",
        "sources": [{"name": "books", "format": "zarr", "url": "books.zarr", "tokens_field": "tokens"}],
        "topology": {"dp": 1, "micro_batches": 1, "tokens_per_micro_batch": 4096},
        "loading": {"unit_tokens": 100},
    }
    plan = plan_from_dict(spec, base_dir=tmp_path)
    src = plan.sources[0]

    def run(run_id: str) -> list[list[int]]:
        sp = pickle.loads(pickle.dumps(plan.source_plan("books", run_id)))  # as a load task receives it
        blocks = [load_block(sp, u.to_dict()) for u in discover_units(src, sp)]
        return [b.tokens[b.offsets[i] : b.offsets[i + 1]].tolist() for b in blocks for i in range(len(b.sample_ids))]

    first = [[i] * 30 for i in range(1, 6)]
    _write_zarr(tmp_path / "books.zarr", first)
    assert run("run-1") == first
    again = pickle.loads(pickle.dumps(plan.source_plan("books", "run-1")))
    assert again is pickle.loads(pickle.dumps(plan.source_plan("books", "run-1")))  # one slice per run
    second = [list(np.arange(40) + 100 * i) for i in range(1, 12)]
    _write_zarr(tmp_path / "books.zarr", second)
    assert run("run-2") == second
