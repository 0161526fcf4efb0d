"""Webdataset shards cut into load units of whole samples (``sources/tar_cuts.py``): every sample
once, in shard order, whatever the members look like (long names in pax or GNU headers,
directories, metadata members, members larger than a unit), and a shard that cannot be cut or
read right is an error naming it, never samples quietly lost."""

from __future__ import annotations

import io
import os
import random
import tarfile

import numpy as np
import pytest

from overlord_dask.errors import SourceError
from overlord_dask.plan import plan_from_dict
from overlord_dask.sources import discover_units, layout_warnings, load_unit
from tests import reference as ref


def _plan(root, url: str, unit_bytes: int, **src):
    return plan_from_dict(
        {
            "name": "tar",
            "base_dir": str(root),
            "seed": 0,
            "sources": [{"name": "w", "format": "webdataset", "url": url, "text_field": "txt", **src}],
            "topology": {"dp": 1, "tokens_per_micro_batch": 4096},
            "loading": {"unit_bytes": unit_bytes},
        },
        where="<test plan>",
    )


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size = len(data)
    tar.addfile(info, io.BytesIO(data))


def _write_shard(path, fmt: int, seed: int) -> None:
    """A shard of 300 samples: short and pax/GNU long keys, text, a few large binary members,
    directory entries and an ``__index__`` member between samples."""
    rng = random.Random(seed)
    with tarfile.open(path, "w", format=fmt) as tar:
        _add(tar, "__index__.json", b"{}")
        for i in range(300):
            key = f"part{i // 100}/{i:05d}" if i % 9 else "deep/" + "d" * 120 + f"/{i:05d}"
            if i % 50 == 0:
                d = tarfile.TarInfo(f"part{i // 100}")
                d.type = tarfile.DIRTYPE
                tar.addfile(d)
            _add(tar, f"{key}.txt", f"sample {i} ".encode() * rng.randint(1, 300))
            if i % 4 == 0:
                _add(tar, f"{key}.jpg", os.urandom(rng.choice([10, 3000, 40_000])))
            if i % 6 == 0:
                _add(tar, f"{key}.json", b'{"i": %d}' % i)


def _units(plan):
    src = plan.sources[0]
    units = discover_units(src, plan)
    return units, [load_unit(src, plan, u) for u in units]


@pytest.mark.parametrize("fmt", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT], ids=["pax", "gnu"])
@pytest.mark.parametrize("unit_bytes", [3000, 20_000, 100_000, 1 << 30])
def test_units_hold_every_sample_once_in_shard_order(tmp_path, fmt, unit_bytes):
    _write_shard(tmp_path / "s-000.tar", fmt, seed=unit_bytes)
    plan = _plan(tmp_path, "s-000.tar", unit_bytes)
    units, blocks = _units(plan)
    samples = ref.webdataset_samples([str(tmp_path / "s-000.tar")])[0]
    want = ref.tokens_of([m["txt"].decode() for k, m in samples if not k.startswith("__")])  # as webdataset skips them
    got = [b.doc(i) for b in blocks for i in range(len(b))]
    assert len(got) == len(want) and all(np.array_equal(g, w) for g, w in zip(got, want))
    assert [len(b) for b in blocks] == ref.webdataset_unit_sizes(str(tmp_path / "s-000.tar"), unit_bytes)
    assert [b.sample_ids.tolist() for b in blocks] == [
        [u.first_id + k for k in range(len(b))] for u, b in zip(units, blocks)
    ]
    size = (tmp_path / "s-000.tar").stat().st_size
    assert len(units) > 1 or unit_bytes >= size
    if unit_bytes < size:  # byte spans that tile the shard
        assert units[0].span[0] == 0 and units[-1].span[1] == size
        assert all(a.span[1] == b.span[0] for a, b in zip(units, units[1:]))


def _inner_tar(n: int) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for i in range(n):
            _add(tar, f"inner{i:04d}.txt", b"x" * 700)
    return buf.getvalue()


