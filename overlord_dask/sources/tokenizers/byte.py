"""The built-in byte tokenizer (backend ``byte``): UTF-8 bytes as ids 3..258 (PAD 0, BOS 1, EOS 2,
image 259), on whole Arrow string arrays with numpy, so the demo and tests need no model files."""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from ...vocab import BOS_ID, EOS_ID, PAD_ID
from .base import TextTokenizer, add_boundaries

BYTE_OFFSET = 3
BYTE_IMAGE_ID = 259


class ByteTokenizer(TextTokenizer):
    """Backend ``byte``."""

    name, bos_id, eos_id, pad_id = "byte", BOS_ID, EOS_ID, PAD_ID

    @classmethod
    def from_spec(cls, spec, base_dir: str | None) -> ByteTokenizer:
        return cls()

    def encode_array(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        if isinstance(texts, pa.ChunkedArray):
            texts = texts.combine_chunks()
        if pa.types.is_null(texts.type):
            texts = texts.cast(pa.string())
        if pa.types.is_string(texts.type):
            off_dtype = np.int32
        elif pa.types.is_large_string(texts.type):
            off_dtype = np.int64
        else:
            raise TypeError(f"byte tokenizer needs a string column, got {texts.type}")
        n = len(texts)
        if n == 0:
            return np.zeros(0, np.int32), np.zeros(1, np.int64)
        _, off_buf, data_buf = texts.buffers()
        offs = np.frombuffer(off_buf, dtype=off_dtype)[texts.offset : texts.offset + n + 1].astype(np.int64)
        data = (
            np.frombuffer(data_buf, dtype=np.uint8)[offs[0] : offs[-1]]
            if data_buf is not None
            else np.zeros(0, np.uint8)
        )
        if texts.null_count:  # a null slot may still span bytes in the data buffer: make it empty
            valid = ~np.asarray(texts.is_null())
            keep = np.repeat(valid, np.diff(offs))
            data = data[keep]
            offs = np.concatenate([[0], np.cumsum(np.diff(offs) * valid)])
        else:
            offs = offs - offs[0]
        return data.astype(np.int32) + BYTE_OFFSET, offs

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [list(np.frombuffer(t.encode("utf-8"), np.uint8).astype(np.int64) + BYTE_OFFSET) for t in texts]

    def encode_offsets(self, text: str):
        ids = self.encode([text])[0]
        char_of = np.repeat(np.arange(len(text)), [len(c.encode("utf-8")) for c in text])
        return ids, np.stack([char_of, char_of + 1], axis=1) if len(char_of) else np.zeros((0, 2), np.int64)

    def token_id(self, token: str) -> int | None:
        return BYTE_IMAGE_ID if token == "<image>" else None

    def decode(self, ids: list[int]) -> str:
        names = {PAD_ID: "<pad>", BOS_ID: "<s>", EOS_ID: "</s>", BYTE_IMAGE_ID: "<image>"}
        out, run = [], bytearray()
        for i in ids:
            if BYTE_OFFSET <= i < BYTE_IMAGE_ID:
                run.append(i - BYTE_OFFSET)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run = bytearray()
            out.append(names.get(i, f"<{i}>"))
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)


def byte_tokenize(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
    """The byte tokenizer's documents: ``utf8_bytes(i) + 3`` then EOS; a null string counts as empty."""
    tokens, offsets = ByteTokenizer().encode_array(texts)
    return add_boundaries(tokens, offsets, None, EOS_ID)[:2]


def byte_detokenize(tokens: np.ndarray) -> str:
    """Inverse of :func:`byte_tokenize` for one document (drops EOS/PAD/BOS)."""
    t = np.asarray(tokens)
    t = t[(t >= BYTE_OFFSET) & (t < BYTE_IMAGE_ID)] - BYTE_OFFSET
    return t.astype(np.uint8).tobytes().decode("utf-8", errors="replace")
