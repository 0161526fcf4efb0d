"""The plan: a validated, declarative description of one data-loading run.

A plan is a tree of pydantic models that forbid unknown fields, so a typo in a YAML key is an error
that names the key instead of a silently ignored setting. Build it in Python::

    plan = Plan(
        name="my-mix",
        seed=7,
        sources=[
            Source(name="web", format="parquet", url="s3://bucket/web/*.parquet", text_field="text", weight=0.7),
            Source(name="books", format="zarr", url="s3://bucket/books.zarr", weight=0.3),
        ],
        topology=Topology(dp=8, micro_batches=4, tokens_per_micro_batch=32768),
    )

or load it from YAML with :func:`overlord_dask.plan.load_plan`. The plan depends on nothing else in
the package: dependencies point one way.
"""

from __future__ import annotations

import math
from typing import Literal

from pydantic import Field, field_validator, model_validator

from . import formats
from .base import Strict, import_callable
from .evaluation import Evaluation
from .feedback import LearnCost, Mixing
from .schedule import Context, Schedule, Stage, weight_at
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
        return weight_at(self.weight, step)

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


class CostModel(Strict):
    """Cost of one document of L tokens, V of them image tokens: `attention·L² + linear·L +
    constant + encoder·V` (documents in a packed micro-batch do not attend to each other, so a
    micro-batch costs the sum over its documents; the backbone sees all L tokens, the vision
    encoder only the V patches)."""

    attention: float = Field(default=1.0, ge=0.0)
    """Coefficient of L² (the attention term)."""
    linear: float | None = Field(default=None, ge=0.0)
    """Default 6·hidden."""
    constant: float = Field(default=0.0, ge=0.0)
    """Cost per document, whatever its length."""
    hidden: int = Field(default=4096, ge=1)
    """The model's hidden size: ``linear`` defaults to 6·hidden."""
    encoder: float = Field(default=0.0, ge=0.0)
    """Vision-encoder cost per image token (patch), added to the backbone cost of the tokens;
    e.g. ``6·d_vit·layers_vit / layers`` relative to the backbone's per-token ``linear`` cost."""
    function: str | None = None
    """Optional `module:callable` mapping an int64 array of document lengths to float costs
    (vectorised); replaces the formula. It must be importable on the scheduler."""
    learn: LearnCost | None = None
    """Learn the coefficients from the step times the trainers report (``true``, or the fit's
    settings): the declared ones are used until the fit settles, then the fitted ones from a
    step recorded in the run's timeline (``planner/learn.py``)."""

    @field_validator("learn", mode="before")
    @classmethod
    def _learn(cls, v):
        return ({} if v else None) if isinstance(v, bool) else v

    @field_validator("function")
    @classmethod
    def _importable(cls, spec: str | None) -> str | None:
        if spec is not None:
            import_callable(spec)
        return spec

    @model_validator(mode="after")
    def _learnable(self) -> CostModel:
        if self.learn is not None and self.function:
            raise ValueError("cost.learn fits the formula's coefficients; it cannot be combined with cost.function")
        return self

    @property
    def linear_coef(self) -> float:
        return self.linear if self.linear is not None else 6.0 * self.hidden


class Autoscale(Strict):
    """Pool sizes from the planner's signals (``overlord_dask/loading/autoscale.py``): each pool gets the
    workers its sources' token demand needs (weights over the schedule ahead × the trainers' step
    rate × measured transform seconds per token), grows at once when the planner waits on one of
    its sources, and shrinks only after ``down_after`` checks in a row said so."""

    enabled: bool = False
    """Size the loader pools from the planner's signals (every source without a declared pool gets its own)."""
    max_workers: int | None = Field(default=None, ge=1, le=100_000)
    """Most pool workers in all (the worker budget); None: no overall cap beyond each pool's."""
    interval_s: float = Field(default=1.0, gt=0, le=3600)
    """Seconds between scaling decisions."""
    headroom: float = Field(default=1.5, ge=1.0, le=100.0)
    """Capacity over measured demand (demand is noisy and a new worker needs time to start)."""
    lead_s: float = Field(default=10.0, ge=0, le=86_400)
    """Look this far ahead on the schedule (at the measured step rate): a pool grows before a
    curriculum stage raises its weight, and shrinks only after the stage that needed it."""
    down_after: int = Field(default=5, ge=1, le=10_000)
    """Consecutive decisions that must agree before a pool shrinks (no flapping)."""


