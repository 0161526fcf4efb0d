"""The service next to the loaders users run today, on the same files, in one run.

    python benchmarks/peers.py                                 # readable table
    python benchmarks/peers.py --json --dp 2 --steps 300 --compute-ms 25
    .venv-peers/bin/python benchmarks/peers.py --json          # every peer (benchmarks/install_peers.sh)

One generated corpus: ``--sources`` text parquet sources (16 files each) weighted 5:3:2 (then
1s), with different document lengths (web-like, chat-like, book-like: a book can fill several
micro-batches), byte tokens. ``--dp`` trainer *processes*, each a fresh interpreter as torchrun
starts them (multiprocessing's ``spawn``), whose DataLoader workers start as they would under
torchrun: forked (``--worker-start``), one micro-batch of ``--tokens`` per rank and step, each computing
``--compute-ms`` per step (sleep). Systems (``benchmarks/peer_pipelines.py``, each composed as
its documentation shows, at its defaults, the doc named there):

- **torchdata** ``nodes``; **mosaic_streaming** (LLM Foundry's pre-concatenated MDS samples,
  ``Stream`` proportions); **litdata** (``optimize`` + ``CombinedStreamingDataset`` weights);
  **ray_data** (``read_parquet`` → ``map_batches`` packing → ``mix`` → ``streaming_split``, its
  driver and cluster in a process beside the trainers, as Ray Train runs them); **energon**
  (webdataset shards prepared with ``energon prepare``, a blended metadataset, a packing task
  encoder, its savable loader);
- **ours**: ``overlord serve`` (2 worker processes) and ``OverlordDataset``, iterated directly;
  **ours_in_process**: ``overlord serve --in-process``, its loaders threads of its one process;
  **ours_in_process_disk**: the same with ``loading.block_store: disk`` (the loaded blocks' token
  ids in files on the local disk, read piece by piece, as Streaming reads its local shards).
  All with ``balance.packing: cut`` (``--packing``).

A peer that cannot run here (not installed) gets a row saying so, never a number.

Figures per system: delivered tokens/s (all ranks, documents' tokens, padding excluded, after
the warm-up); fill (documents' tokens over the micro-batches' capacity); ``prepare_s`` (a peer's
own conversion of the corpus, before any loading); the mean time to a rank's first batch (its
process started, torch imported; the start of what runs beside the trainers, ours' service or Ray
Data's driver and cluster, is ``service_start_s``);
trainer wait share and p99 after ``--warmup`` steps; the loading path's memory (PSS of every
process minus as many bare trainers, as in ``benchmarks/memory.py``), also at the dp of
``--memory-dp`` (a ``--memory-steps`` run each: ``memory_by_dp``); the mix error (largest gap
between a source's token share and its weight over any ``--window`` consecutive steps, all
ranks); shuffle quality per rank and source: the share of consecutive documents that come from
the same file (1/16 for a perfect shuffle of 16 equal files) and the distinct files among 256
consecutive documents (16 at best); and resume exactness: every rank stops at step
``--kill-at``, saves ``state_dict()``, its process exits, a new process loads the state and runs
to the end; the (source, document) stream of every rank and step must equal an uninterrupted
run's (a peer that keeps no state to resume from says so: ``resume_not_supported``).

dp change on resume (``--dp-change``, default 4): a job stops at ``--dp-change-at`` and saves
every rank's ``state_dict()``; a job of another dp loads them (new rank ``r`` loads old rank
``r mod dp``'s, as a checkpoint that is the same on every rank is loaded) and runs as many
rank-steps as the uninterrupted run's first ``--dp-change-steps`` steps (short of any source's
epoch). ``dp_change_repeated_docs``: documents delivered with more tokens than they have and
than the uninterrupted run gave them (a peer that upsamples a small source repeats documents);
``dp_change_lost_docs``: of the documents the uninterrupted run completed within the first 75%
of the tokens the two jobs took from their source, those that arrived with fewer tokens than
there (skipped), even in ``--dp-change-grace`` more steps of the resumed job: late is not lost
(ours plans windows of 16 steps, and a plan for another dp orders a window's documents anew; a
document the resumed job skips, as a per-rank reader that resumes another rank's position in its
own share of the files does, never arrives). A peer whose loader refuses the state says why
(``dp_change_error``).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import glob
import multiprocessing as mp
import os
import pickle
import queue
import socket
import sys
import tempfile
import time
from collections import Counter

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.memory import _pss, _serve, _stop  # noqa: E402
from benchmarks.output import emit_rows  # noqa: E402
from benchmarks.peer_pipelines import PEERS  # noqa: E402

OURS = ("ours", "ours_in_process", "ours_in_process_disk")
FILES, DOCS_PER_FILE = 16, 250
STALL_S = 600  # a run's trainers must finish within this after the last rank did (a hung loader fails it)
KINDS = ("web", "chat", "books")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---- trainer processes -----------------------------------------------------------------------
def _trainer(system: str, rank: int, dp: int, cfg: dict, first: int, last: int, state, ready, stop, out) -> None:
    """Steps [first, last) of one rank: per step the wait, the documents (source, id, tokens); an
    error (a loader that refuses a state, say) is reported as the rank's result."""
    try:
        _train(system, rank, dp, cfg, first, last, state, ready, stop, out)
    except Exception as err:
        ready.put(os.getpid())
        last = (str(err).strip().splitlines() or [""])[-1]  # (a DataLoader worker's error: its traceback's last line)
        out.put((rank, pickle.dumps({"error": f"{type(err).__name__}: {last}"[:500]})))
        stop.wait()


