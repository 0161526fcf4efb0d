"""A source's loading look-ahead: which units to request next, so planning never waits on
metadata it could have had, and what has arrived so far.

Requests walk the source's order from their own cursor, ahead of the planning cursor, until
about the tokens the planner asked for are loaded or on their way, and always to the end of a
shuffle block (``order.py``): a block is planned once every one of its units arrived. While the
source is read by length class (a stage's long share) each class cursor looks ahead on its own;
blocks between the cursors are evicted and come back here when the trailing cursor gets near.

A text source short of metadata asks for about ``REFILL_TOKENS`` worth of units at once, and
then nothing until what is loaded and on its way falls below the target again: the submitter's
auto-partitioning then reads those units with one task (``loading/partition.py``). Asked for one
at a time as the cursor passed them, nearly every unit would be a task of its own, and a load task
costs the whole service CPU whatever it reads (submission, the scheduler's transitions, its
lengths report, its shadow copy, its release).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .stream import SourceStream

MAX_INFLIGHT = 256  # most loads of one source in flight at once (see inflight_for)
REFILL_TOKENS = 1 << 20  # a text source short of metadata asks for about this many tokens' worth of units at once


@dataclass(slots=True)
class LoadRequests:
    n_units: int
    evict_after: int = 4  # blocks between the class cursors further than this past the trailing one are evicted
    epoch: int = 0  # cursor of the next unit to request (its position in the epoch's unit order)
    pos: int = 0
    requested: set = field(default_factory=set)  # (epoch, unit) requested, lengths not yet arrived
    keep_units: int = 0  # the trailing class cursor's look-ahead in blocks, if longer than evict_after
    loaded_units: int = 0  # units whose lengths arrived so far, and their tokens: the look-ahead's yardstick
    loaded_tokens: int = 0
    first_pass: dict = field(default_factory=dict)  # unit -> tokens, for the first epoch's units as they arrive
    images: bool = False  # a unit with images arrived: units are requested one at a time (see refill)

    def restart(self, epoch: int, pos: int) -> None:
        """Request from unit position ``pos`` of ``epoch`` on (a restore: where the planning cursor's block starts)."""
        self.epoch, self.pos = epoch, pos

    def arrived(self, epoch: int, unit: int, tokens: int, images: bool = False) -> None:
        """A unit's lengths arrived and were taken in (``tokens`` in all; ``images``: it holds some)."""
        self.images |= images
        self.loaded_units += 1
        self.loaded_tokens += tokens
        if epoch == 0:
            self.first_pass[unit] = tokens

    def tokens_per_pass(self) -> int | None:
        """Tokens in one pass over the source's files, once every unit was loaded once."""
        return sum(self.first_pass.values()) if len(self.first_pass) >= self.n_units else None

    def inflight_for(self, missing_tokens: int, max_inflight: int) -> int:
        """Loads to keep in flight: ``max_inflight`` (the plan's ``units_ahead``), or as many units
        as the missing tokens need at the tokens per unit seen so far, up to ``MAX_INFLIGHT``. A
        source of tiny documents, or a step larger than a unit holds, otherwise took one load
        round trip per ``units_ahead`` units (one per epoch for a one-unit source): no progress
        for minutes."""
        if missing_tokens <= 0 or not self.loaded_units:
            return max_inflight
        return max(max_inflight, min(MAX_INFLIGHT, math.ceil(missing_tokens / self._tokens_per_unit())))

    def _tokens_per_unit(self) -> float:
        """(once a unit arrived) Tokens per unit seen so far."""
        return max(1.0, self.loaded_tokens / self.loaded_units)

    def refill(self, have: int, target_tokens: int) -> int | None:
        """For a text source whose units' size is known: how many loads to have in flight once
        this round's requests are out, or 0 while the loaded tokens and the loads already on their
        way (at the tokens per unit seen so far) cover ``target_tokens``. None: no batching (no unit
        arrived yet, or units with images, whose bytes per token are far larger and whose loads
        are costly enough to be tasks of their own)."""
        if not self.loaded_units or self.images:
            return None
        per_unit = self._tokens_per_unit()
        if have + len(self.requested) * per_unit >= target_tokens:
            return 0
        return min(MAX_INFLIGHT, len(self.requested) + math.ceil(REFILL_TOKENS / per_unit))

    def want(self, s: SourceStream, target_tokens: int, max_inflight: int) -> list[tuple[int, int]]:
        """Next units of stream ``s`` to load so that about ``target_tokens`` unplanned tokens are
        at hand, always to the end of the shuffle block the last one belongs to."""
        if s.split:
            return self._want_split(s, target_tokens, max_inflight)
        out = []
        # never request units behind the planning cursor (after a restore, say)
        here = s.ordering.first_unit_position(s.epoch, s.pos)
        if (self.epoch, self.pos) < here:
            self.epoch, self.pos = here
        have = s.unplanned_tokens()
        max_inflight = self.inflight_for(target_tokens - have, max_inflight)
        out += self._next_block_in_step(s)
        batch = self.refill(have, target_tokens)
        if batch == 0:
            return out  # what is on its way covers the target
        if batch is not None:
            max_inflight = max(max_inflight, batch)
        block_end = None  # a block is requested whole: its first document waits for every unit
        while (
            len(self.requested) < max_inflight and (have < target_tokens or not s.lengths and not self.requested)
        ) or (block_end is not None and (self.epoch, self.pos) < block_end):
            if block_end is None or (self.epoch, self.pos) >= block_end:
                b = self._block_at(s, self.epoch, self.pos)
                block_end = s.ordering.first_unit_position(*s.ordering.next_block(self.epoch, b))
            key = (self.epoch, int(s.ordering.units(self.epoch)[self.pos]))
            self.epoch, self.pos = self._next_position(s, self.epoch, self.pos)
            if s.has_unit(*key) or key in self.requested:
                continue
            self.requested.add(key)
            out.append(key)
        return out

    def _next_block_in_step(self, s: SourceStream) -> list[tuple[int, int]]:
        """With shuffle blocks of several units: the units of the block after the cursor's,
        requested in step with how far planning is through the current one (a share ``f`` of its
        documents planned: that share of the next block's units asked for), so the next block is
        loaded while this one is planned, not in one burst at its start."""
        lens = s.lengths.get((s.epoch, s.pos))
        if s.block_units <= 1 or lens is None or not len(lens):
            return []
        e, b = s.ordering.next_block(s.epoch, s.pos)
        lo, hi = s.ordering.block_bounds(e, b)
        upto = (e, min(hi, lo + math.ceil((hi - lo) * (s.doc + 1) / len(lens))))
        out = []
        while (self.epoch, self.pos) < upto:
            key = (self.epoch, int(s.ordering.units(self.epoch)[self.pos]))
            self.epoch, self.pos = self._next_position(s, self.epoch, self.pos)
            if not s.has_unit(*key) and key not in self.requested:
                self.requested.add(key)
                out.append(key)
        return out

    @staticmethod
    def _next_position(s: SourceStream, epoch: int, pos: int) -> tuple[int, int]:
        return (epoch, pos + 1) if pos + 1 < s.n_units else (epoch + 1, 0)

    @staticmethod
    def _block_at(s: SourceStream, epoch: int, pos: int) -> int:
        return s.ordering.block_of(epoch, int(s.ordering.units(epoch)[pos]))

    def _want_split(self, s: SourceStream, target_tokens: int, max_inflight: int) -> list[tuple[int, int]]:
        """While reading by length class: the blocks after each class cursor until about
        ``target_tokens`` of that class are at hand (the trailing cursor's may have been evicted
        and come back here). Remembers how far the trailing cursor looks, so eviction spares it."""
        out = []
        max_inflight = self.inflight_for(target_tokens, max_inflight)
        for cls in ("short", "long"):
            e, b = s.class_cursor(cls)[:2]
            have, n = 0, 0
            while have < target_tokens and n < max(64, 4 * s.ordering.n_blocks):
                lens = s.lengths.get((e, b))
                if lens is None:
                    missing = [(e, int(u)) for u in s.ordering.block_units_of(e, b) if not s.has_unit(e, int(u))]
                    missing = [k for k in missing if k not in self.requested]
                    if missing and len(self.requested) >= max_inflight:
                        break
                    self.requested.update(missing)
                    out += missing
                else:
                    have += int(lens[s.class_mask(lens, cls)].sum())
                n += 1
                e, b = s.ordering.next_block(e, b)
            if tuple(s.class_cursor(cls)) == s.trailing():
                self.keep_units = max(self.evict_after, n)
        return out