class Loading(Strict):
    """How far loading and batch construction may run ahead of the trainers (bounded memory)."""

    unit_rows: int = Field(default=4096, ge=1)
    """parquet: at most this many rows per load unit (a unit is one row group or a part of one)."""
    unit_tokens: int = Field(default=1 << 20, ge=1)
    """zarr, megatron: about this many tokens per load unit (rounded to whole documents)."""
    unit_bytes: int = Field(default=8 << 20, ge=1)
    """jsonl (uncompressed, or zstd in frames): about this many bytes per load unit (whole lines)."""
    task_seconds: float | None = Field(default=0.5, gt=0, le=3600)
    """Auto-partitioning: load tasks are cut to about this many seconds of measured CPU. A unit
    that would take over twice as long is read as several parts in parallel; units that take
    under a quarter of it are read together by one task. None: one task per unit. The stream never
    depends on it (units, not tasks, are the grain of the order). A ``transform`` must then be
    per document (it runs on each part)."""
    prefetch_steps: int = Field(default=4, ge=1, le=1024)
    """Steps planned and built ahead of the slowest rank's acknowledged step."""
    units_ahead: int = Field(default=2, ge=1, le=1024)
    """Loads of a source in flight at once, at least: more when the coming windows need more
    units, and a text source asks for about a million tokens' worth of units at a time, which one
    task reads (``planner/lookahead.py``)."""
    retries: int = Field(default=2, ge=0, le=16)
    """Attempts per load unit before ``on_corrupt`` decides."""
    integrity: bool = False
    """Record a digest of each load unit's bytes when its source is indexed, kept with the
    snapshots, and check it on every load: a file that changed or rotted since is an error naming
    the unit (or a quarantined unit, with ``on_corrupt: quarantine``). Costs one read of every
    source's files at indexing (at the first start; a restart reuses the kept digests)."""
    on_corrupt: Literal["fail", "quarantine"] = "fail"
    """A unit that still cannot be read after its retries (a corrupt file, a malformed record):
    ``fail`` stops the run with the unit, file and reason named; ``quarantine`` loads it as empty,
    records it (``status()["quarantined"]``, the dashboard, an ``event=quarantine`` log line) and
    goes on. Never a silent skip."""
    batch_steps: int | None = Field(default=None, ge=1, le=1024)
    """Steps handed out together: one constructor task per group of ranks and one queue item per
    rank name this many consecutive steps, and trainers acknowledge once per such chunk (the
    control path's cost is per chunk, not per step). Default: a quarter of ``prefetch_steps``,
    raised until a chunk holds ~1M tokens (small steps: the fixed cost per chunk is amortised),
    but at most half of ``prefetch_steps`` (one chunk is built while the trainers take another);
    at least 1."""
    autoscale: Autoscale = Field(default_factory=Autoscale)
    """Elastic per-source pools; off by default (every load task runs on any worker)."""
    shadows: int = Field(default=1, ge=0, le=4)
    """Extra copies of every built batch, each on another worker (hot standbys): a worker that
    dies takes its batches with it, and the trainers are served from a shadow instead of waiting
    for the batch to be rebuilt. Costs ``shadows`` × the bytes of the batches in flight (a
    few steps' worth). Needs Dask's active memory manager off (``service/deploy.py`` turns it off), which
    would otherwise drop the copies as redundant."""
    shadow_blocks: bool = True
    """Loaded blocks get the same number of shadows as built batches: a worker that dies takes
    its blocks too, and the next constructor tasks read them from a shadow instead of waiting for
    a reload. Costs ``shadows`` × the bytes of the blocks in flight (``status()["block_shadow_bytes"]``)."""


class Balance(Strict):
    """How the planner spreads attention cost over ranks (issue: stragglers from long documents)."""

    policy: Literal["cost", "none"] = "cost"
    """`cost`: plan `window` steps at once, spread long documents so every rank gets an equal
    share, water-fill short ones (`planner/policies/balance.py`). `none`: exact per-step mixing with
    best-fit packing and no look-ahead (`planner/policies/exact.py`)."""
    sync: Literal["step", "micro_batch"] = "micro_batch"
    """What the trainer waits on: `step` (DDP: ranks sync once per step) or `micro_batch` (FSDP:
    every micro-batch); the imbalance of that one is minimised."""
    window: int = Field(default=16, ge=1, le=256)
    """Steps planned together; long documents move between these steps (mix is exact per window)."""
    fill: float = Field(default=0.97, gt=0.0, le=1.0)
    """Token budget of a step as a fraction of its capacity (slack for balancing)."""
    heavy_tokens: int | None = Field(default=None, ge=1)
    """Pieces at least this long are balanced as outliers; default tokens_per_micro_batch // 16."""
    max_delay: int = Field(default=2, ge=0, le=64)
    """Windows a long piece may wait for similar ones before it is placed alone."""


