"""Indexing a large corpus: 10,000 load units over 1,000 files and 100 sources, cold and warm.

    python benchmarks/corpus_scale.py                 # readable table
    python benchmarks/corpus_scale.py --json --sources 100 --files 10 --row-groups 10

Generates ``--sources`` text parquet sources of ``--files`` files, each of ``--row-groups`` row
groups (one load unit each). Then, for ``cold`` (every file evicted from the page cache first with
``posix_fadvise(DONTNEED)``, as after a reboot or on a node that never read them) and ``warm``
(again right after):

- **index**, in a fresh process: the service's ``index_sources`` (footers only; on remote storage
  sources and each source's files are read in parallel, on a local disk in turn): seconds, units
  found, bytes the process read per file (``rchar``: metadata-only means the footer's speculative read, 64 KB per file
  in pyarrow,
  whatever the file's size; the share of the corpus is reported too), the index's Python heap
  (``tracemalloc`` peak) and the process's RSS growth. Baseline in the same run: the same
  discovery one source and one file at a time (``index (in turn)``).
- **time to first batch**: ``overlord serve`` started (scheduler, planner, 2 workers) until a
  trainer holds its first micro-batch, and the service's PSS then.

With ``--s3`` the same corpus is also uploaded to an S3-compatible server on loopback (moto, as
the tests use) and indexed there, by the service and one file at a time: where every footer read is a request,
which is where reading them in parallel pays (on a local disk the footers are a few ms of CPU).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.output import emit_rows  # noqa: E402

_INDEX = r"""
import json, os, sys, time, tracemalloc
import psutil
from overlord_dask.plan import plan_from_dict
from overlord_dask.service.indexing import index_sources
from overlord_dask.sources import discover_units, fs
plan = plan_from_dict(json.loads(sys.argv[1]), base_dir=sys.argv[2])
sequential = sys.argv[3] == "1"
me = psutil.Process()
rss0, io0 = me.memory_info().rss, me.io_counters().read_chars
tracemalloc.start()
t = time.perf_counter()
if sequential:
    fs.INDEX_THREADS = 1
    units = {s.name: discover_units(s, plan) for s in plan.sources}
else:
    units = index_sources(plan)
secs = time.perf_counter() - t
peak = tracemalloc.get_traced_memory()[1]
read = me.io_counters().read_chars - io0
print(json.dumps({"seconds": secs, "units": sum(map(len, units.values())), "read_bytes": read,
                  "heap_mb": peak / 2**20, "rss_growth_mb": (me.memory_info().rss - rss0) / 2**20}))
