"""The service next to a loader users run today, on the same files: torchdata ``nodes``.

    python benchmarks/peers.py                       # readable table
    python benchmarks/peers.py --json --dp 4 --steps 120 --compute-ms 50

Same sources (``--sources`` generated text parquet sources, weights 4:3:2:1...), same tokens per
step (``--tokens`` per rank, one micro-batch), same byte tokenizer, ``--dp`` trainer *processes*
computing ``--compute-ms`` per step (sleep). Two systems:

- **torchdata** 0.11, as its documentation composes it: per source a resumable ``BaseNode``
  reading the rank's share of the row groups, ``MultiNodeWeightedSampler`` (weights, rank,
  world size, seed; ``CYCLE_FOREVER``), ``ParallelMapper`` tokenizing in 2 worker processes
  (``method="process"``, in order), a packer node (first-fit into the micro-batch, its carry-over
  in its state), ``Prefetcher`` (factor 2) and ``Loader`` (``state_dict()`` /
  ``load_state_dict()``). Its documented settings; nothing tuned down.
- **ours**: ``overlord serve`` (2 workers) and ``OverlordDataset`` in a ``DataLoader``.

Figures per system: delivered tokens/s (all ranks, documents' tokens, padding excluded, after the
warm-up), the mean time to a rank's first batch (its process started, torch imported), trainer
wait share and p99 after ``--warmup`` steps, the loading path's memory (PSS of every process
minus as many bare trainers, as in ``benchmarks/memory.py``), the mix error (largest gap between a
source's token share and its weight over any 20 consecutive steps, all ranks), and resume
exactness: every rank stops at step ``--kill-at``, saves ``state_dict()``, its process exits, a new
process loads the state and runs to the end; the (source, sample id) stream of every rank and step
must equal an uninterrupted run's.
"""

from __future__ import annotations

import argparse
import glob
import multiprocessing as mp
import os
import pickle
import queue
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.memory import _pss, _serve, _stop  # noqa: E402
from benchmarks.output import emit_rows  # noqa: E402


# ---- torchdata: the peer pipeline ----------------------------------------------------------
def _torchdata_loader(files: dict, weights: dict, capacity: int, rank: int, world: int, seed: int):
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
        """Tokenized documents packed first-fit into micro-batches; the carried-over document is state."""

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
    from benchmarks.per_rank import _tokens

    return {"source": doc["source"], "id": doc["id"], "tokens": _tokens(doc["text"])}


# ---- trainer processes -----------------------------------------------------------------------
def _trainer(system: str, rank: int, dp: int, cfg: dict, first: int, last: int, state, ready, stop, out) -> None:
    """Steps [first, last) of one rank: per step the wait, the documents (source, id, tokens)."""
    import torch

    if system == "bare":
        ready.put(os.getpid())
        stop.wait()
        return
    if system == "ours":
        from overlord_dask import OverlordDataset

        ds = OverlordDataset(cfg["address"], rank=rank, dp=dp)
        if state is not None:
            ds.load_state_dict(state)
        loader, holder = torch.utils.data.DataLoader(ds, batch_size=None), ds
    else:
        loader = _torchdata_loader(cfg["files"], cfg["weights"], cfg["tokens"], rank, dp, cfg["seed"])
        if state is not None:
            loader.load_state_dict(state)
        holder = loader
    it = iter(loader)
    waits, ends, steps, t_start = [], [], [], time.perf_counter()
    for step in range(first, last):
        t0 = time.perf_counter()
        mb = next(it)
        waits.append(time.perf_counter() - t0)
        if step == first:
            ready.put(os.getpid())
        lens = np.diff(mb["cu_seqlens"].numpy().astype(np.int64))
        steps.append(
            {"source_ids": mb["source_ids"].tolist(), "sample_ids": mb["sample_ids"].tolist(), "lengths": lens.tolist()}
        )
        time.sleep(cfg["compute_s"])
        ends.append(time.perf_counter())
    wall = time.perf_counter() - t_start
    saved = holder.state_dict()
    first_s = ends[0] - t_start - cfg["compute_s"]
    # pickled here: the state holds tensors, which a queue would share by file descriptor (gone with this process)
    out.put(
        (
            rank,
            pickle.dumps(
                {"waits": waits, "ends": ends, "steps": steps, "wall": wall, "first_s": first_s, "state": saved}
            ),
        )
    )
    stop.wait()  # alive (and measured) until every rank is done
    if system == "ours":
        ds.close()


def _run(system: str, dp: int, cfg: dict, first: int, last: int, states=None, extra_pids=(), sample=True) -> dict:
    ctx = mp.get_context("spawn")
    ready, out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    ps = [
        ctx.Process(
            target=_trainer, args=(system, r, dp, cfg, first, last, states[r] if states else None, ready, stop, out)
        )
        for r in range(dp)
    ]
    for p in ps:
        p.start()
    pids = [ready.get(timeout=600) for _ in range(dp)]
    samples = []
    res: dict = {}
    while len(res) < dp:
        if sample:
            samples.append(_pss(pids + list(extra_pids)))
        try:
            r, v = out.get(timeout=0.5)
            res[r] = pickle.loads(v)
        except queue.Empty:
            if any(p.exitcode not in (None, 0) for p in ps):
                raise RuntimeError(f"a {system} trainer died: exit codes {[p.exitcode for p in ps]}") from None
        if system == "bare" and len(samples) >= 4:
            break
    stop.set()
    for p in ps:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    return {"ranks": [res[r] for r in sorted(res)], "pss_mb": samples}


