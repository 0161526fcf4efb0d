"""Generated chat data and a Llama-3-style tokenizer folder, for the SFT recipe, its tests and
``benchmarks/sft.py``: no download, no model files.

:func:`llama3_style_tokenizer` trains a small byte-level BPE with the special tokens of Llama 3
(``<|begin_of_text|>``, ``<|end_of_text|>``, the header and end-of-turn tokens, and ``<image>``),
a post-processor that adds BOS the way Llama 3's does, and a chat template with
``{% generation %}`` blocks around assistant answers, and saves it as ``save_pretrained`` does
(``tokenizer.json`` + ``tokenizer_config.json``): ``transformers.AutoTokenizer`` loads the same
folder. :func:`generate_chat_corpus` writes conversations as a parquet ``messages`` column.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

SPECIAL_TOKENS = [
    "<|begin_of_text|>",
    "<|end_of_text|>",
    "<|start_header_id|>",
    "<|end_header_id|>",
    "<|eot_id|>",
    "<image>",
]
HEADER = "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' }}"
CHAT_TEMPLATE = (
    "{{- bos_token }}{% for message in messages %}"
    + HEADER
    + "{% if message['role'] == 'assistant' %}"
    + "{% generation %}{{ message['content'] | trim }}<|eot_id|>{% endgeneration %}"
    "{% else %}{{ message['content'] | trim }}<|eot_id|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
)
"""Llama 3's chat format, with the assistant answers (and their end-of-turn token) in generation blocks."""
PLAIN_CHAT_TEMPLATE = CHAT_TEMPLATE.replace("{% generation %}", "").replace("{% endgeneration %}", "")
"""The same format without generation blocks (what most published templates look like)."""
WORDS = (
    "the cat sat on a mat while data loaders stream packed batches to many ranks and every token counts "
    "answer question explain why how what model training long short context image picture shows"
).split()


def _sentence(rng: np.random.Generator, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS, size=int(rng.integers(lo, hi))))


def conversation(
    rng: np.random.Generator, turns: tuple[int, int] = (1, 4), words: tuple[int, int] = (3, 40), images: int = 0
) -> list[dict]:
    """A random conversation: maybe a system prompt, then user/assistant turns; ``images``
    ``<image>`` placeholders go into the first user turn."""
    msgs = [{"role": "system", "content": _sentence(rng, 3, 12)}] if rng.random() < 0.5 else []
    for t in range(int(rng.integers(*turns))):
        user = _sentence(rng, *words)
        if t == 0 and images:
            user = " ".join(["<image>"] * images) + "\n" + user
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": _sentence(rng, *words)}]
    return msgs


def llama3_style_tokenizer(
    path: str | os.PathLike, vocab_size: int = 600, seed: int = 0, template: str = CHAT_TEMPLATE
) -> Path:
    """A Llama-3-style tokenizer folder at ``path`` (see the module docstring)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    rng = np.random.default_rng(seed)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_sentence(rng, 5, 60) for _ in range(500)], trainer=trainer)
    bos = tok.token_to_id("<|begin_of_text|>")
    tok.post_processor = processors.TemplateProcessing(
        single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A $B", special_tokens=[("<|begin_of_text|>", bos)]
    )
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|end_of_text|>",
        "chat_template": template,
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 131072,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return path


def generate_chat_corpus(
    out_dir: str | os.PathLike, n: int = 2000, files: int = 2, seed: int = 0, turns=(1, 4), words=(3, 40)
) -> Path:
    """``n`` conversations as parquet files with a ``messages`` column, under ``out_dir/chat``."""
    rng = np.random.default_rng(seed)
    folder = Path(out_dir) / "chat"
    folder.mkdir(parents=True, exist_ok=True)
    msg_type = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    for f, part in enumerate(np.array_split(np.arange(n), files)):
        convs = [conversation(rng, turns, words) for _ in part]
        pq.write_table(
            pa.table({"messages": pa.array(convs, type=msg_type)}), folder / f"part-{f:03d}.parquet", row_group_size=500
        )
    return folder


__all__ = ["CHAT_TEMPLATE", "PLAIN_CHAT_TEMPLATE", "conversation", "generate_chat_corpus", "llama3_style_tokenizer"]
