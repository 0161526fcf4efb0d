"""Feedback mixing benchmark: does a mixing controller driven by the trainer's losses save tokens?

    python benchmarks/feedback_mixing.py            # readable table
    python benchmarks/feedback_mixing.py --json     # one JSON object

A small next-token model (embeddings of the two previous tokens, an MLP; CPU, one thread) trains
through a running service on three generated sources that differ in what they teach it:

- ``noise``: uniform random tokens (nothing to learn: its loss stays at ln 64);
- ``easy``: each token mostly determines the next (learned in a few hundred steps);
- ``hard``: the next token depends on the previous two, a few choices each (learnable, slowly).

The plan mixes them equally (the **static** mix), as a scraped corpus mixes useful and useless
text. The target is a held-out mix of the learnable sources, ``easy`` and ``hard`` in equal
parts (documents the service never serves). Two runs, same plan, seed and model
initialisation: the static mix, and ``mixing: {controller: odm}`` (``planner/mixing.py``: EXP3
over the sources, rewarded by each source's learning progress from the losses the trainer reports
with ``report(step, loss_by_source(...))``).

Reported: ``tokens_to_target_static`` (tokens until the static run's held-out loss first reaches
its own final value, the mean of its last three evaluations), ``tokens_to_target_controller``
(tokens until the controlled run reaches that same loss), ``token_saving`` (1 - controller /
static; goal >= 15%, ODM reports 19% fewer iterations), ``replay_identical`` (the controlled run's
stream re-planned offline from its plan and recorded decisions equals what it delivered),
``duplicates`` / ``missing`` (delivered against planned pieces, controlled run), the final shares
and the number of decisions.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from output import emit  # noqa: E402  (benchmarks/output.py)

V = 64  # the sources' alphabet
VOCAB = 300  # the model's (pad and special ids of the default tokenizer fit)
SOURCES = ("noise", "easy", "hard")


def generate(kind: str, n_docs: int, rng: np.random.Generator, tables: dict) -> list[np.ndarray]:
    """``n_docs`` documents of ``kind`` (``tables``: the easy and hard sources' fixed rules)."""
    docs = []
    for n in np.clip(rng.lognormal(5.5, 0.5, n_docs), 32, 2000).astype(int):
        x = np.empty(n, np.int64)
        x[:2] = rng.integers(0, V, 2)
        if kind == "noise":
            x[:] = rng.integers(0, V, n)
        elif kind == "easy":
            flip = rng.random(n) < 0.1
            rand = rng.integers(0, V, n)
            for i in range(1, n):
                x[i] = rand[i] if flip[i] else tables["perm"][x[i - 1]]
        else:
            u = rng.random(n)
            for i in range(2, n):
                ctx = x[i - 2] * V + x[i - 1]
                x[i] = tables["next"][ctx, np.searchsorted(tables["cum"][ctx], u[i])]
        docs.append(x)
    return docs


def rules(seed: int) -> dict:
    rng = np.random.default_rng(seed)
    probs = rng.dirichlet(np.full(4, 0.7), V * V)
    return {
        "perm": rng.permutation(V),
        "next": rng.integers(0, V, (V * V, 4)),
        "cum": np.minimum(np.cumsum(probs, axis=1), 1 - 1e-12),
    }


def write_sources(root: Path, docs: int, seed: int) -> dict[str, list[np.ndarray]]:
    """Training sources as zarr files; returns held-out documents of each (never served)."""
    import zarr

    tables = rules(seed)
    held = {}
    for k, name in enumerate(SOURCES):
        rng = np.random.default_rng([seed, k])
        train = generate(name, docs, rng, tables)
        if name != "noise":  # the target: the data worth learning (noise has no held-out part)
            held[name] = generate(name, 150, rng, tables)
        lens = np.array([len(d) for d in train])
        offsets = np.concatenate([[0], np.cumsum(lens)]).astype(np.int64)
        g = zarr.open_group(str(root / f"{name}.zarr"), mode="w")
        g.create_array("tokens", shape=(int(offsets[-1]),), chunks=(1 << 18,), dtype="int32")[:] = np.concatenate(
            train
        ).astype(np.int32)
        g.create_array("offsets", shape=offsets.shape, chunks=(1 << 16,), dtype="int64")[:] = offsets
    return held


class Model:
    """Next token from the two previous ones: embeddings, concatenated, an MLP."""

    def __init__(self, seed: int):
        import torch

        torch.manual_seed(seed)
        self.torch = torch
        self.net = torch.nn.ModuleDict(
            {
                "emb": torch.nn.Embedding(VOCAB + 1, 32),
                "mlp": torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.ReLU(), torch.nn.Linear(256, VOCAB)),
            }
        )
        self.opt = torch.optim.Adam(self.net.parameters(), lr=2e-3)

    def token_losses(self, ids, prev, labels):
        torch = self.torch
        e = self.net["emb"]
        h = torch.cat([e(ids), e(prev)], dim=-1)
        logits = self.net["mlp"](h)
        return torch.nn.functional.cross_entropy(logits, labels, ignore_index=-100, reduction="none")

    def train_step(self, mb: dict):
        torch = self.torch
        ids = torch.as_tensor(mb["input_ids"], dtype=torch.long)
        labels = torch.as_tensor(mb["labels"], dtype=torch.long)
        prev = torch.full_like(ids, VOCAB)  # no previous token at a document's start
        prev[1:] = ids[:-1]
        starts = torch.as_tensor(np.asarray(mb["cu_seqlens"][:-1], np.int64))
        prev[starts[starts < len(ids)]] = VOCAB
        losses = self.token_losses(ids, prev, labels)
        valid = (labels != -100).sum().clamp(min=1)
        self.opt.zero_grad()
        (losses.sum() / valid).backward()
        self.opt.step()
        return losses.detach()

    def held_out_loss(self, held: dict[str, list[np.ndarray]]) -> float:
        """Mean token loss of the held-out mix (the learnable sources' documents in equal parts)."""
        torch = self.torch
        per = []
        with torch.no_grad():
            for docs in held.values():
                ids = torch.as_tensor(np.concatenate([d[:-1] for d in docs]))
                prev = torch.as_tensor(np.concatenate([np.concatenate([[VOCAB], d[:-2]]) for d in docs]))
                labels = torch.as_tensor(np.concatenate([d[1:] for d in docs]))
                per.append(float(self.token_losses(ids, prev, labels).mean()))
        return float(np.mean(per))