def _train(system: str, rank: int, dp: int, cfg: dict, first: int, last: int, state, ready, stop, out) -> None:
    os.dup2(2, 1)  # a peer's messages (Ray's cluster warnings) go to stderr, never into the JSON on stdout
    import torch

    mp.set_start_method(cfg["worker_start"], force=True)  # its DataLoader workers, as under torchrun
    if system == "bare":
        ready.put(os.getpid())
        stop.wait()
        return
    if system in OURS:
        from overlord_dask import OverlordDataset

        ds = OverlordDataset(cfg["address"], rank=rank, dp=dp)
        if state is not None:
            ds.load_state_dict(state)
        loader, holder = ds, ds  # iterated directly, as docs/guide/training.md shows
        record = PEERS["torchdata"].record  # the same packed-batch fields
    else:
        # as torchrun sets a rank up: its environment and a process group
        os.environ.update(
            RANK=str(rank), WORLD_SIZE=str(dp), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(dp), NODE_RANK="0"
        )
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["port"]))
        torch.distributed.init_process_group("gloo", rank=rank, world_size=dp)
        peer = PEERS[system]
        loader, holder = peer.loader(cfg, rank, dp)
        if state is not None and holder is not None:
            holder.load_state_dict(state)
        record = peer.record
    it = iter(loader)
    waits, ends, steps, t_start = [], [], [], time.perf_counter()
    for step in range(first, last):
        t0 = time.perf_counter()
        try:
            mb = next(it)
        except StopIteration:  # the end of an epoch: the training loop's next epoch
            it = iter(loader)
            mb = next(it)
        waits.append(time.perf_counter() - t0)
        if step == first:
            ready.put(os.getpid())
        src, ids, lens, capacity = record(mb)
        steps.append({"source_ids": src, "sample_ids": ids, "lengths": lens, "capacity": capacity})
        time.sleep(cfg["compute_s"])
        ends.append(time.perf_counter())
    wall = time.perf_counter() - t_start
    saved = holder.state_dict() if holder is not None else None
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
    if system in OURS:
        ds.close()
    elif torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def _check_alive(system: str, ps: list, deadline: float) -> None:
    """A trainer that died, or trainers that stalled (no rank got further for ``STALL_S``), end
    the run with an error instead of a benchmark that never returns."""
    if any(p.exitcode not in (None, 0) for p in ps):
        raise RuntimeError(f"a {system} trainer died: exit codes {[p.exitcode for p in ps]}") from None
    if time.monotonic() > deadline:
        raise RuntimeError(f"the {system} trainers stalled: no rank finished within {STALL_S} s")


