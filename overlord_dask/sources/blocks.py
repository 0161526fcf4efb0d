"""The sample block: what one source-loader task produces and keeps on its worker.

A block is a ragged array of documents in flat form (the Arrow/CSR layout): ``tokens`` holds every
document's token ids back to back and ``offsets[i]:offsets[i+1]`` is document ``i``. ``sample_ids``
are stable, source-wide document ids (the document's ordinal in the source's file order), so they
do not depend on how the source was split into load units or on which worker loaded it.
Only ``lengths()`` (a few bytes per document) ever leaves the worker for the planner, with, for
documents the loss sees only in part (chat turns, masked labels), the runs of tokens it ignores
(``masked_runs()``: a few numbers per document, so the planner can count a step's loss tokens).

With ``loading.block_store: disk`` a block's token ids (and loss mask) lie in a file on the
worker's local disk (``block_files.FileArray``: :meth:`SampleBlock.on_disk`), read piece by
piece as batches are built; its offsets and sample ids stay in memory.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from dask.sizeof import sizeof

from .. import masked_runs
from .block_files import FileArray

TOKEN_DTYPE = np.int32
NARROW_TOKEN_DTYPE = np.uint16


def check_tokens(source: str, tokens, narrow: bool = False) -> np.ndarray:
    """Token ids as int32, or a ValueError naming the source: every loader, tokenizer and
    transform ends here, so a float, 2-D or negative id never reaches a trainer (a cast alone
    truncated floats and let negative ids through). With ``narrow``, as uint16 where every id
    fits (a vocabulary under 65,536): what a block keeps (see :class:`SampleBlock`)."""
    t = np.asarray(tokens)
    if t.ndim != 1:
        raise ValueError(f"source {source!r}: tokens must be a 1-D array of ids, got shape {t.shape}")
    dtype = NARROW_TOKEN_DTYPE if narrow else TOKEN_DTYPE
    every_value_fits = t.dtype.kind == "u" and t.dtype.itemsize <= np.dtype(NARROW_TOKEN_DTYPE).itemsize
    if t.size and not every_value_fits:  # (uint8/uint16 ids, as pre-tokenized shards often are: no scan)
        if not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"source {source!r}: token ids must be integers, got {t.dtype}")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi > np.iinfo(TOKEN_DTYPE).max:
            raise ValueError(
                f"source {source!r}: token ids must lie in [0, {np.iinfo(TOKEN_DTYPE).max}], got min {lo}, max {hi}"
            )
        if hi > np.iinfo(NARROW_TOKEN_DTYPE).max:
            dtype = TOKEN_DTYPE
    return np.ascontiguousarray(t, dtype=dtype)


@dataclass(slots=True)
class SampleBlock:
    source: str
    tokens: np.ndarray | FileArray  # [total_tokens]: uint16 where every id fits, else int32
    offsets: np.ndarray  # int64 [n_docs + 1], offsets[0] == 0
    sample_ids: np.ndarray  # int64 [n_docs]
    # multimodal: image patch tensors and where each image's placeholder tokens start in its document
    images: np.ndarray | None = None  # [n_patches, patch_dim]: every image's patches back to back
    image_offsets: np.ndarray | None = (
        None  # int64 [n_docs + 1]: document i owns images image_offsets[i]:image_offsets[i+1]
    )
    image_starts: np.ndarray | None = None  # int64 [n_images]: first placeholder token of the image inside its document
    image_patches: np.ndarray | None = (
        None  # int64 [n_images + 1]: image j is patches image_patches[j]:image_patches[j+1]
    )
    loss_mask: np.ndarray | FileArray | None = (
        None  # uint8 [total_tokens]: 0 where the loss ignores the token as a target; None: all trained
    )

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check (and narrow) the arrays; a ValueError naming the source says what is wrong."""
        # a block lives on its worker while steps draw from it, and is copied to every worker
        # that builds from it: uint16 ids halve both (4.5 bytes per delivered token went between
        # the demo's workers with int32 blocks). Constructors widen ids as they pack them.
        if not isinstance(self.tokens, FileArray):  # (a file holds checked ids: on_disk)
            self.tokens = check_tokens(self.source, self.tokens, narrow=True)
        self.offsets = np.ascontiguousarray(self.offsets, dtype=np.int64)
        self.sample_ids = np.ascontiguousarray(self.sample_ids, dtype=np.int64)
        n = len(self.sample_ids)
        if self.offsets.shape != (n + 1,) or self.offsets[0] != 0 or self.offsets[-1] != len(self.tokens):
            raise ValueError(
                f"source {self.source!r}: inconsistent block (n_docs={n}, offsets shape={self.offsets.shape}, "
                f"offsets[-1]={self.offsets[-1] if len(self.offsets) else None}, tokens={len(self.tokens)})"
            )
        if n and np.any(np.diff(self.offsets) < 0):
            raise ValueError(f"source {self.source!r}: document offsets are not monotone")
        if self.images is not None:
            self.image_offsets = np.ascontiguousarray(self.image_offsets, dtype=np.int64)
            self.image_starts = np.ascontiguousarray(self.image_starts, dtype=np.int64)
            self.image_patches = np.ascontiguousarray(self.image_patches, dtype=np.int64)
            n_img = len(self.image_starts)
            if (
                self.images.ndim != 2
                or self.image_offsets.shape != (n + 1,)
                or self.image_offsets[-1] != n_img
                or self.image_patches.shape != (n_img + 1,)
                or self.image_patches[-1] != len(self.images)
            ):
                raise ValueError(
                    f"source {self.source!r}: inconsistent images (images shape={self.images.shape}, image_offsets "
                    "shape="
                    f"{self.image_offsets.shape}, image_starts={n_img}, image_patches shape={self.image_patches.shape})"
                )
        if self.loss_mask is not None:
            if not isinstance(self.loss_mask, FileArray):
                self.loss_mask = np.ascontiguousarray(self.loss_mask, dtype=np.uint8)
            if self.loss_mask.shape != self.tokens.shape:
                raise ValueError(
                    f"source {self.source!r}: loss mask of shape {self.loss_mask.shape} for {len(self.tokens)} tokens"
                )

    def __len__(self) -> int:
        return len(self.sample_ids)

    def on_disk(self, directory: str | None = None) -> SampleBlock:
        """This block with its token ids and loss mask in files (``block_files``: in
        ``directory``, by default the worker's local directory): what it holds in memory is then
        its offsets and sample ids (and image patches, which stay in memory)."""
        if isinstance(self.tokens, FileArray):
            return self
        mask = self.loss_mask
        return SampleBlock(
            self.source,
            FileArray(self.tokens, directory),
            self.offsets,
            self.sample_ids,
            self.images,
            self.image_offsets,
            self.image_starts,
            self.image_patches,
            None if mask is None else FileArray(mask, directory),
        )

    @classmethod
    def concat(cls, parts: list[SampleBlock]) -> SampleBlock:
        """One block of consecutive parts of a unit (a unit loaded in parts), in order (in memory:
        a constructor task's, for as long as it builds)."""
        if len(parts) == 1:
            return parts[0]
        shift = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]])
        offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, shift)])
        images = image_offsets = image_starts = image_patches = mask = None
        if parts[0].images is not None:
            ishift = np.cumsum([0] + [len(p.image_starts) for p in parts[:-1]])
            pshift = np.cumsum([0] + [len(p.images) for p in parts[:-1]])
            images = np.concatenate([p.images for p in parts])
            image_offsets = np.concatenate(
                [parts[0].image_offsets[:1]] + [p.image_offsets[1:] + s for p, s in zip(parts, ishift)]
            )
            image_starts = np.concatenate([p.image_starts for p in parts])
            image_patches = np.concatenate(
                [parts[0].image_patches[:1]] + [p.image_patches[1:] + s for p, s in zip(parts, pshift)]
            )
        if any(p.loss_mask is not None for p in parts):
            masks = [p.loss_mask if p.loss_mask is not None else np.ones(len(p.tokens), np.uint8) for p in parts]
            mask = np.concatenate([np.asarray(m) for m in masks])
        return cls(
            parts[0].source,
            np.concatenate([np.asarray(p.tokens) for p in parts]),
            offsets,
            np.concatenate([p.sample_ids for p in parts]),
            images,
            image_offsets,
            image_starts,
            image_patches,
            mask,
        )

    @property
    def nbytes(self) -> int:
        """Bytes the block holds in memory (what Dask's memory accounting counts); token ids in a
        file are :attr:`disk_bytes`."""
        extra = (
            0
            if self.images is None
            else (self.images.nbytes + self.image_offsets.nbytes + self.image_starts.nbytes + self.image_patches.nbytes)
        )
        arrays = [a for a in (self.tokens, self.loss_mask) if a is not None and not isinstance(a, FileArray)]
        return sum(a.nbytes for a in arrays) + self.offsets.nbytes + self.sample_ids.nbytes + extra

    @property
    def disk_bytes(self) -> int:
        """Bytes of the block's files (``on_disk``); 0 for a block in memory."""
        return sum(a.nbytes for a in (self.tokens, self.loss_mask) if isinstance(a, FileArray))

    def vision_tokens(self) -> np.ndarray | None:
        """Image tokens per document (None for a text-only block)."""
        if self.images is None:
            return None
        per_doc = self.image_patches[self.image_offsets]  # patches before each document's first image
        return np.diff(per_doc)

    def masked_runs(self) -> np.ndarray | None:
        """The tokens the loss ignores, as runs: int64 ``[n_docs + 1 + 2·runs]``, first each
        document's offset into the run list, then ``(start, stop)`` per run, in the document's
        own positions. None when every token is trained."""
        mask = None if self.loss_mask is None else np.asarray(self.loss_mask)
        if mask is None or mask.all():
            return None
        return masked_runs.encode(mask, self.offsets)

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int64)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


@sizeof.register(SampleBlock)
def _sizeof_block(block: SampleBlock) -> int:
    """Dask's size of a block (what its memory accounting, spilling and ``status()`` bytes see):
    its arrays. Without it a block counted as a few hundred bytes, whatever it held."""
    return block.nbytes + 200
