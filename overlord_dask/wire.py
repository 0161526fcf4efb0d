"""The wire form of a packed micro-batch: narrow integer dtypes, derivable arrays left out.

A packed micro-batch holds three capacity-long token arrays (``input_ids``, ``labels``,
``position_ids``), 12 bytes per token as int32. Two of them follow from the first and from
``cu_seqlens``: a label is the next input token inside a piece (the piece's last token carries
its document's true next token, or -100), and positions restart at every piece. So the wire
carries only the real tokens in the narrowest dtype that holds them (2 bytes per token for a
vocabulary under 65,536) plus one label per piece, and :func:`decode` rebuilds exactly what
``worker.constructors.pack_micro_batch`` makes (tested field by field). Every other integer array
travels narrowed as well; the consumer restores the dtypes in ``DTYPES``.

Where the loss ignores some tokens (chat turns, masked labels) the micro-batch also carries
``"mask"``: one bit per real token (:func:`pack_mask`), 0 where that token is not a target, and
the rebuilt labels are -100 there. A micro-batch where every token is a target carries no mask.

Context-parallel slices are not derivable this way (zigzag chunks): they travel whole, narrowed.

A batch travels as one buffer (:func:`pack_batch`: pickle protocol 5, arrays in-band), not as a
Dask-serialized structure: Dask makes a frame of every array, with its own header and a
compression attempt each, and a fetch of several steps holds dozens of arrays, so one buffer
serializes and deserializes several times faster.

Each batch is pickled once, by the constructor task that builds it (:func:`pack_batch`, on the
worker's task thread): pickling on the worker's event loop at every fetch, and again for every
shadow copy of a chunk, would cost the loop time on every fetch and copy, most at large dp (many
small batches per chunk). A fetch answers with those buffers as they are, one Dask frame each
(:class:`Payload`): joined into one bytes value inside the reply, each would be copied twice more
on the worker's event loop (the join, then msgpack packing the value into the message) and twice
on the trainer's (msgpack's unpacking, then the split). ``benchmarks/throughput.py`` measures the
path end to end.
"""

from __future__ import annotations

import pickle

import numpy as np

from .vocab import PAD_ID

IGNORE_INDEX = -100
DTYPES = {
    "input_ids": np.int32,
    "labels": np.int32,
    "position_ids": np.int32,
    "cu_seqlens": np.int32,
    "sample_ids": np.int64,
    "source_ids": np.int32,
    "chunk_ids": np.int32,
    "piece_starts": np.int64,
    "epochs": np.int32,
    "seg_piece": np.int32,
    "seg_chunk": np.int32,
    "image_positions": np.int32,
    "patch_index": np.int32,
}
PIECE_FIELDS = ("sample_ids", "source_ids", "chunk_ids", "piece_starts", "epochs")
"""Per-piece identity arrays. On the wire they are columns of one table (``"pieces"``), with each
piece's length (``cu_seqlens`` follows) and last label: one narrowing and one pickled array per
micro-batch instead of seven (narrowing even a tiny array costs two reductions); the trainer
copies the columns out contiguous when it decodes."""
_NARROW = tuple(
    (np.dtype(dt), int(np.iinfo(dt).min), int(np.iinfo(dt).max))
    for dt in (np.uint8, np.int8, np.uint16, np.int16, np.int32, np.int64)
)


def narrow(a: np.ndarray) -> np.ndarray:
    """``a`` in the smallest integer dtype that holds all its values (lossless)."""
    if a.size == 0:
        return a.astype(np.uint8)
    lo, hi = int(a.min()), int(a.max())
    for dt, dmin, dmax in _NARROW:  # bounds computed once: np.iinfo per call was a third of encoding
        if dmin <= lo and hi <= dmax:
            return a if a.dtype == dt else a.astype(dt)
    return a


