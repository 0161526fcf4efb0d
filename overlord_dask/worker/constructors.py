"""Data constructors: build packed micro-batches on a worker, a chunk of steps per task.

Input (:func:`build_chunk`, one Dask task): consecutive handed-out steps for a group of ranks, each
step's pieces ``[source, epoch, unit, doc, start, stop]`` with their (rank, micro-batch) slots,
and the sample blocks those pieces live in (Dask resolves the block futures to local or
peer-fetched blocks). What a trainer receives per micro-batch is a dict of numpy arrays, padded
to the token capacity so every micro-batch has the same shape:

- ``input_ids``   int32 [C]  token ids; padding is ``PAD_ID`` after the last piece
- ``labels``      int32 [C]  next token of the same document, ``-100`` at a document's last token
  and on padding (a non-final piece of a split document keeps its true next token)
- ``position_ids`` int32 [C] restart at 0 for every piece; padding counts on from 0 as well
- ``cu_seqlens``  int32 [n+1] piece boundaries over the real tokens (flash-attn varlen layout)
- ``sample_ids``  int64 [n]  source-wide document ids; ``source_ids`` int32 [n] plan source index;
  ``chunk_ids`` int32 [n] piece index inside a split document (``piece_starts`` int64 [n]: its
  first token's offset in the document, exact even when the piece size changed between stages
  or ``balance.packing: cut`` cut the document where a micro-batch ends);
  ``epochs`` int32 [n]
- ``num_tokens``  int        real (non-padding) tokens
- a plan with loss masks (chat turns, masked labels): ``labels`` are also ``-100`` where the
  target token is masked (the wire carries the mask as bits, ``wire.py``)
- multimodal runs also get, per image patch in the micro-batch (one placeholder token each):
  ``image_patches`` [n_patches, patch_dim] (the source's dtype), ``image_positions`` int32
  [n_patches] (the placeholder's position in ``input_ids``) and ``patch_index`` int32
  [n_patches] (the patch's index inside its image, for 2-D position embeddings). A piece that
  cuts through an image carries only that image's patches whose placeholders it holds.

Integer numpy arrays only: they serialize zero-copy, and the trainer converts them to torch.

That is the packed micro-batch the trainer gets. Without context parallelism a constructor
stores its wire form (``wire.py``) and builds that directly: the real tokens and one label per
piece, no padded ``labels``/``position_ids`` to be dropped again. A text-only chunk is built
for all its micro-batches at once (:func:`wire_chunk`); a multimodal micro-batch with its image
patches by :func:`wire_micro_batch`, from the same pass over the pieces as the padded form
(:func:`_gather`).
"""

from __future__ import annotations

import pickle

import numpy as np
from dask.sizeof import sizeof

from .. import pieces as P
from ..batch_layout import BatchLayout
from ..protocol import block_key
from ..sources.blocks import SampleBlock
from ..vocab import PAD_ID
from ..wire import DTYPES, IGNORE_INDEX, encode_batch, narrow, nbytes, pack_batch, pack_mask, piece_table


class _Gathered:
    """What one micro-batch's pieces hold, before any padding: the real tokens end to end, the
    piece boundaries, each piece's next token in its document (``IGNORE_INDEX`` after a
    document's last token), the per-piece identity arrays and the image patches."""

    __slots__ = ("tokens", "cu", "nexts", "meta", "images", "mask")