def make_plan(root: Path, tokens: int, mixing: dict | None):
    from overlord_dask.plan import plan_from_dict

    return plan_from_dict(
        {
            "name": "feedback-mixing",
            "seed": 3,
            "sources": [{"name": n, "format": "zarr", "url": f"{n}.zarr", "weight": 1.0} for n in SOURCES],
            "topology": {"dp": 1, "micro_batches": 1, "tokens_per_micro_batch": tokens},
            "loading": {"prefetch_steps": 8, "unit_tokens": 1 << 16},
            **({"mixing": mixing} if mixing else {}),
        },
        base_dir=str(root),
    )


def train(plan, cluster, steps: int, held: dict, eval_every: int, seed: int) -> dict:
    """Train a fresh model for ``steps`` steps on the service's stream, reporting per-source losses."""
    from overlord_dask import Service, connect
    from overlord_dask.observe.figures import delivered_identities, delivered_record

    model = Model(seed)
    curve, delivered = [(0, model.held_out_loss(held))], []
    with Service.start(plan, cluster=cluster) as service:
        with connect(service.address, 0, timeout=300) as stream:
            for _ in range(steps):
                batch = stream.next_batch()
                delivered.append(delivered_identities(delivered_record(batch)))
                for mb in batch["micro_batches"]:
                    losses = model.train_step(mb)
                    stream.report(batch["step"], stream.loss_by_source(mb, losses.numpy()))
                if (batch["step"] + 1) % eval_every == 0:
                    curve.append((batch["step"] + 1, model.held_out_loss(held)))
            stream.commit()
        timeline, ledger = service.timeline(), service.ledger(0, steps)
    return {"curve": curve, "timeline": timeline, "ledger": ledger, "delivered": delivered}


def tokens_to(curve: list[tuple[int, float]], target: float, tokens_per_step: int) -> int | None:
    for step, loss in curve:
        if loss <= target:
            return step * tokens_per_step
    return None


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--tokens", type=int, default=2048, help="tokens per step")
    ap.add_argument("--eval-every", type=int, default=10)
    ap.add_argument("--docs", type=int, default=6000, help="training documents per source")
    ap.add_argument("--interval", type=int, default=10, help="steps between the controller's decisions")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)

    import torch

    torch.set_num_threads(1)
    from overlord_dask.observe.figures import exactly_once, planned_identities
    from overlord_dask.service.deploy import local_cluster
    from overlord_dask.service.replay import replay

    mixing = {
        "controller": "odm",
        "interval": args.interval,
        "lag": 2,
        "max_change": 0.1,
        "min_share": 0.05,
        "options": {"exploration": 0.02, "eta": 2.0},
    }
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        held = write_sources(root, args.docs, args.seed)
        with local_cluster(n_workers=args.workers) as cluster:
            static = train(make_plan(root, args.tokens, None), cluster, args.steps, held, args.eval_every, args.seed)
            plan = make_plan(root, args.tokens, mixing)
            ctl = train(plan, cluster, args.steps, held, args.eval_every, args.seed)
        target = float(np.mean([loss for _, loss in static["curve"][-3:]]))
        t_static = tokens_to(static["curve"], target, args.tokens)
        t_ctl = tokens_to(ctl["curve"], target, args.tokens)
        again = replay(plan, ctl["timeline"], args.steps)
        ledger = ctl["ledger"]
        dup, miss = exactly_once([planned_identities(ledger[s]) for s in range(args.steps)], ctl["delivered"])
        shares = [d for d in ctl["timeline"].decisions if d.kind == "weights"]
        out = {
            "benchmark": "feedback_mixing",
            "steps": args.steps,
            "tokens_per_step": args.tokens,
            "held_out_final_static": round(target, 4),
            "held_out_final_controller": round(float(np.mean([x for _, x in ctl["curve"][-3:]])), 4),
            "tokens_to_target_static": t_static,
            "tokens_to_target_controller": t_ctl,
            "token_saving": round(1 - t_ctl / t_static, 4) if t_static and t_ctl else None,
            "replay_identical": all(np.array_equal(again[s]["pieces"], ledger[s]["pieces"]) for s in range(args.steps)),
            "duplicates": dup,
            "missing": miss,
            "decisions": len(shares),
            "final_shares": {k: round(v, 3) for k, v in shares[-1].values.items()} if shares else None,
        }
    emit(out, args.json)
    return out


if __name__ == "__main__":
    main()
