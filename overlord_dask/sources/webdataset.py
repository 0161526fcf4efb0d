"""webdataset sources: tar shards (local or any fsspec URL; brace patterns such as
``shard-{000..099}.tar``), each sample the consecutive members that share a key.

As in the webdataset library, a member ``dir/0001.jpg`` belongs to key ``dir/0001`` with
extension ``jpg`` (everything after the first dot of the file name, lower-cased). The plan names
members by extension: ``text_field: txt`` (UTF-8 text, tokenized), or ``tokens_field: ids.json``
(a JSON list of ids, or a ``.npy`` array); ``images_field: jpg,png`` lists the image extensions,
whose members (in member order) go before the text of their sample, on the multimodal path
parquet images take. ``prepare`` steps see each sample as a record: ``__key__``, the text
members as strings, the others as bytes, and the images as a list under ``images_field``.

A plain ``.tar`` shard is cut into load units of about ``loading.unit_bytes`` bytes of whole
samples, found at indexing from a few small reads near each cut (``tar_cuts.py``), so the first
batch waits for one unit, not a whole shard; a unit is read with one ranged request. Compressed
shards (``.tar.gz``) are one unit each, read front to back as a stream. A unit's samples are
counted when it is loaded: sample ids are ``i * 2**32 + k`` for sample ``k`` of unit ``i``. A
sample without the member the plan reads is an error naming the shard and the key, and so is a
damaged header anywhere in a shard.
"""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pyarrow as pa

from ..errors import SourceError
from ..plan import Source, SourcePlan
from . import arrow_views, tar_cuts
from .formats import UNKNOWN_BASE, Format
from .fs import list_files, source_fs
from .units import LoadUnit

TEXT_EXTS = {"txt", "text", "json", "cls", "caption", "md", "html"}  # decoded as UTF-8 in records


def split_name(name: str) -> tuple[str, str]:
    """``dir/0001.seg.jpg`` -> (``dir/0001``, ``seg.jpg``): the webdataset key and extension."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0:
        return name, ""
    return name[:dot], name[dot + 1 :].lower()


def samples(f, where: str, data: bytes | None = None, last: bool = True):
    """``(key, {ext: bytes})`` per sample of a tar stream, in member order. With ``data`` (the
    plain tar bytes ``f`` streams: a shard, or a unit of one, ``last`` when it ends the shard)
    its members must end where it ends (``tar_cuts.check_end``); a compressed stream is guarded
    by its own checksum."""
    key, members = None, {}
    try:
        with tarfile.open(fileobj=f, mode="r|*") as tar:
            for m in tar:
                k = _key(m)
                if k is None:
                    continue
                ext = split_name(m.name)[1]
                if k != key:
                    if key is not None:
                        yield key, members
                    key, members = k, {}
                if ext in members:
                    raise SourceError(f"{where}: sample {k!r} has two {ext!r} members")
                members[ext] = tar.extractfile(m).read()
            if data is not None:
                tar_cuts.check_end(tar, data, last, where)
    except (tarfile.TarError, EOFError, OSError) as err:
        if data is not None and not last and "unexpected end of data" in str(err):
            raise SourceError(tar_cuts.past_end(where)) from None
        raise SourceError(f"{where}: corrupt or truncated tar shard: {type(err).__name__}: {err}") from None
    except ValueError as err:
        raise SourceError(str(err)) from None
    if key is not None:
        yield key, members


def _key(m: tarfile.TarInfo) -> str | None:
    """A member's sample key, or None for one that belongs to no sample (not a file, a member
    without an extension, webdataset's metadata members such as ``__index__``)."""
    if not m.isfile():
        return None
    return _name_key(m.name)


def _name_key(name: str) -> str | None:
    k, ext = split_name(name)
    return None if k.rsplit("/", 1)[-1].startswith("__") or not ext else k


