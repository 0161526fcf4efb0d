"""Chat / SFT data through the service against a per-rank DataLoader doing the same work.

    python benchmarks/sft.py                 # table
    python benchmarks/sft.py --json

Data: ``--convs`` generated conversations (``service/chat_demo.py``: a system prompt half the
time, 1-5 user/assistant turns) as a parquet ``messages`` column, and a Llama-3-style tokenizer
folder with a chat template whose assistant answers are ``{% generation %}`` blocks.

Both systems feed ``--dp`` trainer *processes* that compute ``--compute-ms`` per step (a sleep
spread over the step's micro-batches, as ``trainer_wait.py`` does) and record the time spent in
``next()``:

- overlord: the plan's chat source (``messages_field``), rendered, tokenized and masked on the
  loader workers, packed and balanced by the service, through ``OverlordDataset``;
- peer, in the same run: each rank's ``torch.utils.data.DataLoader`` (``--peer-workers``
  processes) reads its share of the row groups, renders and masks each conversation with
  ``transformers``' ``apply_chat_template(..., return_assistant_tokens_mask=True)`` (what an SFT
  script does today) and packs conversations first-fit into the same micro-batches.

Keys: ``tokens_per_s`` / ``peer_tokens_per_s`` (real tokens delivered per second, all ranks, after
the warm-up), ``wait_share`` / ``peer_wait_share`` (time in ``next()`` over wall time), and
``mask_mismatches``: of the service's first ``--check-steps`` steps, the pieces whose labels
differ anywhere from the labels ``transformers``' mask gives the same conversation (must be 0).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.output import print_rows  # noqa: E402
from benchmarks.trainer_wait import _run_procs, _summarise, _train  # noqa: E402

CHECK_FIELDS = ("input_ids", "labels", "cu_seqlens", "sample_ids", "piece_starts")


class _Keep:
    """The first ``n`` micro-batches of an iterator, kept (as numpy) for the mask check."""

    def __init__(self, it, n: int):
        self.it, self.n, self.kept = iter(it), n, []

    def __iter__(self):
        return self

    def __next__(self):
        mb = next(self.it)
        if len(self.kept) < self.n:
            self.kept.append({k: np.asarray(mb[k]).copy() for k in CHECK_FIELDS})
        return mb


def _overlord(
    address: str, rank: int, dp: int, steps: int, compute_s: float, micro_batches: int, check: int, start, out
) -> None:
    from overlord_dask import OverlordDataset

    t0 = time.perf_counter()
    ds = OverlordDataset(address, rank=rank, dp=dp)
    keep = _Keep(torch.utils.data.DataLoader(ds, batch_size=None, num_workers=0), check * micro_batches)
    res = _train(keep, micro_batches, steps, compute_s, start)
    res["t_start"], res["kept"] = t0, keep.kept
    ds.stream.commit()
    ds.close()
    out.put((rank, res))


def reference(tok, messages) -> tuple[list[int], list[int]]:
    out = tok.apply_chat_template(messages, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    return list(out["input_ids"]), list(out["assistant_masks"])


class PackedChat(torch.utils.data.IterableDataset):
    """The peer: conversations rendered and masked with transformers, packed first-fit."""

    def __init__(self, files: list[str], tokenizer: str, capacity: int, rank: int, world: int):
        super().__init__()
        self.files, self.tokenizer, self.capacity, self.rank, self.world = files, tokenizer, capacity, rank, world

    def __iter__(self):
        import pyarrow.parquet as pq
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(self.tokenizer, local_files_only=True)
        info = torch.utils.data.get_worker_info()
        wid, nw = (info.id, info.num_workers) if info else (0, 1)
        groups = [(f, g) for f in self.files for g in range(pq.ParquetFile(f).num_row_groups)]
        mine = groups[self.rank * nw + wid :: self.world * nw]
        cap = self.capacity
        ids, labels, pos, cu = np.zeros(cap, np.int64), np.full(cap, -100, np.int64), 0, [0]
        while True:
            for f, g in mine:
                for msgs in (
                    pq.ParquetFile(f).read_row_group(g, columns=["messages"], use_threads=False).column(0).to_pylist()
                ):
                    t, m = reference(tok, msgs)
                    L = min(len(t), cap)
                    if pos + L > cap:
                        yield {
                            "input_ids": torch.from_numpy(ids),
                            "labels": torch.from_numpy(labels),
                            "cu_seqlens": torch.tensor(cu, dtype=torch.int32),
                        }
                        ids, labels, pos, cu = np.zeros(cap, np.int64), np.full(cap, -100, np.int64), 0, [0]
                    ids[pos : pos + L] = t[:L]
                    nxt = np.asarray(t[1:L] + [0])
                    lab = np.where(np.asarray(m[1:L] + [0]) == 1, nxt, -100)
                    labels[pos : pos + L] = lab
                    pos += L
                    cu.append(pos)


def _peer(files, tokenizer, rank, dp, steps, compute_s, micro_batches, capacity, workers, start, out) -> None:
    t0 = time.perf_counter()
    loader = torch.utils.data.DataLoader(
        PackedChat(files, tokenizer, capacity, rank, dp),
        batch_size=None,
        num_workers=workers,
        prefetch_factor=2 if workers else None,
    )
    res = _train(loader, micro_batches, steps, compute_s, start)
    res["t_start"] = t0
    out.put((rank, res))


def _tokens_per_s(results: list[dict], warmup: int) -> float:
    return round(
        float(sum(sum(r["tokens"][warmup:]) / max(r["ends"][-1] - r["ends"][warmup - 1], 1e-9) for r in results)), 1
    )


def mask_mismatches(results: list[dict], convs: list, tokenizer: str) -> tuple[int, int]:
    """(pieces whose labels differ from transformers' for the same conversation, pieces checked)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer, local_files_only=True)
    refs: dict[int, tuple] = {}
    bad = checked = 0
    for r in results:
        for mb in r["kept"]:
            cu = mb["cu_seqlens"].astype(int)
            for k in range(len(cu) - 1):
                sid, start = int(mb["sample_ids"][k]), int(mb["piece_starts"][k])
                if sid not in refs:
                    refs[sid] = reference(tok, convs[sid])
                ids, mask = refs[sid]
                n = cu[k + 1] - cu[k]
                want = [ids[p + 1] if p + 1 < len(ids) and mask[p + 1] else -100 for p in range(start, start + n)]
                same = (
                    mb["input_ids"][cu[k] : cu[k + 1]].tolist() == ids[start : start + n]
                    and mb["labels"][cu[k] : cu[k + 1]].tolist() == want
                )
                bad += not same
                checked += 1
    return bad, checked


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--convs", type=int, default=20_000)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per micro-batch")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--warmup", type=int, default=5)
    ap.add_argument("--compute-ms", type=float, default=50.0)
    ap.add_argument("--check-steps", type=int, default=10)
    ap.add_argument("--workers", type=int, default=2, help="Dask worker processes of the service")
    ap.add_argument("--peer-workers", type=int, default=1, help="DataLoader workers per rank in the peer")
    ap.add_argument("--data", default=None, help="a folder for the generated data (default: a temporary one)")
    args = ap.parse_args(argv)

    import pyarrow.parquet as pq

    from overlord_dask import Service
    from overlord_dask.plan import plan_from_dict
    from overlord_dask.service.chat_demo import generate_chat_corpus, llama3_style_tokenizer
    from overlord_dask.service.deploy import local_cluster

    data = args.data or tempfile.mkdtemp(prefix="sft-bench-")
    tok = str(llama3_style_tokenizer(os.path.join(data, "llama3"), vocab_size=2000))
    folder = generate_chat_corpus(data, n=args.convs, files=4, seed=1, turns=(1, 6), words=(5, 120))
    files = sorted(str(p) for p in folder.glob("*.parquet"))
    convs = [c for f in files for c in pq.read_table(f).column("messages").to_pylist()]
    plan = plan_from_dict(
        {
            "name": "sft",
            "tokenizer": tok,
            "sources": [
                {"name": "chat", "format": "parquet", "url": f"{folder}/*.parquet", "messages_field": "messages"}
            ],
            "topology": {"dp": args.dp, "micro_batches": args.micro_batches, "tokens_per_micro_batch": args.tokens},
        },
        base_dir=data,
    )
    ctx = mp.get_context("spawn")
    compute_s = args.compute_ms / 1e3
    with local_cluster(n_workers=args.workers) as cluster, Service.start(plan, cluster=cluster) as service:
        res = _run_procs(
            ctx,
            _overlord,
            lambda r: (service.address, r, args.dp, args.steps, compute_s, args.micro_batches, args.check_steps),
            args.dp,
        )
    peer = _run_procs(
        ctx,
        _peer,
        lambda r: (files, tok, r, args.dp, args.steps, compute_s, args.micro_batches, args.tokens, args.peer_workers),
        args.dp,
    )
    bad, checked = mask_mismatches(res, convs, tok)
    row = {
        "tokens_per_s": _tokens_per_s(res, args.warmup),
        "peer_tokens_per_s": _tokens_per_s(peer, args.warmup),
        "wait_share": _summarise(res, args.warmup)["wait_share"],
        "peer_wait_share": _summarise(peer, args.warmup)["wait_share"],
        "mask_mismatches": bad,
        "pieces_checked": checked,
    }
    out = {
        "benchmark": "sft",
        "cores": os.cpu_count(),
        "dp": args.dp,
        "micro_batches": args.micro_batches,
        "tokens_per_micro_batch": args.tokens,
        "steps": args.steps,
        "warmup": args.warmup,
        "compute_ms": args.compute_ms,
        "convs": args.convs,
        **row,
    }
    if args.json:
        print(json.dumps(out))
    else:
        print_rows([row], list(row))
    return out


if __name__ == "__main__":
    main()
