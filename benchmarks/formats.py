"""The same corpus in every format the service reads, each next to the reader its users run today.

    python benchmarks/formats.py                  # readable table (a corpus of about --mb MB of text)
    python benchmarks/formats.py --json --mb 200 --tokens 100000000

One corpus (``--mb`` MB of text, ``overlord_dask/testing/format_corpus.py``) written as parquet, jsonl.zst
(frames of 1 MB), an HF ``save_to_disk`` Arrow folder, webdataset shards and Megatron ``.bin/.idx``
(pre-tokenized with the byte tokenizer the others are tokenized with on the fly), and the Arrow
folder again on an S3-compatible server on loopback (``arrow.s3``: moto, started by the benchmark;
what a first batch costs when files are fetched by ranged requests). Per format:

- ``index_s``: indexing the source (what every service start pays: ``discover_units``; for
  ``arrow.s3`` the first indexing, whose walk of the message headers later starts find cached);
- ``service_start_s``: ``Service.start`` (2 worker processes) until it returns (the cluster and
  the plugin up; loading and planning go on in the background);
- ``first_batch_s``: from ``Service.start`` to the first batch at a rank;
- ``tokens_per_s``: documents' tokens delivered by the service to ``--dp`` ranks (threads that
  only take batches), over ``--tokens`` tokens after the first batch;
- ``read_tokens_per_s``: what a load task costs on a worker, as tokens per second of this
  process's CPU: units read into blocks (read, tokenize, document boundaries, narrowing) one after
  another until ``--tokens`` tokens, the first unit read before the clock (imports, the
  tokenizer); for ``arrow.s3`` the server's CPU is not counted;
- ``peer_tokens_per_s``: the format's usual reader in the same run, one process, producing the same
  documents' byte-tokenized ids over the same number of tokens: HF ``datasets`` streaming for
  parquet, jsonl and Arrow, local or on S3 (``load_dataset(..., streaming=True)``), the ``webdataset`` library's
  ``WebDataset`` for the shards, a plain memory-mapped read of ``.bin`` by the ``.idx`` for Megatron;
- ``peer_first_batch_s``: from the peer's start (opening the dataset) to its first batch's worth of
  tokens (a rank's micro-batches: 2 × ``--tokens-per-mb``), byte-tokenized. A lower bound on what a
  loader built on it would take: it packs nothing, and its first tokens are its first file's.

The peers hand out documents; the service hands out packed, balanced, resumable batches on several
processes: the ratio says what that costs or gains per format on this machine.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.output import emit_rows  # noqa: E402
from overlord_dask.testing.format_corpus import make_records, source_for, write  # noqa: E402

FORMATS = ("parquet", "jsonl.zst", "arrow", "arrow.s3", "webdataset", "megatron")
SUMMARY = ("index_s", "first_batch_s", "tokens_per_s", "read_tokens_per_s", "peer_tokens_per_s", "peer_first_batch_s")
"""Each format's figures in the output's ``formats`` summary."""
WORDS_PER_DOC = 80  # about 450 bytes of text per record (lognormal lengths)


def _plan(root: Path, fmt: str, url: str, dp: int, tokens_per_mb: int, **source):
    from overlord_dask.plan import plan_from_dict

    return plan_from_dict(
        {
            "name": f"formats-{fmt.replace('.', '-')}",
            "base_dir": str(root),
            "seed": 1,
            "sources": [source_for(fmt.removesuffix(".s3"), url, **source)],
            "topology": {"dp": dp, "micro_batches": 2, "tokens_per_micro_batch": tokens_per_mb},
            "loading": {"prefetch_steps": 8},
        },
        where="<benchmark plan>",
    )


def _index_s(plan) -> tuple[float, list]:
    from overlord_dask.sources import discover_units

    t0 = time.perf_counter()
    units = discover_units(plan.sources[0], plan)
    return time.perf_counter() - t0, units


def _read_tokens_per_s(plan, units: list, tokens: int) -> float:
    from overlord_dask.sources import read_unit

    source = plan.sources[0]
    sp = plan.source_plan(source.name)
    read_unit(source, sp, units[0])  # imports and the tokenizer, before the clock
    t0, got = time.process_time(), 0
    for u in units[1:] or units:
        got += len(read_unit(source, sp, u).block.tokens)
        if got >= tokens:
            break
    return got / max(time.process_time() - t0, 1e-9)


def _service(plan, dp: int, tokens: int) -> tuple[float, float, float]:
    """(seconds until ``Service.start`` returned, first batch seconds, delivered tokens per
    second after it)."""
    from overlord_dask import Service, connect

    t0 = time.perf_counter()
    first, counts, done = [], [0] * dp, threading.Event()
    with Service.start(plan, n_workers=2) as service:
        started = time.perf_counter() - t0

        def rank(r):
            with connect(service.address, r, timeout=600) as s:
                b = s.next_batch()
                first.append(time.perf_counter())
                while not done.is_set():
                    counts[r] += sum(int(mb["num_tokens"]) for mb in b["micro_batches"])
                    if sum(counts) >= tokens:
                        done.set()
                        break
                    b = s.next_batch()

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(dp)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        t_end = time.perf_counter()
    start = min(first)
    return started, start - t0, sum(counts) / max(t_end - start, 1e-9)


def _tokenize(texts: list[str]) -> int:
    import pyarrow as pa

    from overlord_dask.sources.tokenizers import byte_tokenize

    toks, _ = byte_tokenize(pa.array(texts, pa.string()))
    return len(toks)


def _stream_texts(texts, tokens: int, first: tuple[float, int], batch: int = 1000) -> tuple[float, float]:
    """Byte-tokenizing ``texts`` (an iterator) in batches until ``tokens``: tokens per second, and
    the seconds from ``first[0]`` (the peer's start) until it had ``first[1]`` tokens (batches of
    100 texts until then, so that a first batch is not timed at the end of a large one)."""
    t0, n, buf, first_s = time.perf_counter(), 0, [], None
    for t in texts:
        buf.append(t)
        if len(buf) == (batch if first_s is not None else 100):
            n += _tokenize(buf)
            buf = []
            if first_s is None and n >= first[1]:
                first_s = time.perf_counter() - first[0]
            if n >= tokens:
                break
    if buf and n < tokens:
        n += _tokenize(buf)
    if first_s is None:  # (fewer tokens than a first batch: the whole corpus)
        first_s = time.perf_counter() - first[0]
    return n / (time.perf_counter() - t0), first_s


def _peer(
    root: Path, fmt: str, url: str, tokens: int, first_tokens: int, options: dict | None = None
) -> tuple[str, float, float]:
    """(the peer's name, its tokens per second, seconds to its first ``first_tokens``)."""
    first = (time.perf_counter(), first_tokens)
    if fmt in ("parquet", "jsonl.zst"):
        import datasets

        datasets.disable_progress_bars()
        files = sorted(str(p) for p in (root / url).iterdir())
        ds = datasets.load_dataset(
            "parquet" if fmt == "parquet" else "json", data_files=files, split="train", streaming=True
        )
        return "datasets streaming", *_stream_texts((r["text"] for r in ds), tokens, first)
    if fmt == "arrow":
        import datasets

        files = sorted(str(p) for p in (root / url).glob("*.arrow"))
        ds = datasets.load_dataset("arrow", data_files=files, split="train", streaming=True)
        return "datasets streaming", *_stream_texts((r["text"] for r in ds), tokens, first)
    if fmt == "arrow.s3":
        import datasets
        import fsspec

        fs = fsspec.filesystem("s3", **options)
        files = sorted(f"s3://{p}" for p in fs.glob(f"{url}/*.arrow"))
        ds = datasets.load_dataset("arrow", data_files=files, split="train", streaming=True, storage_options=options)
        return "datasets streaming (S3)", *_stream_texts((r["text"] for r in ds), tokens, first)
    if fmt == "webdataset":
        import webdataset as wds

        shards = sorted(str(p) for p in (root / "wds").glob("*.tar"))
        ds = wds.WebDataset(shards, shardshuffle=False).decode()
        return "webdataset.WebDataset", *_stream_texts((s["txt"] for s in ds), tokens, first)
    return "memory map (.bin by .idx)", *_megatron_mmap(root / url, tokens, first_tokens)


def _megatron_mmap(folder: Path, tokens: int, first_tokens: int) -> tuple[float, float]:
    """Documents of every ``.bin`` by the offsets in its ``.idx``, memory-mapped (what Megatron's
    own ``IndexedDataset`` does), touched once each: tokens per second, and seconds to the first
    ``first_tokens``."""
    import struct

    t0, n, first_s = time.perf_counter(), 0, None
    for idx in sorted(folder.glob("*.idx")):
        raw = idx.read_bytes()
        seqs = struct.unpack_from("<Q", raw, 18)[0]
        sizes = np.frombuffer(raw, np.int32, seqs, 34)
        pointers = np.frombuffer(raw, np.int64, seqs, 34 + 4 * seqs)
        data = np.memmap(str(idx)[:-4] + ".bin", dtype=np.uint16, mode="r")
        for p, s in zip(pointers // 2, sizes):
            n += int(np.asarray(data[p : p + s], dtype=np.int32).size)
            if first_s is None and n >= first_tokens:
                first_s = time.perf_counter() - t0
            if n >= tokens:
                return n / (time.perf_counter() - t0), first_s
    elapsed = time.perf_counter() - t0
    return n / elapsed, elapsed if first_s is None else first_s


def _on_s3(root: Path, url: str, state: dict) -> tuple[str, dict]:
    """The local folder ``url`` copied to a moto S3 server on loopback (started once per run)."""
    import fsspec

    from overlord_dask.testing.object_store import create_bucket, start_moto, storage_options

    if "proc" not in state:
        state["proc"], endpoint = start_moto()
        create_bucket(endpoint, "formats")
        state["options"] = storage_options(endpoint)
    fs = fsspec.filesystem("s3", **state["options"])
    folder = url.split("/")[0]
    fs.put(str(root / folder), f"formats/{folder}", recursive=True)
    return f"s3://formats/{url}", state["options"]


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mb", type=float, default=200.0, help="MB of text in the corpus")
    ap.add_argument("--files", type=int, default=8, help="files (shards) per format")
    ap.add_argument("--tokens", type=int, default=100_000_000, help="tokens each system delivers for its tokens/s")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--tokens-per-mb", type=int, default=65536, help="tokens per micro-batch (2 per rank and step)")
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--data", default=None, help="folder for the corpus (default: a temporary one, removed after)")
    args = ap.parse_args(argv)
    root = Path(args.data or tempfile.mkdtemp(prefix="overlord-formats-"))
    os.environ.setdefault("OVERLORD_CACHE_DIR", str(root / "cache"))
    try:
        t0 = time.perf_counter()
        n = max(100, int(args.mb * 1e6 / (WORDS_PER_DOC * 5.6)))
        records = make_records(n, seed=1, mean_words=WORDS_PER_DOC)
        text_mb = sum(len(r["text"].encode()) for r in records) / 1e6
        rows, s3 = [], {}
        for fmt in args.formats.split(","):
            tw = time.perf_counter()
            url = write(root, records, fmt.removesuffix(".s3"), files=args.files)
            size = sum(p.stat().st_size for p in (root / url.split("/")[0]).rglob("*") if p.is_file())
            source, options = {}, None
            if fmt.endswith(".s3"):
                url, options = _on_s3(root, url, s3)
                source = {"storage_options": options}
            write_s = time.perf_counter() - tw
            plan = _plan(root, fmt, url, args.dp, args.tokens_per_mb, **source)
            index_s, units = _index_s(plan)
            read_tps = _read_tokens_per_s(plan, units, args.tokens)
            start_s, first_s, tps = _service(plan, args.dp, args.tokens)
            peer, peer_tps, peer_first_s = _peer(root, fmt, url, args.tokens, 2 * args.tokens_per_mb, options)
            rows.append(
                {
                    "format": fmt,
                    "files_mb": round(size / 1e6, 1),
                    "write_s": round(write_s, 1),
                    "units": len(units),
                    "index_s": float(f"{index_s:.3g}"),
                    "service_start_s": float(f"{start_s:.3g}"),
                    "first_batch_s": float(f"{first_s:.3g}"),
                    "tokens_per_s": round(tps),
                    "read_tokens_per_s": round(read_tps),
                    "peer": peer,
                    "peer_tokens_per_s": round(peer_tps),
                    "peer_first_batch_s": float(f"{peer_first_s:.3g}"),
                    "ratio": round(tps / peer_tps, 2),
                }
            )
        out = {
            "benchmark": "formats",
            "records": n,
            "text_mb": round(text_mb, 1),
            "dp": args.dp,
            "tokens": args.tokens,
            "cpus": os.cpu_count(),
            "total_s": round(time.perf_counter() - t0, 1),
            "rows": rows,
            "formats": {r["format"]: {k: r[k] for k in SUMMARY} for r in rows},
        }
    finally:
        if "proc" in s3:
            s3["proc"].terminate()
        if args.data is None:
            shutil.rmtree(root, ignore_errors=True)
    emit_rows(
        {k: v for k, v in out.items() if k != "formats"} if not args.json else out,
        args.json,
        [
            "format",
            "files_mb",
            "write_s",
            "units",
            "index_s",
            "service_start_s",
            "first_batch_s",
            "tokens_per_s",
            "read_tokens_per_s",
            "peer",
            "peer_tokens_per_s",
            "peer_first_batch_s",
            "ratio",
        ],
    )
    return out


if __name__ == "__main__":
    main()
