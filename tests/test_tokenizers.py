"""The model's own tokenizer (issue "Real tokenizers, chat/SFT data and real image inputs"):
folders and files as users have them, special ids from their config, the boundary policy per
source, tiktoken, transformers and callables with arguments; every document checked against the
tokenizer library itself."""

from __future__ import annotations

import base64
import json

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord_dask.errors import PlanError, SourceError
from overlord_dask.plan import plan_from_dict
from overlord_dask.service.chat_demo import llama3_style_tokenizer
from overlord_dask.sources import discover_units, load_unit
from overlord_dask.sources.tokenizers import load_tokenizer

TEXTS = ["the cat sat on the mat", "", "data loaders stream packed batches", None, "日本 ému"]


class Upper:
    """A tokenizer class with arguments: built once per worker, called with the texts."""

    eos_token_id = 1

    def __init__(self, offset: int):
        self.offset = offset

    def __call__(self, texts):
        return [[ord(c) % 100 + self.offset for c in t.upper()] for t in texts]


def shifted_bytes(texts, shift: int):
    return [[b + shift for b in t.encode()] for t in texts]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return llama3_style_tokenizer(tmp_path_factory.mktemp("tok") / "llama3")


def _docs(tmp_path, texts=TEXTS, **src) -> list[list[int]]:
    pq.write_table(pa.table({"text": pa.array(texts, pa.string())}), tmp_path / "t.parquet", row_group_size=2)
    tok = src.pop("plan_tokenizer", None)
    plan = plan_from_dict(
        {
            "sources": [{"name": "s", "format": "parquet", "url": "t.parquet", "text_field": "text", **src}],
            **({"tokenizer": tok} if tok is not None else {}),
            "topology": {"dp": 1, "tokens_per_micro_batch": 1024},
            "loading": {"unit_rows": 2},
        },
        base_dir=tmp_path,
    )
    blocks = [load_unit(plan.sources[0], plan, u) for u in discover_units(plan.sources[0], plan)]
    return [b.doc(i).tolist() for b in blocks for i in range(len(b))]


def test_a_llama3_style_folder_gives_bos_and_eos_from_its_config(tmp_path, llama3):
    """The folder as save_pretrained writes it: BOS because its post-processor adds one, EOS from
    tokenizer_config.json; every document begins and ends as the tokenizers library says."""
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(llama3 / "tokenizer.json"))
    bos, eos = ref.token_to_id("<|begin_of_text|>"), ref.token_to_id("<|end_of_text|>")
    want = [[bos] + ref.encode(t or "", add_special_tokens=False).ids + [eos] for t in TEXTS]
    assert _docs(tmp_path, tokenizer=str(llama3)) == want
    assert (
        _docs(tmp_path, plan_tokenizer=str(llama3 / "tokenizer.json")) == want
    )  # the file: its folder's config is read
    assert _docs(tmp_path, plan_tokenizer=f"hf:{llama3}/tokenizer.json") == want
    # the boundary policy per source, and the plan's overrides of the config
    assert _docs(tmp_path, tokenizer=str(llama3), add_bos=False) == [d[1:] for d in want]
    eot = ref.token_to_id("<|eot_id|>")
    assert _docs(tmp_path, tokenizer={"path": str(llama3), "eos_token": "<|eot_id|>"}, add_bos=False) == [
        d[1:-1] + [eot] for d in want
    ]
    assert _docs(tmp_path, tokenizer={"path": str(llama3), "add_bos": False, "add_eos": False}) == [
        d[1:-1] for d in want
    ]
    # transformers.AutoTokenizer on the same folder: the same ids, the same boundaries
    assert _docs(tmp_path, tokenizer={"path": str(llama3), "backend": "transformers"}) == want
    loaded = load_tokenizer(str(llama3))
    assert (loaded.bos_id, loaded.eos_id, loaded.pad_id, loaded.image_id) == (bos, eos, eos, ref.token_to_id("<image>"))


def test_a_tokenizer_without_an_end_of_document_token_is_an_error_naming_the_fix(tmp_path, llama3):
    folder = tmp_path / "noeos"
    folder.mkdir()
    (folder / "tokenizer.json").write_text((llama3 / "tokenizer.json").read_text())
    with pytest.raises(
        SourceError,
        match=r"source 's': cannot determine the end-of-document token of tokenizer '.*noeos'.*"
        r"set tokenizer.eos_token or tokenizer.eos_id in the plan, or add_eos: false on the source",
    ):
        _docs(tmp_path, tokenizer=str(folder))
    assert _docs(tmp_path, tokenizer={"path": str(folder), "eos_token": "<|end_of_text|>"})[0][-1] == 1
    with pytest.raises(
        SourceError, match=r"tokenizer '.*noeos' has no token '</eos>' \(tokenizer.eos_token in the plan\)"
    ):
        _docs(tmp_path, tokenizer={"path": str(folder), "eos_token": "</eos>"})