class Checkpoint(Strict):
    """Where the planner's snapshots go, so that a restarted service resumes exactly."""

    url: str | None = None
    """fsspec URL of a folder (`file:///…`, a path, `s3://bucket/run`); None: no snapshots.
    A relative path is resolved against the plan file's folder."""
    storage_options: dict = Field(default_factory=dict)
    """fsspec options for the snapshot location (credentials, endpoint)."""
    keep_bases: int = Field(default=2, ge=1, le=1000)
    """Base snapshots kept (with their deltas) by garbage collection, at least."""
    keep_steps: int = Field(default=2000, ge=0, le=10_000_000)
    """How far back a training job may restart from its checkpoint while the service runs on:
    the planner keeps its state at every planning window of the last ``keep_steps`` committed
    steps (in memory: a few KB per window), and snapshot garbage collection keeps the bases that
    reach that far. A checkpoint older than that is refused, naming the oldest step the service
    can serve."""
    keep_hours: float | None = Field(default=None, gt=0)
    """With a snapshot location: also keep the bases written in the last ``keep_hours`` hours, so
    a job can restart from checkpoints that old (served from storage)."""
    base_every_steps: int = Field(default=1000, ge=1)
    """A full base snapshot after this many committed steps (deltas in between)."""
    base_every_seconds: float = Field(default=600.0, gt=0)
    """... or after this many seconds, whichever comes first."""
    resume: bool = True
    """Start from the newest snapshot at `url` when there is one."""
    on_code_change: Literal["refuse", "accept"] = "refuse"
    """A resumed run whose sources' ``prepare`` functions changed since the snapshot (their code,
    not only their names) would deliver other documents from the resume point on: ``refuse``
    stops the start, naming the function; ``accept`` goes on and logs ``event=code_changed``."""
    commit: Literal["ack", "checkpoint"] = "ack"
    """When a step is durable (what a snapshot resumes from): `ack`, once every rank has consumed
    it; `checkpoint`, once every rank's trainer has saved its state (``stream.state_dict()``).
    A training job restarting from any checkpoint within the retention (``keep_steps``,
    ``keep_hours``) is served in either mode; `checkpoint` keeps the service's own snapshots at
    the trainers' checkpoints, so a restart of everything resumes there whatever the
    retention."""