def test_a_cut_inside_a_tar_stored_in_a_sample_is_an_error_naming_the_shard(tmp_path):
    """A member that is itself a tar holds blocks that pass for headers: a cut placed among them
    is found out when the unit before it is read, and named."""
    with tarfile.open(tmp_path / "s-000.tar", "w") as tar:
        _add(tar, "a.txt", b"first")
        _add(tar, "b.txt", b"second")
        _add(tar, "b.tar", _inner_tar(200))
        for i in range(20):
            _add(tar, f"c{i:02d}.txt", b"later")
    plan = _plan(tmp_path, "s-000.tar", 50_000)
    src = plan.sources[0]
    units = discover_units(src, plan)
    assert len(units) > 1
    with pytest.raises(SourceError, match=r"s-000.tar.*runs past the unit's end .*unit_bytes above"):
        for u in units:
            load_unit(src, plan, u)
    plan = _plan(tmp_path, "s-000.tar", 1 << 30)  # what the error advises: the shard read whole
    assert sum(len(b) for b in _units(plan)[1]) == 22  # a; b (its txt and its tar); c00-c19


@pytest.mark.parametrize("unit_bytes", [4000, 1 << 30], ids=["cut", "whole"])
def test_a_damaged_header_or_a_truncated_shard_is_an_error_not_an_early_end(tmp_path, unit_bytes):
    """``tarfile`` alone ends a stream quietly at a header it cannot read, or at a shard cut at a
    member's boundary: the samples after it would be lost without a word."""
    with tarfile.open(tmp_path / "good.tar", "w") as tar:
        for i in range(40):
            _add(tar, f"{i:03d}.txt", b"text " * 100)
    raw = (tmp_path / "good.tar").read_bytes()
    with tarfile.open(tmp_path / "good.tar") as tar:
        at = tar.getmembers()[30].offset
    (tmp_path / "s-000.tar").write_bytes(raw[:at] + b"garbage!" + raw[at + 8 :])
    plan = _plan(tmp_path, "s-000.tar", unit_bytes)
    with pytest.raises(SourceError, match=r"s-000.tar.*damaged tar header at byte \d+"):
        _units(plan)
    (tmp_path / "s-001.tar").write_bytes(raw[:at])
    plan = _plan(tmp_path, "s-001.tar", unit_bytes)
    with pytest.raises(SourceError, match=r"s-001.tar.*ends without the blocks that end an archive \(truncated\?\)"):
        _units(plan)


def test_a_large_compressed_shard_is_one_unit_and_validate_says_so(tmp_path):
    _write_shard(tmp_path / "s-000.tar", tarfile.PAX_FORMAT, seed=1)
    with tarfile.open(tmp_path / "s-000.tar") as src, tarfile.open(tmp_path / "z-000.tar.gz", "w:gz") as out:
        for m in src.getmembers():
            out.addfile(m, src.extractfile(m) if m.isfile() else None)
    plan = _plan(tmp_path, "z-000.tar.gz", 3000)
    units, blocks = _units(plan)
    assert len(units) == 1 and units[0].span is None and len(blocks[0]) == 300
    (warning,) = layout_warnings(plan.sources[0], plan)
    assert "1 compressed shard(s)" in warning and "z-000.tar.gz" in warning and "Plain .tar shards are cut" in warning
    plain = _plan(tmp_path, "s-000.tar", 3000)
    assert layout_warnings(plain.sources[0], plain) == []


def test_with_integrity_a_unit_digests_its_own_byte_range(tmp_path):
    """``loading.integrity``: a flipped byte fails the one unit whose range holds it."""
    from overlord_dask.plan.versions import PlanVersions
    from overlord_dask.service.indexing import index_sources
    from overlord_dask.service.manifest import with_digests
    from overlord_dask.sources import read_unit

    _write_shard(tmp_path / "s-000.tar", tarfile.PAX_FORMAT, seed=2)
    plan = plan_from_dict(
        {
            **_plan(tmp_path, "s-000.tar", 20_000).model_dump(exclude_defaults=True),
            "loading": {"unit_bytes": 20_000, "integrity": True},
        }
    )
    units = with_digests(PlanVersions(plan), index_sources(plan))["w"]
    assert len(units) > 3 and len({u.digest for u in units}) == len(units)
    data = bytearray((tmp_path / "s-000.tar").read_bytes())
    data[(units[2].span[0] + units[2].span[1]) // 2] ^= 0x01
    (tmp_path / "s-000.tar").write_bytes(bytes(data))
    with pytest.raises(SourceError, match=r"unit 2 \(.*s-000.tar, bytes \d+:\d+\): the unit's bytes changed"):
        read_unit(plan.sources[0], plan, units[2])
    for u in units[:2] + units[3:]:
        read_unit(plan.sources[0], plan, u)
