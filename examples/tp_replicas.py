"""Tensor parallelism: a 2-D mesh (data parallel x tensor parallel); the tensor-parallel ranks of a
data-parallel rank are replicas that receive identical batches from overlord-dask, and the service
builds each batch once.

    overlord serve pipelines/small.yaml --scheduler-file run.json
    torchrun --nproc_per_node 4 examples/tp_replicas.py --address run.json --steps 20

The dataset takes the mesh and reads its place from it (``dp`` data-parallel; ``tp``, and ``pp``
where there is one, make replicas). The model is an MLP over token embeddings, split column- and
row-wise over ``tp`` with ``torch.distributed.tensor.parallel`` (DTensor).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.data import DataLoader

from overlord_dask import OverlordDataset  # overlord


class MLP(torch.nn.Module):
    def __init__(self, vocab: int, dim: int = 64):
        super().__init__()
        self.embed, self.head = torch.nn.Embedding(vocab, dim), torch.nn.Linear(dim, vocab)
        self.up, self.down = torch.nn.Linear(dim, 4 * dim), torch.nn.Linear(4 * dim, dim)

    def forward(self, ids):
        h = self.embed(ids)
        return self.head(h + self.down(torch.relu(self.up(h))))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default=os.environ.get("OVERLORD_ADDRESS", "run.json"))
    ap.add_argument("--steps", type=int, default=10, help="steps this job trains, from where it starts")
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--record", default=None, help="write one JSON line per step to RECORD.rank<r>")
    args = ap.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world // args.tp, args.tp), mesh_dim_names=("dp", "tp"))
    torch.manual_seed(0)
    model = parallelize_module(MLP(args.vocab), mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds = OverlordDataset(args.address, device_mesh=mesh)  # overlord: dp rank from "dp", replica from "tp"
    record = open(f"{args.record}.rank{dist.get_rank()}", "w") if args.record else None
    digest, step_loss, done = hashlib.sha256(), 0.0, 0
    for mb in DataLoader(ds, batch_size=None, num_workers=0):
        digest.update(mb["input_ids"].numpy().tobytes())
        logits = model(mb["input_ids"])
        loss = (
            torch.nn.functional.cross_entropy(logits, mb["labels"], ignore_index=-100, reduction="sum")
            / mb["step_loss_tokens"]  # overlord: per-token loss of the whole step
        )
        loss.backward()
        step_loss += loss.item()
        if mb["last_in_step"]:  # overlord: step on the step's last micro-batch
            for p in model.parameters():  # data parallelism by hand: average the gradients over the dp ranks
                g = p.grad.to_local() if hasattr(p.grad, "to_local") else p.grad
                dist.all_reduce(g, group=mesh["dp"].get_group())
            opt.step()
            opt.zero_grad(set_to_none=True)
            if record:
                record.write(
                    json.dumps(
                        {
                            "step": mb["step"],
                            "dp_rank": ds.rank,
                            "tp_rank": ds.replica,
                            "digest": digest.hexdigest(),
                            "loss": step_loss,
                        }
                    )
                    + "\n"
                )
            if dist.get_rank() == 0:
                print(f"step {mb['step']}: loss {step_loss:.4f}", flush=True)
            digest, step_loss, done = hashlib.sha256(), 0.0, done + 1
            if done >= args.steps:
                break
    ds.commit()  # overlord: the last step is done; a next job starts after it
    ds.close()
    dist.barrier()  # no collective of any rank still in flight when the process groups go
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
