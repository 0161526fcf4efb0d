"""The loaders users pick instead of ours, each composed as its own documentation shows it.

``benchmarks/peers.py`` runs each of these in dp trainer processes on one generated corpus. A
peer is a :class:`Peer`: ``missing()`` (why it cannot run here, or None), ``prepare()`` (its
own conversion of the corpus, timed apart from loading), ``serve()`` (a process the peer runs
beside the trainers, if it has one: Ray Data's driver and cluster), ``loader()`` (one rank's
iterable and the object whose ``state_dict()``/``load_state_dict()`` it resumes from, or None
for a peer that cannot resume: ``resumable``) and ``record()`` (what a batch holds: per piece its
source, an identity and its tokens, and the batch's capacity).

The peers are not in the base install: ``benchmarks/install_peers.sh`` makes ``.venv-peers``
with all of them (MosaicML Streaming and litdata without torchvision, whose PyPI wheel is built
for a CUDA torch and does not load beside the CPU one: Streaming's ``streaming.vision``, which
imports it, is stubbed; its text path does not use it).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time

import numpy as np


def _tokens(text: str) -> np.ndarray:
    """The byte tokens every system reads (``per_rank``'s, imported here: it imports torch)."""
    from benchmarks.per_rank import _tokens as byte_tokens

    return byte_tokens(text)


def _documents(paths: list[str]):
    """(id, text) of a source's documents in file order."""
    import pyarrow.parquet as pq

    for p in paths:
        t = pq.read_table(p, columns=["id", "text"])
        yield from zip(t.column(0).to_pylist(), t.column(1).to_pylist())


def concatenated(paths: list[str], block: int):
    """A source's documents tokenized and concatenated (each ending with EOS), cut into samples
    of exactly ``block`` tokens, the tail dropped: LLM Foundry's ``ConcatTokensDataset``
    (``convert_dataset_hf.py --concat_tokens``), the recipe both Streaming's and litgpt's
    pretraining examples feed from. Yields (tokens, the ids of the documents the sample holds
    parts of, their tokens in it): the benchmark's bookkeeping, not the peer's."""
    toks: list[np.ndarray] = []
    ids: list[int] = []
    lens: list[int] = []
    have = 0
    for doc_id, text in _documents(paths):
        t = _tokens(text)
        while len(t):
            take = min(len(t), block - have)
            toks.append(t[:take])
            ids.append(int(doc_id))
            lens.append(take)
            have += take
            t = t[take:]
            if have == block:
                yield np.concatenate(toks).astype(np.int32), np.asarray(ids, np.int64), np.asarray(lens, np.int64)
                toks, ids, lens, have = [], [], [], 0


def _concat_record(batch) -> tuple[list, list, list, int]:
    """A batch of one concatenated sample: its documents' parts (source, id, tokens)."""
    ids = np.asarray(batch["ids"]).reshape(-1).tolist()
    lens = np.asarray(batch["lens"]).reshape(-1).tolist()
    return [int(np.asarray(batch["source"]).reshape(-1)[0])] * len(ids), ids, lens, int(batch["tokens"].shape[-1])


class Peer:
    name = ""
    doc = ""  # the documentation the composition follows
    resumable = True
    not_resumable = ""  # why not, where it is not

    def missing(self) -> str | None:
        return None

    def prepare(self, root: str, files: dict, cfg: dict) -> dict:
        return {}

    def serve(self, cfg: dict, dp: int) -> tuple[subprocess.Popen | None, dict]:
        """A process the peer runs beside the trainers (its memory counts), and what its trainers
        need to reach it."""
        return None, {}

    def loader(self, cfg: dict, rank: int, dp: int):
        raise NotImplementedError

    def record(self, batch) -> tuple[list, list, list, int]:
        raise NotImplementedError


def _importable(*modules: str) -> str | None:
    import importlib

    for m in modules:
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001 - any failure to import is "cannot run here"
            return f"not installed here ({m}: {type(e).__name__}: {e}); run benchmarks/install_peers.sh"
    return None


# ---- torchdata nodes ------------------------------------------------------------------------------
class TorchData(Peer):
    """torchdata 0.11 ``nodes`` as its documentation composes them: per source a resumable
    ``BaseNode`` reading the rank's share of the row groups, ``MultiNodeWeightedSampler``
    (weights, rank, world size, seed; ``CYCLE_FOREVER``), ``ParallelMapper`` tokenizing in 2
    worker processes (``method="process"``, in order), a packer node (first fit into the
    micro-batch, its carry-over in its state), ``Prefetcher`` (factor 2) and ``Loader``
    (``state_dict()`` / ``load_state_dict()``). Its documented settings; nothing tuned down."""

    name = "torchdata"
    doc = "https://docs.pytorch.org/data/beta/torchdata.nodes.html (MultiNodeWeightedSampler, ParallelMapper)"

    def missing(self):
        return _importable("torchdata.nodes")

    def loader(self, cfg, rank, dp):
        loader = torchdata_loader(cfg["files"], cfg["weights"], cfg["tokens"], rank, dp, cfg["seed"])
        return loader, loader

    def record(self, mb):
        lens = np.diff(mb["cu_seqlens"].numpy().astype(np.int64))
        return mb["source_ids"].tolist(), mb["sample_ids"].tolist(), lens.tolist(), int(mb["input_ids"].shape[-1])


def torchdata_loader(files: dict, weights: dict, capacity: int, rank: int, world: int, seed: int):
    from torchdata.nodes import BaseNode, Loader, MultiNodeWeightedSampler, ParallelMapper, Prefetcher

    class ParquetDocs(BaseNode):
        """One source's documents for one rank (its share of the row groups), resumable."""

        def __init__(self, source: int, paths: list[str]):
            super().__init__()
            import pyarrow.parquet as pq

            groups = [(p, g) for p in paths for g in range(pq.ParquetFile(p).num_row_groups)]
            self.source, self.groups = source, groups[rank::world]

        def reset(self, initial_state=None):
            super().reset(initial_state)
            st = initial_state or {"group": 0, "row": 0}
            self.group, self.row, self.table = st["group"], st["row"], None

        def next(self):
            import pyarrow.parquet as pq

            if self.table is None:
                path, g = self.groups[self.group]
                self.table = pq.ParquetFile(path).read_row_group(g, columns=["id", "text"])
            doc = {
                "source": self.source,
                "id": self.table.column(0)[self.row].as_py(),
                "text": self.table.column(1)[self.row].as_py(),
            }
            self.row += 1
            if self.row == self.table.num_rows:
                self.group, self.row, self.table = (self.group + 1) % len(self.groups), 0, None
            return doc

        def get_state(self):
            return {"group": self.group, "row": self.row}

    class Packer(BaseNode):
        """Tokenized documents packed first-fit into micro-batches, a document longer than one cut
        into micro-batch-sized pieces; the carried-over piece is state."""

        def __init__(self, source):
            super().__init__()
            self.src = source

        def reset(self, initial_state=None):
            super().reset(initial_state)
            if initial_state:
                self.src.reset(initial_state["src"])
                self.carry = initial_state["carry"]
            else:
                self.src.reset()
                self.carry = None

        def next(self):
            from benchmarks.per_rank import as_batch

            ids, pos, cu, docs = np.zeros(capacity, np.int64), 0, [0], []
            while True:
                doc = self.carry if self.carry is not None else self.src.next()
                self.carry = None
                toks = np.asarray(doc["tokens"][:capacity], np.int64)
                if pos + len(toks) > capacity:
                    self.carry = doc
                    break
                if len(doc["tokens"]) > capacity:  # the rest of a long document: its next piece
                    self.carry = {**doc, "tokens": doc["tokens"][capacity:]}
                ids[pos : pos + len(toks)] = toks
                pos += len(toks)
                cu.append(pos)
                docs.append((doc["source"], doc["id"]))
            batch = as_batch(ids, cu, capacity)
            import torch

            batch["source_ids"] = torch.tensor([d[0] for d in docs], dtype=torch.int32)
            batch["sample_ids"] = torch.tensor([d[1] for d in docs], dtype=torch.int64)
            return batch

        def get_state(self):
            return {"src": self.src.state_dict(), "carry": self.carry}

    names = sorted(files)
    nodes = {n: ParquetDocs(i, files[n]) for i, n in enumerate(names)}
    mixed = MultiNodeWeightedSampler(
        nodes, weights, stop_criteria="CYCLE_FOREVER", rank=rank, world_size=world, seed=seed
    )
    tokenized = ParallelMapper(mixed, map_fn=_tokenize_doc, num_workers=2, method="process", in_order=True)
    return Loader(Prefetcher(Packer(tokenized), prefetch_factor=2))


def _tokenize_doc(doc: dict) -> dict:
    return {"source": doc["source"], "id": doc["id"], "tokens": _tokens(doc["text"])}


# ---- MosaicML Streaming ------------------------------------------------------------------------
def _stub_streaming_vision() -> None:
    """``import streaming`` imports ``streaming.vision`` (torchvision); the text path does not use it."""
    import types

    if "streaming.vision" not in sys.modules:
        vision = types.ModuleType("streaming.vision")
        vision.__path__ = []
        sys.modules["streaming.vision"] = vision


class Mosaic(Peer):
    """MosaicML Streaming 0.13 as LLM Foundry feeds pretraining: each source converted once into
    pre-concatenated MDS samples of the micro-batch's length (``convert_dataset_hf.py
    --concat_tokens``, zstd), a ``Stream(local=..., proportion=w)`` per source in one
    ``StreamingDataset(shuffle=True)`` (its default ``py1e`` shuffle, ``batch_size`` the
    per-rank batch), ``StreamingDataLoader`` with 2 workers for ``state_dict()``. Ranks from
    ``RANK``/``WORLD_SIZE``/``LOCAL_*`` as torchrun sets them."""

    name = "mosaic_streaming"
    doc = "https://docs.mosaicml.com/projects/streaming/en/stable/ (Stream proportions); llm-foundry scripts/data_prep"

    def missing(self):
        _stub_streaming_vision()
        return _importable("streaming")

    def prepare(self, root, files, cfg):
        _stub_streaming_vision()
        from streaming import MDSWriter

        out = {}
        for i, name in enumerate(sorted(files)):
            d = os.path.join(root, "mds", name)
            shutil.rmtree(d, ignore_errors=True)  # converted anew: its time is part of the figures
            cols = {"tokens": "ndarray:int32", "source": "int", "ids": "ndarray:int64", "lens": "ndarray:int64"}
            with MDSWriter(out=d, columns=cols, compression="zstd") as w:
                for toks, ids, lens in concatenated(files[name], cfg["tokens"]):
                    w.write({"tokens": toks, "source": i, "ids": ids, "lens": lens})
            out[name] = d
        from streaming.base.util import clean_stale_shared_memory

        clean_stale_shared_memory()
        return {"mds": out}

    def loader(self, cfg, rank, dp):
        _stub_streaming_vision()
        from streaming import Stream, StreamingDataLoader, StreamingDataset

        streams = [Stream(local=cfg["mds"][n], proportion=cfg["weights"][n]) for n in sorted(cfg["mds"])]
        ds = StreamingDataset(streams=streams, shuffle=True, batch_size=1, shuffle_seed=cfg["seed"] + 9176)
        dl = StreamingDataLoader(ds, batch_size=1, num_workers=2)
        return dl, dl

    def record(self, batch):
        return _concat_record(batch)


# ---- litdata -------------------------------------------------------------------------------------
class LitData(Peer):
    """litdata 0.2 as its README composes a weighted mix: ``optimize()`` each source once into
    chunks of pre-concatenated samples (as litgpt prepares pretraining data), a
    ``StreamingDataset(shuffle=True)`` per source, ``CombinedStreamingDataset(weights=...,
    iterate_over_all=False)``, ``StreamingDataLoader`` with 2 workers (its ``state_dict()``).
    Ranks from ``torch.distributed`` (gloo here), as litdata detects them."""

    name = "litdata"
    doc = "https://github.com/Lightning-AI/litData#combine-datasets (CombinedStreamingDataset weights)"

    def missing(self):
        return _importable("litdata")

    def prepare(self, root, files, cfg):
        from litdata import optimize

        out = {}
        for i, name in enumerate(sorted(files)):
            d = os.path.join(root, "litdata", name)
            shutil.rmtree(d, ignore_errors=True)  # converted anew: its time is part of the figures
            optimize(
                fn=_lit_samples,
                inputs=[(i, files[name], cfg["tokens"])],
                output_dir=d,
                chunk_bytes="64MB",
                num_workers=1,
                mode="overwrite",
            )
            out[name] = d
        return {"litdata": out}

    def loader(self, cfg, rank, dp):
        from litdata import CombinedStreamingDataset, StreamingDataLoader, StreamingDataset

        names = sorted(cfg["litdata"])
        parts = [StreamingDataset(cfg["litdata"][n], shuffle=True, seed=cfg["seed"]) for n in names]
        mixed = CombinedStreamingDataset(
            parts, seed=cfg["seed"], weights=[cfg["weights"][n] for n in names], iterate_over_all=False
        )
        dl = StreamingDataLoader(mixed, batch_size=1, num_workers=2)
        return dl, dl

    def record(self, batch):
        return _concat_record(batch)


def _lit_samples(item):
    """litdata ``optimize`` fn: one source's concatenated samples (module level: its workers import it)."""
    source, paths, block = item
    for toks, ids, lens in concatenated(paths, block):
        yield {"tokens": toks, "source": source, "ids": ids, "lens": lens}


# ---- Ray Data -----------------------------------------------------------------------------------
class RayData(Peer):
    """Ray Data 2.60 as Ray Train feeds trainers: per source ``read_parquet(shuffle="files")`` and
    ``map_batches`` tokenizing and packing each batch's documents first fit into micro-batches (a
    document longer than one cut; a batch's last bins padded: a stateless map keeps no carry), the
    sources ``mix``ed by weight (``STOP_ON_SHORTEST``: the weights hold for a whole pass; rows are
    micro-batches), ``streaming_split(dp, equal=True)`` in a driver process that owns the Ray
    cluster (as Ray Train's trainer does), each rank iterating its split (``iter_batches``). The
    cluster listens on loopback only, with a token. Ray Data iterators keep no state: a rank that
    stopped cannot resume where it stopped (Ray Train restarts the epoch)."""

    name = "ray_data"
    doc = (
        "https://docs.ray.io/en/latest/train/user-guides/data-loading-preprocessing.html (streaming_split); "
        "https://docs.ray.io/en/latest/data/api/doc/ray.data.Dataset.mix.html"
    )
    resumable = False
    not_resumable = "Ray Data iterators keep no state to resume from (Ray Train restarts the epoch)"

    def missing(self):
        return _importable("ray.data")

    def serve(self, cfg, dp):
        env = _ray_env(secrets.token_hex(16))
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.peer_pipelines", "ray-driver"],
            cwd=root,
            env={**os.environ, **env},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        proc.stdin.write(json.dumps({k: cfg[k] for k in ("files", "weights", "tokens", "seed")} | {"dp": dp}))
        proc.stdin.close()
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the Ray Data driver exited with {proc.wait()}")
        return proc, {**json.loads(line), "ray_env": env}

    def loader(self, cfg, rank, dp):
        os.environ.update(cfg["ray_env"])
        import ray
        import ray.cloudpickle

        ray.init(address=cfg["ray_address"], log_to_driver=False, logging_level="ERROR")
        with open(cfg["ray_splits"], "rb") as f:
            split = ray.cloudpickle.load(f)[rank]

        class Epochs:  # each iteration a pass over the mix, as a training loop's epochs
            def __iter__(self):
                return iter(split.iter_batches(batch_size=1, batch_format="numpy"))

        return Epochs(), None

    def record(self, batch):
        ids, lens = np.asarray(batch["ids"][0]).tolist(), np.asarray(batch["lens"][0]).tolist()
        return [int(batch["source"][0])] * len(ids), ids, lens, int(batch["capacity"][0])


def _ray_env(token: str) -> dict:
    """A Ray cluster on loopback only (its default binds the host's address), token-authenticated."""
    return {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN": token}


def _ray_pack(batch, source: int, capacity: int):
    """``map_batches`` fn: a batch's documents byte-tokenized and packed first fit into bins of
    ``capacity`` tokens (a longer document cut into whole bins first); every bin, padded."""
    import pyarrow as pa

    from overlord_dask.sources.tokenizers import BYTE_OFFSET, EOS_ID

    bins: list[list] = []  # [used, [ids], [lens], [token arrays]]
    for doc_id, text in zip(batch["id"].to_pylist(), batch["text"].to_pylist()):
        t = np.append(np.frombuffer(text.encode(), np.uint8).astype(np.int32) + BYTE_OFFSET, EOS_ID)
        while len(t):
            take = t[:capacity]
            t = t[capacity:]
            home = next((b for b in bins if b[0] + len(take) <= capacity), None)
            if home is None:
                home = [0, [], [], []]
                bins.append(home)
            home[0] += len(take)
            home[1].append(int(doc_id))
            home[2].append(len(take))
            home[3].append(take)
    tokens = [np.pad(np.concatenate(b[3]), (0, capacity - b[0])) for b in bins]
    return pa.table(
        {
            "tokens": pa.array(tokens, pa.list_(pa.int32())),
            "ids": pa.array([b[1] for b in bins], pa.list_(pa.int64())),
            "lens": pa.array([b[2] for b in bins], pa.list_(pa.int64())),
            "source": pa.array([source] * len(bins), pa.int64()),
            "capacity": pa.array([capacity] * len(bins), pa.int64()),
        }
    )


def ray_driver() -> None:
    """The Ray Data driver (``python -m benchmarks.peer_pipelines ray-driver``, its settings as
    JSON on stdin): starts the cluster, builds the mix and its splits, writes them for the
    trainers, prints the address, then holds the cluster until it is stopped."""
    import tempfile

    import ray
    import ray.cloudpickle
    from ray.data import MixStoppingCondition

    cfg = json.loads(sys.stdin.read())
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")

    def stop(*_):  # the cluster's processes go with the driver (a plain exit would orphan them)
        ray.shutdown()
        sys.exit(0)

    signal.signal(signal.SIGTERM, stop)
    ray.data.DataContext.get_current().enable_progress_bars = False
    names = sorted(cfg["files"])
    parts = [
        ray.data.read_parquet(cfg["files"][n], columns=["id", "text"], shuffle="files").map_batches(
            _ray_pack, fn_kwargs={"source": i, "capacity": cfg["tokens"]}, batch_format="pyarrow"
        )
        for i, n in enumerate(names)
    ]
    mixed = parts[0].mix(
        *parts[1:],
        weights=[cfg["weights"][n] for n in names],
        stopping_condition=MixStoppingCondition.STOP_ON_SHORTEST,
    )
    splits = mixed.streaming_split(cfg["dp"], equal=True)
    path = os.path.join(tempfile.mkdtemp(prefix="ray-splits-"), "splits.pkl")
    with open(path, "wb") as f:
        ray.cloudpickle.dump(splits, f)
    print(json.dumps({"ray_address": ray.get_runtime_context().gcs_address, "ray_splits": path}), flush=True)
    while True:
        time.sleep(3600)


# ---- Megatron-Energon ----------------------------------------------------------------------------
class Energon(Peer):
    """Megatron-Energon 7.4 as its documentation composes a blended, packed pretraining stream:
    each source written as webdataset shards (a sample per document, its text as ``txt``) and
    indexed with ``energon prepare`` (``TextSample``), a ``MetadatasetV2`` blending them by
    weight (each source a subflavor), ``get_train_dataset`` (``batch_size=1``, its example's
    ``shuffle_buffer_size=100``, ``max_samples_per_sequence=100``) with a task encoder that
    tokenizes and packs first fit (``select_samples_to_pack`` / ``pack_selected_samples`` over a
    ``packing_buffer_size`` of 64 pieces; a document longer than a micro-batch cut into pieces
    first), ``get_savable_loader`` with 2 workers (``save_state_rank`` / ``restore_state_rank``)."""

    name = "energon"
    doc = "https://nvidia.github.io/Megatron-Energon/ (metadatasets: blend; packing; save/restore)"

    def missing(self):
        return _importable("megatron.energon", "webdataset")

    def prepare(self, root, files, cfg):
        import pyarrow.parquet as pq
        import webdataset as wds

        base = os.path.join(root, "energon")
        shutil.rmtree(base, ignore_errors=True)  # converted anew: its time is part of the figures
        exe = os.path.join(os.path.dirname(sys.executable), "energon")
        blend = []
        for i, name in enumerate(sorted(files)):
            out = os.path.join(base, name)
            os.makedirs(out)
            for k, path in enumerate(files[name]):
                t = pq.read_table(path, columns=["id", "text"])
                with wds.TarWriter(os.path.join(out, f"shard-{k:03d}.tar")) as w:
                    for doc_id, text in zip(t.column(0).to_pylist(), t.column(1).to_pylist()):
                        w.write({"__key__": f"{doc_id:08d}", "txt": text})
            shards = f"shard-{{000..{len(files[name]) - 1:03d}}}.tar"
            subprocess.run(
                [exe, "prepare", out, "--split-parts", f"train:{shards}", "--non-interactive", "--no-progress"]
                + ["--sample-type", "TextSample", "--field-map", json.dumps({"text": "txt"})],
                check=True,
                stdout=subprocess.DEVNULL,
            )
            blend.append(
                f"      - weight: {cfg['weights'][name]}\n        path: {name}\n        subflavors: {{source: {i}}}"
            )
        mix = os.path.join(base, "mix.yaml")
        with open(mix, "w") as f:
            f.write("__module__: megatron.energon\n__class__: MetadatasetV2\nsplits:\n  train:\n    blend:\n")
            f.write("\n".join(blend) + "\n")
        return {"energon": mix}

    def loader(self, cfg, rank, dp):
        from megatron.energon import WorkerConfig, get_savable_loader, get_train_dataset

        worker_config = WorkerConfig(rank=rank, world_size=dp, num_workers=2)
        ds = get_train_dataset(
            cfg["energon"],
            batch_size=1,
            shuffle_buffer_size=100,
            max_samples_per_sequence=100,
            worker_config=worker_config,
            task_encoder=_energon_packer(cfg["tokens"]),
            packing_buffer_size=64,
        )
        loader = get_savable_loader(ds)
        return loader, _EnergonState(loader)

    def record(self, batch):
        return batch["sources"], batch["ids"], batch["lens"], batch["capacity"]


class _EnergonState:
    """``state_dict()`` / ``load_state_dict()`` over Energon's ``save_state_rank`` / ``restore_state_rank``."""

    def __init__(self, loader) -> None:
        self.loader = loader

    def state_dict(self):
        return self.loader.save_state_rank()

    def load_state_dict(self, state) -> None:
        self.loader.restore_state_rank(state)


def _energon_packer(capacity: int):
    """Energon's task encoder that byte-tokenizes ``TextSample`` s and packs them first fit."""
    from megatron.energon import Sample, TaskEncoder
    from megatron.energon.edataclass import edataclass
    from megatron.energon.task_encoder.base import stateless

    from overlord_dask.sources.tokenizers import BYTE_OFFSET, EOS_ID

    @edataclass
    class Piece(Sample):  # an Energon sample: its restore key lets a saved packing buffer be rebuilt
        tokens: np.ndarray
        sources: list
        ids: list
        lens: list

    class Packer(TaskEncoder):
        @stateless
        def preencode_sample(self, sample):
            t = np.append(np.frombuffer(sample.text.encode(), np.uint8).astype(np.int32) + BYTE_OFFSET, EOS_ID)
            doc, src = int(sample.__key__.rsplit("/", 1)[-1]), int(sample.__subflavors__["source"])
            for a in range(0, len(t), capacity):
                piece = t[a : a + capacity]
                yield Piece.derive_from(sample, tokens=piece, sources=[src], ids=[doc], lens=[len(piece)])

        def select_samples_to_pack(self, samples):
            bins, used = [], []
            for s in samples:
                n = len(s.tokens)
                home = next((i for i, u in enumerate(used) if u + n <= capacity), None)
                if home is None:
                    bins.append([s])
                    used.append(n)
                else:
                    bins[home].append(s)
                    used[home] += n
            return bins

        @stateless
        def pack_selected_samples(self, samples):
            return Piece.derive_from(
                samples[0],
                tokens=np.concatenate([s.tokens for s in samples]),
                sources=[x for s in samples for x in s.sources],
                ids=[x for s in samples for x in s.ids],
                lens=[x for s in samples for x in s.lens],
            )

        def postencode_sample(self, sample):
            return sample

        def batch(self, samples):
            return samples[0]

        def encode_batch(self, piece):
            import torch

            tokens = torch.from_numpy(np.pad(piece.tokens, (0, capacity - len(piece.tokens))))
            return {
                "tokens": tokens,
                "sources": piece.sources,
                "ids": piece.ids,
                "lens": piece.lens,
                "capacity": capacity,
            }

    return Packer()


PEERS = {p.name: p for p in (TorchData(), Mosaic(), LitData(), RayData(), Energon())}

if __name__ == "__main__" and sys.argv[1:] == ["ray-driver"]:
    ray_driver()
