"""JSON Lines sources: one JSON object per line, plain, gzip (``.gz``) or zstd (``.zst``), by extension.

A record is a non-blank line; blank lines are no documents. ``text_field`` (a string key) is
tokenized, or ``tokens_field`` (a list of ints) taken as ids; with ``prepare`` steps every key is
read (nested objects as structs).

How a file is cut into load units depends on what it allows without decompressing it at plan time:

- **plain**: byte ranges of about ``loading.unit_bytes``, from the file size alone. A unit owns the
  lines that start in its range (the line running over its end is read to its newline). Its
  document count is learnt when it is loaded.
- **zstd of several frames**: runs of whole frames of about ``unit_bytes``, from the seek table or
  the frame headers (``compression.py``); a unit owns the lines that start in its frames, and
  decompresses one frame before them (was the boundary a line start?) and the few bytes after
  them that finish its last line.
- **gzip, or zstd of one frame**: the stream can only be entered at its start, so indexing reads
  it once (the one-pass line index: where units of about ``unit_bytes`` begin, and their line
  counts), cached under ``$OVERLORD_CACHE_DIR`` (default ``~/.cache/overlord_dask``) by the file's
  URL, size and modification time; loading unit ``k`` decompresses the file up to its end. A
  file of ``n`` units thus costs about ``n / 2`` decompressions per pass: fine for files of a few
  units, and the reason to prefer plain or multi-frame zstd files (``pzstd``, seekable zstd) for
  large ones, or to raise ``unit_bytes`` to read each file as one unit.

Sample ids are dense (file order) when every unit was counted at indexing; otherwise unit ``i``'s
documents have ids ``i * 2**32 + k`` (``formats.UNKNOWN_BASE``).
"""

from __future__ import annotations

import io
import json
import re
from collections.abc import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.json as pj

from ..errors import SourceError
from ..plan import Source, SourcePlan
from .compression import compression, decompressed, zstd_frames
from .formats import UNKNOWN_BASE, Format
from .fs import list_files, source_fs
from .index_cache import cached
from .units import LoadUnit

SUFFIXES = tuple(f"{stem}{z}" for stem in (".jsonl", ".ndjson", ".json") for z in ("", ".gz", ".zst", ".zstd"))
INDEX_VERSION = 1
_ROW = re.compile(r"in row (\d+)")


