"""Images inside token streams: decoding encoded images into patches, and placing each image's
placeholder tokens into its document's text.

Both multimodal formats end here. zarr stores ready patch tensors; parquet stores encoded images
(PNG, JPEG: what crawls and caption datasets ship), which the loader workers decode, resize and
cut into patches: the CPU-heavy preprocessing that per-source pools exist for. After
:func:`with_image_tokens` a block's lengths count image tokens like text tokens, so packing,
splitting and the cost model need nothing image-specific.
"""

from __future__ import annotations

import io

import numpy as np

from ..errors import SourceError
from .blocks import SampleBlock


def patchify(image: np.ndarray, patch: int) -> np.ndarray:
    """``[H, W, C]`` uint8 → ``[(H/patch)·(W/patch), patch·patch·C]``, patches in row-major order."""
    h, w, c = image.shape
    return image.reshape(h // patch, patch, w // patch, patch, c).transpose(0, 2, 1, 3, 4).reshape(-1, patch * patch * c)


def decode_images(encoded: list, size: int, patch: int, where: str) -> np.ndarray:
    """Decode encoded images, resize to ``size`` × ``size`` RGB and cut into patches:
    ``[n_images, (size/patch)², patch²·3]`` uint8. ``where(i)`` names image ``i`` in an error."""
    from PIL import Image, UnidentifiedImageError

    out = np.empty((len(encoded), (size // patch) ** 2, patch * patch * 3), dtype=np.uint8)
    for i, data in enumerate(encoded):
        try:
            with Image.open(io.BytesIO(data)) as img:
                img = img.convert("RGB")
                if img.size != (size, size):
                    img = img.resize((size, size), Image.BILINEAR)
                out[i] = patchify(np.asarray(img), patch)
        except (UnidentifiedImageError, OSError, ValueError, TypeError) as err:
            raise SourceError(f"{where(i)}: cannot decode image: {type(err).__name__}: {err}") from None
    return out


def with_image_tokens(source, where: str, tokens, offsets, ids, images, img_off, positions) -> SampleBlock:
    """Insert ``patches`` placeholder tokens (``source.image_token_id``) per image at its text
    position in its document; ``img_off`` gives each document's images like ``offsets`` its tokens."""
    P = images.shape[1]
    n_img = np.diff(img_off)
    doc_of = np.repeat(np.arange(len(n_img)), n_img)
    text_len = np.diff(offsets)
    if len(positions) and (np.any(positions < 0) or np.any(positions > text_len[doc_of])):
        bad = int(np.flatnonzero((positions < 0) | (positions > text_len[doc_of]))[0])
        raise SourceError(f"{where}: image {bad} of the unit is at text position {positions[bad]}, outside its document "
                          f"(sample id {ids[doc_of[bad]]}, {text_len[doc_of[bad]]} text tokens)")
    if len(positions) > 1:
        same_doc = doc_of[1:] == doc_of[:-1]
        if np.any(same_doc & (np.diff(positions) < 0)):
            raise SourceError(f"{where}: image positions must not decrease within a document")
    k_in_doc = np.arange(len(positions)) - img_off[doc_of]  # images before this one in its document
    starts = positions + k_in_doc * P  # where its placeholders start in the document with images
    flat_at = offsets[doc_of] + positions  # insertion point in the flat text array
    tokens = np.insert(tokens.astype(np.int32, copy=False), np.repeat(flat_at, P), np.int32(source.image_token_id))  # the id may not fit a narrowed block
    new_offsets = offsets + np.concatenate([[0], np.cumsum(n_img * P)])
    return SampleBlock(source.name, tokens, new_offsets, ids, images=images, image_offsets=img_off, image_starts=starts)
