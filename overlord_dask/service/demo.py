"""The demo corpus and plan: sources with clearly different length distributions.

- ``web``   parquet, a text column (tokenized on the workers by the byte tokenizer); lognormal
  lengths around 700 tokens.
- ``chat``  parquet, a list<int32> ``input_ids`` column (already tokenized); short, ~150 tokens.
- ``books`` zarr, flat ``tokens`` + ``offsets``; long-tailed (Pareto), 512 to 65,536 tokens.
- ``captions`` zarr, multimodal: short captions with 1-3 images each (16 patches of 48 bytes),
  used by ``pipelines/multimodal.yaml`` (the demo plan itself has the first three).
- ``photos`` parquet, multimodal with *encoded* images: short captions with 1-2 JPEG photos each
  (128×128, smooth synthetic scenes), decoded and patched on the workers: a source whose loading
  costs far more CPU per token than the others (``pipelines/photos.yaml``, the autoscale benchmark).

Generated deterministically from a seed; ``scale`` multiplies the number of documents.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import zarr

from ..plan import Plan
from ..plan.io import load_plan, plan_from_dict
from ..sources.tokenizers import BYTE_OFFSET, EOS_ID

CORPUS_VERSION = 6  # 4: books' tokens in 256k-token chunks; 5: captions' in 64k-token chunks; 6: readable chat
_ALPHABET = np.frombuffer(b"etaoinshrdlucmfwypvbgkjqxz      ", dtype=np.uint8)
PLAN_FILE = Path(__file__).parent / "demo_plan.yaml"


def _text_bytes(rng: np.random.Generator, n: int) -> np.ndarray:
    return _ALPHABET[rng.integers(0, len(_ALPHABET), size=n)]


def _lengths(rng: np.random.Generator, kind: str, n: int) -> np.ndarray:
    if kind == "web":
        return np.clip(rng.lognormal(6.5, 0.8, n), 20, 12_000).astype(np.int64)
    if kind == "chat":
        return np.clip(rng.lognormal(5.0, 0.6, n), 8, 2_000).astype(np.int64)
    if kind == "books":
        return np.clip((rng.pareto(1.2, n) + 1) * 512, 512, 65_536).astype(np.int64)
    raise ValueError(kind)


def _write_web(root: Path, rng, n_docs: int, files: int = 4, row_group: int = 1000) -> None:
    (root / "web").mkdir(parents=True, exist_ok=True)
    for f, idx in enumerate(np.array_split(np.arange(n_docs), files)):
        lens = _lengths(rng, "web", len(idx))
        data = _text_bytes(rng, int(lens.sum()))
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        texts = pa.LargeStringArray.from_buffers(
            len(lens), pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.tobytes())
        )
        table = pa.table({"id": pa.array(idx, pa.int64()), "text": texts})
        pq.write_table(
            table, root / "web" / f"part-{f:03d}.parquet", row_group_size=row_group, write_page_checksum=True
        )


def _write_chat(root: Path, rng, n_docs: int, files: int = 2, row_group: int = 2000) -> None:
    (root / "chat").mkdir(parents=True, exist_ok=True)
    for f, idx in enumerate(np.array_split(np.arange(n_docs), files)):
        lens = _lengths(rng, "chat", len(idx))
        # byte-tokenizer ids of readable text (`overlord preview` shows it), drawn as the corpus always was
        draws = rng.integers(0, 256, size=int(lens.sum()), dtype=np.int32)
        toks = (_ALPHABET[draws % len(_ALPHABET)].astype(np.int32) + BYTE_OFFSET).astype(np.int32)
        ends = np.cumsum(lens) - 1
        toks[ends] = EOS_ID
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int32)
        lists = pa.ListArray.from_arrays(pa.array(offsets), pa.array(toks))
        table = pa.table({"id": pa.array(idx, pa.int64()), "input_ids": lists})
        pq.write_table(
            table, root / "chat" / f"part-{f:03d}.parquet", row_group_size=row_group, write_page_checksum=True
        )


def _write_books(root: Path, rng, n_docs: int) -> None:
    lens = _lengths(rng, "books", n_docs)
    offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
    toks = (_text_bytes(rng, int(offsets[-1])).astype(np.int32) + BYTE_OFFSET).astype(np.int32)
    toks[offsets[1:] - 1] = EOS_ID
    g = zarr.open_group(str(root / "books.zarr"), mode="w")
    # chunks no larger than a load unit (the library default unit_tokens is ~1M): a load decompresses only
    # the chunks its unit spans, not a 4x larger one to keep a quarter of it
    g.create_array("tokens", shape=toks.shape, chunks=(1 << 18,), dtype="int32")[:] = toks
    g.create_array("offsets", shape=offsets.shape, chunks=(1 << 16,), dtype="int64")[:] = offsets


def _write_captions(root: Path, rng, n_docs: int, patches: int = 16, patch_dim: int = 48) -> None:
    """A multimodal source: short captions with 1-3 images each (16 patches of 4x4 RGB pixels)."""
    text = np.clip(rng.lognormal(4.5, 0.6, n_docs), 8, 1_000).astype(np.int64)
    offsets = np.concatenate([[0], np.cumsum(text)]).astype(np.int64)
    toks = (_text_bytes(rng, int(offsets[-1])).astype(np.int32) + BYTE_OFFSET).astype(np.int32)
    toks[offsets[1:] - 1] = EOS_ID
    n_img = rng.integers(1, 4, n_docs)
    img_off = np.concatenate([[0], np.cumsum(n_img)]).astype(np.int64)
    doc_of = np.repeat(np.arange(n_docs), n_img)
    positions = np.floor(rng.random(int(img_off[-1])) * (text[doc_of] - 1)).astype(np.int64)
    positions = np.concatenate([np.sort(positions[a:b]) for a, b in zip(img_off[:-1], img_off[1:])])
    images = rng.integers(0, 256, size=(int(img_off[-1]), patches, patch_dim), dtype=np.uint8)
    g = zarr.open_group(str(root / "captions.zarr"), mode="w")
    g.create_array("tokens", shape=toks.shape, chunks=(1 << 16,), dtype="int32")[:] = (
        toks  # the multimodal plan's units
    )
    g.create_array("offsets", shape=offsets.shape, chunks=(1 << 16,), dtype="int64")[:] = offsets
    g.create_array("images", shape=images.shape, chunks=(4096, patches, patch_dim), dtype="uint8")[:] = images
    g.create_array("image_offsets", shape=img_off.shape, chunks=(1 << 16,), dtype="int64")[:] = img_off
    g.create_array("image_positions", shape=positions.shape, chunks=(1 << 16,), dtype="int64")[:] = positions


def _photo(rng, size: int) -> bytes:
    """A smooth synthetic scene (two colours, a wave pattern, a disc) as JPEG bytes."""
    import io

    from PIL import Image

    y, x = np.mgrid[0:size, 0:size].astype(np.float32) / size
    fx, fy, phase = rng.uniform(1, 12, 2).tolist() + [rng.uniform(0, 6.3)]
    t = (np.sin(fx * x * 6.3 + fy * y * 6.3 + phase) + 1) / 2
    c0, c1 = rng.integers(0, 256, (2, 3))
    img = t[..., None] * c0 + (1 - t[..., None]) * c1
    cx, cy, r = rng.uniform(0.2, 0.8, 2).tolist() + [rng.uniform(0.05, 0.3)]
    img[(x - cx) ** 2 + (y - cy) ** 2 < r * r] = rng.integers(0, 256, 3)
    buf = io.BytesIO()
    Image.fromarray(img.astype(np.uint8)).save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def _write_photos(root: Path, rng, n_docs: int, files: int = 2, row_group: int = 250, size: int = 128) -> None:
    """A multimodal parquet source: short captions (text) with 1-2 encoded JPEG photos each."""
    (root / "photos").mkdir(parents=True, exist_ok=True)
    for f, idx in enumerate(np.array_split(np.arange(n_docs), files)):
        n = len(idx)
        lens = np.clip(rng.lognormal(4.0, 0.5, n), 8, 400).astype(np.int64)
        data = _text_bytes(rng, int(lens.sum()))
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        texts = pa.LargeStringArray.from_buffers(n, pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.tobytes()))
        n_img = rng.integers(1, 3, n)
        photos = [[_photo(rng, size) for _ in range(k)] for k in n_img]
        positions = [sorted(rng.integers(0, int(L), k).tolist()) for L, k in zip(lens, n_img)]
        table = pa.table(
            {
                "id": pa.array(idx, pa.int64()),
                "caption": texts,
                "images": pa.array(photos, pa.list_(pa.binary())),
                "image_positions": pa.array(positions, pa.list_(pa.int32())),
            }
        )
        pq.write_table(
            table, root / "photos" / f"part-{f:03d}.parquet", row_group_size=row_group, write_page_checksum=True
        )


def generate_demo_corpus(root: str | os.PathLike, *, scale: float = 1.0, seed: int = 0) -> Path:
    """Write the demo corpus under ``root`` (idempotent: an existing complete corpus is kept)."""
    root = Path(root)
    marker = root / "CORPUS.json"
    meta = {"version": CORPUS_VERSION, "scale": scale, "seed": seed}
    if marker.exists() and json.loads(marker.read_text()) == meta:
        return root
    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    _write_web(root, rng, max(8, int(12_000 * scale)))
    _write_chat(root, rng, max(8, int(20_000 * scale)))
    _write_books(root, rng, max(8, int(3_000 * scale)))
    _write_captions(root, rng, max(8, int(4_000 * scale)))
    _write_photos(root, rng, max(8, int(3_000 * scale)))
    marker.write_text(json.dumps(meta))
    return root


def generate_text_sources(
    root: str | os.PathLike,
    sources: int,
    *,
    files: int = 2,
    docs_per_file: int = 2_000,
    row_group: int = 1_000,
    seed: int = 0,
    kinds: tuple[str, ...] = ("web",),
) -> list[str]:
    """``sources`` text parquet sources ``src-000``, ``src-001``, ... under ``root``, each
    ``files`` files of ``docs_per_file`` documents, their lengths web-like by default or
    ``kinds`` (``web``, ``chat``, ``books``) in turn: the many-source corpora of the memory,
    indexing and peer benchmarks. Idempotent like :func:`generate_demo_corpus`; returns the
    source names."""
    root = Path(root)
    names = [f"src-{i:03d}" for i in range(sources)]
    marker = root / "SOURCES.json"
    meta = {
        "version": CORPUS_VERSION,
        "sources": sources,
        "files": files,
        "docs_per_file": docs_per_file,
        "row_group": row_group,
        "seed": seed,
        **({"kinds": list(kinds)} if tuple(kinds) != ("web",) else {}),
    }
    if marker.exists() and json.loads(marker.read_text()) == meta:
        return names
    for i, name in enumerate(names):
        rng = np.random.default_rng([seed, i])
        sub = root / name
        sub.mkdir(parents=True, exist_ok=True)
        for f in range(files):
            lens = _lengths(rng, kinds[i % len(kinds)], docs_per_file)
            data = _text_bytes(rng, int(lens.sum()))
            offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
            texts = pa.LargeStringArray.from_buffers(
                len(lens), pa.py_buffer(offsets.tobytes()), pa.py_buffer(data.tobytes())
            )
            ids = pa.array(np.arange(f * docs_per_file, (f + 1) * docs_per_file), pa.int64())
            pq.write_table(
                pa.table({"id": ids, "text": texts}), sub / f"part-{f:03d}.parquet", row_group_size=row_group
            )
    marker.write_text(json.dumps(meta))
    return names


def text_sources_plan(names: list[str], weights: list[float] | None = None, **sections) -> dict:
    """Plan data (a dict, as a YAML plan file holds it) over :func:`generate_text_sources`'
    sources, URLs relative to their folder: equal weights unless given; ``sections`` set the
    plan's top-level sections (``topology``, ``loading``, ...) over the demo plan's. Load it with
    ``plan_from_dict(data, base_dir=root)`` or write it as YAML into ``root``."""
    import yaml

    data = yaml.safe_load(PLAN_FILE.read_text())
    weights = weights or [1.0] * len(names)
    data["name"] = f"text-{len(names)}"
    data["sources"] = [
        {"name": n, "format": "parquet", "url": f"{n}/*.parquet", "text_field": "text", "weight": w}
        for n, w in zip(names, weights)
    ]
    return _with_sections(data, sections)


def train_bpe(texts, path: str | os.PathLike, vocab_size: int = 8_192) -> Path:
    """Train a byte-level BPE (Hugging Face ``tokenizers``) on ``texts`` in this process and save
    it as the tokenizer folder ``path`` (``tokenizer.json`` and a ``tokenizer_config.json`` naming
    its special tokens, as ``save_pretrained`` writes them; a plan names the folder as its
    ``tokenizer``). Special tokens take the ids the byte tokenizer uses: ``<pad>`` 0, ``<s>`` 1,
    ``</s>`` 2 (end of text)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<pad>", "<s>", "</s>"],
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(texts, trainer=trainer)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "bos_token": "<s>",
                "eos_token": "</s>",
                "pad_token": "<pad>",
                "add_bos_token": False,
                "tokenizer_class": "PreTrainedTokenizerFast",
            }
        )
    )
    return path


