"""The model's tokenizer on the loader workers: loaded once per worker process from what the plan
names (``plan/text.py``), with its special tokens taken from its own config.

Backends, one module each, behind one registry (``loaded.BACKENDS``, resolved by
:func:`load_tokenizer`):

- ``byte`` (``byte.py``): UTF-8 bytes as ids, no model files;
- ``tokenizers`` (``hf_tokenizers.py``): a ``tokenizer.json``, with its Rust batch encoder;
- ``transformers`` (``hf_transformers.py``): ``AutoTokenizer`` on a folder (sentencepiece, custom);
- ``tiktoken`` (``tiktoken_bpe.py``): a named encoding or a local ``.tiktoken`` ranks file;
- ``callable`` (``function.py``): the user's ``module:callable`` or class.

Each is a :class:`~overlord_dask.sources.tokenizers.base.TextTokenizer` that encodes without
adding special tokens. BOS, EOS, PAD and the image token come, in this order, from the plan's
``*_id``, the plan's ``*_token``, the tokenizer's ``tokenizer_config.json`` and
``special_tokens_map.json`` (or the loaded object's attributes), and for BOS/EOS the tokens its
post-processor adds around a text. Nothing is guessed from token names: a document boundary that
cannot be determined is an error naming the tokenizer and the plan field that fixes it
(:meth:`LoadedTokenizer.document_boundaries`).
"""

from ...vocab import BOS_ID, EOS_ID, PAD_ID
from .base import TextTokenizer, TokenizerError, add_boundaries, flatten
from .byte import BYTE_IMAGE_ID, BYTE_OFFSET, ByteTokenizer, byte_detokenize, byte_tokenize
from .loaded import BACKENDS, LoadedTokenizer, image_token_id, load_tokenizer, resolve_tokenizer
from .tiktoken_bpe import LLAMA3_PATTERN

__all__ = [
    "BACKENDS",
    "BOS_ID",
    "BYTE_IMAGE_ID",
    "BYTE_OFFSET",
    "EOS_ID",
    "LLAMA3_PATTERN",
    "PAD_ID",
    "ByteTokenizer",
    "LoadedTokenizer",
    "TextTokenizer",
    "TokenizerError",
    "add_boundaries",
    "byte_detokenize",
    "byte_tokenize",
    "flatten",
    "image_token_id",
    "load_tokenizer",
    "resolve_tokenizer",
]
