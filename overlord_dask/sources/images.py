"""Images inside token streams: turning encoded images into patches, and placing each image's
placeholder tokens into its document's tokens.

zarr stores ready patch tensors; the record formats store encoded images (PNG, JPEG: what crawls
and caption datasets ship), which the loader workers decode, resize, tile, normalise and cut into
patches: the CPU-heavy preprocessing that per-source pools exist for. An image becomes as many
placeholder tokens as it has patches, so after :func:`with_image_tokens` a block's lengths count
image tokens like text tokens, and packing, splitting and the cost model need nothing
image-specific.

Processing (:class:`ImageProcessor`), built in (Pillow and numpy) or a Hugging Face image
processor folder:

- ``image_tiles == 1``: a square resize to ``image_size``;
- ``image_tiles > 1`` (any-resolution, as LLaVA-NeXT): of the grids of at most ``image_tiles``
  tiles, the one whose shape fits the image's aspect ratio best, keeping as much of its
  resolution as possible; the image is resized into it keeping its aspect ratio (padded with
  black), cut into tiles, and preceded by a thumbnail of the whole image;
- ``image_mean``/``image_std``: ``(x / 255 - mean) / std`` per channel, as float16.
"""

from __future__ import annotations

import functools
import io

import numpy as np

from ..errors import SourceError
from ..plan.base import resolve_url
from .blocks import SampleBlock