def piece_table(lengths: np.ndarray, last_labels: np.ndarray, fields: dict) -> np.ndarray:
    """The wire's ``"pieces"`` table: per piece its length, its last label and ``PIECE_FIELDS``."""
    return narrow(
        np.stack([lengths, last_labels, *(fields[k] for k in PIECE_FIELDS)], axis=1).astype(np.int64, copy=False)
    )


def pack_mask(mask: np.ndarray) -> np.ndarray:
    """A token mask (0/1 per token) as bits: an eighth of a byte per token on the wire."""
    return np.packbits(np.asarray(mask, dtype=bool))


def encode(mb: dict) -> dict:
    """Wire form of one micro-batch (a CP slice or a full micro-batch)."""
    out = {}
    derive = "cu_seqlens" in mb and "labels" in mb and "seg_piece" not in mb
    skip: set = set()
    if derive:
        n, cu = int(mb["num_tokens"]), mb["cu_seqlens"]
        out["capacity"] = len(mb["input_ids"])
        out["tokens"] = narrow(mb["input_ids"][:n])
        last = mb["labels"][cu[1:] - 1] if len(cu) > 1 else np.zeros(0, np.int64)
        skip = {"input_ids", "labels", "position_ids"}
        if all(k in mb for k in PIECE_FIELDS):
            out["pieces"] = piece_table(np.diff(cu), last, mb)
            skip |= {"cu_seqlens", *PIECE_FIELDS}
        else:
            out["last_labels"] = narrow(last) if len(cu) > 1 else np.zeros(0, np.int8)
    for k, v in mb.items():
        if k in skip:
            continue
        out[k] = narrow(v) if k in DTYPES and isinstance(v, np.ndarray) else v
    return out


def decode(w: dict, dtypes: dict = DTYPES, pad_id: int = PAD_ID) -> dict:
    """The micro-batch :func:`encode` was given, with the consumer-facing ``dtypes`` (the
    torch consumer asks for int64 ids straight away: converting afterwards copied every
    token array once more, the largest cost on the trainer's side).

    Every token array is written once, from the narrow wire ``tokens`` (a casting copy), never
    copied from another array of its own size and dtype: two such arrays allocated one after the
    other lie a whole number of pages (plus the allocator's 16-byte header) apart, and a plain
    copy between addresses that close modulo 4 KiB runs many times slower on x86 (4K aliasing),
    which made copying the labels from ``input_ids`` the largest part of decoding."""
    out = {}
    table = w.get("pieces")
    if "tokens" in w:
        C, n = int(w["capacity"]), int(w["num_tokens"])
        tokens = w["tokens"]
        if table is not None:
            lengths, last = table[:, 0], table[:, 1]
            cu = np.empty(len(table) + 1, dtype=dtypes["cu_seqlens"])
            cu[0] = 0
            np.add.accumulate(lengths, dtype=cu.dtype, out=cu[1:])  # (half of what cumsum's casting out= costs)
        else:
            cu, last = w["cu_seqlens"], w["last_labels"]
            lengths = np.diff(cu)
        ids = np.empty(C, dtype=dtypes["input_ids"])
        ids[:n] = tokens
        ids[n:] = pad_id
        labels = np.empty(C, dtype=dtypes["labels"])
        m = max(n - 1, 0)
        labels[:m] = tokens[1:n]
        labels[m:] = IGNORE_INDEX
        if "mask" in w and m:
            targets = np.unpackbits(w["mask"], count=n).view(bool)
            labels[:m][~targets[1:n]] = IGNORE_INDEX  # the loss ignores these targets
        if len(cu) > 1:
            labels[cu[1:] - 1] = last
        pdt = dtypes["position_ids"]
        ar = _arange(C, pdt)
        pos = np.empty(C, dtype=pdt)
        np.subtract(ar[:n], np.repeat(cu[:-1], lengths), out=pos[:n], casting="unsafe")  # restart at every piece
        pos[n:] = ar[: C - n]  # padding counts on from 0
        out.update(input_ids=ids, labels=labels, position_ids=pos)
        if table is not None:
            out["cu_seqlens"] = cu
            columns = table[:, 2:].T  # one contiguous copy per dtype asked for, each field a row of it
            by_dtype = {}
            for i, k in enumerate(PIECE_FIELDS):
                dt = np.dtype(dtypes[k])
                if dt not in by_dtype:
                    by_dtype[dt] = columns.astype(dt, order="C")
                out[k] = by_dtype[dt][i]
    for k, v in w.items():
        if k in ("tokens", "last_labels", "capacity", "pieces", "mask"):
            continue
        out[k] = v.astype(dtypes[k]) if k in dtypes and isinstance(v, np.ndarray) else v
    return out