def _run(system: str, dp: int, cfg: dict, first: int, last: int, states=None, extra_pids=(), sample=True) -> dict:
    ctx = mp.get_context("spawn")
    ready, out, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    cfg = {**cfg, "port": _free_port()}
    ps = [
        ctx.Process(
            target=_trainer, args=(system, r, dp, cfg, first, last, states[r] if states else None, ready, stop, out)
        )
        for r in range(dp)
    ]
    for p in ps:
        p.start()
    pids = []
    deadline = time.monotonic() + STALL_S
    try:
        while len(pids) < dp:
            try:
                pids.append(ready.get(timeout=5))
            except queue.Empty:
                _check_alive(system, ps, deadline)
        samples = []
        res: dict = {}
        while len(res) < dp:
            if sample:
                samples.append(_pss(pids + list(extra_pids)))
            try:
                r, v = out.get(timeout=0.5)
                res[r] = pickle.loads(v)
                deadline = time.monotonic() + STALL_S
            except queue.Empty:
                _check_alive(system, ps, deadline)
            if system == "bare" and len(samples) >= 4:
                break
    except RuntimeError:  # the trainers and their loader workers, none left behind
        import psutil

        for p in ps:
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in psutil.Process(p.pid).children(recursive=True):
                    child.kill()
            p.kill()
        raise
    stop.set()
    for p in ps:
        p.join(timeout=60)
        if p.is_alive():
            p.kill()
    errors = [f"rank {r}: {v['error']}" for r, v in sorted(res.items()) if "error" in v]
    if errors:
        raise RuntimeError(f"{system}: {errors[0]}")
    return {"ranks": [res[r] for r in sorted(res)], "pss_mb": samples}


def _stream(ranks: list[dict]) -> list:
    return [[list(zip(s["source_ids"], s["sample_ids"], s["lengths"])) for s in r["steps"]] for r in ranks]


def _pieces(ranks: list[dict], steps: int | None = None) -> list[tuple]:
    """(source, document, tokens) of every piece ``ranks`` delivered in their first ``steps``
    steps, in delivery order (step by step, ranks in order within a step)."""
    per_rank = _stream(ranks)
    n = min(steps or 1 << 30, max(map(len, per_rank)))
    return [piece for k in range(n) for r in per_rank if k < len(r) for piece in r[k]]


def _doc_tokens(pieces) -> Counter:
    got: Counter = Counter()
    for src, doc, n in pieces:
        got[(src, doc)] += int(n)
    return got


def dp_change_errors(
    reference: list, resumed: list, lengths: dict, share: float = 0.75, late: list = ()
) -> tuple[int, int]:
    """(documents lost, documents repeated) of ``resumed`` (``_pieces`` of the job before the
    stop and of the job resumed with another dp) against ``reference`` (an uninterrupted run
    over as many rank-steps, shorter than any source's epoch): repeated, a document with more
    tokens than it has (``lengths``) and than the reference gave it (a peer that upsamples a
    small source repeats its documents within an epoch, the uninterrupted run too); lost, a
    document the reference completed within the first ``share`` of the tokens the resumed jobs
    took from its source, with fewer tokens than there, counting the pieces ``late`` (the
    resumed job's steps past the check's) too. Repetitions are counted over the check's steps
    only, where the reference ran as long (past them, a source a peer upsamples repeats)."""
    ref, within, got = _doc_tokens(reference), _doc_tokens(resumed), _doc_tokens([*resumed, *late])
    taken: Counter = Counter()
    for (src, _), n in within.items():
        taken[src] += n
    repeated = sum(n > max(lengths[key], ref[key]) for key, n in within.items())
    done_at, seen = {}, Counter()  # document -> its source's tokens in the reference once its last piece is in
    for src, doc, n in reference:
        seen[src] += int(n)
        done_at[(src, doc)] = seen[src]
    lost = sum(got[key] < n for key, n in ref.items() if done_at[key] <= share * taken[key[0]])
    return lost, repeated


@functools.cache
def _doc_bytes(files: tuple) -> dict:
    """(source index, document) -> its text's UTF-8 bytes, over ``files`` ((name, paths) per
    source, sorted by name): read once per run, whichever systems ask."""
    from benchmarks.peer_pipelines import _documents

    return {(i, doc): len(text.encode()) for i, (_, paths) in enumerate(files) for doc, text in _documents(paths)}


def doc_lengths(files: dict, reference: dict) -> dict:
    """(source, document) -> its tokens as the system delivers them: its text's bytes plus the
    system's own per-document extra (an end-of-document token), the commonest in ``reference``."""
    base = _doc_bytes(tuple((name, tuple(files[name])) for name in sorted(files)))
    extra = Counter(n - base[key] for key, n in reference.items()).most_common(1)[0][0]
    return {key: n + extra for key, n in base.items()}


