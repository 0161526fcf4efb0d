"""The sample block: what one source-loader task produces and keeps on its worker.

A block is a ragged array of documents in flat form (the Arrow/CSR layout): ``tokens`` holds every
document's token ids back to back and ``offsets[i]:offsets[i+1]`` is document ``i``. ``sample_ids``
are stable, source-wide document ids (the document's ordinal in the source's file order), so they
do not depend on how the source was split into load units or on which worker loaded it.
Only ``lengths()`` (a few bytes per document) ever leaves the worker for the planner.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from dask.sizeof import sizeof

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
    if t.size:
        if not np.issubdtype(t.dtype, np.integer):
            raise ValueError(f"source {source!r}: token ids must be integers, got {t.dtype}")
        lo, hi = int(t.min()), int(t.max())
        if lo < 0 or hi > np.iinfo(TOKEN_DTYPE).max:
            raise ValueError(f"source {source!r}: token ids must lie in [0, {np.iinfo(TOKEN_DTYPE).max}], got min {lo}, max {hi}")
        if hi > np.iinfo(NARROW_TOKEN_DTYPE).max:
            dtype = TOKEN_DTYPE
    return np.ascontiguousarray(t, dtype=dtype)


@dataclass(slots=True)
class SampleBlock:
    source: str
    tokens: np.ndarray  # [total_tokens]: uint16 where every id fits, else int32
    offsets: np.ndarray  # int64 [n_docs + 1], offsets[0] == 0
    sample_ids: np.ndarray  # int64 [n_docs]
    # multimodal: image patch tensors and where each image's placeholder tokens start in its document
    images: np.ndarray | None = None  # [n_images, patches, patch_dim]
    image_offsets: np.ndarray | None = None  # int64 [n_docs + 1]: document i owns images image_offsets[i]:image_offsets[i+1]
    image_starts: np.ndarray | None = None  # int64 [n_images]: first placeholder token of the image inside its document

    def __post_init__(self) -> None:
        # a block lives on its worker while steps draw from it, and is copied to every worker
        # that builds from it: uint16 ids halve both (4.5 bytes per delivered token went between
        # the demo's workers with int32 blocks). Constructors widen ids as they pack them.
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
            if self.image_offsets.shape != (n + 1,) or self.image_offsets[-1] != len(self.images) or len(self.image_starts) != len(self.images):
                raise ValueError(f"source {self.source!r}: inconsistent images (image_offsets shape={self.image_offsets.shape}, "
                                 f"images={len(self.images)}, image_starts={len(self.image_starts)})")

    def __len__(self) -> int:
        return len(self.sample_ids)

    @classmethod
    def concat(cls, parts: list["SampleBlock"]) -> "SampleBlock":
        """One block of consecutive parts of a unit (a unit loaded in parts), in order."""
        if len(parts) == 1:
            return parts[0]
        shift = np.cumsum([0] + [len(p.tokens) for p in parts[:-1]])
        offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + s for p, s in zip(parts, shift)])
        images = image_offsets = image_starts = None
        if parts[0].images is not None:
            ishift = np.cumsum([0] + [len(p.images) for p in parts[:-1]])
            images = np.concatenate([p.images for p in parts])
            image_offsets = np.concatenate([parts[0].image_offsets[:1]] + [p.image_offsets[1:] + s for p, s in zip(parts, ishift)])
            image_starts = np.concatenate([p.image_starts for p in parts])
        return cls(parts[0].source, np.concatenate([p.tokens for p in parts]), offsets, np.concatenate([p.sample_ids for p in parts]),
                   images, image_offsets, image_starts)

    @property
    def nbytes(self) -> int:
        extra = 0 if self.images is None else self.images.nbytes + self.image_offsets.nbytes + self.image_starts.nbytes
        return self.tokens.nbytes + self.offsets.nbytes + self.sample_ids.nbytes + extra

    @property
    def patches_per_image(self) -> int:
        return 0 if self.images is None else int(self.images.shape[1])

    def vision_tokens(self) -> np.ndarray | None:
        """Image tokens per document (None for a text-only block)."""
        if self.images is None:
            return None
        return np.diff(self.image_offsets) * self.patches_per_image

    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets).astype(np.int64)

    def doc(self, i: int) -> np.ndarray:
        return self.tokens[self.offsets[i] : self.offsets[i + 1]]


@sizeof.register(SampleBlock)
def _sizeof_block(block: SampleBlock) -> int:
    """Dask's size of a block (what its memory accounting, spilling and ``status()`` bytes see):
    its arrays. Without it a block counted as a few hundred bytes, whatever it held."""
    return block.nbytes + 200
