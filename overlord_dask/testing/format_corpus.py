"""One corpus written in every format the service reads, each with the library its users write it
with: pyarrow (parquet), ``json`` + ``gzip``/``zstandard`` (jsonl), HF ``datasets``
(``save_to_disk`` Arrow folders), ``webdataset`` (tar shards) and megatron-core's indexed-dataset
builder (``.bin/.idx``, token ids of the byte tokenizer; the published layout written by hand where
megatron-core is not installed). ``benchmarks/formats.py`` and the tests use it.

Records: ``{"id", "text", "lang", "quality"}``. :func:`source_for` gives the plan's source entry
for a written format.
"""

from __future__ import annotations

import gzip
import json
import struct
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

FORMATS = ("parquet", "jsonl", "jsonl.zst", "jsonl.gz", "arrow", "webdataset", "megatron")
WORDS = (
    "the",
    "data",
    "loader",
    "plans",
    "every",
    "step",
    "of",
    "a",
    "run",
    "über",
    "naïve",
    "东京",
    "token",
    "mix",
    "source",
    "balance",
    "rank",
    '"quoted"',
    "tab\there",
    "line\nbreak",
)


def make_records(n: int, seed: int = 0, mean_words: int = 60) -> list[dict]:
    """``n`` records of random text (unicode, quotes, tabs and newlines inside the strings; a few
    empty), a language and a quality score."""
    rng = np.random.default_rng(seed)
    lens = np.clip(rng.lognormal(np.log(mean_words), 0.8, n), 0, 40 * mean_words).astype(int)
    lens[rng.random(n) < 0.02] = 0
    words = np.array(WORDS)
    return [
        {
            "id": i,
            "text": " ".join(words[rng.integers(0, len(words), k)]),
            "lang": ["en", "fr", "de"][int(rng.integers(0, 3))],
            "quality": round(float(rng.random()), 4),
        }
        for i, k in enumerate(lens)
    ]


def _split(records: list[dict], files: int) -> list[list[dict]]:
    return [list(part) for part in np.array_split(np.array(records, dtype=object), files)]


def _jsonl(records: list[dict]) -> bytes:
    return "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records).encode()


def write(
    root: Path, records: list[dict], fmt: str, *, files: int = 4, frame_bytes: int = 1 << 20, row_group: int = 2000
) -> str:
    """Write ``records`` as ``fmt`` under ``root``; returns the source URL (relative to ``root``)."""
    root = Path(root)
    parts = _split(records, files)
    if fmt == "parquet":
        (root / "parquet").mkdir(parents=True, exist_ok=True)
        for i, part in enumerate(parts):
            pq.write_table(
                pa.Table.from_pylist(part), root / "parquet" / f"part-{i:03d}.parquet", row_group_size=row_group
            )
        return "parquet"
    if fmt.startswith("jsonl"):
        folder = root / fmt.replace(".", "_")
        folder.mkdir(parents=True, exist_ok=True)
        for i, part in enumerate(parts):
            raw = _jsonl(part)
            path = folder / f"part-{i:03d}.{fmt}"
            if fmt == "jsonl.gz":
                path.write_bytes(gzip.compress(raw, compresslevel=6))
            elif fmt == "jsonl.zst":  # frames of about frame_bytes, cut anywhere (not at line ends), as pzstd does
                import zstandard

                c = zstandard.ZstdCompressor(level=3)
                path.write_bytes(
                    b"".join(c.compress(raw[a : a + frame_bytes]) for a in range(0, len(raw), frame_bytes))
                )
            else:
                path.write_bytes(raw)
        return folder.name
    if fmt == "arrow":
        import datasets

        datasets.disable_progress_bars()
        ds = datasets.Dataset.from_list(records)
        ds.save_to_disk(str(root / "arrow"), num_shards=files)
        return "arrow"
    if fmt == "webdataset":
        import webdataset as wds

        (root / "wds").mkdir(parents=True, exist_ok=True)
        for i, part in enumerate(parts):
            with wds.TarWriter(str(root / "wds" / f"shard-{i:03d}.tar")) as w:
                for r in part:
                    w.write(
                        {
                            "__key__": f"{r['id']:09d}",
                            "txt": r["text"],
                            "json": json.dumps({"lang": r["lang"], "quality": r["quality"]}),
                        }
                    )
        return f"wds/shard-{{000..{files - 1:03d}}}.tar"
    if fmt == "megatron":
        from overlord_dask.sources.tokenizers import byte_tokenize

        (root / "megatron").mkdir(parents=True, exist_ok=True)
        for i, part in enumerate(parts):
            t, o = byte_tokenize(pa.array([r["text"] for r in part], pa.string()))
            write_megatron(
                root / "megatron" / f"part-{i:03d}_text_document", [t[o[k] : o[k + 1]] for k in range(len(o) - 1)]
            )
        return "megatron"
    raise ValueError(f"unknown format {fmt!r}")


def write_megatron(prefix: Path, docs: list[np.ndarray]) -> None:
    """``prefix.bin/.idx`` of uint16 token documents: with megatron-core's builder, or the same
    layout written by hand where megatron-core is not installed."""
    try:
        import torch
        from megatron.core.datasets.indexed_dataset import IndexedDatasetBuilder
    except ImportError:
        _write_megatron_layout(prefix, docs)
        return
    b = IndexedDatasetBuilder(f"{prefix}.bin", dtype=np.uint16)
    for d in docs:
        b.add_document(torch.from_numpy(np.asarray(d, np.int64)), [len(d)])
    b.finalize(f"{prefix}.idx")


def _write_megatron_layout(prefix: Path, docs: list[np.ndarray]) -> None:
    sizes = np.array([len(d) for d in docs], np.int32)
    with open(f"{prefix}.bin", "wb") as f:
        for d in docs:
            f.write(np.asarray(d, np.uint16).tobytes())
    pointers = (
        np.concatenate([[0], np.cumsum(sizes[:-1].astype(np.int64) * 2)]).astype(np.int64)
        if len(docs)
        else np.zeros(0, np.int64)
    )
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, 8, len(sizes), len(sizes) + 1))
        f.write(sizes.tobytes() + pointers.tobytes() + np.arange(len(sizes) + 1, dtype=np.int64).tobytes())


def source_for(fmt: str, url: str, name: str | None = None, **extra) -> dict:
    """The plan's source entry reading ``url`` written as ``fmt``."""
    entry = {"name": name or fmt.replace(".", "_"), "format": fmt.split(".")[0], "url": url, **extra}
    if fmt == "webdataset":
        entry.setdefault("text_field", "txt")
    elif fmt != "megatron":
        entry.setdefault("text_field", "text")
    return entry