def shuffle_quality(ranks: list[dict], n_sources: int) -> tuple[float, float]:
    """(share of consecutive documents of a source, on a rank, from the same file; mean distinct
    files among 256 consecutive documents of a source), over every rank and source. A document
    split over several pieces counts once, where it first appears."""
    same, pairs, distinct = 0, 0, []
    for r in ranks:
        seen: set = set()
        per_source: list[list[int]] = [[] for _ in range(n_sources)]
        for s in r["steps"]:
            for src, doc in zip(s["source_ids"], s["sample_ids"]):
                if (src, doc) not in seen:
                    seen.add((src, doc))
                    per_source[src].append(doc // DOCS_PER_FILE)
        for files in per_source:
            f = np.asarray(files)
            same += int((f[1:] == f[:-1]).sum())
            pairs += max(len(f) - 1, 0)
            distinct += [len(set(f[i : i + 256].tolist())) for i in range(0, len(f) - 255, 256)]
    return (same / pairs if pairs else float("nan")), (float(np.mean(distinct)) if distinct else float("nan"))


def _figures(system: str, full: dict, bare_mb: float, weights: np.ndarray, warmup: int, window: int) -> dict:
    from overlord_dask.observe.figures import window_mix_errors

    ranks = full["ranks"]
    steps = len(ranks[0]["steps"])
    per_step = np.zeros((steps, len(weights)))
    capacity = 0
    for r in ranks:
        for k, s in enumerate(r["steps"]):
            np.add.at(per_step[k], np.asarray(s["source_ids"], int), np.asarray(s["lengths"], float))
            capacity += s["capacity"]
    tokens = per_step[warmup:].sum()
    waits = np.concatenate([np.asarray(r["waits"][warmup:]) for r in ranks])
    share = np.mean([sum(r["waits"][warmup:]) / max(r["ends"][-1] - r["ends"][warmup - 1], 1e-9) for r in ranks])
    wall = max(r["ends"][-1] for r in ranks) - min(r["ends"][warmup - 1] for r in ranks)  # after the warm-up, all ranks
    mem = np.asarray(full["pss_mb"][len(full["pss_mb"]) // 4 :] or full["pss_mb"]) - bare_mb
    same_file, files_256 = shuffle_quality(ranks, len(weights))
    return {
        "system": system,
        "tokens_per_s": round(tokens / wall),
        "fill": round(float(per_step.sum() / max(capacity, 1)), 4),
        "wait_share": round(float(share), 4),
        "wait_p99_ms": round(float(np.percentile(waits, 99)) * 1e3, 2),
        "time_to_first_batch_s": round(float(np.mean([r["first_s"] for r in ranks])), 2),
        "memory_mb": round(float(np.median(mem)), 1),
        "mix_error_window_max": round(
            float(window_mix_errors(per_step, np.tile(weights, (steps, 1)), window).max()), 4
        ),
        "same_file_neighbours": round(same_file, 3),
        "files_per_256_docs": round(files_256, 1),
    }


def _started(system: str, dp: int, cfg: dict, serve) -> tuple:
    """What runs beside ``dp`` trainers of ``system`` (ours' service, Ray Data's driver), started:
    its process (or None) and the trainers' settings."""
    t0 = time.perf_counter()
    if system in OURS:
        proc, address = serve(system != "ours", dp, disk=system == "ours_in_process_disk")
        extra = {"address": address}
    else:
        proc, extra = PEERS[system].serve(cfg, dp)
    return proc, {**cfg, **extra, "service_start_s": time.perf_counter() - t0}


def memory_at(system: str, dp: int, cfg: dict, steps: int, bare_mb: float, serve) -> float:
    """The loading path's memory (MB, PSS less ``dp`` bare trainers) with ``dp`` ranks taking
    ``steps`` steps: the median of the samples after the first quarter."""
    proc, c = _started(system, dp, cfg, serve)
    try:
        run = _run(system, dp, c, 0, steps, extra_pids=[proc.pid] if proc else ())
    finally:
        if proc:
            _stop(proc)
    samples = run["pss_mb"][len(run["pss_mb"]) // 4 :] or run["pss_mb"]
    return round(float(np.median(samples)) - bare_mb, 1)


def measure_system(system: str, dp: int, cfg: dict, args, bare_mb: float, weights: np.ndarray, serve=None) -> dict:
    def started():
        return _started(system, dp, cfg, serve)

    proc, c = started()
    try:
        full = _run(system, dp, c, 0, args.steps, extra_pids=[proc.pid] if proc else ())
    finally:
        if proc:
            _stop(proc)
    figures = {
        **_figures(system, full, bare_mb, weights, args.warmup, args.window),
        "prepare_s": round(cfg.get("prepare_s", {}).get(system, 0.0), 2),
        "service_start_s": round(c["service_start_s"], 2),
    }
    if system not in OURS and not PEERS[system].resumable:
        why = PEERS[system].not_resumable
        return {**figures, "resume_identical": None, "resume_not_supported": why, "dp_change_not_supported": why}
    proc, c2 = started()
    try:
        head = _run(system, dp, c2, 0, args.kill_at, sample=False)
        tail = _run(system, dp, c2, args.kill_at, args.steps, states=[r["state"] for r in head["ranks"]], sample=False)
    finally:
        if proc:
            _stop(proc)
    resumed = [h + t for h, t in zip(_stream(head["ranks"]), _stream(tail["ranks"]))]
    reference = _stream(full["ranks"])
    mismatched = sum(a != b for ra, rb in zip(reference, resumed) for a, b in zip(ra, rb))
    figures = {**figures, "resume_identical": mismatched == 0, "resume_steps_differing": mismatched}
    return {**figures, **dp_changed(system, dp, cfg, args, serve, full)}


def dp_changed(system: str, dp: int, cfg: dict, args, serve, full: dict) -> dict:
    """The job stopped at ``--dp-change-at`` and resumed from its states with ``--dp-change``
    ranks (see the module's docstring): lost and repeated documents, or the error the peer's
    loader raised."""
    new_dp, at, total = args.dp_change, args.dp_change_at, args.dp_change_steps
    if not new_dp or new_dp == dp:
        return {}
    last = at + (total - at) * dp // new_dp  # as many rank-steps as the reference's first ``total`` steps
    proc, c = _started(system, dp, cfg, serve)  # (ours: a service of the old dp; the new job re-plans it)
    try:
        head = _run(system, dp, c, 0, at, sample=False)
        states = [head["ranks"][r % dp]["state"] for r in range(new_dp)]
        tail = _run(system, new_dp, c, at, last + args.dp_change_grace, states=states, sample=False)
    except RuntimeError as err:
        return {"dp_change": f"{dp}->{new_dp}", "dp_change_error": str(err)}
    finally:
        if proc:
            _stop(proc)
    reference = _pieces(full["ranks"], total)
    after = _pieces(tail["ranks"])
    within = len(_pieces(tail["ranks"], last - at))  # (pieces come step by step)
    resumed, late = _pieces(head["ranks"]) + after[:within], after[within:]
    lengths = doc_lengths(cfg["files"], _doc_tokens(reference))
    lost, repeated = dp_change_errors(reference, resumed, lengths, late=late)
    return {"dp_change": f"{dp}->{new_dp}", "dp_change_lost_docs": lost, "dp_change_repeated_docs": repeated}


def generate_corpus(root: str, n_sources: int, row_group: int = DOCS_PER_FILE) -> list[str]:
    """``n_sources`` text sources of ``FILES`` files each, lengths web-, chat- and book-like in
    turn, row groups of ``row_group`` documents."""
    from overlord_dask.service.demo import generate_text_sources

    return generate_text_sources(
        root, n_sources, files=FILES, docs_per_file=DOCS_PER_FILE, row_group=row_group, kinds=KINDS
    )


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--sources", type=int, default=3)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank and step (one micro-batch)")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--kill-at", type=int, default=120)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--window", type=int, default=20)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--packing", choices=["whole", "cut"], default="cut", help="ours: balance.packing")
    ap.add_argument("--systems", nargs="+", default=[*PEERS, *OURS], choices=[*PEERS, *OURS])
    ap.add_argument(
        "--worker-start",
        choices=["fork", "spawn"],
        default="fork",
        help="how the trainers' DataLoader workers start (torchrun's trainers fork theirs)",
    )
    ap.add_argument("--data", default=None, help="folder for the generated sources (default: a temporary one)")
    ap.add_argument("--memory-dp", type=int, nargs="*", default=[], help="also the memory at these dp (e.g. 8 32)")
    ap.add_argument("--memory-steps", type=int, default=40, help="steps of each --memory-dp run")
    ap.add_argument("--dp-change", type=int, default=4, help="dp of the resumed job in the dp-change check (0: none)")
    ap.add_argument("--dp-change-at", type=int, default=40, help="the step the dp-change check stops at")
    ap.add_argument("--dp-change-steps", type=int, default=100, help="the check's rank-steps, as steps of the first dp")
    ap.add_argument(
        "--dp-change-grace",
        type=int,
        default=16,
        help="steps the resumed job runs on past the check's: a document delivered there is late, not lost "
        "(ours orders each window of balance.window steps, 16, anew for the new dp)",
    )
    ap.add_argument(
        "--row-group",
        type=int,
        default=DOCS_PER_FILE,
        help="documents per parquet row group (smaller: more row groups, as dp 32 needs for the peers that "
        "split a source's row groups over the ranks)",
    )
    args = ap.parse_args(argv)
    if args.dp_change and not 0 < args.dp_change_at < args.dp_change_steps <= args.steps:
        ap.error("the dp-change check needs 0 < --dp-change-at < --dp-change-steps <= --steps")

    with tempfile.TemporaryDirectory() as tmp:
        root = args.data or tmp
        names = generate_corpus(root, args.sources, args.row_group)
        raw = np.array([5.0, 3.0, 2.0] + [1.0] * max(args.sources - 3, 0))[: args.sources]
        weights = raw / raw.sum()
        cfg = {
            "tokens": args.tokens,
            "compute_s": args.compute_ms / 1e3,
            "seed": args.seed,
            "files": {n: sorted(glob.glob(os.path.join(root, n, "*.parquet"))) for n in names},
            "weights": {n: float(w) for n, w in zip(names, weights)},
            "prepare_s": {},
        }
        rows, skipped = [], []
        for system in args.systems:
            why = None if system in OURS else PEERS[system].missing()
            if why:
                skipped.append({"system": system, "not_supported": why})
                continue
            if system not in OURS:
                t0 = time.perf_counter()
                with contextlib.redirect_stdout(sys.stderr):  # (a peer's conversion prints progress)
                    cfg.update(PEERS[system].prepare(root, cfg["files"], cfg))
                cfg["prepare_s"][system] = time.perf_counter() - t0
        cfg["worker_start"] = args.worker_start
        bare = _run("bare", args.dp, cfg, 0, 1)
        bare_mb = float(np.median(bare["pss_mb"]))
        balance = {"packing": args.packing}

        def serve(in_process: bool, dp: int, disk: bool = False):
            return _serve(
                root,
                names,
                dp,
                args.tokens,
                2,
                weights=list(map(float, weights)),
                seed=args.seed,
                in_process=in_process,
                balance=balance,
                loading={"block_store": "disk"} if disk else None,
            )

        for system in args.systems:
            if any(s["system"] == system for s in skipped):
                continue
            rows.append(measure_system(system, args.dp, cfg, args, bare_mb, weights, serve=serve))
        memory = []  # the loading path's memory at other dp (--memory-dp), a short run each
        for dp in args.memory_dp:
            bare_dp = float(np.median(_run("bare", dp, cfg, 0, 1)["pss_mb"]))
            for row in rows:
                mb = memory_at(row["system"], dp, cfg, args.memory_steps, bare_dp, serve)
                memory.append({"system": row["system"], "dp": dp, "memory_mb": mb})
    out = {
        "benchmark": "peers",
        "cores": os.cpu_count(),
        "dp": args.dp,
        "sources": args.sources,
        "row_group_docs": args.row_group,
        "weights": [round(float(w), 4) for w in weights],
        "tokens_per_rank_step": args.tokens,
        "compute_ms": args.compute_ms,
        "steps": args.steps,
        "kill_at": args.kill_at,
        "worker_start": args.worker_start,
        "packing": args.packing,
        "systems": args.systems,
        "rows": rows,
        "memory_by_dp": memory,
        "not_supported": skipped,
    }
    emit_rows(
        out,
        args.json,
        [
            "system",
            "tokens_per_s",
            "fill",
            "wait_share",
            "wait_p99_ms",
            "time_to_first_batch_s",
            "prepare_s",
            "service_start_s",
            "memory_mb",
            "mix_error_window_max",
            "same_file_neighbours",
            "files_per_256_docs",
            "resume_identical",
            "dp_change_lost_docs",
            "dp_change_repeated_docs",
        ],
    )
    return out


if __name__ == "__main__":
    main()