def _gather(pieces, blocks: dict[str, SampleBlock], capacity: int, piece_tokens: int, multimodal: bool) -> _Gathered:
    """One pass over the pieces: a slice copy and two scalar reads per piece; everything
    else (labels, positions, padding, the identity arrays) is computed on whole arrays."""
    rows = np.asarray(pieces, dtype=P.DTYPE).reshape(-1, P.WIDTH)
    n = len(rows)
    lens = P.lengths(rows)
    cu = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    if n and cu[-1] > capacity:
        k = int(np.argmax(cu[1:] > capacity))
        raise ValueError(f"micro-batch over capacity: {int(cu[k + 1])} > {capacity} tokens (planner bug)")
    parts, masks, nexts, sample_ids = [], [], np.empty(n, dtype=np.int64), np.empty(n, dtype=np.int64)
    patches, patch_pos, patch_idx = [], [], []
    by_unit: dict[tuple, SampleBlock] = {}
    for k, row in enumerate(rows.tolist()):
        unit, doc, start, stop = tuple(row[: P.UNIT + 1]), row[P.DOC], row[P.START], row[P.STOP]
        block = by_unit.get(unit)
        if block is None:
            block = by_unit[unit] = blocks[block_key(*unit)]
        if block.images is not None:
            _image_patches(block, doc, start, stop, int(cu[k]), patches, patch_pos, patch_idx)
        d0, d1 = int(block.offsets[doc]), int(block.offsets[doc + 1])
        parts.append(block.tokens[d0 + start : d0 + stop])
        after = d0 + stop
        has_next = after < d1 and (block.loss_mask is None or block.loss_mask[after])
        nexts[k] = block.tokens[after] if has_next else IGNORE_INDEX
        masks.append(None if block.loss_mask is None else block.loss_mask[d0 + start : after])
        sample_ids[k] = block.sample_ids[doc]
    g = _Gathered()
    g.tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)
    g.mask = None
    if any(m is not None for m in masks):
        g.mask = np.concatenate([m if m is not None else np.ones(len(p), np.uint8) for p, m in zip(parts, masks)])
    g.cu, g.nexts = cu.astype(np.int32), nexts
    g.meta = {
        "sample_ids": sample_ids,
        "source_ids": rows[:, P.SOURCE].astype(np.int32),
        "chunk_ids": (rows[:, P.START] // piece_tokens).astype(np.int32),
        "piece_starts": rows[:, P.START].copy(),
        "epochs": rows[:, P.EPOCH].astype(np.int32),
    }
    g.images = None
    if multimodal:
        dims = [b.images.shape[1:] for b in blocks.values() if b.images is not None]
        dtype = next((b.images.dtype for b in blocks.values() if b.images is not None), np.uint8)
        g.images = {
            "image_patches": np.concatenate(patches)
            if patches
            else np.zeros((0,) + (dims[0] if dims else (0,)), dtype=dtype),
            "image_positions": np.concatenate(patch_pos).astype(np.int32) if patch_pos else np.zeros(0, np.int32),
            "patch_index": np.concatenate(patch_idx).astype(np.int32) if patch_idx else np.zeros(0, np.int32),
        }
    return g


def pack_micro_batch(
    pieces,
    blocks: dict[str, SampleBlock],
    capacity: int,
    piece_tokens: int,
    multimodal: bool = False,
    pad_id: int = PAD_ID,
) -> dict:
    """The packed micro-batch of the module docstring, padded to ``capacity`` with ``pad_id``."""
    g = _gather(pieces, blocks, capacity, piece_tokens, multimodal)
    n = int(g.cu[-1])
    input_ids = np.full(capacity, pad_id, dtype=np.int32)
    input_ids[:n] = g.tokens
    labels = np.full(capacity, IGNORE_INDEX, dtype=np.int32)
    labels[: max(n - 1, 0)] = input_ids[1:n]  # the next token inside a piece ...
    if g.mask is not None and n > 1:
        labels[: n - 1][g.mask[1:n] == 0] = IGNORE_INDEX  # ... unless the loss ignores it
    if len(g.cu) > 1:
        labels[g.cu[1:] - 1] = g.nexts  # ... and at a piece's end, its document's (or -100)
    position_ids = np.arange(capacity, dtype=np.int32)
    position_ids[:n] -= np.repeat(g.cu[:-1], np.diff(g.cu))  # restart at 0 for every piece
    position_ids[n:] = np.arange(capacity - n, dtype=np.int32)  # padding counts on from 0 as well
    out = {
        "input_ids": input_ids,
        "labels": labels,
        "position_ids": position_ids,
        "cu_seqlens": g.cu,
        **g.meta,
        "num_tokens": n,
    }
    if g.images is not None:
        out.update(g.images)
    return out


def wire_micro_batch(
    pieces, blocks: dict[str, SampleBlock], capacity: int, piece_tokens: int, multimodal: bool = False
) -> dict:
    """``wire.encode(pack_micro_batch(...))`` without building the padded arrays the wire form
    leaves out (labels, positions, padding): what a constructor stores when there is no
    context parallelism (tested equal)."""
    g = _gather(pieces, blocks, capacity, piece_tokens, multimodal)
    n = int(g.cu[-1])
    out = {
        "capacity": capacity,
        "tokens": narrow(g.tokens),
        "pieces": piece_table(np.diff(g.cu), g.nexts, g.meta),
        "num_tokens": n,
    }
    if g.mask is not None and not g.mask.all():
        out["mask"] = pack_mask(g.mask)
    if g.images is not None:
        out.update({k: narrow(v) if k in DTYPES else v for k, v in g.images.items()})
    return out


def _image_patches(
    block: SampleBlock, doc: int, start: int, stop: int, pos: int, patches, patch_pos, patch_idx
) -> None:
    """The patches of document ``doc``'s images whose placeholder tokens lie in [start, stop)."""
    for i in range(int(block.image_offsets[doc]), int(block.image_offsets[doc + 1])):
        s0, p0 = int(block.image_starts[i]), int(block.image_patches[i])
        a, b = max(s0, start), min(s0 + int(block.image_patches[i + 1]) - p0, stop)
        if a < b:
            patches.append(block.images[p0 + a - s0 : p0 + b - s0])
            patch_pos.append(pos + (a - start) + np.arange(b - a))
            patch_idx.append(np.arange(a - s0, b - s0))


def build_rank_batch(
    step: int, rank: int, micro_batches: list, blocks: dict[str, SampleBlock], piece_tokens: int, layout: BatchLayout
) -> dict:
    """Every micro-batch of ``rank`` for ``step``, padded (:func:`pack_micro_batch`); with
    ``cp > 1`` each micro-batch also carries its ``cp`` context-parallel slices (``"cp"``).
    :func:`build_chunk` uses it for context-parallel chunks, whose slices are cut from the
    padded form."""
    lay = layout
    mbs = [pack_micro_batch(mb, blocks, lay.capacity, piece_tokens, lay.multimodal, lay.pad_id) for mb in micro_batches]
    if lay.cp > 1:
        for mb in mbs:
            mb["cp"] = cp_slices(mb, lay.cp, lay.cp_split_tokens, lay.pad_id)
    return {"step": step, "rank": rank, "micro_batches": mbs}


def split_step(pieces: bytes, slot: bytes, ranks: range, micro_batches: int) -> list[list[np.ndarray]]:
    """Decode a task's step (``pieces.pack`` of its piece rows, ``pieces.slot_bytes`` of their
    ``[rank, micro_batch]``) into ``[rank][micro_batch] -> piece rows`` for ``ranks``."""
    rows = P.unpack(pieces)
    sl = P.slot_from_bytes(slot)
    flat = P.flat_slots(sl, micro_batches)
    order = P.stable_order(flat)
    bounds = np.searchsorted(flat[order], np.arange(ranks.start * micro_batches, ranks.stop * micro_batches + 1))
    return [
        [rows[order[bounds[i * micro_batches + m] : bounds[i * micro_batches + m + 1]]] for m in range(micro_batches)]
        for i in range(len(ranks))
    ]


class BlockRefs:
    """Where each unit's block is among a constructor task's load results (``deps``, the task's
    one Dask argument holding futures): per block key an index into ``deps``, ``("parts",
    [indices])`` or ``("group", i, index)``. An object Dask passes through as it is, so a task's
    arguments hold one future per load task instead of a future, a tuple and a key per unit."""

    __slots__ = ("entries",)

    def __init__(self, entries: dict):
        self.entries = entries

    @classmethod
    def of(cls, blocks: dict) -> tuple[BlockRefs, list]:
        """From ``{block key: future, ("parts", [futures]) or ("group", i, future)}``: the refs
        and the distinct futures, in order of first use."""
        deps: list = []
        where: dict = {}

        def ref(fut) -> int:
            i = where.get(fut.key)
            if i is None:
                i = where[fut.key] = len(deps)
                deps.append(fut)
            return i

        entries: dict = {}
        for k, e in blocks.items():
            if not isinstance(e, tuple):
                entries[k] = ref(e)
            elif e[0] == "parts":
                entries[k] = ("parts", [ref(f) for f in e[1]])
            else:
                entries[k] = ("group", e[1], ref(e[2]))
        return cls(entries), deps

    def resolve(self, deps: list) -> dict[str, SampleBlock]:
        """Block key -> the unit's block, from the tasks' results ``deps``."""
        out = {}
        for k, e in self.entries.items():
            if not isinstance(e, tuple):
                out[k] = deps[e]
            elif e[0] == "parts":
                out[k] = SampleBlock.concat([deps[i] for i in e[1]])
            else:
                out[k] = deps[e[2]][e[1]]
        return out


class BuiltChunk:
    """A constructor task's result: ``batches[step][rank]``, each already packed for the wire
    (``wire.pack_batch``) when ``encoded``, else whole (context parallelism: every CP rank is sent
    its own slice).

    A class rather than nested dicts so that Dask sizes it in O(1) (``nbytes``, counted once when
    it is built): Dask sizes every task result at least twice, and walking a dict of arrays per
    (step, rank, micro-batch) each time costs a worker CPU per step. Packed at build time, on
    the task thread, so that neither a fetch nor a shadow copy pickles arrays on the worker's
    event loop (``wire.py``)."""

    __slots__ = ("encoded", "batches", "nbytes")

    def __init__(self, encoded: bool, batches: dict[int, dict[int, dict]]):
        self.encoded = encoded
        if encoded:
            self.batches = {s: {r: pack_batch(b) for r, b in per_rank.items()} for s, per_rank in batches.items()}
            self.nbytes = sum(len(b) for per_rank in self.batches.values() for b in per_rank.values())
        else:
            self.batches = batches
            self.nbytes = sum(nbytes(b) for per_rank in batches.values() for b in per_rank.values())

    def __reduce_ex__(self, protocol):
        if self.encoded and protocol >= 5:
            # each packed batch out of band: Dask sends it as a frame of its own, as it is. Pickled
            # in band, a shadow copy of a chunk would be copied twice on the serving worker's
            # event loop (into this pickle, then into Dask's)
            keys = [(s, r) for s, per_rank in self.batches.items() for r in per_rank]
            return _restore_packed, (keys, self.nbytes, *(pickle.PickleBuffer(self.batches[s][r]) for s, r in keys))
        # one in-band buffer: pickled with its arrays out of band, a shadow copy to another worker
        # would be a Dask frame per array, each serialized on the serving worker's event loop
        return _restore_chunk, (pickle.dumps((self.encoded, self.batches, self.nbytes), protocol=5),)

    def packed(self, step: int, rank: int, cp_rank: int | None = None) -> bytes:
        """One (step, rank[, cp rank]) batch, packed for the wire."""
        b = self.batches[step][rank]
        if self.encoded:
            return b
        return pack_batch(encode_batch(select_cp(b, cp_rank) if cp_rank is not None else b))

    def batch(self, step: int, rank: int, cp_rank: int | None = None) -> dict:
        """The wire form of one (step, rank[, cp rank]) batch."""
        return pickle.loads(self.packed(step, rank, cp_rank))


def _restore_chunk(payload: bytes) -> BuiltChunk:
    chunk = BuiltChunk.__new__(BuiltChunk)
    chunk.encoded, chunk.batches, chunk.nbytes = pickle.loads(payload)
    return chunk


def _restore_packed(keys: list, nbytes: int, *buffers) -> BuiltChunk:
    """A packed chunk from its batches' buffers (Dask's frames as they arrived: no copy)."""
    chunk = BuiltChunk.__new__(BuiltChunk)
    chunk.encoded, chunk.nbytes, chunk.batches = True, nbytes, {}
    for (s, r), b in zip(keys, buffers):
        chunk.batches.setdefault(s, {})[r] = b
    return chunk


@sizeof.register(BuiltChunk)
def _sizeof_chunk(chunk: BuiltChunk) -> int:
    return chunk.nbytes + 200


def wire_chunk(steps: list[dict], ranks: range, layout: BatchLayout, blocks: dict[str, SampleBlock]) -> dict:
    """Every (step, rank) batch of a text-only chunk in wire form, built for the whole chunk at
    once: what :func:`wire_micro_batch` makes for each micro-batch (tested equal once decoded),
    without its fixed cost per micro-batch.

    Per micro-batch, :func:`_gather` and the wire form pay a fixed cost of numpy calls on arrays
    of a few dozen entries (the piece table, its narrowing, the token narrowing, the identity
    arrays) besides a Python loop over the pieces. Here every per-piece quantity (block offsets,
    last labels, sample ids, the piece table) is computed with one numpy call per *block* over
    all of the chunk's pieces in it, the tokens are narrowed once per chunk, and the only loop
    left per piece is its slice copy. The chunk's narrow dtypes are those of its widest
    micro-batch (lossless; the consumer restores its own dtypes either way)."""
    lo, n_ranks = ranks.start, len(ranks)
    micro_batches, capacity = layout.micro_batches, layout.capacity
    rows_l, mb_l, pt_l = [], [], []
    for i, sp in enumerate(steps):
        rows = P.unpack(sp["pieces"])
        sl = P.slot_from_bytes(sp["slot"])
        mine = (sl[:, 0] >= lo) & (sl[:, 0] < ranks.stop)  # as split_step: other ranks' pieces are not this task's
        if not mine.all():
            rows, sl = rows[mine], sl[mine]
        rows_l.append(rows)
        mb_l.append((i * n_ranks + sl[:, 0].astype(np.int64) - lo) * micro_batches + sl[:, 1])
        pt_l.append(np.full(len(rows), sp["piece_tokens"], dtype=np.int64))
    n_mb = len(steps) * n_ranks * micro_batches
    rows, mb_of = np.concatenate(rows_l), np.concatenate(mb_l)
    order = P.stable_order(mb_of)  # micro-batch by micro-batch, each in the planner's piece order
    rows, mb_of, piece_tokens = rows[order], mb_of[order], np.concatenate(pt_l)[order]
    n = len(rows)
    src, epoch, doc, start, stop = (rows[:, c] for c in (P.SOURCE, P.EPOCH, P.DOC, P.START, P.STOP))
    lens = P.lengths(rows)
    mb_bounds = np.searchsorted(mb_of, np.arange(n_mb + 1))
    mb_tokens = np.bincount(mb_of, weights=lens, minlength=n_mb).astype(np.int64)
    if n and mb_tokens.max() > capacity:
        raise ValueError(f"micro-batch over capacity: {int(mb_tokens.max())} > {capacity} tokens (planner bug)")
    # per block, over all its pieces at once: where each piece starts in the block's token
    # array, its next token in its document, its document's sample id
    a = np.empty(n, dtype=np.int64)
    nexts = np.empty(n, dtype=np.int64)
    sample_ids = np.empty(n, dtype=np.int64)
    ukey, uinv = P.unique_rows(P.units(rows), return_inverse=True)
    block_of: list[SampleBlock] = []
    by_block, bb = P.grouped(uinv, len(ukey))
    for j, (s, e, u) in enumerate(ukey.tolist()):
        block = blocks[block_key(s, e, u)]
        sel = by_block[bb[j] : bb[j + 1]]
        d = doc[sel]
        d0, d1 = block.offsets[d], block.offsets[d + 1]
        a[sel] = d0 + start[sel]
        after = d0 + stop[sel]
        has_next = after < d1
        if block.loss_mask is not None:  # the loss ignores a masked next token
            has_next[has_next] = block.loss_mask[after[has_next]] != 0
        nx = np.full(len(sel), IGNORE_INDEX, dtype=np.int64)
        nx[has_next] = block.tokens[after[has_next]]
        nexts[sel], sample_ids[sel] = nx, block.sample_ids[d]
        block_of.append(block)
    tok_of = [b.tokens for b in block_of]
    toks = [tok_of[j][x : x + m] for j, x, m in zip(uinv.tolist(), a.tolist(), lens.tolist())]  # the one loop per piece
    tokens = narrow(np.concatenate(toks)) if toks else np.zeros(0, dtype=np.uint8)
    mask = None
    if any(b.loss_mask is not None for b in block_of):
        mask = np.concatenate(
            [
                block_of[j].loss_mask[x : x + m] if block_of[j].loss_mask is not None else np.ones(m, np.uint8)
                for j, x, m in zip(uinv.tolist(), a.tolist(), lens.tolist())
            ]
        )
    table = piece_table(
        lens,
        nexts,
        {
            "sample_ids": sample_ids,
            "source_ids": src,
            "chunk_ids": start // piece_tokens,
            "piece_starts": start,
            "epochs": epoch,
        },
    )
    tok_bounds = np.zeros(n_mb + 1, dtype=np.int64)
    np.cumsum(mb_tokens, out=tok_bounds[1:])
    tb, pb = tok_bounds.tolist(), mb_bounds.tolist()
    out: dict[int, dict[int, dict]] = {}
    k = 0
    for sp in steps:
        per_rank = out[sp["step"]] = {}
        for rank in ranks:
            mbs = []
            for _ in range(micro_batches):
                mbs.append(
                    {
                        "capacity": capacity,
                        "tokens": tokens[tb[k] : tb[k + 1]],
                        "pieces": table[pb[k] : pb[k + 1]],
                        "num_tokens": tb[k + 1] - tb[k],
                    }
                )
                if mask is not None and not mask[tb[k] : tb[k + 1]].all():
                    mbs[-1]["mask"] = pack_mask(mask[tb[k] : tb[k + 1]])
                k += 1
            per_rank[rank] = {
                "step": sp["step"],
                "rank": rank,
                "micro_batches": mbs,
                "loss_tokens": sp.get("loss_tokens"),
            }
            per_rank[rank].update(plan_fields(layout))
    return out


def build_chunk(
    steps: list[dict], ranks: tuple[int, int], layout: BatchLayout, blocks: dict | BlockRefs, deps: list = ()
) -> BuiltChunk:
    """One constructor task: consecutive ``steps`` (a chunk task's, ``scheduler/chunks.py``: the
    pieces of ranks ``[lo, hi)``) for those ranks, packed to ``layout``, from ``blocks`` (block key
    -> a unit's block; or ``BlockRefs`` into the load results ``deps``, as the submitter passes
    them). The result stays on the worker until every rank
    acknowledged its last step; trainers fetch their (step, rank) batches from it directly
    (``batch_server``). Without context parallelism the batches are stored in wire form
    (``wire.encode``: narrow dtypes, derivable arrays left out); with it, whole, since every CP
    rank is sent its own slice."""
    ranks = range(*ranks)
    if isinstance(blocks, BlockRefs):
        blocks = blocks.resolve(deps)
    cp, multimodal, capacity = layout.cp, layout.multimodal, layout.capacity
    if cp == 1 and not multimodal:
        return BuiltChunk(True, wire_chunk(steps, ranks, layout, blocks))
    out: dict[int, dict[int, dict]] = {}
    for sp in steps:
        per_rank = split_step(sp["pieces"], sp["slot"], ranks, layout.micro_batches)
        out[sp["step"]] = {}
        for rank, mbs in zip(ranks, per_rank):
            if cp > 1:
                batch = build_rank_batch(sp["step"], rank, mbs, blocks, sp["piece_tokens"], layout)
            else:
                mbs = [wire_micro_batch(mb, blocks, capacity, sp["piece_tokens"], multimodal) for mb in mbs]
                batch = {"step": sp["step"], "rank": rank, "micro_batches": mbs}
            out[sp["step"]][rank] = {**batch, "loss_tokens": sp.get("loss_tokens"), **plan_fields(layout)}
    return BuiltChunk(cp == 1, out)


def plan_fields(layout: BatchLayout) -> dict:
    """What a batch says of its plan, where it is not the default: the pad id, and that some
    sources' loss ignores some tokens (the trainer then adds ``loss_mask`` unless told not to)."""
    pad = {"pad_id": layout.pad_id} if layout.pad_id != PAD_ID else {}
    return {**pad, **({"loss_masks": True} if layout.loss_masks else {})}


def zigzag_chunks(length: int, cp: int) -> np.ndarray:
    """Boundaries of ``2·cp`` near-equal chunks of a sequence (``[2cp+1]`` offsets)."""
    n = 2 * cp
    sizes = np.full(n, length // n, dtype=np.int64)
    sizes[: length % n] += 1
    return np.concatenate([[0], np.cumsum(sizes)])


def cp_slices(mb: dict, cp: int, split_tokens: int, pad_id: int = PAD_ID) -> list[dict]:
    """Cut a packed micro-batch into ``cp`` context-parallel slices.

    A piece of at least ``split_tokens`` tokens is cut into ``2·cp`` chunks and CP rank ``j`` gets
    chunks ``j`` and ``2·cp−1−j`` (the load-balanced zigzag layout for causal attention: every rank
    holds one early and one late chunk). Shorter pieces go whole to the CP rank with the fewest
    tokens so far. Each slice is cut from the full micro-batch, so ``position_ids`` keep the true
    positions inside the document and ``labels`` the true next tokens. Per slice:
    ``input_ids``/``labels``/``position_ids`` (padded to the longest slice, so a CP group has one
    shape), ``cu_seqlens`` over its segments, ``seg_piece`` (which piece of the micro-batch a
    segment belongs to), ``seg_chunk`` (zigzag chunk index, -1 for a whole piece), ``num_tokens``.
    """
    cu = mb["cu_seqlens"].astype(np.int64)
    segs: list[list[tuple[int, int, int, int]]] = [[] for _ in range(cp)]  # (start, stop, piece, chunk)
    load = np.zeros(cp, dtype=np.int64)
    for k in range(len(cu) - 1):
        a, b = int(cu[k]), int(cu[k + 1])
        if b - a >= split_tokens:
            bounds = a + zigzag_chunks(b - a, cp)
            for j in range(cp):
                for c in (j, 2 * cp - 1 - j):
                    segs[j].append((int(bounds[c]), int(bounds[c + 1]), k, c))
                    load[j] += bounds[c + 1] - bounds[c]
        else:
            j = int(np.argmin(load))
            segs[j].append((a, b, k, -1))
            load[j] += b - a
    width = int(load.max()) if len(load) else 0
    out = []
    for j in range(cp):
        idx = np.concatenate([np.arange(a, b) for a, b, _, _ in segs[j]]) if segs[j] else np.zeros(0, np.int64)
        n = len(idx)
        sl = {
            "input_ids": np.full(width, pad_id, dtype=np.int32),
            "labels": np.full(width, IGNORE_INDEX, dtype=np.int32),
            "position_ids": np.arange(width, dtype=np.int32) - n,
            "cu_seqlens": np.concatenate([[0], np.cumsum([b - a for a, b, _, _ in segs[j]])]).astype(np.int32),
            "seg_piece": np.array([k for _, _, k, _ in segs[j]], dtype=np.int32),
            "seg_chunk": np.array([c for _, _, _, c in segs[j]], dtype=np.int32),
            "num_tokens": n,
        }
        sl["input_ids"][:n] = mb["input_ids"][idx]
        sl["labels"][:n] = mb["labels"][idx]
        sl["position_ids"][:n] = mb["position_ids"][idx]
        if "image_positions" in mb:  # the patches whose placeholders this slice holds, at their slice positions
            where = np.full(len(mb["input_ids"]), -1, dtype=np.int64)
            where[idx] = np.arange(n)
            at = where[mb["image_positions"]]
            keep = at >= 0
            sl["image_patches"], sl["image_positions"] = mb["image_patches"][keep], at[keep].astype(np.int32)
            sl["patch_index"] = mb["patch_index"][keep]
        out.append(sl)
    return out


def select_cp(batch: dict, cp_rank: int) -> dict:
    """The view of a rank batch that CP rank ``cp_rank`` needs: its slice of every micro-batch
    (token arrays replaced by the slice's), plus the per-piece identity arrays."""
    mbs = []
    for mb in batch["micro_batches"]:
        piece_meta = {k: mb[k] for k in ("sample_ids", "source_ids", "chunk_ids", "piece_starts", "epochs")}
        mbs.append({**mb["cp"][cp_rank], **piece_meta, "cp_rank": cp_rank})
    return {**batch, "micro_batches": mbs}


def check_micro_batch(mb: dict, capacity: int) -> None:
    """Raise ValueError unless a packed micro-batch is self-consistent: ``cu_seqlens`` starts at 0,
    increases and ends at ``num_tokens``; ``position_ids`` restart at 0 exactly at each boundary;
    ``labels`` are the next token inside a piece and -100 on padding; per-piece arrays agree."""
    cu = mb["cu_seqlens"].astype(np.int64)
    n = len(cu) - 1
    if (
        mb["input_ids"].shape != (capacity,)
        or mb["labels"].shape != (capacity,)
        or mb["position_ids"].shape != (capacity,)
    ):
        raise ValueError(f"token arrays must have shape ({capacity},)")
    if cu[0] != 0 or np.any(np.diff(cu) <= 0) or cu[-1] != mb["num_tokens"] or cu[-1] > capacity:
        raise ValueError(f"bad cu_seqlens {cu.tolist()} for num_tokens={mb['num_tokens']}")
    for k in ("sample_ids", "source_ids", "chunk_ids", "piece_starts", "epochs"):
        if len(mb[k]) != n:
            raise ValueError(f"{k} has {len(mb[k])} entries for {n} pieces")
    pos = mb["position_ids"].astype(np.int64)
    expected = np.arange(cu[-1]) - np.repeat(cu[:-1], np.diff(cu))
    if not np.array_equal(pos[: cu[-1]], expected):
        raise ValueError("position_ids do not restart at the cu_seqlens boundaries")
    lab, ids = mb["labels"], mb["input_ids"]
    inner = np.ones(cu[-1], dtype=bool)
    inner[cu[1:] - 1] = False  # a piece's last token may label the next token of its document
    idx = np.flatnonzero(inner)
    if not np.array_equal(lab[idx], ids[idx + 1]):
        raise ValueError("labels are not the next input token inside a piece")
    if np.any(lab[cu[-1] :] != IGNORE_INDEX) or np.any(ids[cu[-1] :] != PAD_ID):
        raise ValueError("padding must have PAD input ids and -100 labels")
