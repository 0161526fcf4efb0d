"""Backend ``transformers``: ``transformers.AutoTokenizer.from_pretrained`` on a folder
(sentencepiece models, custom tokenizer classes; local files only: a remote folder is copied into
the cache first)."""

from __future__ import annotations

import os

import numpy as np

from ...plan.base import resolve_url
from .base import TextTokenizer, TokenizerError


class TransformersTokenizer(TextTokenizer):
    """``transformers.AutoTokenizer`` on a local folder (a remote one is copied to the cache)."""

    def __init__(self, url: str, kwargs: dict):
        try:
            from transformers import AutoTokenizer
        except ImportError:
            raise TokenizerError(
                f"tokenizer {url!r} needs the 'transformers' package (backend: transformers)"
            ) from None
        self.name = url
        try:
            self.tok = AutoTokenizer.from_pretrained(_local_folder(url), local_files_only=True, **kwargs)
        except TokenizerError:
            raise
        except Exception as err:
            raise TokenizerError(
                f"cannot load tokenizer folder {url!r} with transformers.AutoTokenizer: {type(err).__name__}: {err}"
            ) from None
        self.bos_id, self.eos_id, self.pad_id = self.tok.bos_token_id, self.tok.eos_token_id, self.tok.pad_token_id
        self.chat_template = getattr(self.tok, "chat_template", None)
        full = self.tok("a", add_special_tokens=True)["input_ids"]
        plain = self.tok("a", add_special_tokens=False)["input_ids"]
        self.adds_bos = bool(len(full) > len(plain) and self.bos_id is not None and full[0] == self.bos_id)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.tok(texts, add_special_tokens=False)["input_ids"] if texts else []

    def encode_offsets(self, text: str):
        out = self.encode_offsets_batch([text])
        return None if out is None else out[0]

    def encode_offsets_batch(self, texts: list[str]):
        if not getattr(self.tok, "is_fast", False):  # a slow (Python) tokenizer reports no offsets
            return None
        out = self.tok(texts, add_special_tokens=False, return_offsets_mapping=True)
        return [
            (ids, np.asarray(om, dtype=np.int64).reshape(-1, 2))
            for ids, om in zip(out["input_ids"], out["offset_mapping"])
        ]

    def token_id(self, token: str) -> int | None:
        tid = self.tok.convert_tokens_to_ids(token)
        return None if tid is None or tid == self.tok.unk_token_id and token != self.tok.unk_token else tid

    def special_strings(self) -> dict[str, str]:
        return {k: v for k, v in self.tok.special_tokens_map.items() if isinstance(v, str)}

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    @classmethod
    def from_spec(cls, spec, base_dir: str | None) -> TransformersTokenizer:
        return cls(resolve_url(spec.location, base_dir), spec.kwargs)


def _local_folder(url: str) -> str:
    """A local copy of a tokenizer folder (the folder itself when it is local)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    if "file" in (fs.protocol if isinstance(fs.protocol, tuple) else (fs.protocol,)):
        return path
    import hashlib

    cache = os.path.join(
        os.environ.get("OVERLORD_CACHE_DIR", os.path.expanduser("~/.cache/overlord-dask")),
        "tokenizers",
        hashlib.sha1(url.encode()).hexdigest()[:16],
    )
    if not os.path.isdir(cache):
        fs.get(path.rstrip("/") + "/", cache + ".part/", recursive=True)
        os.replace(cache + ".part", cache)
    return cache
