"""Which documents a step carried, for loss-spike forensics: every piece of a delivered step with
its rank and micro-batch, source, file, row or byte range, document, sample id, token range,
tokens and a preview of its text decoded with the plan's tokenizer::

    service.explain(41_337)                    # every rank of step 41,337
    service.explain(41_337, rank=3)            # one rank
    overlord explain run.json --step 41337 --rank 3           # a running service
    overlord explain pipelines/pretrain.yaml --step 41337     # offline: the plan and its snapshots

A step is explained from its ledger entry: the pieces the planner placed, by rank and
micro-batch. A running service keeps the entries of its recent steps; for an older step, or a run
no service holds any more, the entry is planned again from the plan, the timeline its snapshots
recorded (live updates, the planner's decisions, skips) and the newest window start the snapshots
keep at or before the step (``SnapshotStore.window_at``; without snapshots, from step 0): the
planner is a pure function of those, so the replay is what was delivered (``replay.py``). A skipped
step says which skip covers it and what it would have carried. The previews read the pieces'
units here, in this process, as a worker reads them (the sources must be reachable); ``tokens=True``
also returns each piece's token ids (the tests compare them with what the trainers received).
"""

from __future__ import annotations

import numpy as np

from .. import pieces as P
from ..plan import Plan
from ..planner.timeline import Timeline
from ..sources import read_unit
from ..sources.tokenizers import load_tokenizer
from ..sources.units import LoadUnit
from .replay import replay, training_units


def where_in_file(unit: LoadUnit, doc: int) -> dict:
    """Where document ``doc`` of ``unit`` lies in its file: a row (parquet: in its row group), a
    document index, or the unit's byte range and the document's place in it (jsonl)."""
    out: dict = {"file": unit.path}
    if unit.span is not None:
        out["bytes"] = [int(unit.span[0]), int(unit.span[1])]
        out["line_in_range"] = doc
    elif unit.part >= 0:
        out["row_group"], out["row"] = unit.part, unit.start + doc
    else:
        out["document_in_file"] = unit.start + doc
    return out


class Explainer:
    """Explains ledger entries of one run: its plan, timeline and training units (indexed once)."""

    def __init__(self, plan: Plan, timeline: Timeline, units: dict[str, list[LoadUnit]] | None = None):
        self.plan, self.timeline = plan, timeline
        self.units = units if units is not None else training_units(plan, timeline)
        self._blocks: dict[tuple[str, int], object] = {}

    def entry(self, step: int, entry: dict, *, rank: int | None = None, preview: int = 160, tokens: bool = False):
        """``{"step", "skipped", "pieces": [...]}`` of ledger ``entry`` (``pieces``, ``slot``,
        ``sample_ids``), the pieces of ``rank`` only if given, each previewed in up to
        ``preview`` characters (0: no preview, no unit read)."""
        rows, slot, ids = entry["pieces"], entry["slot"], entry["sample_ids"]
        skip = self.timeline.skip_at(step)
        out = []
        for k in np.flatnonzero(slot[:, 0] == rank) if rank is not None else range(len(rows)):
            src, epoch, unit, doc, start, stop = (int(x) for x in rows[k, : P.WIDTH])
            name = self.timeline.source_names[src]
            u = self.units[name][unit]
            piece = {
                "rank": int(slot[k, 0]),
                "micro_batch": int(slot[k, 1]),
                "source": name,
                "epoch": epoch,
                "unit": unit,
                **where_in_file(u, doc),
                "document": doc,
                "sample_id": int(ids[k]),
                "start": start,
                "stop": stop,
                "tokens": stop - start,
            }
            if preview or tokens:
                ids_ = self._tokens(name, u, doc, start, stop)
                if tokens:
                    piece["token_ids"] = ids_.tolist()
                if preview:
                    piece["preview"] = self._decode(name, ids_)[:preview]
            out.append(piece)
        return {
            "step": step,
            "skipped": None if skip is None else {"steps": [skip.at, skip.values["until"]], "reason": skip.reason},
            "pieces": out,
        }

    def _tokens(self, name: str, unit: LoadUnit, doc: int, start: int, stop: int) -> np.ndarray:
        block = self._blocks.get((name, unit.index))
        if block is None:
            if len(self._blocks) > 64:  # a step reads a few dozen units: keep a bounded cache
                self._blocks.clear()
            source = self.timeline.source(name)
            block = self._blocks[(name, unit.index)] = read_unit(source, self._plan_of(name), unit).block
        return block.doc(doc)[start:stop].astype(np.int64)

    def _plan_of(self, name: str) -> Plan:
        """The newest plan version that declares source ``name`` (its folder resolves the URLs)."""
        return next(p for _, p in reversed(self.timeline.versions) if any(s.name == name for s in p.sources))

    def _decode(self, name: str, ids: np.ndarray) -> str:
        plan = self._plan_of(name)
        source = plan.source(name)
        spec = plan.tokenizer_of(source) if (source.text_field or source.messages_field) else plan.tokenizer
        try:
            return load_tokenizer(spec, plan.base_dir).decode(ids.tolist())
        except Exception as err:  # (image placeholders, ids past the vocabulary): say so, in the preview
            return f"<not decodable with {name!r}'s tokenizer: {err}>"


def replayed_entry(plan: Plan, timeline: Timeline, step: int, start=None, units=None) -> dict:
    """Step ``step``'s ledger entry planned again (from ``start``, a stored window start at or
    before it, if given; else from step 0)."""
    return replay(plan, timeline, step + 1, start=start, units=units)[step]


def _store(plan: Plan):
    """The run's snapshot store (None: the plan keeps no snapshots)."""
    from ..plan.base import resolve_url
    from ..snapshots import SnapshotStore

    ck = plan.checkpoint
    return SnapshotStore(resolve_url(ck.url, plan.base_dir), ck.storage_options) if ck.url else None


def window_start(plan: Plan, step: int):
    """The newest window start the run's snapshots keep at or before ``step`` (None: none, plan
    from step 0)."""
    store = _store(plan)
    return None if store is None else store.window_at(step)


def explain_offline(plan: Plan, step: int, **kw) -> dict:
    """Explain ``step`` of the run ``plan`` describes, from its snapshots (``checkpoint.url``:
    the timeline they recorded, and the newest window start at or before the step) or, without
    snapshots, by planning the plan from step 0."""
    timeline, start, store = Timeline(plan), None, _store(plan)
    loaded = store.load() if store is not None else None
    if loaded is not None:
        timeline = Timeline.from_state(plan, loaded[0])
        start = store.window_at(step)
    explainer = Explainer(plan, timeline)
    return explainer.entry(step, replayed_entry(plan, timeline, step, start, explainer.units), **kw)
