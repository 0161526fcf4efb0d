"""Real image inputs (issue "Real tokenizers, chat/SFT data and real image inputs"): ``<image>``
placeholders in the text expanded after tokenization to each image's patch tokens, any-resolution
tiling that keeps the aspect ratio, normalisation, a Hugging Face image processor folder; patches
stay with their placeholders through splits and context-parallel slices."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from overlord_dask import Service, connect
from overlord_dask.errors import SourceError
from overlord_dask.plan import plan_from_dict
from overlord_dask.service.chat_demo import llama3_style_tokenizer
from overlord_dask.sources import discover_units, read_unit
from overlord_dask.sources.images import best_grid, patchify
from tests.harness import run_ranks

MEAN, STD = [0.48, 0.46, 0.41], [0.27, 0.26, 0.28]


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return llama3_style_tokenizer(tmp_path_factory.mktemp("tok") / "llama3")


def _png(rng, w: int, h: int) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(buf, format="PNG")
    return buf.getvalue()


def _records(tmp_path, n=40, seed=0, bad=None):
    rng = np.random.default_rng(seed)
    texts, images = [], []
    for _ in range(n):
        k = int(rng.integers(0, 3))
        words = ["the cat sat"] * int(rng.integers(1, 12))
        for _ in range(k):
            words.insert(int(rng.integers(0, len(words) + 1)), "<image>")
        texts.append(" ".join(words))
        images.append([_png(rng, int(rng.integers(20, 90)), int(rng.integers(20, 90))) for _ in range(k)])
    if bad is not None:
        texts[bad] += " <image>"  # one placeholder more than images
    pq.write_table(
        pa.table({"text": texts, "images": pa.array(images, pa.list_(pa.binary()))}),
        tmp_path / "p.parquet",
        row_group_size=20,
    )
    return texts, images


def _plan(tmp_path, llama3, **src):
    source = {
        "name": "img",
        "format": "parquet",
        "url": "p.parquet",
        "text_field": "text",
        "images_field": "images",
        "image_placeholders": True,
        "image_size": 16,
        "patch_size": 8,
        **src,
    }
    topo = src.pop("topology", None)
    source.pop("topology", None)
    return plan_from_dict(
        {
            "sources": [source],
            "tokenizer": str(llama3),
            "topology": topo or {"dp": 1, "tokens_per_micro_batch": 4096},
            "loading": {"unit_rows": 20},
        },
        base_dir=tmp_path,
    )


def _blocks(plan):
    src = plan.sources[0]
    out = [read_unit(src, plan, u) for u in discover_units(src, plan)]
    return [o.block for o in out], sum(o.dropped for o in out)


def _reference_tiles(data: bytes, size: int, tiles: int) -> list[np.ndarray]:
    """Independent any-resolution tiling: the thumbnail, then the grid's tiles, normalised."""
    img = Image.open(io.BytesIO(data)).convert("RGB")
    out = [np.asarray(img.resize((size, size), Image.BICUBIC))]
    cols, rows = best_grid(img.width, img.height, tiles, size)
    if (cols, rows) != (1, 1):
        W, H = cols * size, rows * size
        s = min(W / img.width, H / img.height)
        nw, nh = max(1, round(img.width * s)), max(1, round(img.height * s))
        canvas = Image.new("RGB", (W, H))
        canvas.paste(img.resize((nw, nh), Image.BICUBIC), ((W - nw) // 2, (H - nh) // 2))
        grid = np.asarray(canvas)
        out += [grid[r * size : (r + 1) * size, c * size : (c + 1) * size] for r in range(rows) for c in range(cols)]
    return [((t / 255.0 - np.array(MEAN)) / np.array(STD)).astype(np.float16) for t in out]


def test_placeholders_expand_to_tiled_normalised_patches(tmp_path, llama3):
    texts, images = _records(tmp_path)
    plan = _plan(tmp_path, llama3, image_tiles=4, image_mean=MEAN, image_std=STD)
    blocks, dropped = _blocks(plan)
    from tokenizers import Tokenizer

    ref = Tokenizer.from_file(str(llama3 / "tokenizer.json"))
    image_id = ref.token_to_id("<image>")
    bos, eos = ref.token_to_id("<|begin_of_text|>"), ref.token_to_id("<|end_of_text|>")
    assert dropped == 0
    row = 0
    for b in blocks:
        assert b.images.dtype == np.float16
        for d in range(len(b)):
            doc = b.doc(d).tolist()
            patches = [_reference_tiles(x, 16, 4) for x in images[row]]
            # the text without placeholders, each image's patch tokens where its placeholder was
            want, pieces = [bos], texts[row].split("<image>")
            for k, piece in enumerate(pieces):
                want += ref.encode(piece, add_special_tokens=False).ids if piece else []
                if k < len(pieces) - 1:
                    want += [image_id] * sum(len(patchify(t, 8)) for t in patches[k])
            want += [eos]
            assert doc == want  # added tokens split the text before the BPE: the pieces encode on their own
            got_imgs = range(b.image_offsets[d], b.image_offsets[d + 1])
            for k, j in enumerate(got_imgs):
                mine = b.images[b.image_patches[j] : b.image_patches[j + 1]]
                np.testing.assert_allclose(
                    mine.astype(np.float32),
                    np.concatenate([patchify(t, 8) for t in patches[k]]).astype(np.float32),
                    atol=2e-2,
                )
                s = int(b.image_starts[j])
                assert doc[s : s + len(mine)] == [image_id] * len(mine)
            row += 1
    assert row == len(texts)
    # aspect ratio decides the grid: a wide image gets more columns than rows
    assert (
        best_grid(200, 50, 4, 16) == (4, 1)
        and best_grid(50, 200, 4, 16) == (1, 4)
        and best_grid(60, 60, 4, 16) == (2, 2)
    )


def test_a_count_of_placeholders_unlike_the_images_names_the_record_or_is_dropped(tmp_path, llama3):
    _records(tmp_path, bad=5)
    with pytest.raises(
        SourceError,
        match=r"source 'img' unit 0 \(.*p\.parquet.*record 5 \(sample id 5\): the record has \d images but \d "
        r"'<image>' placeholders",
    ):
        _blocks(_plan(tmp_path, llama3))
    blocks, dropped = _blocks(_plan(tmp_path, llama3, on_bad_record="drop"))
    assert dropped == 1 and blocks[0].lengths()[5] == 0 and blocks[0].image_offsets[6] == blocks[0].image_offsets[5]


def test_a_hugging_face_image_processor_folder(tmp_path, llama3):
    """LLaVA-NeXT's any-resolution processor, saved as a folder, does the decoding, tiling and
    normalising; its tiles are cut into patches."""
    from transformers.models.llava_next.image_processing_pil_llava_next import LlavaNextImageProcessorPil

    proc = LlavaNextImageProcessorPil(
        size={"shortest_edge": 16},
        crop_size={"height": 16, "width": 16},
        image_grid_pinpoints=[[16, 32], [32, 16], [32, 32]],
    )
    proc.save_pretrained(tmp_path / "proc")
    texts, images = _records(tmp_path, n=20)
    blocks, _ = _blocks(_plan(tmp_path, llama3, image_processor="proc"))
    b = blocks[0]
    j = 0
    for d in range(len(b)):
        for x in images[d]:
            px = np.asarray(
                proc(images=[Image.open(io.BytesIO(x)).convert("RGB")], return_tensors="np")["pixel_values"]
            )[0]
            want = np.concatenate([patchify(t.transpose(1, 2, 0), 8) for t in px])
            np.testing.assert_allclose(
                b.images[b.image_patches[j] : b.image_patches[j + 1]].astype(np.float32), want, atol=2e-2
            )
            j += 1
    assert j > 0


@pytest.mark.integration
def test_patches_stay_with_their_placeholders_through_splits_and_cp(cluster, tmp_path, llama3):
    texts, images = _records(tmp_path, n=120, seed=2)
    plan = _plan(
        tmp_path,
        llama3,
        image_tiles=4,
        topology={"dp": 2, "cp": 2, "cp_min_tokens": 16, "tokens_per_micro_batch": 256, "max_doc_tokens": 64},
    )
    blocks, _ = _blocks(plan)
    by_id = {int(b.sample_ids[d]): (b, d) for b in blocks for d in range(len(b))}
    from overlord_dask.sources.tokenizers import image_token_id

    image_id = image_token_id(plan.sources[0], plan)
    got = {}
    with Service.start(plan, cluster=cluster) as service:

        def consume(key):
            rank, cp_rank = key
            with connect(service.address, rank, 2, cp_rank=cp_rank, timeout=120) as s:
                got[key] = [s.next_batch() for _ in range(6)]
                s.commit()

        run_ranks(consume, [(r, c) for r in range(2) for c in range(2)])
    seen = 0
    for batches in got.values():
        for batch in batches:
            for sl in batch["micro_batches"]:
                ids = sl["input_ids"]
                assert (ids[sl["image_positions"]] == image_id).all()
                assert len(sl["image_positions"]) == int((ids[: sl["num_tokens"]] == image_id).sum())
                seg = np.searchsorted(sl["cu_seqlens"], sl["image_positions"], side="right") - 1
                for p, j, patch, k in zip(sl["image_positions"], seg, sl["image_patches"], sl["patch_index"]):
                    piece = int(sl["seg_piece"][j])
                    b, d = by_id[int(sl["sample_ids"][piece])]
                    pos = int(sl["piece_starts"][piece]) + int(
                        sl["position_ids"][p]
                    )  # the token's place in its document
                    imgs = range(b.image_offsets[d], b.image_offsets[d + 1])
                    img = next(
                        i
                        for i in imgs
                        if b.image_starts[i] <= pos < b.image_starts[i] + b.image_patches[i + 1] - b.image_patches[i]
                    )
                    assert k == pos - b.image_starts[img]
                    np.testing.assert_array_equal(patch, b.images[b.image_patches[img] + k])
                    seen += 1
    assert seen > 100


def test_webdataset_shards_with_image_placeholders(tmp_path, llama3):
    """A webdataset sample's images (its jpg/png members) go where its text has `<image>`."""
    import webdataset as wds

    rng = np.random.default_rng(5)
    texts, images = [], []
    (tmp_path / "wds").mkdir()
    with wds.TarWriter(str(tmp_path / "wds" / "shard-000.tar")) as w:
        for i in range(12):
            pics = [_png(rng, 24, 24) for _ in range(1 + i % 2)]
            text = "the cat <image> sat" + (" on <image> the mat" if len(pics) == 2 else "")
            sample = {"__key__": f"{i:04d}", "txt": text, "png": pics[0]}
            if len(pics) == 2:
                sample["jpg"] = _png(
                    rng, 24, 24
                )  # a second member (PNG bytes under another extension: Pillow reads either)
                pics[1] = sample["jpg"]
            w.write(sample)
            texts.append(text)
            images.append(pics)
    plan = plan_from_dict(
        {
            "sources": [
                {
                    "name": "img",
                    "format": "webdataset",
                    "url": "wds/shard-000.tar",
                    "text_field": "txt",
                    "images_field": "png,jpg",
                    "image_placeholders": True,
                    "image_size": 16,
                    "patch_size": 8,
                }
            ],
            "tokenizer": str(llama3),
            "topology": {"dp": 1, "tokens_per_micro_batch": 4096},
        },
        base_dir=tmp_path,
    )
    (block,), dropped = _blocks(plan)
    image_id = image_token_id_of(plan)
    assert dropped == 0 and len(block) == 12
    for d in range(12):
        doc = block.doc(d).tolist()
        assert doc.count(image_id) == 4 * len(images[d])  # (16 / 8)² patches per image
        first = doc.index(image_id)
        assert doc[first : first + 4] == [image_id] * 4 and doc[0] != image_id  # after BOS and "the cat"


def image_token_id_of(plan):
    from overlord_dask.sources.tokenizers import image_token_id

    return image_token_id(plan.sources[0], plan)