def test_tiktoken_ranks_file_with_its_special_tokens(tmp_path):
    """A local tiktoken ranks file (as Llama 3 ships ``tokenizer.model``), its split pattern and
    special tokens from the plan: ids equal tiktoken's own, with the EOS the plan names."""
    import tiktoken

    ranks = {bytes([b]): b for b in range(256)}
    for i, merge in enumerate([b"th", b"the", b"at", b" the", b"ca", b"cat"]):
        ranks[merge] = 256 + i
    (tmp_path / "tok.tiktoken").write_text("".join(f"{base64.b64encode(k).decode()} {v}\n" for k, v in ranks.items()))
    specials = {"<|begin_of_text|>": 300, "<|end_of_text|>": 301}
    spec = {"path": "tiktoken:tok.tiktoken", "kwargs": {"special_tokens": specials}, "eos_token": "<|end_of_text|>"}
    got = _docs(tmp_path, tokenizer=spec)
    from overlord_dask.sources.tokenizers import LLAMA3_PATTERN

    enc = tiktoken.Encoding("t", pat_str=LLAMA3_PATTERN, mergeable_ranks=ranks, special_tokens=specials)
    assert got == [enc.encode(t or "") + [301] for t in TEXTS]
    with pytest.raises(
        SourceError, match="cannot determine the end-of-document token of tokenizer 'tiktoken:tok.tiktoken'"
    ):
        _docs(tmp_path, tokenizer={k: v for k, v in spec.items() if k != "eos_token"})


def test_callable_tokenizers_take_arguments_from_the_plan(tmp_path):
    assert _docs(
        tmp_path, tokenizer={"path": "tests.test_tokenizers:shifted_bytes", "kwargs": {"shift": 10}, "eos_id": 2}
    ) == [[b + 10 for b in (t or "").encode()] + [2] for t in TEXTS]
    assert _docs(tmp_path, tokenizer={"path": "tests.test_tokenizers:Upper", "kwargs": {"offset": 5}}) == [
        [ord(c) % 100 + 5 for c in (t or "").upper()] + [1] for t in TEXTS
    ]  # the class says its EOS
    with pytest.raises(PlanError, match="cannot import 'tests.test_tokenizers:nope'"):
        _docs(tmp_path, tokenizer="tests.test_tokenizers:nope")


@pytest.mark.integration
def test_the_plan_tokenizer_pads_the_micro_batches(cluster, tmp_path, llama3):
    """Padding is the plan tokenizer's pad id (its EOS, when it declares no pad), on the wire too."""
    from overlord_dask import Service, connect

    pq.write_table(
        pa.table({"text": [f"the cat sat on mat {i} " * (1 + i % 7) for i in range(300)]}), tmp_path / "t.parquet"
    )
    plan = plan_from_dict(
        {
            "sources": [{"name": "s", "format": "parquet", "url": "t.parquet", "text_field": "text"}],
            "tokenizer": {"path": str(llama3), "pad_id": 7},
            "topology": {"dp": 1, "tokens_per_micro_batch": 512},
        },
        base_dir=tmp_path,
    )
    with Service.start(plan, cluster=cluster) as service, connect(service.address, 0, 1, timeout=60) as s:
        mb = s.next_batch()["micro_batches"][0]
        n = int(mb["num_tokens"])
        assert n < len(mb["input_ids"]) and (mb["input_ids"][n:] == 7).all()
        assert mb["input_ids"][0] == 0  # BOS of the first document
        s.commit()


def test_tokenizer_shorthands_resolve_to_their_backends():
    from overlord_dask.plan.text import Tokenizer

    kinds = {
        p: Tokenizer.model_validate(p).kind
        for p in [
            "byte",
            "./llama3",
            "hf:tok.json",
            "tiktoken:cl100k_base",
            "os.path:join",
            "s3://bucket/tok",
            "C:/tok",
        ]
    }
    assert kinds == {
        "byte": "byte",
        "./llama3": "auto",
        "hf:tok.json": "tokenizers",
        "tiktoken:cl100k_base": "tiktoken",
        "os.path:join": "callable",
        "s3://bucket/tok": "auto",
        "C:/tok": "auto",
    }
    assert json.loads(Tokenizer.model_validate("byte").model_dump_json())["path"] == "byte"


