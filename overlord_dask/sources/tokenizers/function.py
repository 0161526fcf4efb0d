"""Backend ``callable``: the user's own ``module:callable`` mapping a list of strings to lists of
ids, called with the plan's ``kwargs``, or a class built once with them."""

from __future__ import annotations

from ...plan.base import import_callable
from .base import SPECIALS, TextTokenizer


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

    @classmethod
    def from_spec(cls, spec, base_dir: str | None) -> CallableTokenizer:
        return cls(spec.path, spec.kwargs)
