"""Megatron-LM indexed datasets: ``.bin`` files of token ids with their ``.idx`` index (what
Megatron's ``preprocess_data.py`` writes), read as they are, already tokenized.

The source's ``url`` is a dataset prefix as Megatron's ``--data-path`` names it (``corpus_text_document``
for ``corpus_text_document.bin/.idx``), one of the two files, or a folder or glob of them (every
``.idx`` with its ``.bin``, in sorted order). A document is the sequences the index's document
array groups (one each, as ``preprocess_data.py`` writes them); its tokens are delivered as stored
(an end-of-document token, if the preprocessing appended one, included).

The index layout (``MMIDIDX``, version 1): a 34-byte header (magic, version, dtype code,
sequence count, document-array length), then int32 sequence sizes, int64 byte pointers into the
``.bin``, int64 document starts. Units are document ranges of about ``loading.unit_tokens``
tokens, found from the index alone; a load reads its slices of the index and its token range of
the ``.bin``: by memory map on a local disk, by ranged reads on an object store. An index that
does not match its ``.bin`` (another size, pointers out of order) is an error naming both files.
"""

from __future__ import annotations

import struct

import numpy as np

from ..errors import SourceError
from ..plan import Source, SourcePlan
from .blocks import SampleBlock, check_tokens
from .formats import Format
from .fs import is_local, list_files, source_fs
from .units import LoadUnit

MAGIC = b"MMIDIDX\x00\x00"
HEADER = 34
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32, 8: np.uint16}


class Index:
    """One ``.idx`` file's header, and slices of its arrays read on demand."""

    def __init__(self, fs, path: str, local: bool):
        self.fs, self.path, self.local = fs, path, local
        with fs.open(path, "rb") as f:
            head = f.read(HEADER)
        if len(head) < HEADER or head[:9] != MAGIC:
            raise SourceError(f"{path} is not a Megatron index (no MMIDIDX header)")
        version, code, self.n_seqs, self.n_doc_idx = struct.unpack_from("<QBQQ", head, 9)
        if version != 1:
            raise SourceError(f"{path}: Megatron index version {version} is not supported (expected 1)")
        if code not in DTYPES:
            raise SourceError(f"{path}: unknown token dtype code {code}")
        self.dtype = np.dtype(DTYPES[code])
        self.n_docs = self.n_doc_idx - 1
        need = HEADER + 12 * self.n_seqs + 8 * self.n_doc_idx
        size = fs.size(path)
        if size < need:
            raise SourceError(f"{path}: truncated Megatron index ({size} bytes, its header announces {need})")

    def _read(self, offset: int, dtype, start: int, stop: int) -> np.ndarray:
        itemsize = np.dtype(dtype).itemsize
        if stop <= start:
            return np.zeros(0, dtype)
        if self.local:
            return np.array(
                np.memmap(self.path, dtype=dtype, mode="r", offset=offset + start * itemsize, shape=(stop - start,))
            )
        with self.fs.open(self.path, "rb") as f:
            f.seek(offset + start * itemsize)
            return np.frombuffer(f.read((stop - start) * itemsize), dtype=dtype).copy()

    def sizes(self, a: int, b: int) -> np.ndarray:
        return self._read(HEADER, "<i4", a, b).astype(np.int64)

    def pointers(self, a: int, b: int) -> np.ndarray:
        return self._read(HEADER + 4 * self.n_seqs, "<i8", a, b)

    def doc_idx(self, a: int, b: int) -> np.ndarray:
        return self._read(HEADER + 12 * self.n_seqs, "<i8", a, b)


def _pairs(source: Source, plan: SourcePlan) -> tuple[object, list[str]]:
    """The dataset prefixes (path without ``.bin``/``.idx``) of a source."""
    fs, path = source_fs(source, plan.base_dir)
    for ext in (".bin", ".idx"):
        if path.endswith(ext):
            path = path[: -len(ext)]
    if fs.exists(path + ".idx"):
        prefixes = [path]
    elif fs.exists(path + ".bin"):
        raise SourceError(
            f"source {source.name!r}: {path}.bin has no {path}.idx beside it (the index Megatron writes with the .bin)"
        )
    else:
        fs, files = list_files(source, plan.base_dir, (".idx",))
        prefixes = [f[:-4] for f in files if f.endswith(".idx")]
        if not prefixes:
            raise SourceError(f"source {source.name!r}: no .idx files in {source.url!r}")
    for p in prefixes:
        if not fs.exists(p + ".bin"):
            raise SourceError(f"source {source.name!r}: {p}.idx has no {p}.bin beside it")
    return fs, prefixes


