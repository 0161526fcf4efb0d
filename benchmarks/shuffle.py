"""Shuffle quality: how many files a source's neighbouring documents come from.

    python benchmarks/shuffle.py            # readable table
    python benchmarks/shuffle.py --json     # one JSON object

Real corpora are written in order (a file per crawl dump, repository, language, date), so the
order a loader walks a source in decides whether a step sees two files or two hundred. For each
layout (files of documents, one load unit per file) and each order, over one epoch of the source:

- ``same_file``: the share of consecutive documents that come from the same file (a global
  permutation: about 1 / files);
- ``files_per_256``: distinct files in each run of 256 consecutive documents, on average;
- ``docs_to_all_files``: documents until every file has been reached (lower is better);
- ``open_files_max``: the most files open at once (a file must be at hand from its first document
  in the order to its last: what a loader keeps resident, in memory or in a local cache).

Orders, in the same run: ours at the default ``loading.shuffle_units`` and two other settings
(the real ``SourceStream`` of the planner walking the run's first epoch with the default
``shuffle_warmup_units``, and the default setting once more without the warm-up; its units
loaded as its lookahead asks for them; ``resident_units_max`` is the most units it held at once,
``units_before_first`` what it needed loaded before its first document); a global permutation of every document; and
MosaicML Streaming's ``py1e`` (its default algorithm), ``py1br`` and ``py1s`` on the same shard
sizes (seed 9176, one canonical node, block 2^18), and ``py1e`` at the block ``StreamingDataset``
sets by default on one node (4,000,000 samples: near-global, every shard of the 1,000-file layout
open at once, in its local disk cache). Their shuffle functions are pure numpy: the benchmark loads
``streaming.base.shuffle`` without the package's ``__init__``, which pulls torchvision.

``planner_ms_per_step`` (``--planner``): the real ``PlannerState`` (dp 4, 2 micro-batches of 8k
tokens, policy cost) over the 1,000-file layout, per setting, time per planned step.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time
import types

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from output import emit_rows  # noqa: E402  (benchmarks/output.py)

from overlord_dask.plan import Loading, plan_from_dict  # noqa: E402
from overlord_dask.planner.state import PlannerState  # noqa: E402
from overlord_dask.planner.streams import SourceStream  # noqa: E402

MOSAIC_SEED, MOSAIC_BLOCK = 9176, 1 << 18
MOSAIC_DEFAULT_BLOCK = 4_000_000  # StreamingDataset's default on one node: max(4M // canonical nodes, 2^18)
DOC_TOKENS_MEAN = 700  # web-like documents (lognormal)


def layouts(big: bool) -> dict[str, np.ndarray]:
    """Documents per file for each layout."""
    rng = np.random.default_rng(0)
    out = {"64x400": np.full(64, 400, np.int64)}
    out["unequal_300"] = np.clip(rng.lognormal(6.5, 1.3, 300), 5, 30_000).astype(np.int64)  # 5 .. 30k per file
    if big:
        out["1000x4096"] = np.full(1000, 4096, np.int64)
    return out


# ---- figures -------------------------------------------------------------------------------------
def figures(files: np.ndarray, n_files: int) -> dict:
    """Same-file neighbours, files per 256 documents, documents until every file is reached, of a
    stream given as each document's file."""
    same = float(np.mean(files[1:] == files[:-1])) if len(files) > 1 else 0.0
    w = len(files) // 256 * 256
    per = files[:w].reshape(-1, 256)
    distinct = float(np.mean([len(np.unique(r)) for r in per])) if len(per) else float("nan")
    seen = np.zeros(n_files, bool)
    first = np.full(n_files, -1, np.int64)
    _, idx = np.unique(files, return_index=True)
    first[np.unique(files)] = idx
    seen[np.unique(files)] = True
    until = int(first.max()) + 1 if seen.all() else None
    # files "open" at once: a file must be at hand from its first document to its last
    last = np.full(n_files, -1, np.int64)
    last[files] = np.arange(len(files))  # (numpy: the last write of an index wins)
    ev = np.zeros(len(files) + 1, np.int64)
    np.add.at(ev, first[seen], 1)
    np.add.at(ev, last[seen] + 1, -1)
    open_max = int(np.cumsum(ev).max())
    return {
        "same_file": round(same, 4),
        "files_per_256": round(distinct, 1),
        "docs_to_all_files": until,
        "open_files_max": open_max,
    }


# ---- orders --------------------------------------------------------------------------------------
def ours(sizes: np.ndarray, shuffle_units: int, warmup: int, seed: int = 0) -> tuple[np.ndarray, dict]:
    """The file of each document of epoch 0 in the order the planner's stream walks the source,
    its units loaded as its lookahead asks (with lengths drawn per file), and what it held."""
    n = len(sizes)
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    s = SourceStream("src", 0, n, first, seed, 1 << 30, block_units=shuffle_units, evict_after=4, warmup_units=warmup)
    rng = np.random.default_rng(1)
    lengths = [np.clip(rng.lognormal(6.3, 0.8, int(k)), 8, 16_000).astype(np.int64) for k in sizes]
    target = 4 * 8192 * 17 * 13 // 10  # what the planner asks for ahead: a window of 16 steps of 32k tokens, +30%
    total_docs = int(sizes.sum())
    out = np.empty(total_docs, np.int64)
    done, resident, before_first = 0, 0, None
    while done < total_docs:
        for e, u in s.loads.want(s, target, Loading().units_ahead):
            s.add_lengths(e, u, lengths[u])
        resident = max(resident, s.loaded_units())
        rows, enough = s.pieces_ahead(target)
        if not len(rows):
            continue  # the block is not complete yet: load more
        if before_first is None:
            before_first = s.loaded_units()
        rows = rows[rows[:, 0] == 0][: total_docs - done]  # epoch 0 only
        out[done : done + len(rows)] = rows[:, 1]
        done += len(rows)
        s.take(rows)
        s.finished_units()
    return out, {"resident_units_max": resident, "units_before_first": before_first}