def demo_texts(data_dir: str | os.PathLike, max_docs: int = 5_000) -> list[str]:
    """Up to ``max_docs`` documents of the demo corpus's ``web`` text (what :func:`train_bpe` learns from)."""
    out: list[str] = []
    for f in sorted((Path(data_dir) / "web").glob("*.parquet")):
        out += pq.read_table(f, columns=["text"]).column(0).to_pylist()[: max_docs - len(out)]
        if len(out) >= max_docs:
            break
    return out


def demo_plan(data_dir: str | os.PathLike, **overrides) -> Plan:
    """The demo plan (``pipelines/demo.yaml`` holds the same) pointed at ``data_dir``.

    ``overrides`` replace top-level sections, e.g. ``topology={"dp": 2, ...}``.
    """
    import yaml

    data = _with_sections(yaml.safe_load(PLAN_FILE.read_text()), overrides)
    return plan_from_dict(data, where=str(PLAN_FILE), base_dir=Path(data_dir).resolve())


def example_plan(name: str, data_dir: str | os.PathLike, **overrides) -> Plan:
    """An example plan of ``pipelines/`` (``demo``, ``curriculum``, ``long_context``,
    ``multimodal``, ``photos``, ...), shipped in the package, pointed at the demo corpus in
    ``data_dir`` (its ``../demo-data`` URLs rebased); ``overrides`` as for :func:`demo_plan`."""
    from importlib import resources

    import yaml

    res = resources.files("overlord_dask").joinpath("pipelines", f"{name}.yaml")
    if not res.is_file():
        names = sorted(
            p.name.removesuffix(".yaml")
            for p in resources.files("overlord_dask").joinpath("pipelines").iterdir()
            if p.name.endswith(".yaml")
        )
        raise ValueError(f"no example plan {name!r}; the examples: {names}")
    data = yaml.safe_load(res.read_text())
    root = str(Path(data_dir).resolve())
    for s in data.get("sources", []):
        if s.get("url", "").startswith("../demo-data"):
            s["url"] = root + s["url"][len("../demo-data") :]
    return plan_from_dict(_with_sections(data, overrides), where=f"pipelines/{name}.yaml", base_dir=root)


def _with_sections(data: dict, sections: dict) -> dict:
    """Plan data with top-level ``sections`` set: a dict merges into the section it names
    (``topology={"dp": 2}`` keeps the other topology fields), anything else replaces it."""
    for k, v in sections.items():
        data[k] = {**data[k], **v} if isinstance(v, dict) and isinstance(data.get(k), dict) else v
    return data


__all__ = [
    "demo_plan",
    "demo_texts",
    "example_plan",
    "generate_demo_corpus",
    "generate_text_sources",
    "load_plan",
    "text_sources_plan",
    "train_bpe",
]