"""


def _evict(files: list[str]) -> None:
    """Drop the files' pages from the page cache (no root needed: advice on our own descriptors)."""
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def _index(plan: dict, root: str, sequential: bool) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", _INDEX, json.dumps(plan), root, "1" if sequential else "0"],
        capture_output=True,
        text=True,
    )
    if out.returncode:
        raise RuntimeError(out.stderr)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _first_batch(plan: dict, root: str) -> dict:
    import psutil
    import yaml

    from overlord_dask import connect

    path = os.path.join(root, "plan.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(plan, f)
    exe = os.path.join(os.path.dirname(sys.executable), "overlord")
    t0 = time.perf_counter()
    proc = subprocess.Popen([exe, "serve", path, "--workers", "2"], stdout=subprocess.PIPE, text=True)
    try:
        address = json.loads(proc.stdout.readline())["address"]
        up = time.perf_counter() - t0
        with connect(address, 0, timeout=300) as stream:
            stream.next_batch()
            first = time.perf_counter() - t0
            tree = [psutil.Process(proc.pid)] + psutil.Process(proc.pid).children(recursive=True)
            pss = sum(p.memory_full_info().pss for p in tree) / 2**20
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    return {"service_up_s": up, "first_batch_s": first, "service_pss_mb": pss}


def _s3_rows(plan: dict, root: str, names: list[str]) -> list[dict]:
    """Upload the corpus to a loopback S3 server and index it there, by the service and in turn."""
    import s3fs

    from overlord_dask.testing.object_store import create_bucket, start_moto, storage_options

    proc, endpoint = start_moto()
    try:
        opts = storage_options(endpoint)
        create_bucket(endpoint, "overlord")
        fs = s3fs.S3FileSystem(**opts)
        for n in names:
            fs.put(os.path.join(root, n), f"overlord/corpus/{n}", recursive=True)
        remote = {
            **plan,
            "sources": [
                {**s, "url": f"s3://overlord/corpus/{s['name']}/*.parquet", "storage_options": opts}
                for s in plan["sources"]
            ],
        }
        rows = []
        for how in ("service", "in turn"):
            r = _index(remote, root, how == "in turn")
            rows.append(
                {
                    "phase": "s3",
                    "what": f"index ({how})",
                    "seconds": round(r["seconds"], 3),
                    "units": r["units"],
                    "heap_mb": round(r["heap_mb"], 1),
                    "rss_growth_mb": round(r["rss_growth_mb"], 1),
                }
            )
        return rows
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--sources", type=int, default=100)
    ap.add_argument("--files", type=int, default=10, help="files per source")
    ap.add_argument("--row-groups", type=int, default=10, help="row groups (load units) per file")
    ap.add_argument("--rows", type=int, default=20, help="documents per row group")
    ap.add_argument("--data", default=None, help="folder for the generated corpus (default: a temporary one)")
    ap.add_argument("--s3", action="store_true", help="also index the corpus on a loopback S3 server (moto)")
    args = ap.parse_args(argv)

    from overlord_dask.service.demo import generate_text_sources, text_sources_plan

    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or tmp
        t = time.perf_counter()
        names = generate_text_sources(
            root, args.sources, files=args.files, docs_per_file=args.row_groups * args.rows, row_group=args.rows
        )
        generated = time.perf_counter() - t
        files = sorted(glob.glob(os.path.join(root, "src-*", "*.parquet")))
        corpus_bytes = sum(os.path.getsize(f) for f in files)
        plan = text_sources_plan(
            names,
            topology={"dp": 2, "micro_batches": 1, "tokens_per_micro_batch": 8192},
            loading={"unit_rows": args.rows},
        )
        rows = []
        for phase in ("cold", "warm"):
            for how in ("service", "in turn"):
                if phase == "cold":
                    _evict(files)
                r = _index(plan, root, how == "in turn")
                rows.append(
                    {
                        "phase": phase,
                        "what": f"index ({how})",
                        "seconds": round(r["seconds"], 3),
                        "units": r["units"],
                        "read_kb_per_file": round(r["read_bytes"] / len(files) / 1024, 1),
                        "read_share": round(r["read_bytes"] / corpus_bytes, 4),
                        "heap_mb": round(r["heap_mb"], 1),
                        "rss_growth_mb": round(r["rss_growth_mb"], 1),
                    }
                )
            if phase == "cold":
                _evict(files)
            fb = _first_batch(plan, root)
            rows.append(
                {
                    "phase": phase,
                    "what": "time to first batch",
                    "seconds": round(fb["first_batch_s"], 2),
                    "service_up_s": round(fb["service_up_s"], 2),
                    "service_pss_mb": round(fb["service_pss_mb"], 1),
                }
            )
        if args.s3:
            rows += _s3_rows(plan, root, names)

    def pick(phase: str, what: str) -> dict:
        return next(r for r in rows if r["phase"] == phase and r["what"] == what)

    out = {
        "benchmark": "corpus_scale",
        "cores": os.cpu_count(),
        "sources": args.sources,
        "files": len(files),
        "units": pick("cold", "index (service)")["units"],
        "corpus_mb": round(corpus_bytes / 2**20, 1),
        "generate_s": round(generated, 1),
        "index_cold_s": pick("cold", "index (service)")["seconds"],
        "index_warm_s": pick("warm", "index (service)")["seconds"],
        "index_sequential_cold_s": pick("cold", "index (in turn)")["seconds"],
        "index_heap_mb": pick("cold", "index (service)")["heap_mb"],
        "index_read_kb_per_file": pick("cold", "index (service)")["read_kb_per_file"],
        "index_read_share": pick("cold", "index (service)")["read_share"],
        "first_batch_cold_s": pick("cold", "time to first batch")["seconds"],
        "first_batch_warm_s": pick("warm", "time to first batch")["seconds"],
        **(
            {
                "index_s3_s": pick("s3", "index (service)")["seconds"],
                "index_s3_sequential_s": pick("s3", "index (in turn)")["seconds"],
            }
            if args.s3
            else {}
        ),
        "rows": rows,
    }
    emit_rows(
        out,
        args.json,
        [
            "phase",
            "what",
            "seconds",
            "units",
            "read_kb_per_file",
            "read_share",
            "heap_mb",
            "rss_growth_mb",
            "service_up_s",
            "service_pss_mb",
        ],
    )
    return out


if __name__ == "__main__":
    main()