def _stream(ranks: list[dict]) -> list:
    return [[list(zip(s["source_ids"], s["sample_ids"])) for s in r["steps"]] for r in ranks]


def _figures(
    system: str, full: dict, bare_mb: float, n_sources: int, weights: np.ndarray, warmup: int, window: int
) -> dict:
    from overlord_dask.observe.figures import window_mix_errors

    ranks = full["ranks"]
    steps = len(ranks[0]["steps"])
    per_step = np.zeros((steps, n_sources))
    for r in ranks:
        for k, s in enumerate(r["steps"]):
            np.add.at(per_step[k], np.asarray(s["source_ids"], int), np.asarray(s["lengths"], float))
    tokens = per_step[warmup:].sum()
    waits = np.concatenate([np.asarray(r["waits"][warmup:]) for r in ranks])
    share = np.mean([sum(r["waits"][warmup:]) / max(r["ends"][-1] - r["ends"][warmup - 1], 1e-9) for r in ranks])
    wall = max(r["ends"][-1] for r in ranks) - min(r["ends"][warmup - 1] for r in ranks)  # after the warm-up, all ranks
    mem = np.asarray(full["pss_mb"][len(full["pss_mb"]) // 4 :] or full["pss_mb"]) - bare_mb
    return {
        "system": system,
        "tokens_per_s": round(tokens / wall),
        "wait_share": round(float(share), 4),
        "wait_p99_ms": round(float(np.percentile(waits, 99)) * 1e3, 2),
        "time_to_first_batch_s": round(float(np.mean([r["first_s"] for r in ranks])), 2),
        "memory_mb": round(float(np.median(mem)), 1),
        "mix_error_window_max": round(
            float(window_mix_errors(per_step, np.tile(weights, (steps, 1)), window).max()), 4
        ),
    }


def measure_system(system: str, dp: int, cfg: dict, args, bare_mb: float, weights: np.ndarray, serve=None) -> dict:
    def started():
        if system != "ours":
            return None, cfg
        proc, address = serve()
        return proc, {**cfg, "address": address}

    proc, c = started()
    try:
        full = _run(system, dp, c, 0, args.steps, extra_pids=[proc.pid] if proc else ())
    finally:
        if proc:
            _stop(proc)
    proc, c = started()
    try:
        head = _run(system, dp, c, 0, args.kill_at, sample=False)
        tail = _run(system, dp, c, args.kill_at, args.steps, states=[r["state"] for r in head["ranks"]], sample=False)
    finally:
        if proc:
            _stop(proc)
    resumed = [h + t for h, t in zip(_stream(head["ranks"]), _stream(tail["ranks"]))]
    reference = _stream(full["ranks"])
    mismatched = sum(a != b for ra, rb in zip(reference, resumed) for a, b in zip(ra, rb))
    return {
        **_figures(system, full, bare_mb, len(weights), weights, args.warmup, args.window),
        "resume_identical": mismatched == 0,
        "resume_steps_differing": mismatched,
    }


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dp", type=int, default=4)
    ap.add_argument("--sources", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=16384, help="tokens per rank and step (one micro-batch)")
    ap.add_argument("--steps", type=int, default=120)
    ap.add_argument("--kill-at", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--data", default=None, help="folder for the generated sources (default: a temporary one)")
    args = ap.parse_args(argv)

    from overlord_dask.service.demo import generate_text_sources

    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or tmp
        names = generate_text_sources(root, args.sources)
        raw = np.arange(args.sources, 0, -1, dtype=float)
        weights = raw / raw.sum()
        cfg = {
            "tokens": args.tokens,
            "compute_s": args.compute_ms / 1e3,
            "seed": args.seed,
            "files": {n: sorted(glob.glob(os.path.join(root, n, "*.parquet"))) for n in names},
            "weights": {n: float(w) for n, w in zip(names, weights)},
        }
        bare = _run("bare", args.dp, cfg, 0, 1)
        bare_mb = float(np.median(bare["pss_mb"]))
        serve = lambda: _serve(root, names, args.dp, args.tokens, 2, weights=list(map(float, weights)), seed=args.seed)  # noqa: E731
        rows = [
            measure_system("torchdata", args.dp, cfg, args, bare_mb, weights),
            measure_system("ours", args.dp, cfg, args, bare_mb, weights, serve=serve),
        ]
    out = {
        "benchmark": "peers",
        "cores": os.cpu_count(),
        "dp": args.dp,
        "sources": args.sources,
        "tokens_per_rank_step": args.tokens,
        "compute_ms": args.compute_ms,
        "steps": args.steps,
        "kill_at": args.kill_at,
        "rows": rows,
    }
    emit_rows(
        out,
        args.json,
        [
            "system",
            "tokens_per_s",
            "wait_share",
            "wait_p99_ms",
            "time_to_first_batch_s",
            "memory_mb",
            "mix_error_window_max",
            "resume_identical",
        ],
    )
    return out


if __name__ == "__main__":
    main()
