"""Chat / SFT data (issue "Real tokenizers, chat/SFT data and real image inputs"): conversations
rendered with the tokenizer's chat template, only assistant turns trained; the mask checked token
for token against ``transformers``' ``apply_chat_template(..., return_assistant_tokens_mask=True)``
on the loader, through packing, split documents, context-parallel slices and the wire, and in the
step's loss-token count."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from overlord_dask import Service, connect
from overlord_dask.errors import SourceError
from overlord_dask.plan import plan_from_dict
from overlord_dask.service.chat_demo import (
    PLAIN_CHAT_TEMPLATE,
    conversation,
    generate_chat_corpus,
    llama3_style_tokenizer,
)
from overlord_dask.sources import discover_units, read_unit
from tests.harness import run_ranks

MSG = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return llama3_style_tokenizer(tmp_path_factory.mktemp("tok") / "llama3")


@pytest.fixture(scope="module")
def hf(llama3):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(llama3), local_files_only=True)


def reference(hf, messages) -> tuple[list[int], list[int]]:
    out = hf.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


def _plan(tmp_path, llama3, sources, **top):
    return plan_from_dict(
        {
            "sources": sources,
            "tokenizer": str(llama3),
            "topology": {"dp": 1, "tokens_per_micro_batch": 1024, **top.pop("topology", {})},
            "loading": {"unit_rows": 40},
            **top,
        },
        base_dir=tmp_path,
    )


def _load(plan, i=0):
    src = plan.sources[i]
    loaded = [read_unit(src, plan, u) for u in discover_units(src, plan)]
    return [ld.block for ld in loaded], sum(ld.dropped for ld in loaded)


@pytest.mark.parametrize("template", ["generation blocks", "plain"])
def test_chat_records_are_masked_as_transformers_masks_them(tmp_path, llama3, hf, template):
    rng = np.random.default_rng(3)
    convs = [conversation(rng) for _ in range(60)]
    pq.write_table(pa.table({"messages": pa.array(convs, MSG)}), tmp_path / "c.parquet", row_group_size=25)
    tok = (
        {"path": str(llama3)}
        if template == "generation blocks"
        else {"path": str(llama3), "chat_template": PLAIN_CHAT_TEMPLATE}
    )
    plan = _plan(
        tmp_path,
        llama3,
        [{"name": "chat", "format": "parquet", "url": "c.parquet", "messages_field": "messages", "tokenizer": tok}],
    )
    blocks, dropped = _load(plan)
    assert dropped == 0
    docs = [
        (b.doc(i).tolist(), b.loss_mask[b.offsets[i] : b.offsets[i + 1]].tolist())
        for b in blocks
        for i in range(len(b))
    ]
    assert docs == [reference(hf, c) for c in convs]
    assert all(d[0][0] == hf.bos_token_id for d in docs)  # the template writes BOS; no second one, no EOS added


def test_roles_to_train_on_are_configurable(tmp_path, llama3, hf):
    convs = [
        [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": "the cat"},
            {"role": "assistant", "content": "sat"},
        ]
    ]
    pq.write_table(pa.table({"messages": pa.array(convs, MSG)}), tmp_path / "c.parquet")
    plan = _plan(
        tmp_path,
        llama3,
        [
            {
                "name": "chat",
                "format": "parquet",
                "url": "c.parquet",
                "messages_field": "messages",
                "train_roles": ["user", "assistant"],
            }
        ],
    )
    (block,), _ = _load(plan)
    ids, mask = block.tokens.tolist(), block.loss_mask.tolist()
    trained = hf.decode([t for t, m in zip(ids, mask) if m])
    assert trained == "the cat<|eot_id|>sat<|eot_id|>"  # the user turn too; headers and the system prompt never


def test_pre_tokenized_labels_and_masks(tmp_path, llama3):
    ids = [[5, 6, 7, 8], [9, 10]]
    pq.write_table(
        pa.table({"ids": ids, "labels": [[-100, -100, 7, 8], [-100, 10]], "m": [[0, 1, 1, 0], [1, 1]]}),
        tmp_path / "t.parquet",
    )
    base = {"name": "t", "format": "parquet", "url": "t.parquet", "tokens_field": "ids"}
    (b,), _ = _load(_plan(tmp_path, llama3, [{**base, "labels_field": "labels"}]))
    assert b.loss_mask.tolist() == [0, 0, 1, 1, 0, 1]
    (b,), _ = _load(_plan(tmp_path, llama3, [{**base, "loss_mask_field": "m"}]))
    assert b.loss_mask.tolist() == [0, 1, 1, 0, 1, 1]
    pq.write_table(pa.table({"ids": ids, "labels": [[-100, 3, 7, 8], [-100, 10]]}), tmp_path / "t.parquet")
    with pytest.raises(
        SourceError, match=r"source 't': .*row 0: label 3 at token 1 is neither -100 nor the token \(6\)"
    ):
        _load(_plan(tmp_path, llama3, [{**base, "labels_field": "labels"}]))


def test_bad_conversations_name_their_record_or_are_dropped(tmp_path, llama3):
    convs = [
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}],
        [{"role": "user", "content": "hi"}, {"role": "robot", "content": "beep"}],
        [{"role": "user", "content": "only a question"}],
        [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok"}],
    ]
    pq.write_table(pa.table({"messages": pa.array(convs, MSG)}), tmp_path / "c.parquet")
    src = {"name": "chat", "format": "parquet", "url": "c.parquet", "messages_field": "messages"}
    with pytest.raises(
        SourceError,
        match=r"source 'chat' unit 0 \(.*c\.parquet.*\): record 1 \(sample id 1\): message 1 has role 'robot', "
        r"not one of \['system', 'user', 'assistant', 'tool'\]",
    ):
        _load(_plan(tmp_path, llama3, [src]))
    blocks, dropped = _load(_plan(tmp_path, llama3, [{**src, "on_bad_record": "drop"}]))
    assert dropped == 2 and blocks[0].lengths().tolist()[1:3] == [0, 0] and min(blocks[0].lengths()[[0, 3]]) > 0
    pq.write_table(pa.table({"messages": pa.array(convs[2:3], MSG)}), tmp_path / "c.parquet")
    with pytest.raises(
        SourceError, match=r"record 0 \(sample id 0\): no turn to train on \(no message of roles \['assistant'\]\)"
    ):
        _load(_plan(tmp_path, llama3, [src]))
    # a tokenizer without a chat template: the plan field that fixes it
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "tokenizer.json").write_text((llama3 / "tokenizer.json").read_text())
    (bare / "tokenizer_config.json").write_text('{"eos_token": "<|end_of_text|>"}')
    with pytest.raises(
        SourceError,
        match=r"source 'chat': tokenizer '.*bare' has no chat template .*set tokenizer.chat_template in the plan",
    ):
        _load(_plan(tmp_path, llama3, [{**src, "tokenizer": str(bare)}]))
    with pytest.raises(
        SourceError, match=r"messages_field 'text' in .* has type string, expected a list of \{role, content\} messages"
    ):
        pq.write_table(pa.table({"text": ["x"]}), tmp_path / "c.parquet")
        _load(_plan(tmp_path, llama3, [{**src, "messages_field": "text"}]))


def _chat_and_text(tmp_path, llama3, **topology):
    chat_dir = generate_chat_corpus(tmp_path, n=240, files=2, seed=5, words=(3, 60))
    rng = np.random.default_rng(0)
    pq.write_table(
        pa.table({"text": [" ".join(["the cat sat on a mat"] * int(rng.integers(1, 30))) for _ in range(400)]}),
        tmp_path / "web.parquet",
    )
    plan = _plan(
        tmp_path,
        llama3,
        [
            {"name": "chat", "format": "parquet", "url": "chat/*.parquet", "messages_field": "messages", "weight": 2},
            {"name": "web", "format": "parquet", "url": "web.parquet", "text_field": "text"},
        ],
        topology={"dp": 2, "micro_batches": 2, "tokens_per_micro_batch": 512, "max_doc_tokens": 96, **topology},
    )
    convs = [c for f in sorted(chat_dir.glob("*.parquet")) for c in pq.read_table(f).column("messages").to_pylist()]
    return plan, convs


def _expected_label(ref, sample, pos) -> int:
    """The shifted label of document position ``pos``: the next token where it is a target."""
    ids, mask = ref[sample]
    return ids[pos + 1] if pos + 1 < len(ids) and mask[pos + 1] else -100


@pytest.mark.integration
def test_masks_travel_through_packing_splits_and_the_wire(cluster, tmp_path, llama3, hf):
    """Chat and plain text mixed, documents split across micro-batches: every label of every chat
    piece is the reference's (-100 on every masked target), text pieces are all trained, and
    step_loss_tokens counts the labels that are not -100 over the whole step, in both conventions."""
    plan, convs = _chat_and_text(tmp_path, llama3)
    ref = [tuple(reference(hf, c)) for c in [[{k: v for k, v in m.items() if v is not None} for m in c] for c in convs]]
    dp, steps, got = 2, 10, {}
    with Service.start(plan, cluster=cluster) as service:

        def consume(key):
            rank, conv = key
            opts = {"loss_mask": True} if conv == "shifted" else {"labels": "hf"}
            with connect(service.address, rank, dp, replica=0 if conv == "shifted" else 1, timeout=120, **opts) as s:
                for _ in range(steps):
                    b = s.next_batch()
                    got[(rank, conv, b["step"])] = b["micro_batches"]
                s.commit()

        run_ranks(consume, [(r, c) for r in range(dp) for c in ("shifted", "hf")])
        assert service.status()["failure"] is None
    chat_pieces = masked = 0
    for step in range(steps):
        counts = {"shifted": 0, "hf": 0}
        for rank in range(dp):
            for ma, mh in zip(got[(rank, "shifted", step)], got[(rank, "hf", step)]):
                cu = ma["cu_seqlens"].astype(int)
                for k in range(len(cu) - 1):
                    a, b = cu[k], cu[k + 1]
                    start = int(ma["piece_starts"][k])
                    if ma["source_ids"][k] != 0:
                        assert (ma["labels"][a : b - 1] != -100).all()
                        continue
                    chat_pieces += 1
                    sample = int(ma["sample_ids"][k])
                    assert ma["input_ids"][a:b].tolist() == ref[sample][0][start : start + b - a]
                    want = [_expected_label(ref, sample, start + i) for i in range(b - a)]
                    assert ma["labels"][a:b].tolist() == want
                    masked += want.count(-100)
                    hf_want = [-100] + [
                        ref[sample][0][start + i] if ref[sample][1][start + i] else -100 for i in range(1, b - a)
                    ]
                    assert mh["labels"][a:b].tolist() == hf_want
                np.testing.assert_array_equal(ma["loss_mask"], (ma["labels"] != -100).astype(np.float32))
                np.testing.assert_array_equal(
                    mh["loss_mask"], (mh["labels"] != -100).astype(np.float32)
                )  # a masked plan: by default
                counts["shifted"] += int((ma["labels"] != -100).sum())
                counts["hf"] += int((mh["labels"] != -100).sum())
        for rank in range(dp):
            assert all(mb["step_loss_tokens"] == counts["shifted"] for mb in got[(rank, "shifted", step)]), step
            assert all(mb["step_loss_tokens"] == counts["hf"] for mb in got[(rank, "hf", step)]), step
    assert chat_pieces > 20 and masked > 100


@pytest.mark.integration
def test_masks_survive_context_parallel_slices(cluster, tmp_path, llama3, hf):
    plan, convs = _chat_and_text(tmp_path, llama3, cp=2, cp_min_tokens=8)
    ref = [tuple(reference(hf, c)) for c in [[{k: v for k, v in m.items() if v is not None} for m in c] for c in convs]]
    dp, steps, got = 2, 6, {}
    with Service.start(plan, cluster=cluster) as service:

        def consume(key):
            rank, cp_rank = key
            with connect(service.address, rank, dp, cp_rank=cp_rank, timeout=120) as s:
                got[key] = [s.next_batch() for _ in range(steps)]
                s.commit()

        run_ranks(consume, [(r, c) for r in range(dp) for c in range(2)])
    checked = 0
    for batches in got.values():
        for batch in batches:
            for sl in batch["micro_batches"]:
                cu = sl["cu_seqlens"].astype(int)
                for j in range(len(cu) - 1):
                    piece = int(sl["seg_piece"][j])
                    if sl["source_ids"][piece] != 0:
                        continue
                    sample, start = int(sl["sample_ids"][piece]), int(sl["piece_starts"][piece])
                    for t in range(cu[j], cu[j + 1]):
                        pos = start + int(sl["position_ids"][t])
                        assert sl["input_ids"][t] == ref[sample][0][pos]
                        assert sl["labels"][t] == _expected_label(ref, sample, pos)
                        checked += 1
    assert checked > 500


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["jsonl.zst", "arrow", "webdataset"])
def test_chat_records_read_alike_from_every_record_format(tmp_path, llama3, fmt):
    """The same conversations as jsonl.zst lines, an HF save_to_disk folder, or webdataset shards
    (a ``json`` member per sample) give the blocks parquet gives."""
    import json

    from overlord_dask.testing.format_corpus import write

    rng = np.random.default_rng(9)
    convs = [conversation(rng) for _ in range(50)]
    pq.write_table(pa.table({"messages": pa.array(convs, MSG)}), tmp_path / "c.parquet")
    want, _ = _load(
        _plan(
            tmp_path, llama3, [{"name": "chat", "format": "parquet", "url": "c.parquet", "messages_field": "messages"}]
        )
    )
    if fmt == "webdataset":
        import webdataset as wds

        (tmp_path / "wds").mkdir()
        with wds.TarWriter(str(tmp_path / "wds" / "shard-000.tar")) as w:
            for i, c in enumerate(convs):
                w.write({"__key__": f"{i:06d}", "json": json.dumps({"messages": c})})
        src = {"format": "webdataset", "url": "wds/shard-000.tar", "messages_field": "json"}
    else:
        url = write(tmp_path, [{"id": i, "messages": c} for i, c in enumerate(convs)], fmt, files=2)
        src = {
            "format": fmt.split(".")[0],
            "url": url + ("/*.jsonl.zst" if fmt == "jsonl.zst" else ""),
            "messages_field": "messages",
        }
    got, _ = _load(_plan(tmp_path, llama3, [{"name": "chat", **src}]))

    def flat(blocks):
        return [b.doc(i).tolist() for b in blocks for i in range(len(b))], np.concatenate(
            [b.loss_mask for b in blocks]
        ).tolist()

    assert flat(got) == flat(want)


@pytest.mark.parametrize("backend", ["transformers", "byte", "callable"])
def test_other_backends_mask_the_same_characters(tmp_path, llama3, backend):
    """transformers (fast: character offsets), the byte tokenizer (byte offsets) and a function
    (no offsets: encoded span by span) train on the same characters of each conversation."""
    rng = np.random.default_rng(4)
    convs = [conversation(rng) for _ in range(20)]
    pq.write_table(pa.table({"messages": pa.array(convs, MSG)}), tmp_path / "c.parquet")
    ref, _ = _load(
        _plan(
            tmp_path, llama3, [{"name": "chat", "format": "parquet", "url": "c.parquet", "messages_field": "messages"}]
        )
    )
    tok = {
        "transformers": {"path": str(llama3), "backend": "transformers"},
        "byte": {"path": "byte"},
        "callable": {"path": "tests.test_tokenizers:shifted_bytes", "kwargs": {"shift": 3}, "eos_id": 2},
    }[backend]
    if backend != "transformers":
        import json

        tok["chat_template"] = json.loads((llama3 / "tokenizer_config.json").read_text())["chat_template"]
    got, _ = _load(
        _plan(
            tmp_path,
            llama3,
            [{"name": "chat", "format": "parquet", "url": "c.parquet", "messages_field": "messages", "tokenizer": tok}],
        )
    )
    from tokenizers import Tokenizer

    rt = Tokenizer.from_file(str(llama3 / "tokenizer.json"))

    def trained_text(blocks, decode):
        return [
            decode([t for t, m in zip(b.doc(i).tolist(), b.loss_mask[b.offsets[i] : b.offsets[i + 1]].tolist()) if m])
            for b in blocks
            for i in range(len(b))
        ]

    want = trained_text(ref, lambda ids: rt.decode(ids, skip_special_tokens=False))
    if backend == "transformers":
        assert trained_text(got, lambda ids: rt.decode(ids, skip_special_tokens=False)) == want
    else:
        assert trained_text(got, lambda ids: bytes(i - 3 for i in ids).decode()) == want  # both shift bytes by 3