class WebDatasetFormat(Format):
    name = "webdataset"
    suffixes = (".tar", ".tar.gz", ".tgz")

    def check(self, source: Source) -> None:
        if source.images_field and not source.images_exts:
            raise ValueError(f"images_field {source.images_field!r} lists no image extensions (e.g. 'jpg,png')")

    def discover(self, source: Source, plan: SourcePlan) -> list[LoadUnit]:
        fs, files = list_files(source, plan.base_dir, self.suffixes)
        step = plan.loading.unit_bytes
        spans: list[tuple[str, tuple | None]] = []
        for path in files:
            spans += [(path, span) for span in _shard_spans(fs, path, step)]
        return [
            LoadUnit(source.name, i, path, -1, 0, -1, i * UNKNOWN_BASE, span) for i, (path, span) in enumerate(spans)
        ]

    def regions(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> list[tuple[str, int, int | None]]:
        return [(unit.path, 0, None)] if unit.span is None else [(unit.path, unit.span[0], unit.span[1])]

    def warnings(self, source: Source, plan: SourcePlan) -> list[str]:
        fs, files = list_files(source, plan.base_dir, self.suffixes)
        big = [p for p in files if not p.endswith(".tar") and fs.size(p) > 4 * plan.loading.unit_bytes]
        if not big:
            return []
        return [
            f"source {source.name!r}: {len(big)} compressed shard(s) (e.g. {big[0]}) are read whole, each as one load "
            "unit: a first batch waits for a whole shard. Plain .tar shards are cut into units of "
            "loading.unit_bytes."
        ]

    def read(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> pa.Table:
        fs, _ = source_fs(source, plan.base_dir)
        field = source.text_field or source.tokens_field or source.messages_field
        image_exts = source.images_exts
        rows = []
        try:
            with fs.open(unit.path, "rb") as f:
                data, last = None, True
                if unit.span is not None:
                    lo, hi, ends = unit.span
                    f.seek(lo)
                    data, last = f.read(hi - lo), bool(ends)
                    if len(data) != hi - lo:
                        raise SourceError(
                            f"{unit.describe()}: the shard holds {lo + len(data):,} bytes, not {hi:,} (changed since "
                            "it was indexed?)"
                        )
                elif unit.path.endswith(".tar"):
                    data = f.read()
                stream = f if data is None else tar_cuts.unit_stream(data, last)
                for key, members in samples(stream, unit.describe(), data, last):
                    if field not in members and not source.prepare:
                        raise SourceError(
                            f"{unit.describe()}: sample {key!r} has no {field!r} member (members: {sorted(members)})"
                        )
                    rows.append(_record(source, unit, key, members, image_exts))
        except FileNotFoundError:
            raise SourceError(f"{unit.describe()}: shard not found") from None
        return _table(source, rows)


def _shard_spans(fs, path: str, step: int) -> list[tuple[int, int, int] | None]:
    """A shard's units as byte spans ``(lo, hi, 1 if the unit ends the shard else 0)`` of whole
    samples (``tar_cuts.py``); a compressed shard, or one under ``step`` bytes, is one unit read
    whole (None)."""
    size = fs.size(path)
    if not path.endswith(".tar") or size <= step:
        return [None]
    with fs.open(path, "rb", block_size=tar_cuts.WINDOW) as f:
        starts = tar_cuts.cuts(f, size, step, _name_key)
    return [(lo, hi, int(hi == size)) for lo, hi in zip(starts, starts[1:] + [size])]


def _record(source: Source, unit: LoadUnit, key: str, members: dict, image_exts: tuple) -> dict:
    rec: dict = {"__key__": key}
    for ext, data in members.items():
        if ext == source.text_field or (source.prepare and ext in TEXT_EXTS):
            try:
                rec[ext] = data.decode("utf-8")
            except UnicodeDecodeError as err:
                raise SourceError(f"{unit.describe()}: member {key}.{ext} is not UTF-8 text: {err}") from None
        elif ext in (source.tokens_field, source.labels_field, source.loss_mask_field):
            rec[ext] = _ids(data, ext, f"{unit.describe()}: member {key}.{ext}")
        elif ext == source.messages_field:
            rec[ext] = _messages(data, f"{unit.describe()}: member {key}.{ext}")
        else:
            rec[ext] = data
    if image_exts:
        rec[source.images_field] = [members[e] for e in members if e in image_exts]
        rec[source.image_positions_field] = [0] * len(rec[source.images_field])
    return rec


def _messages(data: bytes, where: str) -> list:
    """A chat member: a JSON list of messages, or an object with one under ``messages``."""
    try:
        value = json.loads(data)
    except ValueError as err:
        raise SourceError(f"{where}: not JSON: {err}") from None
    if isinstance(value, dict):
        value = value.get("messages")
    if not isinstance(value, list):
        raise SourceError(
            f"{where}: expected a JSON list of messages (or an object with 'messages'), got {type(value).__name__}"
        )
    return value


def _ids(data: bytes, ext: str, where: str) -> list[int]:
    try:
        if ext.endswith("npy"):
            arr = np.load(io.BytesIO(data), allow_pickle=False)
        else:
            arr = np.asarray(json.loads(data))
    except (ValueError, OSError) as err:
        raise SourceError(f"{where}: cannot read token ids: {err}") from None
    if arr.ndim != 1 or (arr.size and not np.issubdtype(arr.dtype, np.integer)):
        raise SourceError(
            f"{where}: token ids must be a flat list of integers (got shape {arr.shape}, dtype {arr.dtype})"
        )
    return arr.astype(np.int64).tolist()


def _table(source: Source, rows: list[dict]) -> pa.Table:
    """The shard's records with the plan's fields typed (so an empty shard, or one whose samples
    all lack an optional member, still has them)."""
    cols: dict = {}
    for r in rows:
        for k in r:
            cols.setdefault(k, None)
    field = source.text_field or source.tokens_field or source.messages_field
    types = {field: pa.string() if source.text_field else pa.list_(pa.int64())}
    if source.messages_field:
        types = {field: None}  # inferred: messages may carry more than role and content
    for name in (source.labels_field, source.loss_mask_field):
        if name:
            types[name] = pa.list_(pa.int64())
    if source.images_field:
        types[source.images_field] = pa.list_(pa.binary())
        types[source.image_positions_field] = pa.list_(pa.int64())
    out = {}
    for k in list(cols) + [k for k in types if k not in cols]:
        values = [r.get(k) for r in rows]
        if k == source.messages_field:
            out[k] = (
                pa.array(values)
                if any(v is not None for v in values)
                else pa.array(values, pa.list_(pa.struct([("role", pa.string())])))
            )
            continue
        typ = types.get(k)
        if typ is None:
            typ = pa.string() if all(v is None or isinstance(v, str) for v in values) else pa.binary()
        out[k] = arrow_views.from_items(values, typ)
    return (
        pa.table(out)
        if out
        else pa.table({field: arrow_views.from_items([], types[field] or pa.list_(pa.struct([("role", pa.string())])))})
    )