class JsonlFormat(Format):
    name = "jsonl"
    suffixes = SUFFIXES

    # ---- indexing ---------------------------------------------------------------------------------------
    def discover(self, source: Source, plan: SourcePlan) -> list[LoadUnit]:
        fs, files = list_files(source, plan.base_dir, self.suffixes)
        step = plan.loading.unit_bytes
        cuts: list[tuple[str, int, int, tuple]] = []  # (path, doc start, doc stop or -1, span)
        for path in files:
            cuts += _file_units(fs, path, step, source)
        counted = all(stop >= 0 for _, _, stop, _ in cuts)
        docs: dict[str, int] = {}  # documents per file, when counted
        for path, _, stop, _ in cuts:
            docs[path] = max(docs.get(path, 0), stop)
        base = dict(zip(docs, np.cumsum([0] + list(docs.values())[:-1]).tolist()))
        return [
            LoadUnit(source.name, i, path, -1, start, stop, base[path] + start if counted else i * UNKNOWN_BASE, span)
            for i, (path, start, stop, span) in enumerate(cuts)
        ]

    # ---- loading ------------------------------------------------------------------------------------------
    def read(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> pa.Table:
        fs, _ = source_fs(source, plan.base_dir)
        kind = compression(unit.path)
        try:
            with fs.open(unit.path, "rb") as f:
                data = _unit_bytes(f, kind, unit)
        except FileNotFoundError:
            raise SourceError(f"{unit.describe()}: file not found") from None
        lines = data.split(b"\n")
        if lines and lines[-1] == b"":
            lines.pop()
        keep = [i for i, line in enumerate(lines) if line.strip()]
        if unit.stop >= 0:  # a counted unit (or part of one): documents start..stop of the file
            lo = unit.start - unit.span[2]
            keep = keep[lo : lo + unit.n_docs]
        records = b"\n".join(lines[i] for i in keep)
        return _parse(source, unit, records, lambda row: _line_number(fs, kind, unit, keep[row]))


def _file_units(fs, path: str, step: int, source: Source) -> list[tuple[str, int, int, tuple]]:
    """One file's units: ``(path, first document, stop or -1, span)``."""
    kind = compression(path)
    size = fs.size(path)
    if kind is None:
        return [(path, 0, -1, (lo, min(lo + step, size))) for lo in range(0, size, step)]
    if kind == "zstd":
        with fs.open(path, "rb") as f:
            frames = zstd_frames(f, size, path)
        if len(frames) > 1:
            return _frame_units(path, frames, step)
    return [(path, a, b, (lo, hi, a)) for lo, hi, a, b in _line_index(fs, path, kind, size, step)]


def _frame_units(path: str, frames: list, step: int) -> list[tuple[str, int, int, tuple]]:
    """Runs of whole frames of about ``step`` decompressed bytes (compressed bytes times 4 where
    a frame does not say its size): span ``(first frame's offset, end offset, previous frame's
    offset or -1)``."""
    out, run, size = [], [], 0
    for k, (_off, csize, dsize) in enumerate(frames):
        run.append(k)
        size += dsize if dsize is not None else 4 * csize
        if size >= step or k == len(frames) - 1:
            a, b = run[0], run[-1]
            prev = frames[a - 1][0] if a > 0 else -1
            out.append((path, 0, -1, (frames[a][0], frames[b][0] + frames[b][1], prev)))
            run, size = [], 0
    return out


def _line_index(fs, path: str, kind: str, size: int, step: int) -> list[tuple[int, int, int, int]]:
    """The one-pass line index of a stream that can only be read from its start: units of about
    ``step`` decompressed bytes, cut at line starts, as ``(lo, hi, first document, stop)``
    (documents: non-blank lines). Cached by URL, size, modification time and ``step``
    (``index_cache.py``)."""
    units = cached(
        fs, path, size, "jsonl-index", [INDEX_VERSION, step], lambda: _build_line_index(fs, path, kind, step)
    )
    return [tuple(u) for u in units]


def _build_line_index(fs, path: str, kind: str, step: int) -> list[tuple[int, int, int, int]]:
    units, lo, pos, docs, doc_lo, carry = [], 0, 0, 0, 0, b""
    with fs.open(path, "rb") as f:
        for chunk in decompressed(f, kind, path):
            data = carry + chunk
            end = data.rfind(b"\n") + 1
            whole, carry = data[:end], data[end:]
            for line in whole.split(b"\n")[:-1]:
                pos += len(line) + 1
                if line.strip():
                    docs += 1
                if pos - lo >= step:
                    units.append((lo, pos, doc_lo, docs))
                    lo, doc_lo = pos, docs
    if carry.strip():
        docs += 1
    pos += len(carry)
    if pos > lo:
        units.append((lo, pos, doc_lo, docs))
    return units


def _slice(chunks: Iterator[bytes], lo: int, hi: int) -> Iterator[bytes]:
    """The bytes ``[lo, hi)`` of a stream of chunks (read no further than ``hi``)."""
    pos = 0
    for chunk in chunks:
        a, b = max(lo - pos, 0), min(hi - pos, len(chunk))
        if a < b:
            yield chunk[a:b]
        pos += len(chunk)
        if pos >= hi:
            return


def _unit_bytes(f, kind: str | None, unit: LoadUnit) -> bytes:
    """The unit's lines: whole, from the first it owns through the last."""
    span = unit.span
    if unit.stop >= 0:  # line index: decompress from the start, keep [lo, hi)
        return b"".join(_slice(decompressed(f, kind, unit.path), span[0], span[1]))
    if kind is None:
        lo, hi = span
        f.seek(max(lo - 1, 0))
        data = f.read(hi - lo + (1 if lo > 0 else 0))
        starts_line = lo == 0 or data[:1] == b"\n"
        data = data[1:] if lo > 0 else data
        data += _rest_of_line(_plain_chunks(f), data)
    else:
        c_a, c_b, c_prev = span
        starts_line = c_prev < 0 or _ends_line(decompressed(f, kind, unit.path, c_prev, c_a))
        data = b"".join(decompressed(f, kind, unit.path, c_a, c_b))
        data += _rest_of_line(decompressed(f, kind, unit.path, c_b), data)
    if not starts_line:  # the first line began before the unit: its owner reads it
        cut = data.find(b"\n")
        data = b"" if cut < 0 else data[cut + 1 :]
    return data


def _plain_chunks(f) -> Iterator[bytes]:
    while True:
        data = f.read(1 << 16)
        if not data:
            return
        yield data


def _ends_line(chunks: Iterator[bytes]) -> bool:
    last = b""
    for c in chunks:
        if c:
            last = c[-1:]
    return last in (b"", b"\n")


def _rest_of_line(chunks: Iterator[bytes], data: bytes) -> bytes:
    """The bytes after ``data`` up to and including the next newline (the end of the line
    ``data`` ends inside), or nothing if ``data`` ends a line."""
    if not data or data.endswith(b"\n"):
        return b""
    out = []
    for c in chunks:
        cut = c.find(b"\n")
        if cut >= 0:
            out.append(c[: cut + 1])
            break
        out.append(c)
    return b"".join(out)


def _parse(source: Source, unit: LoadUnit, records: bytes, line_of) -> pa.Table:
    """The records as a table: with prepare steps every key (types inferred), else only the
    field the plan reads."""
    if not records:
        return _empty(source)
    if source.prepare or source.messages_field or source.labels_field or source.loss_mask_field:
        opts = pj.ParseOptions(
            newlines_in_values=False
        )  # every key, types inferred (messages may carry more than role and content)
    else:
        field = (
            pa.field(source.text_field, pa.string())
            if source.text_field
            else pa.field(source.tokens_field, pa.list_(pa.int64()))
        )
        opts = pj.ParseOptions(explicit_schema=pa.schema([field]), unexpected_field_behavior="ignore")
    try:
        return pj.read_json(
            io.BytesIO(records),
            read_options=pj.ReadOptions(block_size=max(len(records) + 1, 1 << 20), use_threads=False),
            parse_options=opts,
        )
    except (pa.ArrowInvalid, pa.ArrowTypeError) as err:
        row = _bad_row(records, str(err))
        where = f"line {line_of(row)}" if row is not None else "a record"
        raise SourceError(
            f"source {source.name!r}: malformed JSON in {unit.path}, {where}: {_reason(records, row, err)}"
        ) from None


def _empty(source: Source) -> pa.Table:
    if source.text_field:
        return pa.table({source.text_field: pa.array([], pa.string())})
    if source.messages_field:
        return pa.table(
            {
                source.messages_field: pa.array(
                    [], pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
                )
            }
        )
    return pa.table({source.tokens_field: pa.array([], pa.list_(pa.int64()))})


def _bad_row(records: bytes, message: str) -> int | None:
    """Which record (0-based) is malformed: the first that is not a JSON object, else the row
    Arrow names (a value of another type than the rows before it)."""
    for k, line in enumerate(records.split(b"\n")):
        try:
            if not isinstance(json.loads(line), dict):
                return k
        except ValueError:
            return k
    m = _ROW.search(message)
    return int(m.group(1)) if m else None  # Arrow counts rows from 0


def _reason(records: bytes, row: int | None, err: Exception) -> str:
    if row is None:
        return str(err)
    line = records.split(b"\n")[row]
    try:
        value = json.loads(line)
    except json.JSONDecodeError as bad:
        return f"{bad.msg} (column {bad.colno}): {line[:80]!r}"
    except ValueError as bad:
        return f"{bad}: {line[:80]!r}"
    if not isinstance(value, dict):
        return f"expected a JSON object, got {type(value).__name__}: {line[:80]!r}"
    return f"{_ROW.sub('', str(err).removeprefix('JSON parse error: ')).strip()}: {line[:80]!r}"


def _line_number(fs, kind, unit: LoadUnit, line: int) -> int:
    """The 1-based line number in the file of the unit's ``line`` (0-based among its lines):
    the lines that begin before the unit's first line are counted (read again, on this error
    path only)."""
    with fs.open(unit.path, "rb") as f:
        if unit.stop >= 0:  # line index: the decompressed bytes before the unit
            prefix = _slice(decompressed(f, kind, unit.path), 0, unit.span[0])
        else:  # the bytes (plain) or whole frames (zstd) before the unit's range
            prefix = decompressed(f, kind, unit.path, 0, unit.span[0])
        before, last = 0, b"\n"
        for chunk in prefix:
            if chunk:
                before += chunk.count(b"\n")
                last = chunk[-1:]
    return before + (last != b"\n") + line + 1  # a line cut by the unit's start is the previous unit's
