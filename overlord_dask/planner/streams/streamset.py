"""Every source's stream, by plan index, and what the planner tracks per source beside it.

The planner's per-source part: the streams (order, cursor, loaded metadata; ``stream.py``), the
documents a drop policy skipped, the units passed that planned pieces still reference, and the
piece costs that depend on a source's metadata (image tokens). Its snapshot state is the cursors
and drop counters; everything else is reloaded metadata.
"""

from __future__ import annotations

import numpy as np

from ... import pieces as P
from ...errors import PlanError
from ...plan import CostModel
from ...plan.schedule import Context
from ..cost_model import doc_costs
from .loss_targets import LossTargets
from .stream import SourceStream


class StreamSet:
    def __init__(self, seed: int, piece_tokens: int, evict_after: int, shuffle_units: int = 1, warmup_units: int = 0):
        self.seed, self.piece_tokens, self.evict_after = seed, piece_tokens, evict_after
        self.shuffle_units = shuffle_units  # loading.shuffle_units: units per shuffle block (order.py)
        self.warmup_units = warmup_units  # loading.shuffle_warmup_units: the run's first blocks (order.py)
        self.streams: list[SourceStream] = []
        self.names: list[str] = []
        self.dropped = np.zeros((0, 2), dtype=np.int64)  # documents, tokens skipped by a drop policy, per source
        self.held: set[tuple[int, int, int]] = set()  # passed units still referenced by planned pieces
        self.targets = LossTargets()  # what a planned piece's labels hold (loss_targets.py)

    def add(self, name: str, first_ids) -> SourceStream:
        """A new source (at the next index), given its units' first sample ids."""
        s = SourceStream(
            name=name,
            index=len(self.streams),
            n_units=len(first_ids),
            first_ids=np.asarray(first_ids, dtype=np.int64),
            seed=self.seed,
            piece_tokens=self.piece_tokens,
            evict_after=self.evict_after,
            block_units=self.shuffle_units,
            warmup_units=self.warmup_units,
        )
        self.streams.append(s)
        self.names.append(name)
        self.dropped = np.concatenate([self.dropped, np.zeros((1, 2), np.int64)])
        return s

    def __len__(self) -> int:
        return len(self.streams)

    def __iter__(self):
        return iter(self.streams)

    def __getitem__(self, i: int) -> SourceStream:
        return self.streams[i]

    def by_name(self, name: str) -> SourceStream:
        try:
            return self.streams[self.names.index(name)]
        except ValueError:
            raise KeyError(f"unknown source {name!r}; sources: {self.names}") from None

    # ---- loading look-ahead -------------------------------------------------------------------
    def wanted(
        self, weights: np.ndarray, step_tokens: int, window_steps: int, units_ahead: int, starved_on: str | None
    ) -> list[list]:
        """Units to load next, ``[source, epoch, unit]`` each: for every source with a weight over
        the coming windows, enough to plan the next window and then some; more for a source that
        planning found short (``starved_on``)."""
        out = []
        for s, w in zip(self.streams, weights):
            if w <= 0:
                continue
            target = max(1, int(w * step_tokens * (window_steps + 1) * 1.3))
            if s.name == starved_on:  # planning needs more of this source than the look-ahead holds
                target = s.unplanned_tokens() + 1 if not s.split else 2 * target
            for epoch, unit in s.loads.want(s, target, units_ahead):
                out.append([s.name, epoch, unit])
        return out

    MAX_PASSES_PER_WINDOW = 4

    def check_pass(
        self, s: SourceStream, weight: float, step_budget: int, window_steps: int, tokens_per_micro_batch: int
    ) -> None:
        """A source whose whole pass over its files is a small part of what one planning window
        takes from it would repeat every document many times per step (all-empty documents, a
        handful of tiny ones, micro-batches far larger than the corpus): fail, saying so, instead
        of loading the same units over and over with no batch in sight."""
        per_pass = s.loads.tokens_per_pass()
        need = weight * step_budget * window_steps
        if weight > 0 and need > self.MAX_PASSES_PER_WINDOW * per_pass:
            raise PlanError(
                f"source {s.name!r} holds only {per_pass:,} tokens in a whole pass over its files ({s.n_units} units), "
                "but a "
                f"planning window of {window_steps} steps takes about {int(need):,} tokens from it (weight "
                f"{weight:.3g}), "
                f"{need / max(per_pass, 1):.0f} passes: every document would repeat within a few steps. Lower its "
                "weight, use "
                f"smaller micro-batches (tokens_per_micro_batch={tokens_per_micro_batch:,}), or add data"
            )

    # ---- per window ---------------------------------------------------------------------------
    def apply_context(self, ctx: Context) -> None:
        """Every stream's piece size, drop policy and length classes for a window in ``ctx``."""
        for s in self.streams:
            s.piece_tokens = ctx.piece_tokens
            s.drop_over = ctx.piece_tokens if ctx.long_policy == "drop" else None
            s.set_split(ctx.long_tokens if ctx.long_share is not None else None)

    def drain_drops(self) -> np.ndarray:
        """Dropped documents recorded since the last call, as rows [source, epoch, unit, doc, tokens]."""
        rows = []
        for i, s in enumerate(self.streams):
            for (e, u, d), L in s.drops.items():
                rows.append((i, e, u, d, L))
            s.drops.clear()
        out = np.array(sorted(rows), dtype=np.int64).reshape(-1, 5)
        if len(out):
            np.add.at(self.dropped[:, 0], out[:, 0], 1)
            np.add.at(self.dropped[:, 1], out[:, 0], out[:, 4])
        return out

    def forget_drops(self) -> None:
        """A window that could not be planned: the drops it recorded are recorded again on retry."""
        for s in self.streams:
            s.drops.clear()

    def costs(self, rows: np.ndarray, cost: CostModel) -> np.ndarray:
        """Cost of planned piece rows: the backbone's cost of their tokens plus the vision
        encoder's cost of their image tokens."""
        out = doc_costs(P.lengths(rows), cost)
        if cost.encoder > 0:
            out += cost.encoder * self.piece_vision(rows)
        return out

    def piece_vision(self, rows: np.ndarray) -> np.ndarray:
        """Image tokens in planned piece rows (each source's share of its documents' images)."""
        out = np.zeros(len(rows))
        for i in np.unique(rows[:, P.SOURCE]):
            sel = rows[:, P.SOURCE] == i
            out[sel] = self.streams[int(i)].piece_vision(rows[sel][:, P.EPOCH : P.STOP + 1])
        return out

    def passed_units(self, rows: np.ndarray) -> list[list]:
        """Units that ``rows`` (pieces waiting to be placed, restored from a snapshot) reference
        but the cursors have passed: ``[source name, epoch, unit]``, to load again for their
        blocks (the planner needs no metadata of them: the rows hold it). They count as held
        until no waiting piece references them."""
        out = []
        for i, e, u in P.unique_rows(P.units(rows)).tolist() if len(rows) else []:
            if self.streams[i].behind(e, u):
                self.held.add((i, e, u))
                out.append([self.names[i], e, u])
        return out

    def finished_units(self, in_use: list[np.ndarray]) -> list[list]:
        """Units the cursors have passed that no piece in ``in_use`` (planned rows not handed out
        yet, or their ``[source, epoch, unit]`` columns) references: ``[source name, epoch,
        unit]`` whose blocks no later step needs."""
        for i, s in enumerate(self.streams):
            self.held.update((i, e, u) for e, u in s.finished_units())
        if not self.held:
            return []
        refs = [P.units(rows) for rows in in_use]
        used = {tuple(r) for r in P.unique_rows(np.concatenate(refs)).tolist()} if refs else set()
        done = [k for k in self.held if k not in used]
        self.held.difference_update(done)
        for i, e, u in done:
            self.streams[i].vision.pop((e, u), None)
            self.targets.forget((i, e, u))
        return [[self.names[i], e, u] for i, e, u in sorted(done)]

    # ---- ids ------------------------------------------------------------------------------------
    def _ids(self, source: np.ndarray, unit: np.ndarray, doc: np.ndarray) -> np.ndarray:
        """Source-wide sample ids of documents given by source index, unit and index in the unit."""
        out = np.empty(len(source), dtype=np.int64)
        for i, s in enumerate(self.streams):
            sel = source == i
            out[sel] = s.first_ids[unit[sel]] + doc[sel]
        return out

    def sample_ids(self, rows: np.ndarray) -> np.ndarray:
        """Source-wide sample ids of planned pieces."""
        return self._ids(rows[:, P.SOURCE], rows[:, P.UNIT], rows[:, P.DOC])

    def dropped_ids(self, drops: np.ndarray) -> np.ndarray:
        """Drop rows ``[source, epoch, unit, doc, tokens]`` as ``[source, epoch, sample id, tokens]``."""
        out = np.empty((len(drops), 4), dtype=np.int64)
        out[:, 0], out[:, 1], out[:, 3] = drops[:, 0], drops[:, 1], drops[:, 4]
        out[:, 2] = self._ids(drops[:, 0], drops[:, 2], drops[:, 3])
        return out

    # ---- state ----------------------------------------------------------------------------------
    def get_state(self) -> dict:
        return {
            "cursors": [list(s.cursor()) for s in self.streams],
            "dropped": P.to_bytes(self.dropped),
            "shuffle_units": self.shuffle_units,
            "shuffle_warmup_units": self.warmup_units,
        }

    def set_state(self, state: dict) -> None:
        """Cursors and drop counters of a snapshot (whose run may have had fewer sources then).
        The snapshot's documents were ordered in shuffle blocks of its ``shuffle_units`` (1 in a
        snapshot that does not say): another setting would make its cursors point elsewhere. Its
        warm-up shaped the run's first epoch, which the cursors point into: the set is built with
        the snapshot's (``PlannerState``), whatever the plan says now."""
        recorded = int(state.get("shuffle_units", 1))
        if recorded != self.shuffle_units:
            raise PlanError(
                f"the snapshot's run orders its documents in shuffle blocks of loading.shuffle_units={recorded} "
                f"units, the plan says {self.shuffle_units}: the order (and what was delivered) depends on it; "
                f"resume with shuffle_units: {recorded}, or start a new run"
            )
        for s, cur in zip(self.streams, state["cursors"]):
            s.restore(tuple(cur))
            s.loads.restart(*s.ordering.first_unit_position(s.epoch, s.pos))
        d = P.from_bytes(state["dropped"], 2)
        self.dropped = np.concatenate([d, np.zeros((len(self.streams) - len(d), 2), np.int64)])

    def status(self) -> dict:
        return {
            "cursors": {s.name: list(s.cursor()[:4]) for s in self.streams},
            "loaded_units": {s.name: s.loaded_units() for s in self.streams},
            "dropped": {s.name: {"docs": int(d), "tokens": int(t)} for s, (d, t) in zip(self.streams, self.dropped)},
        }
