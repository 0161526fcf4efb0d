"""A data source of a plan: its files and format, what to read of them (fields, tokenizer,
images), how its records are prepared, its weight over steps and the pool its loaders run on."""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from . import formats
from .base import Strict, import_callable
from .schedule import Schedule, weight_at
from .text import Tokenizer


class Prepare(Strict):
    """One step of preparing a source's records before they are tokenized, on the loader workers
    (formats that read records: parquet, jsonl, arrow, webdataset). Exactly one of ``record`` and
    ``batch``. A dropped record stays in its place as an empty document (its sample id and the
    order of the others unchanged) and is counted per source (``status()``, the dashboard)."""

    record: str | None = None
    """``module:callable`` taking one record (a dict of every column) and returning it, changed or
    not, or None to drop it: keep ``lang == "en"``, strip boilerplate."""
    batch: str | None = None
    """``module:callable`` taking a ``pyarrow.Table`` of the unit's records and returning one: it
    may change columns and drop rows, and keeps the ``_row`` column it is given (each kept row's
    position in the unit)."""
    kwargs: dict = Field(default_factory=dict)
    """Keyword arguments the callable is called with (after the record or table)."""

    @model_validator(mode="after")
    def _one(self) -> Prepare:
        if (self.record is None) == (self.batch is None):
            raise ValueError("a prepare step names exactly one of record or batch (a module:callable)")
        import_callable(self.record or self.batch)
        return self

    @property
    def function(self) -> str:
        return self.record or self.batch


class Pool(Strict):
    """A source's loader pool: workers that run only load tasks of the sources naming it (and any
    constructor task whose blocks they hold). Pinned by a Dask worker resource
    (``overlord-pool-<name>``), never by worker address, so a replaced worker joins the pool."""

    name: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    """Sources that name the same pool share it; default: the source's own name."""
    workers: int | None = Field(default=None, ge=0, le=100_000)
    """A fixed size; None: sized by the autoscaler between ``min_workers`` and ``max_workers``."""
    min_workers: int = Field(default=1, ge=0, le=100_000)
    """Autoscaled pools: never fewer workers than this."""
    max_workers: int | None = Field(default=None, ge=1, le=100_000)
    """Autoscaled pools: never more workers than this (None: only ``loading.autoscale.max_workers`` caps it)."""
    cores: int = Field(default=1, ge=1, le=1024)
    """Threads per worker (one load task per thread)."""
    memory: str = "auto"
    """Memory limit per worker (``"4GB"``; ``auto``: the machine's share)."""

    @model_validator(mode="after")
    def _bounds(self) -> Pool:
        if self.max_workers is not None and self.max_workers < self.min_workers:
            raise ValueError(f"pool max_workers={self.max_workers} is below min_workers={self.min_workers}")
        return self


