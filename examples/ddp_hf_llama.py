"""DDP training of a Hugging Face Llama-architecture model fed by an overlord-dask service.

    overlord serve pipelines/small.yaml --scheduler-file run.json      # the service, elsewhere
    torchrun --nproc_per_node 2 examples/ddp_hf_llama.py --address run.json --steps 50   # 50 steps

What a script adds for overlord-dask (marked ``# overlord`` below): the dataset (rank and world
size come from torchrun), HF-style labels in the ``[1, C]`` layout, a document mask so that packed
documents do not attend to each other, and the step's loss-token count for per-token loss
normalisation without an all-reduce. The model is built from a small config with random weights
(no download); on a GPU pass ``--device cuda``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import DataLoader
from transformers import LlamaConfig, LlamaForCausalLM

from overlord_dask import OverlordDataset  # overlord
from overlord_dask.trainer.masks import document_mask  # overlord


def tiny_llama(vocab: int, hidden: int = 64, layers: int = 2) -> LlamaForCausalLM:
    cfg = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1 << 16,
        attn_implementation="sdpa",
    )
    return LlamaForCausalLM(cfg)


def where_it_starts(step: int) -> str:
    """Why this job's first step is ``step`` (a job without a checkpoint takes the run's next step)."""
    if step == 0:
        return "step 0: the run's first"
    return (
        f"step {step}: the first step the ranks of the previous job had not all acknowledged "
        "(a job without a checkpoint goes on where the run is; load a checkpoint's state_dict() to go back)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--address", default=os.environ.get("OVERLORD_ADDRESS", "run.json"), help="service address or scheduler file"
    )
    ap.add_argument("--steps", type=int, default=20, help="steps this job trains, from where it starts")
    ap.add_argument("--vocab", type=int, default=512, help="the model's vocabulary (the demo's byte ids are below 260)")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--record", default=None, help="write one JSON line per step (loss, tokens) to RECORD.rank<r>")
    args = ap.parse_args()

    dist.init_process_group("nccl" if args.device == "cuda" else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = (
        torch.device(args.device, int(os.environ.get("LOCAL_RANK", 0)))
        if args.device == "cuda"
        else torch.device("cpu")
    )
    torch.manual_seed(0)  # the same initial weights on every rank
    model = DDP(tiny_llama(args.vocab).to(device))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

    ds = OverlordDataset(args.address, labels="hf", batch_dim=True, pin_memory=args.device == "cuda")  # overlord
    log = open(f"{args.record}.rank{rank}", "w") if args.record else None
    step_loss, done = torch.zeros((), device=device), 0
    for mb in DataLoader(ds, batch_size=None, num_workers=0):
        if done == 0 and mb["micro_batch"] == 0 and rank == 0:
            print(f"this job starts at {where_it_starts(mb['step'])}", flush=True)
        capacity = mb["input_ids"].shape[-1]
        mask = document_mask(mb["cu_seqlens"], capacity).to(device)  # overlord: no attention across documents
        sync = mb["last_in_step"]  # overlord: all-reduce on the step's last micro-batch
        with model.no_sync() if not sync else contextlib.nullcontext():  # DDP all-reduces once per step
            out = model(
                input_ids=mb["input_ids"].to(device),
                position_ids=mb["position_ids"].to(device),  # overlord: positions restart per document
                attention_mask=mask,
                labels=mb["labels"].to(device),
                num_items_in_batch=mb["step_loss_tokens"],
            )  # overlord: the whole step's tokens
            (out.loss * world).backward()  # DDP averages over ranks: the step's gradient is that of the mean token loss
        step_loss += out.loss.detach()
        if sync:
            opt.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(step_loss)  # for the log only: the mean token loss of the whole step
            if log:
                log.write(
                    json.dumps({"step": mb["step"], "loss": step_loss.item(), "tokens": int(mb["step_loss_tokens"])})
                    + "\n"
                )
            if rank == 0:
                print(f"step {mb['step']}: loss {step_loss.item():.4f}", flush=True)
            step_loss.zero_()
            done += 1
            if done >= args.steps:
                break
    ds.commit()  # overlord: the last step is done; a next job starts after it
    ds.close()
    if log:
        log.close()
    dist.barrier()  # no collective of any rank still in flight when the process groups go
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