def patchify(image: np.ndarray, patch: int) -> np.ndarray:
    """``[H, W, C]`` → ``[(H/patch)·(W/patch), patch·patch·C]``, patches in row-major order."""
    h, w, c = image.shape
    return (
        image.reshape(h // patch, patch, w // patch, patch, c).transpose(0, 2, 1, 3, 4).reshape(-1, patch * patch * c)
    )


def best_grid(width: int, height: int, max_tiles: int, size: int) -> tuple[int, int]:
    """(columns, rows) of at most ``max_tiles`` tiles of ``size`` that shows the image best: the
    most of its pixels at their resolution (capped by the image's own), then the least padding."""
    best, key = (1, 1), None
    for cols in range(1, max_tiles + 1):
        for rows in range(1, max_tiles // cols + 1):
            gw, gh = cols * size, rows * size
            scale = min(gw / width, gh / height)
            shown = min(int(width * scale) * int(height * scale), width * height)
            k = (shown, -(gw * gh))
            if key is None or k > key:
                best, key = (cols, rows), k
    return best


class ImageProcessor:
    """A source's image preprocessing: encoded bytes -> ``[patches, patch_dim]``."""

    def __init__(self, size: int, patch: int, tiles: int = 1, mean=None, std=None, hf_folder: str | None = None):
        self.size, self.patch, self.tiles = size, patch, tiles
        self.mean = None if mean is None else np.asarray(mean, dtype=np.float32)
        self.std = None if std is None else np.asarray(std, dtype=np.float32)
        self.hf = None
        if hf_folder is not None:
            try:
                from transformers import AutoImageProcessor

                self.hf = AutoImageProcessor.from_pretrained(hf_folder, local_files_only=True)
            except Exception as err:
                raise SourceError(f"cannot load image processor {hf_folder!r}: {type(err).__name__}: {err}") from None

    def __call__(self, data: bytes) -> np.ndarray:
        from PIL import Image

        with Image.open(io.BytesIO(data)) as img:
            img = img.convert("RGB")
            if self.hf is not None:
                return self._hf(img)
            tiles = [self._resize(img, self.size, self.size)]
            if self.tiles > 1:
                cols, rows = best_grid(img.width, img.height, self.tiles, self.size)
                if (cols, rows) != (1, 1):
                    grid = self._fit(img, cols * self.size, rows * self.size)
                    tiles += [
                        grid[r * self.size : (r + 1) * self.size, c * self.size : (c + 1) * self.size]
                        for r in range(rows)
                        for c in range(cols)
                    ]
        return np.concatenate([self._patches(t) for t in tiles])

    @staticmethod
    def _resize(img, w: int, h: int) -> np.ndarray:
        from PIL import Image

        return np.asarray(img if img.size == (w, h) else img.resize((w, h), Image.BICUBIC))

    def _fit(self, img, w: int, h: int) -> np.ndarray:
        """``img`` resized into ``w`` × ``h`` keeping its aspect ratio, centred on black."""
        scale = min(w / img.width, h / img.height)
        nw, nh = max(1, round(img.width * scale)), max(1, round(img.height * scale))
        out = np.zeros((h, w, 3), dtype=np.uint8)
        y, x = (h - nh) // 2, (w - nw) // 2
        out[y : y + nh, x : x + nw] = self._resize(img, nw, nh)
        return out

    def _patches(self, tile: np.ndarray) -> np.ndarray:
        if self.mean is None:
            return patchify(tile, self.patch)
        x = (tile.astype(np.float32) / 255.0 - self.mean) / self.std
        return patchify(x.astype(np.float16), self.patch)

    def _hf(self, img) -> np.ndarray:
        px = np.asarray(self.hf(images=[img], return_tensors="np")["pixel_values"])
        px = px.reshape(-1, *px.shape[-3:])  # [tiles, C, H, W] (any-resolution processors add a tile axis)
        h, w = px.shape[-2:]
        if h % self.patch or w % self.patch:
            raise SourceError(f"image processor tiles of {h}x{w} pixels are not a multiple of patch_size={self.patch}")
        return np.concatenate([patchify(t.transpose(1, 2, 0).astype(np.float16), self.patch) for t in px])


@functools.lru_cache(maxsize=16)
def _processor(size, patch, tiles, mean, std, folder) -> ImageProcessor:
    return ImageProcessor(size, patch, tiles, mean, std, folder)


def processor_of(source, base_dir: str | None) -> ImageProcessor:
    """The source's image processor, built once per worker process."""
    folder = resolve_url(source.image_processor, base_dir) if source.image_processor else None
    return _processor(
        source.image_size,
        source.patch_size,
        source.image_tiles,
        tuple(source.image_mean or ()) or None,
        tuple(source.image_std or ()) or None,
        folder,
    )


def decode_images(encoded: list, processor: ImageProcessor, where) -> tuple[list[np.ndarray], dict[int, str]]:
    """Each encoded image's patches, and the errors of those that failed (index -> message;
    their entry is None). ``where(i)`` names image ``i``."""
    from PIL import UnidentifiedImageError

    out, errors = [], {}
    for i, data in enumerate(encoded):
        try:
            out.append(processor(data))
        except (UnidentifiedImageError, OSError, ValueError, TypeError) as err:
            out.append(None)
            errors[i] = f"{where(i)}: cannot decode image: {type(err).__name__}: {err}"
    return out, errors


def with_image_tokens(
    source: str,
    image_id: int,
    where: str,
    tokens,
    offsets,
    ids,
    patches: list[np.ndarray],
    img_off,
    positions,
    mask: np.ndarray | None = None,
) -> SampleBlock:
    """Insert one placeholder token (``image_id``) per patch of each image at its text position
    in its document; ``img_off`` gives each document's images like ``offsets`` its tokens. Image
    tokens are never loss targets."""
    counts = np.array([len(p) for p in patches], dtype=np.int64)
    n_img = np.diff(img_off)
    doc_of = np.repeat(np.arange(len(n_img)), n_img)
    text_len = np.diff(offsets)
    if len(positions) and (np.any(positions < 0) or np.any(positions > text_len[doc_of])):
        bad = int(np.flatnonzero((positions < 0) | (positions > text_len[doc_of]))[0])
        raise SourceError(
            f"{where}: image {bad} of the unit is at text position {positions[bad]}, outside its document "
            f"(sample id {ids[doc_of[bad]]}, {text_len[doc_of[bad]]} text tokens)"
        )
    if len(positions) > 1:
        same_doc = doc_of[1:] == doc_of[:-1]
        if np.any(same_doc & (np.diff(positions) < 0)):
            raise SourceError(f"{where}: image positions must not decrease within a document")
    patch_off = np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)
    before_in_doc = patch_off[:-1] - patch_off[img_off[doc_of]]  # image tokens of earlier images of its document
    starts = positions + before_in_doc  # where its placeholders start in the document with images
    at = np.repeat(offsets[doc_of] + positions, counts)  # insertion points in the flat text array
    tokens = np.insert(np.asarray(tokens, dtype=np.int64), at, image_id)
    if mask is not None:
        mask = np.insert(mask, at, np.uint8(0))
    per_doc = np.diff(patch_off[img_off])  # image tokens per document
    new_offsets = offsets + np.concatenate([[0], np.cumsum(per_doc)])
    dims = next((p.shape[1:] for p in patches), (0,))
    images = np.concatenate(patches) if patches else np.zeros((0, *dims), np.uint8)
    return SampleBlock(
        source,
        tokens,
        new_offsets,
        ids,
        images=images,
        image_offsets=img_off,
        image_starts=starts,
        image_patches=patch_off,
        loss_mask=mask,
    )
