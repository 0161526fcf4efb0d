"""The model's tokenizer on the loader workers: loaded once per worker process from what the plan
names (``plan/text.py``), with its special tokens taken from its own config.

Backends:

- ``byte``: UTF-8 bytes as ids 3..258 (PAD 0, BOS 1, EOS 2, image 259), on whole Arrow string
  arrays with numpy, so the demo and tests need no model files;
- ``tokenizers``: a ``tokenizer.json`` (a file, or a folder as ``save_pretrained`` writes it),
  run with its Rust batch encoder;
- ``transformers``: ``AutoTokenizer.from_pretrained`` on a folder (sentencepiece models, custom
  tokenizer classes; local files only: a remote folder is copied into the cache first);
- ``tiktoken``: a named encoding or a local ``.tiktoken`` ranks file;
- ``callable``: ``module:callable`` mapping a list of strings to lists of ids, called with the
  plan's ``kwargs``, or a class built once with them.

BOS, EOS, PAD and the image token come, in this order, from the plan's ``*_id``, the plan's
``*_token``, the tokenizer's ``tokenizer_config.json`` and ``special_tokens_map.json`` (or the
loaded object's attributes), and for BOS/EOS the tokens its post-processor adds around a text.
Nothing is guessed from token names: a document boundary that cannot be determined is an error
naming the tokenizer and the plan field that fixes it (:func:`boundaries`).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import pyarrow as pa

from ..plan.base import import_callable, resolve_url
from ..plan.text import Tokenizer, tokenizer_spec
from ..vocab import BOS_ID, EOS_ID, PAD_ID

BYTE_OFFSET = 3
BYTE_IMAGE_ID = 259
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
"""The split pattern of a local tiktoken ranks file when the plan gives none (Llama 3's)."""
CONFIG_FILES = ("tokenizer_config.json", "special_tokens_map.json")
SPECIALS = ("bos", "eos", "pad")


class TokenizerError(ValueError):
    """A tokenizer that cannot be loaded or lacks what the plan needs; the message names both."""


class TextTokenizer:
    """A loaded tokenizer: ``encode`` adds no special tokens (documents get theirs from the
    source's boundary policy, chats from their template) but reads special-token strings in the
    text as the special tokens. Subclasses fill the ids they know."""

    name: str = "?"
    bos_id: int | None = None
    eos_id: int | None = None
    pad_id: int | None = None
    adds_bos: bool = False  # what the tokenizer itself does when asked to add special tokens
    chat_template: str | None = None

    def encode(self, texts: list[str]) -> list[list[int]]:
        raise NotImplementedError

    def encode_offsets(self, text: str) -> tuple[list[int], np.ndarray] | None:
        """Ids of ``text`` and each token's ``[start, end)`` character span (``[n, 2]``), or None
        when the backend cannot say (then chats are encoded segment by segment)."""
        return None

    def encode_offsets_batch(self, texts: list[str]) -> list | None:
        """:meth:`encode_offsets` of each text (None where the backend cannot say)."""
        return [self.encode_offsets(t) for t in texts]

    def token_id(self, token: str) -> int | None:
        return None

    def special_strings(self) -> dict[str, str]:
        """What chat templates see as ``bos_token``, ``eos_token``, ... (strings)."""
        return {}

    def decode(self, ids: list[int]) -> str:
        """Text of ``ids``, special tokens written out (what ``overlord preview`` shows)."""
        return " ".join(map(str, ids))

    def encode_array(self, texts: pa.Array) -> tuple[np.ndarray, np.ndarray]:
        """Arrow strings -> (token ids, offsets [n + 1]), no special tokens added."""
        docs = self.encode([t if t is not None else "" for t in texts.to_pylist()])
        return flatten(self.name, docs, len(texts))


def flatten(name: str, docs, n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` documents' id sequences (a tokenizer's output, named ``name`` in errors) as
    (token ids, offsets [n + 1]); a wrong count, a 2-D or a non-integer document is an error."""
    docs = [np.asarray(d) for d in docs]
    if len(docs) != n:
        raise ValueError(f"tokenizer {name} returned {len(docs)} documents for {n} texts")
    for i, d in enumerate(docs):
        if d.ndim != 1:
            raise ValueError(
                f"tokenizer {name} returned a {d.ndim}-D array of shape {d.shape} for document {i}; expected a 1-D "
                "sequence of token ids"
            )
        if d.size and not np.issubdtype(d.dtype, np.integer):
            raise ValueError(f"tokenizer {name} returned {d.dtype} values for document {i}; token ids must be integers")
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum([len(d) for d in docs], out=offsets[1:])
    tokens = np.concatenate(docs).astype(np.int64, copy=False) if docs else np.zeros(0, np.int64)
    return tokens, offsets  # SampleBlock checks the range of the ids


# ---- byte -------------------------------------------------------------------------------------------
class ByteTokenizer(TextTokenizer):
    name, bos_id, eos_id, pad_id = "byte", BOS_ID, EOS_ID, PAD_ID

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


def add_boundaries(
    tokens: np.ndarray,
    offsets: np.ndarray,
    bos: int | None,
    eos: int | None,
    mask: np.ndarray | None = None,
    positions: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None, np.ndarray | None]:
    """Documents with ``bos`` before and ``eos`` after each one (None: not that one): (tokens,
    offsets, loss mask, image positions). A BOS is never a loss target, an EOS is (the model
    learns to end a document); image positions shift past the BOS."""
    n = len(offsets) - 1
    if bos is None and eos is None:
        return tokens, offsets, mask, positions
    tokens = np.asarray(tokens, dtype=np.int64)
    if bos is not None:
        tokens = np.insert(tokens, offsets[:-1], bos)
        if mask is not None:
            mask = np.insert(mask, offsets[:-1], np.uint8(0))
        offsets = offsets + np.arange(n + 1)
        if positions is not None:
            positions = positions + 1
    if eos is not None:
        tokens = np.insert(tokens, offsets[1:], eos)
        if mask is not None:
            mask = np.insert(mask, offsets[1:], np.uint8(1))
        offsets = offsets + np.arange(n + 1)
    return tokens, offsets, mask, positions


# ---- tokenizers / transformers ----------------------------------------------------------------------
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


# ---- tiktoken -----------------------------------------------------------------------------------------
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


# ---- callable -----------------------------------------------------------------------------------------
class CallableTokenizer(TextTokenizer):
    """``module:callable``: a function called as ``fn(texts, **kwargs)``, or a class built once as
    ``cls(**kwargs)`` whose instances are called with the texts and may say their special ids
    (``bos_token_id``, ``eos_token_id``, ``pad_token_id``) and ``chat_template``."""

    def __init__(self, ref: str, kwargs: dict):
        self.name = ref
        obj = import_callable(ref)
        if isinstance(obj, type):
            self.fn, self.kwargs = obj(**kwargs), {}
        else:
            self.fn, self.kwargs = obj, dict(kwargs)
        for name in SPECIALS:
            setattr(self, f"{name}_id", getattr(self.fn, f"{name}_token_id", None))
        self.chat_template = getattr(self.fn, "chat_template", None)
        self._token_id = getattr(self.fn, "token_to_id", None)

    def encode(self, texts: list[str]) -> list[list[int]]:
        return self.fn(texts, **self.kwargs)

    def decode(self, ids: list[int]) -> str:
        dec = getattr(self.fn, "decode", None)
        return dec(ids) if dec is not None else super().decode(ids)

    def token_id(self, token: str) -> int | None:
        return self._token_id(token) if self._token_id else None


# ---- loading --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Loaded:
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


def _backend(spec: Tokenizer, url: str) -> str:
    kind = spec.kind
    if kind != "auto":
        return kind
    import fsspec

    fs, path = fsspec.core.url_to_fs(url)
    if fs.isdir(path) and not fs.exists(f"{path.rstrip('/')}/tokenizer.json"):
        return "transformers"  # a sentencepiece model or a custom class: only transformers reads those
    return "tokenizers"


@functools.lru_cache(maxsize=32)
def _load(spec_json: str, base_dir: str | None) -> Loaded:
    spec = Tokenizer.model_validate_json(spec_json)
    kind = spec.kind
    if kind == "byte":
        tok: TextTokenizer = ByteTokenizer()
    elif kind == "callable":
        tok = CallableTokenizer(spec.path, spec.kwargs)
    elif kind == "tiktoken":
        tok = TiktokenTokenizer(spec.location, spec.kwargs, base_dir)
    else:
        url = resolve_url(spec.location, base_dir)
        tok = TransformersTokenizer(url, spec.kwargs) if _backend(spec, url) == "transformers" else HFTokenizer(url)

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
    return Loaded(
        tok,
        spec,
        bos,
        eos,
        pad if pad is not None else eos if eos is not None else PAD_ID,
        image,
        template if template is not None else tok.chat_template,
    )


def load_tokenizer(spec, base_dir: str | None = None) -> Loaded:
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
