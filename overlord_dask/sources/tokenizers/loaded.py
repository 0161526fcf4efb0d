"""Loading the tokenizer a plan names, once per process, with the special ids its config and the
plan settle: the backends' registry (:data:`BACKENDS`) and :func:`load_tokenizer`."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ...errors import PlanError
from ...plan.base import resolve_url
from ...plan.text import Tokenizer, tokenizer_spec
from ...vocab import PAD_ID
from .base import SPECIALS, TextTokenizer, TokenizerError, add_boundaries
from .byte import ByteTokenizer
from .function import CallableTokenizer
from .hf_tokenizers import HFTokenizer
from .hf_transformers import TransformersTokenizer
from .tiktoken_bpe import TiktokenTokenizer

BACKENDS: dict[str, type[TextTokenizer]] = {
    "byte": ByteTokenizer,
    "tokenizers": HFTokenizer,
    "transformers": TransformersTokenizer,
    "tiktoken": TiktokenTokenizer,
    "callable": CallableTokenizer,
}
"""Backend name (``Tokenizer.backend``, or what ``auto`` resolves to) -> its class, built with
``cls.from_spec(spec, base_dir)``."""


@dataclass(frozen=True)
class LoadedTokenizer:
    """A tokenizer with the ids the plan and its config settle."""

    tok: TextTokenizer
    spec: Tokenizer
    bos_id: int | None
    eos_id: int | None
    pad_id: int
    image_id: int | None
    chat_template: str | None

    @property
    def name(self) -> str:
        return self.spec.path

    def document_boundaries(
        self, add_bos: bool | None, add_eos: bool | None, chat: bool, source: str
    ) -> tuple[int | None, int | None]:
        """The (BOS, EOS) a source's documents get (None: none), or an error naming what fixes it."""
        bos = (
            add_bos
            if add_bos is not None
            else self.spec.add_bos
            if self.spec.add_bos is not None
            else (self.tok.adds_bos and not chat)
        )
        eos = add_eos if add_eos is not None else self.spec.add_eos if self.spec.add_eos is not None else not chat
        if bos and self.bos_id is None:
            raise TokenizerError(
                f"tokenizer {self.name!r} declares no BOS token (no bos_token in its config): "
                f"set tokenizer.bos_token or tokenizer.bos_id in the plan, or add_bos: false on the source"
            )
        if eos and self.eos_id is None:
            raise TokenizerError(
                f"cannot determine the end-of-document token of tokenizer {self.name!r} "
                f"(no eos_token in its tokenizer_config.json or special_tokens_map.json, and it adds none itself): "
                f"set tokenizer.eos_token or tokenizer.eos_id in the plan, or add_eos: false on the source"
            )
        return (self.bos_id if bos else None), (self.eos_id if eos else None)

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``; a run of image placeholder tokens is written once with its count."""
        if self.image_id is None or self.image_id not in ids:
            return self.tok.decode(ids)
        parts, cur = [], []
        k = 0
        while k < len(ids):
            if ids[k] == self.image_id:
                j = k
                while j < len(ids) and ids[j] == self.image_id:
                    j += 1
                parts.append(self.tok.decode(cur))
                parts.append(f"<image×{j - k}>")
                cur, k = [], j
            else:
                cur.append(ids[k])
                k += 1
        parts.append(self.tok.decode(cur))
        return "".join(parts)

    def specials(self) -> dict[str, str]:
        """The special-token strings a chat template reads (``bos_token``, ``eos_token``, ...), the
        plan's overrides included."""
        out = dict(self.tok.special_strings())
        for name in SPECIALS:
            given = getattr(self.spec, f"{name}_token")
            if given is not None:
                out[f"{name}_token"] = given
        return out

    def template(self, base_dir: str | None, source: str) -> str:
        t = self.chat_template
        if t is None:
            raise TokenizerError(
                f"tokenizer {self.name!r} has no chat template (none in its tokenizer_config.json, "
                f"chat_template.jinja or chat_template.json): set tokenizer.chat_template in the plan"
            )
        return t