_ARANGES: dict[tuple[int, np.dtype], np.ndarray] = {}


def _arange(n: int, dtype) -> np.ndarray:
    """``np.arange(n, dtype)``, made once per (capacity, dtype) and only ever read."""
    key = (n, np.dtype(dtype))
    a = _ARANGES.get(key)
    if a is None:
        a = _ARANGES[key] = np.arange(n, dtype=dtype)
        a.flags.writeable = False
    return a


def hf_labels(labels: np.ndarray, cu_seqlens: np.ndarray, num_tokens: int) -> np.ndarray:
    """The labels of models that shift them themselves (Hugging Face), from the shifted ones:
    moved one to the right (the token itself, or -100 where it is no target), -100 at the first
    token of every piece (the model's shift never predicts across documents) and on padding."""
    n = int(num_tokens)
    out = np.full(len(labels), IGNORE_INDEX, dtype=labels.dtype)
    out[1:n] = labels[: max(n - 1, 0)]
    out[np.asarray(cu_seqlens[:-1], dtype=np.intp)] = IGNORE_INDEX
    return out


def encode_batch(batch: dict) -> dict:
    return {**batch, "micro_batches": [encode(mb) for mb in batch["micro_batches"]]}


def decode_batch(batch: dict, dtypes: dict = DTYPES) -> dict:
    """A batch's micro-batches decoded; padded with the batch's ``pad_id`` (the plan tokenizer's)."""
    pad = batch.get("pad_id", PAD_ID)
    return {**batch, "micro_batches": [decode(mb, dtypes, pad) for mb in batch["micro_batches"]]}


def pack_batch(batch: dict) -> bytes:
    """One wire-form batch as bytes (pickle protocol 5, arrays in-band)."""
    return pickle.dumps(batch, protocol=5)


class Payload:
    """What a worker answers a fetch with: the :func:`pack_batch` buffers of the steps asked
    for, sent as they are, one Dask frame each (no join, no copy into the message); on the
    trainer's side the frames are views of the received message. Wrap it in
    ``distributed.protocol.to_serialize`` in a reply."""

    __slots__ = ("frames",)

    def __init__(self, frames: list):
        self.frames = frames

    def batches(self) -> list[dict]:
        """The batches (the trainer trusts its service's workers, as Dask does)."""
        return [pickle.loads(f) for f in self.frames]


_registered = False


def register_payload_with_dask() -> None:
    """Teach Dask's serialization :class:`Payload` (once per process): a worker's fetch replies
    carry it, and a trainer reads it through Dask's comms where it uses them (TLS). The
    trainer's own TCP comms read it without Dask (``trainer/comm.py``), so this module does not
    import ``distributed`` itself."""
    global _registered
    if _registered:
        return
    _registered = True
    from distributed.protocol import dask_deserialize, dask_serialize

    @dask_serialize.register(Payload)
    def _serialize_payload(payload: Payload) -> tuple[dict, list]:
        return {"compression": (None,) * len(payload.frames)}, list(payload.frames)  # token ids barely compress

    @dask_deserialize.register(Payload)
    def _deserialize_payload(header: dict, frames: list) -> Payload:
        return Payload(list(frames))


def nbytes(batch: dict) -> int:
    """Bytes of a batch's arrays (numpy or torch)."""
    return sum(v.nbytes for mb in batch["micro_batches"] for v in mb.values() if hasattr(v, "nbytes"))