class Source(Strict):
    """One data source: a set of files in one format, read by its own loader tasks."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    """Stable name; seeds and sample ids derive from it, never from the source's list position."""
    format: str
    """A registered format (``parquet``, ``zarr``, ``jsonl``, ``arrow``, ``webdataset``,
    ``megatron``, or one a package registers) or a reader class as ``module:Class``
    (``overlord_dask.sources.formats.Format``)."""
    url: str
    """fsspec URL, path or glob (`s3://b/web/*.parquet`, `data/web/*.parquet`). A relative path is
    resolved against the plan file's folder."""
    weight: float | Schedule = Field(default=1.0)
    """Mixing weight, a number or a :class:`~overlord_dask.plan.schedule.Schedule` over steps;
    weights are normalised over the sources active at a step, so they need not sum to one."""
    start_step: int = Field(default=0, ge=0)
    """The source enters the mix at this step (weight 0 before)."""
    stop_step: int | None = Field(default=None, ge=1)
    """The source leaves the mix at this step (weight 0 from then on). Its position is kept: a
    later plan update that brings it back continues where it stopped."""
    text_field: str | None = None
    """Record formats: the string column (key, for jsonl; member extension, for webdataset, e.g.
    ``txt``) tokenized by `tokenizer`."""
    tokens_field: str | None = None
    """Record formats: a list<int> column (key) of token ids. zarr: the name of the flat token
    array (default `tokens`)."""
    offsets_field: str = "offsets"
    """zarr: the int64 array of document start offsets, length n_docs + 1."""
    tokenizer: Tokenizer | None = None
    """For `text_field` and `messages_field`: the model's tokenizer (:class:`~overlord_dask.plan.text.Tokenizer`:
    `byte`, a tokenizer folder or file, `tiktoken:NAME`, `module:callable`, or a mapping with
    overrides). Default: the plan's `tokenizer`."""
    add_bos: bool | None = None
    """Begin each document with the tokenizer's BOS (default: the tokenizer's policy; chat sources: no,
    their template writes the boundaries)."""
    add_eos: bool | None = None
    """End each document with the tokenizer's EOS (default: yes; chat sources: no)."""
    messages_field: str | None = None
    """Record formats: a chat column, a list of ``{role, content}`` messages per record, rendered
    with the tokenizer's chat template; only the turns of ``train_roles`` are trained on (the
    others get labels -100)."""
    train_roles: list[str] = Field(default_factory=lambda: ["assistant"], min_length=1)
    """Chat sources: the roles whose turns the loss sees."""
    roles: list[str] = Field(default_factory=lambda: ["system", "user", "assistant", "tool"])
    """Chat sources: the roles a message may have; another is an error naming the record."""
    labels_field: str | None = None
    """With `tokens_field`: a list<int> column of labels aligned with the tokens; -100 marks a
    token the loss ignores (other values must equal the token: the trainer shifts)."""
    loss_mask_field: str | None = None
    """With `tokens_field`: a list<int|bool> column aligned with the tokens, 0 where the loss ignores a token."""
    on_bad_record: Literal["error", "drop"] = "error"
    """A record that cannot become a document (an unknown role, no trainable turn, an image count
    that differs from its placeholders, an undecodable image): ``error`` stops with its source,
    file and sample id; ``drop`` keeps it as an empty document and counts it as dropped."""
    transform: str | None = None
    """Optional `module:callable` applied to each loaded sample block (filter, truncate, remap)."""
    transform_kwargs: dict = Field(default_factory=dict)
    """Keyword arguments the `transform` is called with (after the block)."""
    prepare: list[Prepare] = Field(default_factory=list)
    """Record formats: steps applied to each unit's records, in order, before tokenizing
    (:class:`Prepare`)."""
    storage_options: dict = Field(default_factory=dict)
    """Passed to fsspec (e.g. `endpoint_url` and credentials for S3)."""
    images_field: str | None = None
    """Multimodal. zarr: an array ``[n_images, patches, patch_dim]`` of image patch tensors.
    webdataset: the image members' extensions, comma-separated (``jpg,png``), placed before the
    text in member order.
    parquet, arrow: a ``list<binary>`` column of encoded images (PNG, JPEG, anything Pillow reads), decoded
    on the loader workers, resized to ``image_size`` and cut into ``patch_size`` patches. Each
    image becomes ``patches`` placeholder tokens (``image_token_id``) in its document's token
    stream, so a sample's length counts its image tokens; the batch carries the patches and the
    position of each one's placeholder."""
    image_offsets_field: str = "image_offsets"
    """zarr, multimodal: int64 ``[n_docs + 1]``, document i owns images ``image_offsets[i]:image_offsets[i+1]``."""
    image_positions_field: str = "image_positions"
    """Multimodal: the text-token offset in its document where each image goes. zarr: int64
    ``[n_images]``; parquet: a ``list<int>`` column, one entry per image of the row."""
    image_placeholders: bool = False
    """Record formats, multimodal: images go where the text has the tokenizer's ``image_token``
    (``<image>``, the LLaVA / Energon convention), one placeholder per image of the record, instead
    of an ``image_positions_field`` column."""
    image_token_id: int | None = Field(default=None, ge=0)
    """Placeholder token id of an image patch; default: the tokenizer's id of its ``image_token``
    (the byte tokenizer: 259)."""
    image_size: int = Field(default=32, ge=1, le=4096)
    """parquet, arrow, webdataset, multimodal: decoded images are resized to ``image_size`` ×
    ``image_size`` RGB (each tile, with ``image_tiles`` > 1)."""
    patch_size: int = Field(default=8, ge=1, le=1024)
    """Side of a square patch; a tile is ``(image_size / patch_size)²`` patches of
    ``patch_size² · 3`` values."""
    image_tiles: int = Field(default=1, ge=1, le=64)
    """Above 1: any-resolution tiling. An image keeps its aspect ratio: it is resized into the grid
    of at most this many ``image_size`` tiles that fits it best, cut into tiles, and preceded by a
    thumbnail tile of the whole image; its number of patches then depends on its shape."""
    image_mean: list[float] | None = Field(default=None, min_length=3, max_length=3)
    """Normalise pixels: ``(x / 255 - mean) / std`` per channel (float16 patches); None: raw uint8 patches."""
    image_std: list[float] | None = Field(default=None, min_length=3, max_length=3)
    """Per-channel standard deviations of that normalisation (with ``image_mean``)."""
    image_processor: str | None = None
    """A Hugging Face image processor folder (``preprocessor_config.json``; local or relative to the
    plan's folder) that decodes, resizes, tiles and normalises instead; its tiles are cut into
    ``patch_size`` patches."""
    holdout: float | list[str] | None = None
    """Units held out of training for evaluation (``plan/evaluation.py``): a fraction of the
    source's units (``0.01``), or patterns of its files' paths (``["*/part-099.parquet"]``)."""
    pool: Pool | None = None
    """The worker pool this source's load tasks run on (``loading.autoscale`` sizes pools it does
    not fix). None: the source's own pool while autoscaling, else any worker."""

    @field_validator("format")
    @classmethod
    def _registered(cls, name: str) -> str:
        return formats.check(name)

    @field_validator("holdout")
    @classmethod
    def _holdout(cls, h):
        if isinstance(h, float) and not 0.0 < h < 1.0:
            raise ValueError(f"holdout as a fraction of the units must lie in (0, 1), got {h}")
        if isinstance(h, list) and not h:
            raise ValueError("holdout as file patterns needs at least one pattern")
        return h

    @field_validator("weight")
    @classmethod
    def _non_negative(cls, w):
        if not isinstance(w, Schedule) and not (math.isfinite(w) and w >= 0):
            raise ValueError(f"weight must be a finite number >= 0 (got {w})")
        return w

    @model_validator(mode="after")
    def _fields_fit_format(self) -> Source:
        if self.stop_step is not None and self.stop_step <= self.start_step:
            raise ValueError(
                f"source {self.name!r}: stop_step={self.stop_step} must be after start_step={self.start_step}"
            )
        if self.format in formats.RECORDS:
            if sum(f is not None for f in (self.text_field, self.tokens_field, self.messages_field)) != 1:
                raise ValueError(
                    f"{self.format} source {self.name!r} needs exactly one of text_field, tokens_field or "
                    "messages_field "
                    f"(got text_field={self.text_field!r}, tokens_field={self.tokens_field!r}, "
                    f"messages_field={self.messages_field!r})"
                )
            if self.images_field is not None and self.image_size % self.patch_size:
                raise ValueError(
                    f"source {self.name!r}: image_size={self.image_size} must be a multiple of "
                    f"patch_size={self.patch_size}"
                )
            if (self.labels_field or self.loss_mask_field) and not self.tokens_field:
                raise ValueError(f"source {self.name!r}: labels_field and loss_mask_field go with tokens_field")
            if self.labels_field and self.loss_mask_field:
                raise ValueError(f"source {self.name!r}: give one of labels_field and loss_mask_field")
            if (self.image_mean is None) != (self.image_std is None):
                raise ValueError(f"source {self.name!r}: image_mean and image_std go together")
            unknown = sorted(set(self.train_roles) - set(self.roles))
            if unknown:
                raise ValueError(f"source {self.name!r}: train_roles {unknown} are not among roles {self.roles}")
        elif self.format in formats.TOKENS:
            if self.text_field is not None:
                raise ValueError(f"{self.format} source {self.name!r} stores token ids; text_field is not allowed")
            if self.prepare:
                raise ValueError(
                    f"{self.format} source {self.name!r} stores token ids, not records: prepare is not allowed"
                )
        return self

    @property
    def token_array(self) -> str:
        return self.tokens_field or "tokens"

    def weight_at(self, step: int) -> float:
        """This source's own (unnormalised) weight at ``step``, 0 outside [start_step, stop_step)."""
        if step < self.start_step or (self.stop_step is not None and step >= self.stop_step):
            return 0.0
        try:
            return weight_at(self.weight, step)
        except Exception as err:  # a user's weight function: the run's error must name the source and the step
            fn = getattr(self.weight, "function", None)
            raise ValueError(
                f"source {self.name!r}: weight function {fn!r} failed at step {step}: {type(err).__name__}: {err}"
            ) from None

    @property
    def data_key(self) -> tuple:
        """What fixes the source's documents and their order; a plan update may not change it."""
        return (
            self.format,
            self.url,
            self.text_field,
            self.tokens_field,
            self.offsets_field,
            None if self.tokenizer is None else self.tokenizer.model_dump_json(),
            self.transform,
            tuple(sorted((k, repr(v)) for k, v in self.transform_kwargs.items())),
            tuple((p.record, p.batch, tuple(sorted(p.kwargs.items()))) for p in self.prepare),
            self.images_field,
            self.image_offsets_field,
            self.image_positions_field,
            self.image_token_id,
            self.image_size,
            self.patch_size,
            self.add_bos,
            self.add_eos,
            self.messages_field,
            tuple(self.train_roles),
            self.labels_field,
            self.loss_mask_field,
            self.image_placeholders,
            self.image_tiles,
            tuple(self.image_mean or ()),
            tuple(self.image_std or ()),
            self.image_processor,
            tuple(self.holdout) if isinstance(self.holdout, list) else self.holdout,
        )

    @property
    def masks_loss(self) -> bool:
        """Whether the loss ignores some of this source's tokens (chat turns, label or mask columns)."""
        return bool(self.messages_field or self.labels_field or self.loss_mask_field)

    @property
    def images_exts(self) -> tuple[str, ...]:
        """webdataset: the image members' extensions named by ``images_field``."""
        return tuple(e.strip().lower().lstrip(".") for e in (self.images_field or "").split(",") if e.strip())

    @property
    def pool_name(self) -> str:
        """The pool this source loads on (its own name unless the plan names a shared pool)."""
        return (self.pool.name if self.pool is not None and self.pool.name else None) or self.name