class Plan(Strict):
    """A whole run: sources and their mix, topology, cost model and loading bounds."""

    name: str = Field(default="overlord", pattern=r"^[A-Za-z0-9_.-]+$", max_length=64)
    """The run's name (run ids, logs, snapshot checks)."""
    seed: int = Field(default=0, ge=0, lt=2**63)
    """Seeds every source's order (with the source's name, the epoch and the unit): the same plan and seed give the
    same stream."""
    sources: list[Source] = Field(min_length=1)
    """The data sources and their weights."""
    tokenizer: Tokenizer = Field(default_factory=Tokenizer)
    """The model's tokenizer (:class:`~overlord_dask.plan.text.Tokenizer`), for every text and chat
    source that names none; its pad id pads the micro-batches."""
    topology: Topology
    """The trainers' layout and micro-batch size."""
    cost: CostModel = Field(default_factory=CostModel)
    """The cost of a document, which the balancer evens out over ranks."""
    loading: Loading = Field(default_factory=Loading)
    """What is read and built ahead, retries, shadows, pools."""
    balance: Balance = Field(default_factory=Balance)
    """How steps are selected and laid out over ranks."""
    checkpoint: Checkpoint = Field(default_factory=Checkpoint)
    """Snapshots of the planner and when a step becomes final."""
    mixing: Mixing = Field(default_factory=Mixing)
    """A controller that sets the mix from the trainers' reported losses (off by default)."""
    evaluation: Evaluation = Field(default_factory=Evaluation)
    """The evaluation stream of the sources' held-out units (``Source.holdout``)."""
    stages: list[Stage] = Field(default_factory=list)
    """Curriculum stages in step order (mix and context strategy per stage); see
    :class:`~overlord_dask.plan.schedule.Stage`."""
    steps: int | None = Field(default=None, ge=1)
    """Planned length of the run in steps: weight functions are checked over it, and inspection
    tables show the declared mix up to it. The service itself runs until it is stopped."""
    base_dir: str | None = None
    """Folder that relative source URLs are resolved against (set by `load_plan` to the plan file's
    folder; defaults to the working directory)."""

    @field_validator("sources")
    @classmethod
    def _unique_names(cls, sources: list[Source]) -> list[Source]:
        seen: set[str] = set()
        for s in sources:
            if s.name in seen:
                raise ValueError(f"duplicate source name {s.name!r}")
            seen.add(s.name)
        return sources

    @model_validator(mode="after")
    def _consistent_pools(self) -> Plan:
        declared: dict[str, tuple] = {}
        for s in self.sources:
            if s.pool is None:
                continue
            spec = s.pool.model_dump(exclude={"name"})
            other = declared.setdefault(s.pool_name, (s.name, spec))
            if other[1] != spec:
                raise ValueError(
                    f"sources {other[0]!r} and {s.name!r} share pool {s.pool_name!r} but declare it differently"
                )
        return self

    @model_validator(mode="after")
    def _valid_curriculum(self) -> Plan:
        names = {s.name for s in self.sources}
        starts = [st.start_step for st in self.stages]
        if any(b <= a for a, b in zip(starts, starts[1:])):
            raise ValueError(f"stages must start at strictly increasing steps (got {starts})")
        if len({st.name for st in self.stages}) != len(self.stages):
            raise ValueError(f"stage names must be unique (got {[st.name for st in self.stages]})")
        for st in self.stages:
            for what, mix in (("weights", st.weights), ("long_sources", st.long_sources)):
                unknown = sorted(set(mix or {}) - names)
                if unknown:
                    raise ValueError(
                        f"stage {st.name!r} {what} name unknown sources {unknown}; sources: {sorted(names)}"
                    )
            if st.long_share is not None and self.balance.policy != "cost":
                raise ValueError(
                    f"stage {st.name!r}: long_share needs balance.policy 'cost' (the exact per-step policy reads each "
                    "source in one order)"
                )
            if st.max_doc_tokens is not None and st.max_doc_tokens > self.topology.tokens_per_micro_batch:
                raise ValueError(
                    f"stage {st.name!r}: max_doc_tokens={st.max_doc_tokens} exceeds tokens_per_micro_batch="
                    f"{self.topology.tokens_per_micro_batch}: a piece must fit into one micro-batch"
                )
        unknown = sorted(set(self.mixing.bounds) - names)
        if unknown:
            raise ValueError(f"mixing bounds name unknown sources {unknown}; sources: {sorted(names)}")
        thresholds = {st.long_tokens for st in self.stages if st.long_tokens is not None}
        if len(thresholds) > 1:
            raise ValueError(
                f"long_tokens must be the same in every stage of a run (got {sorted(thresholds)}): documents are "
                "classified once, so that long and short ones each keep an exact position"
            )
        self.check_weights()
        return self

    def check_weights(self, start: int = 0) -> None:
        """Raise ValueError naming the step (and source) where a weight is negative or where no
        source is active. Piecewise schedules are checked at their knots (linear in between);
        weight functions at every step up to ``steps`` (or 10,000 steps without it)."""
        horizon = max(self.steps or 0, max(self.change_points(), default=0) + 1)
        steps = set(self.change_points()) | {start}
        if any(isinstance(s.weight, Schedule) and s.weight.is_function for s in self.sources):
            steps |= set(range(start, max(horizon, self.steps or 10_000)))
        for step in sorted(t for t in steps if t >= start):
            w = self.weights_at(step, normalise=False)
            for name, v in w.items():
                if not (math.isfinite(v) and v >= 0):
                    raise ValueError(f"source {name!r} has weight {v} at step {step}; weights must be finite and >= 0")
            if sum(w.values()) <= 0:
                raise ValueError(
                    f"no source is active at step {step} (every weight is 0 there{self._stage_hint(step)})"
                )

    def _stage_hint(self, step: int) -> str:
        st = self.stage_at(step)
        hint = f", in stage {st.name!r}" if st is not None else ""
        gone = [
            f"{s.name!r} stops at {s.stop_step}"
            for s in self.sources
            if s.stop_step is not None and s.stop_step <= step
        ]
        later = [f"{s.name!r} starts at {s.start_step}" for s in self.sources if s.start_step > step]
        return hint + "".join(f"; {x}" for x in gone + later)

    def change_points(self) -> list[int]:
        """Steps at which some weight or the context strategy may change (sorted)."""
        return sorted(self._points(smooth=True) | {0})

    def jumps(self) -> list[int]:
        """Steps at which the mix or the context strategy changes abruptly: the planner starts a
        planning window there, so that no window mixes two regimes (ramps and weight functions
        change smoothly and are followed step by step inside a window)."""
        return sorted(self._points(smooth=False) - {0})

    def _points(self, smooth: bool) -> set[int]:
        pts: set[int] = set()
        for s in self.sources:
            pts.add(s.start_step)
            if s.stop_step is not None:
                pts.add(s.stop_step)
            if isinstance(s.weight, Schedule):
                pts.update(s.weight.knots() if smooth else s.weight.jumps())
        for st in self.stages:
            pts.add(st.start_step)
            if smooth:
                pts.add(st.start_step + st.ramp_steps)
        return pts

    def stage_at(self, step: int) -> Stage | None:
        cur = None
        for st in self.stages:
            if st.start_step > step:
                break
            cur = st
        return cur

    def _stage_weights(self, i: int, step: int) -> dict[str, float]:
        """Raw weights in stage ``i`` (-1: before any stage) at ``step``."""
        st = self.stages[i] if i >= 0 else None
        if st is None or st.weights is None:
            own = {s.name: s.weight_at(step) for s in self.sources}
        else:
            own = {s.name: (st.weights.get(s.name, 0.0) if _in_window(s, step) else 0.0) for s in self.sources}
        if st is not None and st.ramp_steps and step < st.start_step + st.ramp_steps:
            prev = self._stage_weights(i - 1, step)
            a = (step - st.start_step + 1) / (st.ramp_steps + 1)
            own = {k: (1 - a) * prev[k] + a * own[k] for k in own}
        return own

    def weights_at(self, step: int, *, normalise: bool = True) -> dict[str, float]:
        """Mixing weights by source name at ``step`` (normalised to sum to one by default)."""
        i = -1
        for k, st in enumerate(self.stages):
            if st.start_step <= step:
                i = k
        w = self._stage_weights(i, step)
        if not normalise:
            return w
        for name, v in w.items():  # a weight function may misbehave beyond the steps validation checked
            if not (math.isfinite(v) and v >= 0):
                raise ValueError(f"source {name!r} has weight {v} at step {step}; weights must be finite and >= 0")
        total = sum(w.values())
        if not total > 0:
            raise ValueError(f"no source is active at step {step}{self._stage_hint(step)}")
        return {k: v / total for k, v in w.items()}

    def weights(self) -> dict[str, float]:
        """Normalised mixing weights by source name at step 0."""
        return self.weights_at(0)

    def context_at(self, step: int) -> Context:
        """The context strategy (maximum piece length, long-document policy and share) at ``step``."""
        st = self.stage_at(step)
        default = self.topology.piece_tokens
        if st is None:
            return Context(stage=None, piece_tokens=default)
        return Context(
            stage=st.name,
            piece_tokens=st.max_doc_tokens or default,
            long_policy=st.long_policy,
            long_tokens=st.long_tokens,
            long_share=st.long_share,
            long_sources=st.long_sources,
        )

    def _repr_html_(self) -> str:
        from .display import plan_html

        return plan_html(self)

    def tokenizer_of(self, source: Source) -> Tokenizer:
        """The tokenizer a source's text is encoded with: its own, else the plan's."""
        return source.tokenizer or self.tokenizer

    @property
    def loss_masks(self) -> bool:
        """Whether any source marks tokens the loss ignores (chat turns, label or mask columns):
        then the micro-batches carry a mask."""
        return any(s.masks_loss for s in self.sources)

    def source(self, name: str) -> Source:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(f"no source named {name!r}; sources: {[s.name for s in self.sources]}")


def _in_window(source: Source, step: int) -> bool:
    return step >= source.start_step and (source.stop_step is None or step < source.stop_step)
