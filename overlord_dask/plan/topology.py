"""The trainers' layout as the plan declares it: data-parallel ranks, micro-batches per step, the
token capacity of a micro-batch, context parallelism."""

from __future__ import annotations

from pydantic import Field, model_validator

from .base import Strict


class Topology(Strict):
    """The trainer's data-parallel layout; each step delivers `micro_batches` packed micro-batches to
    each of `dp` ranks."""

    dp: int = Field(ge=1, le=65536)
    """Data-parallel ranks: the trainers' world size divided by their tensor, pipeline and context parallelism."""
    micro_batches: int = Field(default=1, ge=1, le=4096)
    """Micro-batches per rank per optimizer step (gradient accumulation)."""
    tokens_per_micro_batch: int = Field(ge=16, le=1 << 24)
    """Token capacity of one packed micro-batch (the memory constraint)."""
    max_doc_tokens: int | None = Field(default=None, ge=1)
    """Documents longer than this are split into consecutive pieces of at most this many tokens
    (each piece keeps the document's sample id and gets a chunk index). Default and upper bound:
    `tokens_per_micro_batch`."""

    cp: int = Field(default=1, ge=1, le=64)
    """Context-parallel group size: each data-parallel rank is a group of `cp` GPUs that share its
    micro-batches; long pieces are split across them (zigzag), short ones go whole to one."""
    cp_min_tokens: int | None = Field(default=None, ge=2)
    """With cp > 1: pieces at least this long are split across the group (default:
    tokens_per_micro_batch // 8); shorter ones stay whole on the least-loaded CP rank."""

    @model_validator(mode="after")
    def _doc_fits(self) -> Topology:
        if self.max_doc_tokens is not None and self.max_doc_tokens > self.tokens_per_micro_batch:
            raise ValueError(
                f"max_doc_tokens={self.max_doc_tokens} exceeds tokens_per_micro_batch="
                f"{self.tokens_per_micro_batch}: a piece must fit into one micro-batch"
            )
        return self

    @property
    def cp_split_tokens(self) -> int:
        return max(2 * self.cp, self.cp_min_tokens or self.tokens_per_micro_batch // 8)

    @property
    def piece_tokens(self) -> int:
        return self.max_doc_tokens or self.tokens_per_micro_batch

    @property
    def step_tokens(self) -> int:
        return self.dp * self.micro_batches * self.tokens_per_micro_batch
