"""Hugging Face ``Trainer`` fed by overlord-dask: every rank trains on its own stream.

    overlord serve pipelines/small.yaml --scheduler-file run.json
    torchrun --nproc_per_node 2 examples/hf_trainer.py --address run.json --steps 20

``Trainer`` hands an ``IterableDataset`` to ``accelerate``, which would read it on rank 0 only and
split the batches, or shard it over the ranks: ``PerRankTrainerMixin`` gives it the rank's own
stream instead, and ``HFBatches`` yields the model's keyword arguments (``[1, C]`` tensors,
unshifted labels, a document mask). An optimizer step is a planned step:
``gradient_accumulation_steps`` is the plan's ``micro_batches``.
"""

from __future__ import annotations

import argparse
import json
import os

import torch.distributed as dist
from transformers import Trainer, TrainerCallback, TrainingArguments

from overlord_dask.trainer.integrations import HFBatches, PerRankTrainerMixin  # overlord

try:
    from examples.ddp_hf_llama import tiny_llama
except ImportError:  # run as a script from examples/
    from ddp_hf_llama import tiny_llama


class OverlordTrainer(PerRankTrainerMixin, Trainer):  # overlord
    pass


class Record(TrainerCallback):
    """One JSON line per optimizer step: the loss this rank logged (tests read it)."""

    def __init__(self, path: str):
        self.path = path

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            with open(self.path, "a") as f:
                f.write(json.dumps({"step": state.global_step, "loss": logs["loss"]}) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default=os.environ.get("OVERLORD_ADDRESS", "run.json"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--output-dir", default="hf-trainer-out")
    ap.add_argument("--record", default=None, help="write one JSON line per step to RECORD.rank<r>")
    args = ap.parse_args()

    batches = HFBatches(args.address)  # overlord: rank and world size from torchrun
    micro_batches = batches.dataset.stream.micro_batches  # overlord: micro-batches per planned step
    training = TrainingArguments(
        output_dir=args.output_dir,
        max_steps=args.steps,
        gradient_accumulation_steps=micro_batches,
        per_device_train_batch_size=1,
        learning_rate=1e-3,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        dataloader_num_workers=0,
        remove_unused_columns=False,
        use_cpu=True,
        ddp_backend="gloo",
    )
    callbacks = [Record(f"{args.record}.rank{batches.dataset.rank}")] if args.record else []
    trainer = OverlordTrainer(model=tiny_llama(args.vocab), args=training, train_dataset=batches, callbacks=callbacks)
    trainer.train()
    batches.dataset.close()
    if dist.is_initialized():  # accelerate made the process group; a live gloo group can abort the exit
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
