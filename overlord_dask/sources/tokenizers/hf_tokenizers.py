"""Backend ``tokenizers``: a ``tokenizer.json`` (a file, or a folder as ``save_pretrained`` writes
it), run with the Hugging Face ``tokenizers`` library's Rust batch encoder, its special tokens and
chat template read from the folder's config files."""

from __future__ import annotations

import json
import os

import numpy as np

from ...plan.base import resolve_url
from .base import TextTokenizer, TokenizerError

CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")


def _read_json(fs, path: str) -> dict:
    if not fs.exists(path):
        return {}
    with fs.open(path, "r", encoding="utf-8") as f:
        return json.load(f)


def _token_string(value) -> str | None:
    """A config's special token: a string or ``{"content": ...}`` (AddedToken)."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _template_of(config: dict, fs, folder: str | None) -> str | None:
    """The chat template a tokenizer folder declares: ``chat_template.jinja``, the config's
    ``chat_template`` (a string, or named templates: the ``default`` one), or ``chat_template.json``."""
    if folder is not None and fs.exists(f"{folder}/chat_template.jinja"):
        with fs.open(f"{folder}/chat_template.jinja", "r", encoding="utf-8") as f:
            return f.read()
    t = config.get("chat_template")
    if t is None and folder is not None:
        t = _read_json(fs, f"{folder}/chat_template.json").get("chat_template")
    if isinstance(t, list):
        named = {d.get("name"): d.get("template") for d in t}
        t = named.get("default", next(iter(named.values()), None))
    return t


class HFTokenizer(TextTokenizer):
    """A ``tokenizers.Tokenizer`` (``tokenizer.json``) with its folder's config files."""

    def __init__(self, url: str):
        try:
            from tokenizers import Tokenizer as RustTokenizer
        except ImportError:
            raise TokenizerError(
                "tokenizer files need the 'tokenizers' package (pip install 'overlord-dask[hf]')"
            ) from None
        import fsspec

        fs, path = fsspec.core.url_to_fs(url)
        folder = path if fs.isdir(path) else None
        file = f"{folder}/tokenizer.json" if folder else path
        self.name = url
        try:
            with fs.open(file, "r", encoding="utf-8") as f:
                self.tok = RustTokenizer.from_str(f.read())
        except FileNotFoundError:
            raise TokenizerError(
                f"tokenizer file not found: {fs.unstrip_protocol(file)!r} (a tokenizer is `byte`, a tokenizer folder "
                "or "
                "file, `tiktoken:NAME` or `module:callable`)"
            ) from None
        except Exception as err:  # a file that is not a tokenizer: say which
            first = str(err).splitlines()[0] if str(err) else ""
            raise TokenizerError(f"cannot load tokenizer file {url!r}: {type(err).__name__}: {first}") from None
        config_dir = folder or os.path.dirname(path)
        self.config = {}
        for name in reversed(CONFIG_FILES):  # tokenizer_config.json wins over special_tokens_map.json
            self.config.update(_read_json(fs, f"{config_dir}/{name}"))
        self.chat_template = _template_of(self.config, fs, config_dir)
        self._from_post_processor()

    def _from_post_processor(self) -> None:
        plain = self.tok.encode("a", add_special_tokens=False).ids
        full = self.tok.encode("a", add_special_tokens=True).ids
        k = next((i for i in range(len(full) - len(plain) + 1) if full[i : i + len(plain)] == plain), None)
        prefix, suffix = (full[:k], full[k + len(plain) :]) if k is not None else ([], [])
        self.adds_bos = bool(prefix)
        for name, ids in (("bos", prefix), ("eos", suffix)):
            token = _token_string(self.config.get(f"{name}_token"))
            tid = self.token_id(token) if token else None
            setattr(self, f"{name}_id", tid if tid is not None else (ids[0] if len(ids) == 1 else None))
        pad = _token_string(self.config.get("pad_token"))
        self.pad_id = self.token_id(pad) if pad else None
        if "add_bos_token" in self.config:
            self.adds_bos = bool(self.config["add_bos_token"])

    def encode(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def encode_offsets(self, text: str):
        return self.encode_offsets_batch([text])[0]

    def encode_offsets_batch(self, texts: list[str]) -> list:
        return [
            (e.ids, np.asarray(e.offsets, dtype=np.int64).reshape(-1, 2))
            for e in self.tok.encode_batch(texts, add_special_tokens=False)
        ]

    def token_id(self, token: str) -> int | None:
        return self.tok.token_to_id(token)

    def special_strings(self) -> dict[str, str]:
        return {
            k: v
            for k, v in ((k, _token_string(v)) for k, v in self.config.items() if k.endswith("_token"))
            if v is not None
        }

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=False)

    @classmethod
    def from_spec(cls, spec, base_dir: str | None) -> HFTokenizer:
        return cls(resolve_url(spec.location, base_dir))
