"""FSDP2 (``fully_shard``) training with a DCP checkpoint of the model, the optimizer and the data
stream; restarted, it goes on from its last checkpoint exactly.

    overlord serve pipelines/small.yaml --scheduler-file run.json      # the service, elsewhere
    torchrun --nproc_per_node 2 examples/fsdp2_dcp.py --address run.json --steps 100 --checkpoint-dir ckpt

Kill the job at any point and run the same command again: it loads ``ckpt/latest``, and the
service (still running) serves the steps from that checkpoint on again, the very batches it served
the first time. The data state is tiny and the same on every rank (``{"version", "next_step"}``),
so DCP stores it once. What a script adds for overlord-dask is marked ``# overlord``.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader

from overlord_dask import OverlordDataset  # overlord
from overlord_dask.trainer.masks import document_mask  # overlord

try:
    from examples.ddp_hf_llama import tiny_llama, where_it_starts
except ImportError:  # run as a script from examples/
    from ddp_hf_llama import tiny_llama, where_it_starts


class TrainState(Stateful):
    """What a checkpoint holds: model, optimizer, the data stream's position, the step."""

    def __init__(self, model, opt, data):
        self.model, self.opt, self.data, self.step = model, opt, data, 0

    def state_dict(self) -> dict:
        model, optim = get_state_dict(self.model, self.opt)
        return {"model": model, "optim": optim, "data": self.data.state_dict(), "step": self.step}  # overlord: data

    def load_state_dict(self, state: dict) -> None:
        set_state_dict(self.model, self.opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        self.data.load_state_dict(state["data"])  # overlord: the service goes back to this step if it is past it
        self.step = state["step"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--address", default=os.environ.get("OVERLORD_ADDRESS", "run.json"), help="service address or scheduler file"
    )
    ap.add_argument(
        "--steps", type=int, default=20, help="the run's last step + 1: a resumed job trains up to the same step"
    )
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--checkpoint-dir", default="ckpt")
    ap.add_argument("--checkpoint-every", type=int, default=5)
    ap.add_argument("--record", default=None, help="append one JSON line per step (loss, tokens) to RECORD.rank<r>")
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = ap.parse_args()

    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo")
    rank = dist.get_rank()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = init_device_mesh(args.device, (dist.get_world_size(),), mesh_dim_names=("dp",))
    torch.manual_seed(0)
    model = tiny_llama(args.vocab).to(device)
    for layer in model.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ds = OverlordDataset(args.address, device_mesh=mesh, labels="hf", batch_dim=True, pin_memory=cuda)  # overlord
    state = TrainState(model, opt, ds)

    ckpt = Path(args.checkpoint_dir)
    latest = ckpt / "latest"
    if latest.exists():
        dcp.load({"train": state}, checkpoint_id=str(ckpt / latest.read_text().strip()))
        if rank == 0:
            print(f"resumed at step {state.step}", flush=True)
    record = open(f"{args.record}.rank{rank}", "a") if args.record else None

    step_loss, step_ids, first = torch.zeros((), device=device), 0, True
    for mb in DataLoader(ds, batch_size=None, num_workers=0):
        if first:  # where this job starts, and whether the run still has steps for it
            first = False
            if rank == 0 and not latest.exists():
                print(f"this job starts at {where_it_starts(mb['step'])}", flush=True)
            if mb["step"] >= args.steps:
                if rank == 0:
                    print(
                        f"the run is at step {mb['step']}, --steps is {args.steps} (the run's last step + 1): "
                        "nothing to train",
                        flush=True,
                    )
                break
        step_ids += int(mb["input_ids"].sum())
        mask = document_mask(mb["cu_seqlens"], mb["input_ids"].shape[-1]).to(device)  # overlord: no cross-document
        out = model(
            input_ids=mb["input_ids"].to(device),
            position_ids=mb["position_ids"].to(device),  # overlord: positions restart per document
            attention_mask=mask,
            labels=mb["labels"].to(device),
            num_items_in_batch=mb["step_loss_tokens"],
        )  # overlord: the step's loss tokens
        (out.loss * dist.get_world_size()).backward()  # FSDP averages gradients over ranks
        step_loss += out.loss.detach()
        if not mb["last_in_step"]:  # overlord: step on the step's last micro-batch
            continue
        opt.step()
        opt.zero_grad(set_to_none=True)
        dist.all_reduce(step_loss)
        state.step = mb["step"] + 1
        if record:
            record.write(json.dumps({"step": mb["step"], "loss": step_loss.item(), "ids": step_ids}) + "\n")
            record.flush()
        if rank == 0:
            print(f"step {mb['step']}: loss {step_loss.item():.4f}", flush=True)
        step_loss.zero_()
        step_ids = 0
        if state.step % args.checkpoint_every == 0 or state.step >= args.steps:
            name = f"step-{state.step}"
            dcp.save({"train": state}, checkpoint_id=str(ckpt / name))
            dist.barrier()
            if rank == 0:  # only a complete checkpoint becomes the one to resume from
                (ckpt / "latest.tmp").write_text(name)
                os.replace(ckpt / "latest.tmp", latest)
        if state.step >= args.steps:
            break
    ds.close()
    dist.barrier()  # no collective of any rank still in flight when the process groups go
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
