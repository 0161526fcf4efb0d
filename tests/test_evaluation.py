"""An evaluation stream (issue "Run it for weeks"): held-out units never reach training, and
every rank reads its share of a finite evaluation stream, the same in every run."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord_dask import Service, connect
from overlord_dask.errors import PlanError, ServiceError
from overlord_dask.plan import plan_from_dict
from overlord_dask.service.holdout import split
from overlord_dask.service.indexing import index_sources
from overlord_dask.trainer.evaluation import EvalStream
from tests.harness import run_ranks


def _corpus(tmp_path):
    rng = np.random.default_rng(0)
    for name, n in (("web", 600), ("code", 300)):
        (tmp_path / name).mkdir()
        for f in range(3):
            texts = [f"{name} {f} {i} " + "word " * int(rng.integers(5, 80)) for i in range(n // 3)]
            pq.write_table(pa.table({"text": texts}), tmp_path / name / f"part-{f}.parquet", row_group_size=50)


def _plan(tmp_path, evaluation=None, **top):
    return plan_from_dict(
        {
            "seed": 3,
            "sources": [
                {
                    "name": "web",
                    "format": "parquet",
                    "url": "web/*.parquet",
                    "text_field": "text",
                    "weight": 0.6,
                    "holdout": 0.2,
                },
                {
                    "name": "code",
                    "format": "parquet",
                    "url": "code/*.parquet",
                    "text_field": "text",
                    "weight": 0.4,
                    "holdout": ["part-2.parquet"],
                },
            ],
            "topology": {"dp": 2, "micro_batches": 2, "tokens_per_micro_batch": 1024},
            "loading": {"unit_rows": 50},
            **({"evaluation": evaluation} if evaluation else {}),
            **top,
        },
        base_dir=tmp_path,
    )


def _held_ids(plan) -> dict[str, set]:
    out = {}
    for name, units in index_sources(plan).items():
        _, held = split(plan.seed, plan.source(name), units)
        out[name] = {i for u in held for i in range(u.first_id, u.first_id + u.n_docs)}
    return out


def test_holdout_is_a_stable_choice_of_units(tmp_path):
    _corpus(tmp_path)
    plan = _plan(tmp_path)
    units = index_sources(plan)
    train, held = split(plan.seed, plan.source("web"), units["web"])
    assert 0 < len(held) < len(units["web"]) and [u.index for u in train] == list(range(len(train)))
    assert split(plan.seed, plan.source("web"), units["web"])[1] == held  # the same every time
    _, code = split(plan.seed, plan.source("code"), units["code"])
    assert {u.path.rsplit("/", 1)[-1] for u in code} == {"part-2.parquet"}
    bad = plan_from_dict(
        {
            "sources": [
                {"name": "s", "format": "parquet", "url": "code/*.parquet", "text_field": "text", "holdout": ["nope*"]}
            ],
            "topology": {"dp": 1, "tokens_per_micro_batch": 1024},
        },
        base_dir=tmp_path,
    )
    with pytest.raises(PlanError, match=r"source 's': holdout patterns \['nope\*'\] match none of its files"):
        split(0, bad.sources[0], index_sources(bad)["s"])
    with pytest.raises(PlanError, match="holdout as a fraction of the units must lie in"):
        _plan(
            tmp_path,
            sources=[{"name": "s", "format": "parquet", "url": "code/*.parquet", "text_field": "text", "holdout": 1.0}],
        )


@pytest.mark.integration
def test_held_out_documents_never_reach_training_and_every_rank_reads_the_same_eval_stream(cluster, tmp_path):
    _corpus(tmp_path)
    plan = _plan(tmp_path)
    held = _held_ids(plan)
    names = [s.name for s in plan.sources]
    trained: dict[str, set] = {n: set() for n in names}
    evals = []
    for run in range(2):  # a second run (a restart) reads the same evaluation stream
        got = {}
        with Service.start(plan, cluster=cluster) as service:

            def train(rank):
                with connect(service.address, rank, 2, timeout=60) as s:
                    for _ in range(60 if run == 0 else 2):  # past a whole pass of both sources
                        for mb in s.next_batch()["micro_batches"]:
                            for src, sid in zip(mb["source_ids"], mb["sample_ids"]):
                                trained[names[src]].add(int(sid))
                    got[rank] = [
                        list(EvalStream(service.address, rank, 2)) for _ in range(2)
                    ]  # read twice, beside training
                    s.commit()

            run_ranks(train, [0, 1])
            assert service.status()["failure"] is None
        evals.append(got)
    assert all(trained[n] for n in names) and all(held[n] for n in names)
    for n in names:
        assert not trained[n] & held[n], f"held-out documents of {n} reached training"
    first = evals[0]
    assert len(first[0][0]) == len(first[1][0]) > 0  # every rank the same number of micro-batches
    seen: dict[str, set] = {n: set() for n in names}
    for rank in (0, 1):
        for a, b, c in zip(
            first[rank][0], first[rank][1], evals[1][rank][0]
        ):  # read again, and in the next run: identical
            for k in ("input_ids", "labels", "cu_seqlens", "sample_ids"):
                np.testing.assert_array_equal(a[k], b[k])
                np.testing.assert_array_equal(a[k], c[k])
            for src, sid in zip(a["source_ids"], a["sample_ids"]):
                seen[names[src]].add(int(sid))
    assert seen == held  # every held-out document, on exactly the ranks' shares
    assert sum(len(mbs[0]) for mbs in first.values()) == 2 * len(first[0][0])


@pytest.mark.integration
def test_an_evaluation_budget_is_shared_by_weight(cluster, tmp_path):
    _corpus(tmp_path)
    plan = _plan(tmp_path, evaluation={"tokens": 3000, "weights": {"web": 1.0, "code": 1.0}, "micro_batches": 1})
    with Service.start(plan, cluster=cluster) as service:
        mbs = [mb for r in (0, 1) for mb in EvalStream(service.address, r)]
    plain = _plan(tmp_path, sources=[{"name": "w", "format": "parquet", "url": "web/*.parquet", "text_field": "text"}])
    with Service.start(plain, cluster=cluster) as other:
        with pytest.raises(
            ServiceError, match=r"rank 0: the plan holds out no evaluation data \(set a source's holdout\)"
        ):
            list(EvalStream(other.address, 0))
    tokens = {0: 0, 1: 0}
    for mb in mbs:
        cu = mb["cu_seqlens"]
        for k, src in enumerate(mb["source_ids"]):
            tokens[int(src)] += int(cu[k + 1] - cu[k])
    longest = 500  # bytes of the longest document (the byte tokenizer): the one that crosses the budget is whole
    assert 1500 <= tokens[0] < 1500 + longest and 1500 <= tokens[1] < 1500 + longest  # each its half
