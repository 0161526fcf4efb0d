"""webdataset sources: tar shards (local or any fsspec URL; brace patterns such as
``shard-{000..099}.tar``), each sample the consecutive members that share a key.

As in the webdataset library, a member ``dir/0001.jpg`` belongs to key ``dir/0001`` with
extension ``jpg`` (everything after the first dot of the file name, lower-cased). The plan names
members by extension: ``text_field: txt`` (UTF-8 text, tokenized), or ``tokens_field: ids.json``
(a JSON list of ids, or a ``.npy`` array); ``images_field: jpg,png`` lists the image extensions,
whose members (in member order) go before the text of their sample, on the multimodal path
parquet images take. ``prepare`` steps see each sample as a record: ``__key__``, the text
members as strings, the others as bytes, and the images as a list under ``images_field``.

A shard is one load unit, read front to back as a stream (no seeks: object stores serve it as one
request). Its samples are counted when it is loaded: sample ids are ``i * 2**32 + k`` for sample
``k`` of shard ``i``. A sample without the member the plan reads is an error naming the shard and
the key.
"""

from __future__ import annotations

import io
import json
import tarfile

import numpy as np
import pyarrow as pa

from ..errors import SourceError
from ..plan import Source, SourcePlan
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


def samples(f, where: str):
    """``(key, {ext: bytes})`` per sample of a tar stream, in member order."""
    key, members = None, {}
    try:
        with tarfile.open(fileobj=f, mode="r|*") as tar:
            for m in tar:
                if not m.isfile():
                    continue
                k, ext = split_name(m.name)
                if k.rsplit("/", 1)[-1].startswith("__") or not ext:
                    continue  # webdataset's metadata members (__index__ ...)
                if k != key:
                    if key is not None:
                        yield key, members
                    key, members = k, {}
                if ext in members:
                    raise SourceError(f"{where}: sample {k!r} has two {ext!r} members")
                members[ext] = tar.extractfile(m).read()
    except (tarfile.TarError, EOFError, OSError) as err:
        raise SourceError(f"{where}: corrupt or truncated tar shard: {type(err).__name__}: {err}") from None
    if key is not None:
        yield key, members


class WebDatasetFormat(Format):
    name = "webdataset"
    suffixes = (".tar", ".tar.gz", ".tgz")

    def check(self, source: Source) -> None:
        if source.images_field and not source.images_exts:
            raise ValueError(f"images_field {source.images_field!r} lists no image extensions (e.g. 'jpg,png')")

    def discover(self, source: Source, plan: SourcePlan) -> list[LoadUnit]:
        _, files = list_files(source, plan.base_dir, self.suffixes)
        return [LoadUnit(source.name, i, path, -1, 0, -1, i * UNKNOWN_BASE) for i, path in enumerate(files)]

    def read(self, source: Source, plan: SourcePlan, unit: LoadUnit) -> pa.Table:
        fs, _ = source_fs(source, plan.base_dir)
        field = source.text_field or source.tokens_field or source.messages_field
        image_exts = source.images_exts
        rows = []
        try:
            with fs.open(unit.path, "rb") as f:
                for key, members in samples(f, unit.describe()):
                    if field not in members and not source.prepare:
                        raise SourceError(
                            f"{unit.describe()}: sample {key!r} has no {field!r} member (members: {sorted(members)})"
                        )
                    rows.append(_record(source, unit, key, members, image_exts))
        except FileNotFoundError:
            raise SourceError(f"{unit.describe()}: shard not found") from None
        return _table(source, rows)


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
        out[k] = pa.array(values, type=typ)
    return (
        pa.table(out)
        if out
        else pa.table({field: pa.array([], types[field] or pa.list_(pa.struct([("role", pa.string())])))})
    )