@pytest.mark.integration
def test_plan_local_code_reaches_the_workers_without_an_install(cluster, tmp_path):
    """A tokenizer module and a prepare package next to the plan file: importable where the plan
    is loaded, uploaded to the scheduler and the workers by the service (the plan's folder is
    gone from under them once the service has started)."""
    from overlord_dask import Service, connect
    from overlord_dask.plan import load_plan

    code, data = tmp_path / "plan", tmp_path / "data"
    (code / "localprep_pkg").mkdir(parents=True)
    data.mkdir()
    (code / "localtok_mod.py").write_text(
        "def encode(texts, shift):\n    return [[b + shift for b in t.encode()] for t in texts]\n"
    )
    (code / "localprep_pkg" / "__init__.py").write_text("")
    (code / "localprep_pkg" / "steps.py").write_text(
        "def upper(rec):\n    return {**rec, 'text': rec['text'].upper()}\n"
    )
    pq.write_table(pa.table({"text": [f"doc {i} " * (1 + i % 5) for i in range(200)]}), data / "t.parquet")
    (code / "plan.yaml").write_text(
        "sources:\n"
        f"  - {{name: s, format: parquet, url: {data / 't.parquet'}, text_field: text,\n"
        "     tokenizer: {path: 'localtok_mod:encode', kwargs: {shift: 4}, eos_id: 2},\n"
        "     prepare: [{record: 'localprep_pkg.steps:upper'}]}\n"
        "topology: {dp: 1, tokens_per_micro_batch: 256}\n"
    )
    plan = load_plan(code / "plan.yaml")
    with Service.start(plan, cluster=cluster) as service:
        import shutil

        shutil.rmtree(code)
        with connect(service.address, 0, 1, timeout=60) as s:
            mb = s.next_batch()["micro_batches"][0]
            first = mb["input_ids"][: int(mb["cu_seqlens"][1])].tolist()
            s.commit()
        assert service.status()["failure"] is None
    assert bytes(t - 4 for t in first[:-1]).decode().startswith("DOC ") and first[-1] == 2


def truncate(block, keep: int):
    from overlord_dask.sources.blocks import SampleBlock

    lens = np.minimum(block.lengths(), keep)
    docs = [block.doc(i)[:k] for i, k in enumerate(lens)]
    return SampleBlock(block.source, np.concatenate(docs), np.concatenate([[0], np.cumsum(lens)]), block.sample_ids)


def test_a_transform_takes_arguments_from_the_plan(tmp_path):
    docs = _docs(tmp_path, transform="tests.test_tokenizers:truncate", transform_kwargs={"keep": 3})
    assert docs == [
        ([b + 3 for b in (t or "").encode()] + [2])[:3] for t in TEXTS
    ]  # the byte tokenizer's documents, cut to 3


def _boundaries_by_two_insertions(tokens, offsets, bos, eos, mask):
    """What add_boundaries computed before it did one pass: int64 ids, BOS then EOS inserted."""
    n = len(offsets) - 1
    tokens = np.asarray(tokens, dtype=np.int64)
    if bos is not None:
        tokens = np.insert(tokens, offsets[:-1], bos)
        mask = None if mask is None else np.insert(mask, offsets[:-1], np.uint8(0))
        offsets = offsets + np.arange(n + 1)
    if eos is not None:
        tokens = np.insert(tokens, offsets[1:], eos)
        mask = None if mask is None else np.insert(mask, offsets[1:], np.uint8(1))
        offsets = offsets + np.arange(n + 1)
    return tokens, offsets, mask


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.uint8, np.int64])
@pytest.mark.parametrize("bos,eos", [(1, 2), (None, 2), (1, None), (1, 300)])
def test_boundaries_are_added_in_one_pass_in_the_ids_own_dtype(dtype, bos, eos):
    from overlord_dask.sources.tokenizers import add_boundaries

    rng = np.random.default_rng(0)
    lengths = np.array([3, 0, 5, 0, 0, 1, 7])  # empty documents get their BOS and EOS too, in order
    offsets = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    tokens = rng.integers(3, 250, offsets[-1]).astype(dtype)
    mask = rng.integers(0, 2, offsets[-1]).astype(np.uint8)
    got, got_offsets, got_mask, got_positions = add_boundaries(tokens, offsets, bos, eos, mask, np.array([0, 2]))
    want, want_offsets, want_mask = _boundaries_by_two_insertions(tokens, offsets, bos, eos, mask)
    assert got.tolist() == want.tolist() and got_offsets.tolist() == want_offsets.tolist()
    assert got_mask.tolist() == want_mask.tolist()
    assert got_positions.tolist() == ([1, 3] if bos is not None else [0, 2])  # image positions move past a BOS
    fits = max(v for v in (bos, eos) if v is not None) <= np.iinfo(dtype).max
    assert got.dtype == (np.dtype(dtype) if fits else np.dtype(np.int64))  # no copy to int64 where the ids fit
