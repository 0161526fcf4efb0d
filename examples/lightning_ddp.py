"""PyTorch Lightning (DDP) fed by overlord-dask.

    overlord serve pipelines/small.yaml --scheduler-file run.json
    torchrun --nproc_per_node 2 examples/lightning_ddp.py --address run.json --steps 20

Lightning takes the ``DataLoader`` of ``train_dataloader()`` as it is for an ``IterableDataset``
(no distributed sampler), so each rank's loader is its own stream; ``accumulate_grad_batches``
is the plan's ``micro_batches``, so that an optimizer step is a planned step. The data position is
saved with Lightning's checkpoints (``on_save_checkpoint``/``on_load_checkpoint``).
"""

from __future__ import annotations

import argparse
import json
import os

import lightning as L
import torch
from torch.utils.data import DataLoader

from overlord_dask import OverlordDataset  # overlord
from overlord_dask.trainer.masks import document_mask  # overlord

try:
    from examples.ddp_hf_llama import tiny_llama
except ImportError:  # run as a script from examples/
    from ddp_hf_llama import tiny_llama


class LitLM(L.LightningModule):
    def __init__(self, dataset: OverlordDataset, vocab: int, record: str | None):
        super().__init__()
        self.dataset, self.model, self.record = dataset, tiny_llama(vocab), record

    def train_dataloader(self):
        return DataLoader(self.dataset, batch_size=None, num_workers=0)  # overlord: the rank's stream, whole

    def training_step(self, mb, batch_idx):
        out = self.model(
            input_ids=mb["input_ids"],
            position_ids=mb["position_ids"],  # overlord: positions restart per document
            labels=mb["labels"],
            attention_mask=document_mask(
                mb["cu_seqlens"], mb["input_ids"].shape[-1]
            ),  # overlord: no attention across documents
            num_items_in_batch=mb["step_loss_tokens"],
        )  # overlord: the whole step's loss tokens
        if self.record and mb["last_in_step"]:
            with open(self.record, "a") as f:
                f.write(json.dumps({"step": mb["step"], "rank": mb["rank"], "loss": out.loss.item()}) + "\n")
        return out.loss * self.trainer.world_size  # DDP averages gradients over ranks

    def configure_optimizers(self):
        return torch.optim.AdamW(self.model.parameters(), lr=1e-3)

    def on_save_checkpoint(self, checkpoint: dict) -> None:
        checkpoint["overlord"] = self.dataset.state_dict()  # overlord

    def on_load_checkpoint(self, checkpoint: dict) -> None:
        self.dataset.load_state_dict(checkpoint["overlord"])  # overlord


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--address", default=os.environ.get("OVERLORD_ADDRESS", "run.json"))
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--record", default=None, help="write one JSON line per step to RECORD.rank<r>")
    args = ap.parse_args()

    torch.manual_seed(0)
    ds = OverlordDataset(args.address, labels="hf", batch_dim=True)  # overlord: rank and world size from torchrun
    record = f"{args.record}.rank{ds.rank}" if args.record else None
    trainer = L.Trainer(
        accelerator="cpu",
        devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)),
        strategy="ddp",
        max_steps=args.steps,
        accumulate_grad_batches=ds.stream.micro_batches,  # overlord
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(LitLM(ds, args.vocab, record))
    ds.commit()  # overlord: the last step is done; a next job starts after it
    ds.close()


if __name__ == "__main__":
    main()
