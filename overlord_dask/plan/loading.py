"""How far the service reads and builds ahead of the trainers, how load units are cut, what a
failed load does, and the loader pools' autoscaler."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Strict


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
    """jsonl (uncompressed, or zstd in frames), webdataset (plain ``.tar``): about this many bytes
    per load unit (whole lines, whole samples)."""
    task_seconds: float | None = Field(default=0.5, gt=0, le=3600)
    """Auto-partitioning: load tasks are cut to about this many seconds of measured CPU. A unit
    that would take over twice as long is read as several parts in parallel; units that take
    under a quarter of it are read together by one task. None: one task per unit. The stream never
    depends on it (units, not tasks, are the grain of the order). A ``transform`` must then be
    per document (it runs on each part)."""
    shuffle_units: int = Field(default=64, ge=1, le=100_000)
    """Load units whose documents are shuffled together (a *shuffle block*: ``planner/streams/order.py``).
    Each epoch a source's units are permuted and cut into blocks of this many; the documents of a
    block's units are permuted together, so neighbouring documents come from that many different
    units (files are written in order: by dump, repository, language, date). What it costs: a
    block's units are all loaded (and resident on the workers) before its first document is
    planned, so a source holds up to about twice this many units at a time (the run's first batch
    waits for ``shuffle_warmup_units``' worth). 1: units one after another, documents shuffled inside
    each (a shard shuffle). ``benchmarks/shuffle.py`` compares settings with a global shuffle."""
    shuffle_warmup_units: int = Field(default=4, ge=0, le=100_000)
    """The run's first shuffle blocks: epoch 0 starts with blocks of this many units, then twice
    as many, and so on while they are smaller than ``shuffle_units`` and hold at most an eighth of
    the source's units (``order.py``), so the first batch waits for this many units' loading
    instead of a whole block's, and each next block loads while the one before it is planned.
    The warm-up blocks' neighbours come from fewer units. 0 (or at least ``shuffle_units``): none.
    Fixed when a run starts: a resumed run keeps the warm-up its snapshot records."""
    block_store: Literal["memory", "disk"] = "memory"
    """Where a worker keeps the token ids of the units it loaded (what the shuffle blocks hold):
    ``memory``, or ``disk``: in files in the worker's local directory (Dask's
    ``temporary-directory``: put it on a local NVMe disk), read piece by piece as batches are
    built (``sources/block_files.py``). On disk the blocks cost the workers a few bytes per
    document of memory, and the page cache keeps what is being read; each piece a constructor
    takes costs a read. For plans whose blocks outgrow memory (many sources, large units, a
    large ``shuffle_units``). Image patches stay in memory. The stream is the same either way."""
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
    few steps' worth). Only kept where another worker runs in another process (none for
    ``overlord serve --in-process``, whose workers die together). Needs Dask's active memory
    manager off (``service/deploy.py`` turns it off), which would otherwise drop the copies as
    redundant."""
    shadow_blocks: bool = True
    """Loaded blocks get the same number of shadows as built batches: a worker that dies takes
    its blocks too, and the next constructor tasks read them from a shadow instead of waiting for
    a reload. Costs ``shadows`` × the bytes of the blocks in flight (``status()["block_shadow_bytes"]``)."""
