"""How a plan names its tokenizer, and what a document's boundaries are.

A model is trained with one tokenizer, and its documents begin and end with that tokenizer's
special tokens. So the plan names the tokenizer the way users have it (a folder as
``save_pretrained`` writes it, a ``tokenizer.json``, a tiktoken encoding, their own function) and
the special ids come from the tokenizer's own config, with plan fields to override each one.
Loading the files is the workers' business (``sources/tokenizers/``); this module only
validates what the plan says.

Written as a string in YAML, a tokenizer is a shorthand::

    tokenizer: byte                       # the built-in byte tokenizer
    tokenizer: ./llama3                   # a folder (tokenizer.json, tokenizer_config.json, ...)
    tokenizer: hf:tokenizer.json          # a tokenizers file (hf: is optional for paths)
    tokenizer: tiktoken:cl100k_base       # a tiktoken encoding (name or a local .tiktoken file)
    tokenizer: mypkg.tok:encode           # a function (list of strings -> lists of ids)

or as a mapping with overrides::

    tokenizer: {path: ./llama3, eos_token: "<|eot_id|>", add_bos: true}
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from .base import Strict, import_callable, is_callable_ref


class Tokenizer(Strict):
    """A tokenizer and its special tokens. Every ``*_token`` names a token string of the
    tokenizer's vocabulary, every ``*_id`` gives the id itself; either overrides what the
    tokenizer's config says."""

    path: str = "byte"
    """``byte``; a tokenizer folder or file (local, relative to the plan's folder, or any fsspec
    URL); ``tiktoken:NAME`` or ``tiktoken:PATH``; or ``module:callable``."""
    backend: Literal["auto", "byte", "tokenizers", "transformers", "tiktoken", "callable"] = "auto"
    """``auto`` picks from ``path``: the ``tokenizers`` library for a ``tokenizer.json`` (its Rust
    batch encoder), ``transformers.AutoTokenizer`` for a folder without one (sentencepiece
    models), tiktoken for ``tiktoken:``, ``callable`` for ``module:callable``. ``transformers``
    loads any folder with ``AutoTokenizer`` (local files only)."""
    kwargs: dict = Field(default_factory=dict)
    """``callable``: keyword arguments the function is called with (after the texts), or a class is
    built with (once per worker; its instances are called with the texts). ``transformers``: passed
    to ``AutoTokenizer.from_pretrained``. ``tiktoken`` with a file: ``pattern`` (the split regex)
    and ``special_tokens`` (name -> id)."""
    bos_token: str | None = None
    """The token that begins a document; default: the tokenizer config's ``bos_token``."""
    eos_token: str | None = None
    """The token that ends a document; default: the tokenizer config's ``eos_token``."""
    pad_token: str | None = None
    """The padding token; default: the tokenizer config's ``pad_token`` (see ``pad_id``)."""
    image_token: str = "<image>"
    """The placeholder string of an image in the text, and its token (when the vocabulary has it)."""
    bos_id: int | None = Field(default=None, ge=0)
    """The BOS token's id, where the tokenizer has no ``bos_token`` (or to override it)."""
    eos_id: int | None = Field(default=None, ge=0)
    """The EOS token's id, where the tokenizer has no ``eos_token`` (or to override it)."""
    pad_id: int | None = Field(default=None, ge=0)
    """Padding of micro-batches; default: the config's ``pad_token``, else the EOS id (padding never
    reaches a loss: its labels are -100)."""
    image_token_id: int | None = Field(default=None, ge=0)
    """The id of ``image_token``, where the vocabulary has no such token (or to override it)."""
    add_bos: bool | None = None
    """Begin every text document with BOS; default: what the tokenizer does itself (its config's
    ``add_bos_token``, or a BOS its post-processor adds). A source may override it."""
    add_eos: bool | None = None
    """End every text document with EOS; default: yes (packed documents must not run into each
    other). A source may override it."""
    chat_template: str | None = None
    """A jinja chat template (the text, or a ``.jinja`` file relative to the plan's folder)
    replacing the tokenizer's own, for sources with ``messages_field``."""

    @model_validator(mode="before")
    @classmethod
    def _shorthand(cls, value):
        if isinstance(value, str):
            return {"path": value}
        return value

    @model_validator(mode="after")
    def _resolvable(self) -> Tokenizer:
        if self.kind == "callable":
            import_callable(self.path)  # a typo fails on the user's machine, not on a worker
        elif self.kwargs and self.kind in ("byte", "tokenizers"):
            raise ValueError(f"tokenizer {self.path!r}: kwargs are for callable, transformers and tiktoken tokenizers")
        return self

    @property
    def kind(self) -> str:
        """The backend ``auto`` resolves to, from the path alone (``tokenizers`` and ``transformers``
        are told apart by the files, when the tokenizer is loaded)."""
        if self.backend != "auto":
            return self.backend
        if self.path == "byte":
            return "byte"
        if self.path.startswith("tiktoken:"):
            return "tiktoken"
        if self.path.startswith("hf:"):
            return "tokenizers"
        if is_callable_ref(self.path):
            return "callable"
        return "auto"

    @property
    def location(self) -> str:
        """The path without its ``hf:``/``tiktoken:`` prefix."""
        for prefix in ("hf:", "tiktoken:"):
            if self.path.startswith(prefix):
                return self.path[len(prefix) :]
        return self.path

    @property
    def label(self) -> str:
        return self.path


def tokenizer_spec(value) -> Tokenizer:
    """A :class:`Tokenizer` from a plan value (a string shorthand or a mapping)."""
    return value if isinstance(value, Tokenizer) else Tokenizer.model_validate(value)