def backend_of(spec: Tokenizer, base_dir: str | None) -> str:
    """The backend a tokenizer spec names, ``auto`` resolved: ``transformers`` for a folder
    without a ``tokenizer.json`` (sentencepiece models, custom classes: only transformers reads
    those), else ``tokenizers``."""
    kind = spec.kind
    if kind != "auto":
        return kind
    import fsspec

    url = resolve_url(spec.location, base_dir)
    fs, path = fsspec.core.url_to_fs(url)
    if fs.isdir(path) and not fs.exists(f"{path.rstrip('/')}/tokenizer.json"):
        return "transformers"  # a sentencepiece model or a custom class: only transformers reads those
    return "tokenizers"


@functools.lru_cache(maxsize=32)
def _load(spec_json: str, base_dir: str | None) -> LoadedTokenizer:
    spec = Tokenizer.model_validate_json(spec_json)
    try:
        tok = BACKENDS[backend_of(spec, base_dir)].from_spec(spec, base_dir)
    except (TokenizerError, PlanError):
        raise
    except Exception as err:  # a user's class whose constructor raised, a file its library cannot read
        raise TokenizerError(f"tokenizer {spec.path!r} could not be built: {type(err).__name__}: {err}") from None

    def special(name: str) -> int | None:
        given_id, given = getattr(spec, f"{name}_id"), getattr(spec, f"{name}_token")
        if given_id is not None:
            return given_id
        if given is not None:
            tid = tok.token_id(given)
            if tid is None:
                raise TokenizerError(
                    f"tokenizer {spec.path!r} has no token {given!r} (tokenizer.{name}_token in the plan)"
                )
            return tid
        return getattr(tok, f"{name}_id")

    bos, eos = special("bos"), special("eos")
    pad = special("pad")
    image = spec.image_token_id if spec.image_token_id is not None else tok.token_id(spec.image_token)
    template = spec.chat_template
    if template is not None and template.endswith(".jinja"):
        import fsspec

        with fsspec.open(resolve_url(template, base_dir), "r", encoding="utf-8") as f:
            template = f.read()
    return LoadedTokenizer(
        tok,
        spec,
        bos,
        eos,
        pad if pad is not None else eos if eos is not None else PAD_ID,
        image,
        template if template is not None else tok.chat_template,
    )


def load_tokenizer(spec, base_dir: str | None = None) -> LoadedTokenizer:
    """The tokenizer a plan names (a :class:`~overlord_dask.plan.text.Tokenizer` or its string
    shorthand), loaded once per process."""
    return _load(tokenizer_spec(spec).model_dump_json(), None if base_dir is None else str(base_dir))


def resolve_tokenizer(spec, base_dir: str | None = None) -> Callable[[pa.Array], tuple[np.ndarray, np.ndarray]]:
    """Arrow strings -> (tokens, offsets) of documents as a text source with the default boundary
    policy gets them (what a per-rank baseline tokenizes with)."""
    loaded = load_tokenizer(spec, base_dir)
    bos, eos = loaded.document_boundaries(None, None, False, "?")

    def tokenize(texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        tokens, offsets = loaded.tok.encode_array(texts)
        return add_boundaries(tokens, offsets, bos, eos)[:2]

    return tokenize


def image_token_id(source, plan) -> int:
    """The placeholder id of a multimodal source's image tokens: the source's ``image_token_id``,
    else its tokenizer's id of its ``image_token``; an error naming both fields otherwise."""
    if source.image_token_id is not None:
        return source.image_token_id
    loaded = load_tokenizer(plan.tokenizer_of(source), plan.base_dir)
    if loaded.image_id is None:
        raise TokenizerError(
            f"tokenizer {loaded.name!r} has no token {loaded.spec.image_token!r} for images: "
            f"add it to the tokenizer, name one it has as tokenizer.image_token, or set image_token_id on the source"
        )
    return loaded.image_id