class MegatronFormat(Format):
    name = "megatron"
    records = False

    def check(self, source: Source) -> None:
        if source.images_field:
            raise ValueError("megatron sources hold token ids only; images_field is not supported")

    def discover(self, source: Source, plan: SourcePlan) -> list[LoadUnit]:
        fs, prefixes = _pairs(source, plan)
        local = is_local(source, plan.base_dir)
        units, first_id, step = [], 0, plan.loading.unit_tokens
        for prefix in prefixes:
            offsets = _check(fs, prefix, Index(fs, prefix + ".idx", local), source)
            n_docs = len(offsets) - 1
            targets = np.arange(step, offsets[-1], step)
            cuts = np.unique(np.concatenate([[0], np.searchsorted(offsets, targets, side="left"), [n_docs]]))
            for a, b in zip(cuts[:-1], cuts[1:]):
                if b > a:
                    units.append(
                        LoadUnit(source.name, len(units), prefix + ".bin", -1, int(a), int(b), first_id + int(a))
                    )
            first_id += n_docs
        return units

    def read(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> SampleBlock:
        fs, _ = source_fs(source, plan.base_dir)
        prefix = unit.path[:-4]
        idx = Index(fs, prefix + ".idx", is_local(source, plan.base_dir))
        if unit.stop > idx.n_docs:
            raise SourceError(
                f"{unit.describe()}: the index now holds {idx.n_docs} documents (it changed since the source was "
                "indexed)"
            )
        starts = idx.doc_idx(unit.start, unit.stop + 1)
        s0, s1 = int(starts[0]), int(starts[-1])
        sizes = idx.sizes(s0, s1)
        seq_off = np.concatenate([[0], np.cumsum(sizes)])
        offsets = seq_off[starts - s0]
        n = int(seq_off[-1])
        if n:
            first = int(idx.pointers(s0, s0 + 1)[0])
            tokens = _bin_range(fs, unit.path, idx.dtype, first, n, idx.local)
        else:
            tokens = np.zeros(0, idx.dtype)
        ids = np.arange(unit.first_id, unit.first_id + unit.n_docs, dtype=np.int64)
        return SampleBlock(source.name, check_tokens(source.name, tokens), offsets, ids)


def _bin_range(fs, path: str, dtype: np.dtype, byte_offset: int, count: int, local: bool) -> np.ndarray:
    if local:
        return np.array(np.memmap(path, dtype=dtype, mode="r", offset=byte_offset, shape=(count,)))
    with fs.open(path, "rb") as f:
        f.seek(byte_offset)
        data = f.read(count * dtype.itemsize)
    if len(data) != count * dtype.itemsize:
        raise SourceError(
            f"{path}: ends inside the token range the index gives ({byte_offset} + {count * dtype.itemsize} bytes)"
        )
    return np.frombuffer(data, dtype=dtype)


def _check(fs, prefix: str, idx: Index, source: Source) -> np.ndarray:
    """Document token offsets (``[n_docs + 1]``) of one dataset, after checking that its index
    describes its ``.bin``: sizes and pointers contiguous from 0, the ``.bin`` exactly as long."""
    sizes = idx.sizes(0, idx.n_seqs)
    pointers = idx.pointers(0, idx.n_seqs)
    docs = idx.doc_idx(0, idx.n_doc_idx)
    where = f"source {source.name!r}: {prefix}.idx does not match {prefix}.bin"
    if len(docs) < 1 or docs[0] != 0 or docs[-1] != idx.n_seqs or np.any(np.diff(docs) < 0):
        raise SourceError(
            f"source {source.name!r}: {prefix}.idx: its document starts must run from 0 to its {idx.n_seqs} sequences"
        )
    if np.any(sizes < 0):
        raise SourceError(f"{where}: negative sequence sizes")
    expect = np.concatenate([[0], np.cumsum(sizes[:-1] * idx.dtype.itemsize)]) if idx.n_seqs else np.zeros(0, np.int64)
    if not np.array_equal(pointers, expect):
        bad = int(np.flatnonzero(pointers != expect)[0])
        raise SourceError(
            f"{where}: sequence {bad} starts at byte {pointers[bad]}, its predecessors end at {expect[bad]}"
        )
    bin_size = fs.size(prefix + ".bin")
    total = int(sizes.sum()) * idx.dtype.itemsize
    if bin_size != total:
        raise SourceError(
            f"{where}: the index describes {total:,} bytes of {idx.dtype} tokens, the .bin holds {bin_size:,}"
        )
    seq_off = np.concatenate([[0], np.cumsum(sizes)])
    return seq_off[docs]
