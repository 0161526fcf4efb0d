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

from pydantic import Field, field_validator, model_validator

from .balance import Balance
from .base import Strict
from .checkpoint import Checkpoint
from .cost import CostModel
from .evaluation import Evaluation, check_evaluation
from .loading import Loading
from .mixing import Mixing, check_bounds
from .schedule import Context, Schedule, Stage
from .source import Source
from .source_plan import SourcePlan
from .text import Tokenizer
from .topology import Topology


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
        check_bounds(self.mixing, names)
        thresholds = {st.long_tokens for st in self.stages if st.long_tokens is not None}
        if len(thresholds) > 1:
            raise ValueError(
                f"long_tokens must be the same in every stage of a run (got {sorted(thresholds)}): documents are "
                "classified once, so that long and short ones each keep an exact position"
            )
        self.check_weights()
        return self

    @model_validator(mode="after")
    def _valid_evaluation(self) -> Plan:
        check_evaluation(self.evaluation, self.sources)
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
            w = self.declared_weights(step, normalise=False)
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

    def declared_weights(self, step: int = 0, *, normalise: bool = True) -> dict[str, float]:
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

    def source_plan(self, name: str, run_id: str | None = None) -> SourcePlan:
        """Source ``name``'s slice of this plan for run ``run_id`` (what its load tasks carry;
        not validated again)."""
        return SourcePlan.model_construct(
            name=self.name,
            seed=self.seed,
            base_dir=self.base_dir,
            tokenizer=self.tokenizer,
            loading=self.loading,
            sources=[self.source(name)],
            run_id=run_id,
        )

    def source(self, name: str) -> Source:
        for s in self.sources:
            if s.name == name:
                return s
        raise KeyError(f"no source named {name!r}; sources: {[s.name for s in self.sources]}")


def _in_window(source: Source, step: int) -> bool:
    return step >= source.start_step and (source.stop_step is None or step < source.stop_step)
