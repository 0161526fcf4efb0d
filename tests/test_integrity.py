"""Integrity over weeks (issue "Run it for weeks"): with ``loading.integrity`` every unit's bytes
are checked against the digest taken when its source was first indexed; the digests live with
the snapshots, so a restart checks against what the run first saw. Without it, every run with a
checkpoint keeps its files' sizes and modification stamps, and a restart refuses files that
changed or vanished (``checkpoint.on_data_change``)."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord_dask import Service, connect
from overlord_dask.errors import SourceError
from overlord_dask.plan import plan_from_dict, plan_to_dict
from overlord_dask.plan.versions import PlanVersions
from overlord_dask.service.indexing import index_sources
from overlord_dask.service.manifest import check_files, with_digests
from overlord_dask.sources import read_unit
from overlord_dask.sources.formats import get_format

TEXTS = [f"document {i} " + "the cat sat on the mat " * (1 + i % 9) for i in range(600)]


def _write(path):
    # no page checksums, no compression: a flipped byte inside a data page decodes to other text
    pq.write_table(pa.table({"text": TEXTS}), path, row_group_size=200, compression="NONE", write_page_checksum=False)


def _plan(tmp_path, checkpoint=None, **loading):
    return plan_from_dict(
        {
            "sources": [{"name": "s", "format": "parquet", "url": "t.parquet", "text_field": "text"}],
            "topology": {"dp": 1, "tokens_per_micro_batch": 2048},
            "loading": {"unit_rows": 100, "integrity": True, **loading},
            "checkpoint": {"url": str(tmp_path / "ck"), **(checkpoint or {})},
        },
        base_dir=tmp_path,
    )


def _flip(tmp_path, plan, unit):
    """Flip one byte in the middle of ``unit``'s row group."""
    ((path, lo, hi),) = get_format("parquet").regions(plan.sources[0], plan, unit)
    data = bytearray((tmp_path / "t.parquet").read_bytes())
    data[(lo + hi) // 2] ^= 0x01
    (tmp_path / "t.parquet").write_bytes(bytes(data))


def test_a_flipped_byte_in_a_data_page_is_caught(tmp_path):
    _write(tmp_path / "t.parquet")
    plan = _plan(tmp_path)
    plain = index_sources(plan)["s"]
    units = with_digests(PlanVersions(plan), index_sources(plan))["s"]
    assert len(units) == 6 and all(u.digest for u in units)
    assert units[0].digest == units[1].digest != units[2].digest  # two units of one row group share its digest
    before = read_unit(plan.sources[0], plan, plain[3]).block
    _flip(tmp_path, plan, units[3])
    silently = read_unit(plan.sources[0], plan, plain[3]).block  # without a digest: other text, no word
    assert not np.array_equal(silently.tokens, before.tokens)
    with pytest.raises(
        SourceError,
        match=r"source 's' unit 3 \(.*t\.parquet, row group 1 rows 100:200\): the unit's bytes changed since "
        r"the source was indexed",
    ):
        read_unit(plan.sources[0], plan, units[3])
    read_unit(plan.sources[0], plan, units[0])  # the other row groups are as they were


@pytest.mark.integration
def test_a_restart_checks_the_files_against_what_the_run_first_saw(cluster, tmp_path):
    """The first start keeps the digests with the snapshots; a byte flipped before the second
    start is noticed there (not taken as the file's new truth): its unit is quarantined."""
    _write(tmp_path / "t.parquet")
    plan = _plan(tmp_path, on_corrupt="quarantine", retries=0)
    with Service.start(plan, cluster=cluster) as service, connect(service.address, 0, timeout=60) as s:
        s.next_batch()
        s.commit()
    assert (tmp_path / "ck" / "manifest" / "s.json").exists()
    units = index_sources(plan)["s"]
    _flip(tmp_path, plan, units[5])
    with Service.start(plan, cluster=cluster) as service, connect(service.address, 0, timeout=60) as s:
        for _ in range(60):
            s.next_batch()
            if len(service.status()["quarantined"]) == 2:
                break
        s.commit()
        quarantined = service.status()["quarantined"]
    assert sorted(q["unit"] for q in quarantined) == [4, 5]  # both units of the row group
    assert "bytes changed since the source was indexed" in quarantined[0]["reason"]


def test_without_integrity_a_file_changed_between_starts_is_refused_naming_it(tmp_path):
    """The identities kept at the first start (size, mtime) against the files at the next: a
    rewritten file is refused, unless the plan accepts data changes (which keeps the new ones)."""
    _write(tmp_path / "t.parquet")
    plan = _plan(tmp_path, integrity=False)
    check_files(PlanVersions(plan), index_sources(plan))  # the first start keeps them
    assert (tmp_path / "ck" / "manifest" / "files" / "s.json").exists()
    check_files(PlanVersions(plan), index_sources(plan))  # unchanged: nothing to say
    _flip(tmp_path, plan, index_sources(plan)["s"][5])  # same size, rewritten
    with pytest.raises(
        SourceError,
        match=r"source 's': files differ from when the run first indexed them \(changed \(size or modification "
        r"stamp\): .*t\.parquet\).*checkpoint\.on_data_change: accept",
    ):
        check_files(PlanVersions(plan), index_sources(plan))
    accepting = _plan(tmp_path, checkpoint={"on_data_change": "accept"}, integrity=False)
    check_files(PlanVersions(accepting), index_sources(accepting))  # accepted: the new stamps are kept
    check_files(PlanVersions(plan), index_sources(plan))  # so the next start goes on
    (tmp_path / "t.parquet").unlink()
    _write(tmp_path / "u.parquet")
    moved = plan_from_dict(
        {**plan_to_dict(plan), "sources": [{**plan_to_dict(plan)["sources"][0], "url": "*.parquet"}]}, base_dir=tmp_path
    )
    with pytest.raises(SourceError, match=r"gone: .*t\.parquet"):
        check_files(PlanVersions(moved), index_sources(moved))
    check_files(PlanVersions(moved), index_sources(moved), resuming=False)  # a fresh run keeps its own files


@pytest.mark.integration
def test_a_start_on_changed_files_fails_before_it_takes_a_worker(cluster, tmp_path):
    _write(tmp_path / "t.parquet")
    plan = _plan(tmp_path, integrity=False)
    with Service.start(plan, cluster=cluster) as service, connect(service.address, 0, timeout=60) as s:
        s.next_batch()
        s.commit()
    _flip(tmp_path, plan, index_sources(plan)["s"][0])
    with pytest.raises(SourceError, match=r"source 's': files differ from when the run first indexed them"):
        Service.start(plan, cluster=cluster)