def global_permutation(sizes: np.ndarray) -> np.ndarray:
    files = np.repeat(np.arange(len(sizes)), sizes)
    return files[np.random.default_rng(2).permutation(len(files))]


def mosaic_shuffles():
    """MosaicML Streaming's shuffle algorithms (``streaming.base.shuffle``), loaded without the
    ``streaming`` package's ``__init__`` (which imports torchvision); None if not installed."""
    spec = importlib.util.find_spec("streaming")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = list(spec.submodule_search_locations)[0]
    for name, path in (("streaming", root), ("streaming.base", os.path.join(root, "base"))):
        if name not in sys.modules:
            mod = types.ModuleType(name)
            mod.__path__ = [path]
            sys.modules[name] = mod
    from streaming.base.shuffle import get_shuffle

    return get_shuffle


def mosaic(get_shuffle, algo: str, sizes: np.ndarray, block: int = MOSAIC_BLOCK) -> np.ndarray:
    ids = get_shuffle(algo, sizes.astype(np.int64), 1, MOSAIC_SEED, 0, block)
    return np.searchsorted(np.cumsum(sizes), ids, side="right")


# ---- the planner's cost --------------------------------------------------------------------------
def planner_ms_per_step(sizes: np.ndarray, shuffle_units: int, steps: int) -> float:
    plan = plan_from_dict(
        {
            "seed": 1,
            "sources": [{"name": "web", "format": "parquet", "url": "web/*.parquet", "text_field": "text"}],
            "topology": {"dp": 4, "micro_batches": 2, "tokens_per_micro_batch": 8192},
            "loading": {"shuffle_units": shuffle_units, "prefetch_steps": 64},
        }
    )
    first = np.concatenate([[0], np.cumsum(sizes)[:-1]]).tolist()
    st = PlannerState(plan, {"web": first})
    rng = np.random.default_rng(1)
    lengths = [np.clip(rng.lognormal(6.3, 0.8, int(k)), 8, 16_000).astype(np.int64) for k in sizes]
    t_plan, planned = 0.0, 0
    while planned < steps:
        for name, e, u in st.wanted():
            st.add_lengths(name, e, u, lengths[u])
        t0 = time.perf_counter()
        st.plan_ahead(16)
        got, _ = st.plan_steps(steps - planned)
        t_plan += time.perf_counter() - t0
        for p in got:
            for r in range(4):
                st.ack(r, p["step"])
        planned += len(got)
    return round(t_plan / steps * 1e3, 3)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--settings", default="1,16,256", help="shuffle_units besides the default, comma-separated")
    ap.add_argument("--small", action="store_true", help="leave out the 1,000 x 4,096 layout (a quick run)")
    ap.add_argument("--planner-steps", type=int, default=200, help="steps planned for planner_ms_per_step (0: skip)")
    args = ap.parse_args(argv)
    default, warmup = Loading().shuffle_units, Loading().shuffle_warmup_units
    settings = [default] + [int(x) for x in args.settings.split(",") if x and int(x) != default]
    get_shuffle = mosaic_shuffles()
    if args.planner_steps:  # the first planner of the process pays for warming up: not a setting's cost
        planner_ms_per_step(layouts(False)["64x400"], default, 20)
    rows = []
    for name, sizes in layouts(not args.small).items():
        n = len(sizes)
        for k, warm in [(k, warmup) for k in settings] + [(default, 0)]:
            files, held = ours(sizes, k, warm)
            label = f"ours shuffle_units={k}" + (" (default)" if k == default else "")
            label += f", shuffle_warmup_units={warm}" if warm != warmup else ""
            row = {"layout": name, "order": label, **figures(files, n), **held}
            if args.planner_steps and name != "64x400" and warm == warmup:
                row["planner_ms_per_step"] = planner_ms_per_step(sizes, k, args.planner_steps)
            rows.append(row)
        rows.append({"layout": name, "order": "global permutation", **figures(global_permutation(sizes), n)})
        for algo, block in (("py1e", MOSAIC_BLOCK), ("py1br", MOSAIC_BLOCK), ("py1s", MOSAIC_BLOCK), ("py1e", None)):
            label = f"mosaic {algo}" + (" (default block, 1 node)" if block is None else "")
            if get_shuffle is None:
                rows.append({"layout": name, "order": label, "note": "mosaicml-streaming not installed"})
                continue
            order = mosaic(get_shuffle, algo, sizes, block or MOSAIC_DEFAULT_BLOCK)
            rows.append({"layout": name, "order": label, **figures(order, n)})
    out = {"benchmark": "shuffle", "default_shuffle_units": default, "rows": rows}
    columns = ["layout", "order", "same_file", "files_per_256", "docs_to_all_files", "open_files_max"]
    columns += ["resident_units_max"]
    columns += ["units_before_first", "planner_ms_per_step"]
    emit_rows(out, args.json, columns)
    return out


if __name__ == "__main__":
    main()
