"""Backend ``tiktoken``: a named tiktoken encoding, or a local ``.tiktoken`` ranks file with its
split pattern and special tokens from the plan's ``kwargs``."""

from __future__ import annotations

import os

import numpy as np

from ...plan.base import resolve_url
from .base import TextTokenizer, TokenizerError

LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""The split pattern of a local tiktoken ranks file when the plan gives none (Llama 3's)."""


class TiktokenTokenizer(TextTokenizer):
    def __init__(self, location: str, kwargs: dict, base_dir: str | None):
        try:
            import tiktoken
        except ImportError:
            raise TokenizerError(f"tokenizer tiktoken:{location} needs the 'tiktoken' package") from None
        self.name = f"tiktoken:{location}"
        specials = {str(k): int(v) for k, v in kwargs.get("special_tokens", {}).items()}
        try:
            if "/" in location or "." in location:  # a ranks file
                from tiktoken.load import load_tiktoken_bpe

                ranks = load_tiktoken_bpe(resolve_url(location, base_dir))
                self.enc = tiktoken.Encoding(
                    os.path.basename(location),
                    pat_str=kwargs.get("pattern", LLAMA3_PATTERN),
                    mergeable_ranks=ranks,
                    special_tokens=specials,
                )
            else:
                self.enc = tiktoken.get_encoding(location)
        except Exception as err:
            raise TokenizerError(f"cannot load tokenizer {self.name!r}: {type(err).__name__}: {err}") from None
        self.eos_id = (
            self.enc.eot_token if "<|endoftext|>" in self.enc.special_tokens_set else None
        )  # the encoding's own end of text

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_batch(texts, allowed_special="all")

    def encode_offsets(self, text: str):
        ids = self.enc.encode(text, allowed_special="all")
        _, starts = self.enc.decode_with_offsets(ids)
        starts = np.asarray(starts, dtype=np.int64)
        ends = np.append(starts[1:], len(text)) if len(starts) else starts
        return ids, np.stack([starts, np.maximum(ends, starts)], axis=1) if len(ids) else np.zeros((0, 2), np.int64)

    def token_id(self, token: str) -> int | None:
        try:
            return self.enc.encode_single_token(token)
        except KeyError:
            return None

    def decode(self, ids: list[int]) -> str:
        return self.enc.decode(ids)

    @classmethod
    def from_spec(cls, spec, base_dir: str | None) -> TiktokenTokenizer:
        return cls(spec.location, spec.kwargs, base_dir)
