"""What the labels of planned pieces hold: how many are loss targets, counted by the planner from
metadata alone (``step_loss_tokens``, so a trainer's per-token loss needs no all-reduce).

Per unit that planned pieces may still reference: its documents' lengths in file order (a
piece that ends before its document does labels the document's next token) and, where the loss
ignores some tokens, its masked runs (``masked_runs.py``), kept until no planned piece needs
them.
"""

from __future__ import annotations

import numpy as np

from ... import masked_runs
from ... import pieces as P

# cut gathers from units of up to this many documents on average (copying ~8k lengths costs
# about what one unit's turn of the per-unit loop does), or as many as 16 per piece
GATHER_DOCS_PER_UNIT, GATHER_DOCS_PER_PIECE = 8192, 16


class LossTargets:
    def __init__(self) -> None:
        # (source, epoch, unit) -> document lengths in file order, while planned pieces may reference the unit
        self.doc_lengths: dict[tuple[int, int, int], np.ndarray] = {}
        # (source, epoch, unit) -> masked runs of units where the loss ignores some tokens
        self.masked: dict[tuple[int, int, int], np.ndarray] = {}

    def forget(self, key: tuple[int, int, int]) -> None:
        """A unit no planned piece references any more."""
        self.doc_lengths.pop(key, None)
        self.masked.pop(key, None)

    def cut(self, rows: np.ndarray) -> np.ndarray:
        """Per row of ``rows``, whether it ends before its document does (a split document's
        pieces but its last): its last token's label is the document's next token."""
        if not len(rows):
            return np.zeros(0, bool)
        units, inverse = P.unique_rows(P.units(rows), return_inverse=True)
        lens = [self.doc_lengths[key] for key in map(tuple, units.tolist())]
        sizes = np.fromiter(map(len, lens), np.int64, len(lens))
        few_of_large_units = sizes.sum() > GATHER_DOCS_PER_UNIT * len(lens) + GATHER_DOCS_PER_PIECE * len(rows)
        if few_of_large_units:
            cut = np.zeros(len(rows), bool)
            for key, at in self._by_unit(rows, units, inverse):
                cut[at] = rows[at, P.STOP] < self.doc_lengths[key][rows[at, P.DOC]]
            return cut
        # every piece's document length in one gather from the units' lengths laid end to end
        # (a loop over a step's units cost a sort and three array operations per unit)
        doc_len = np.concatenate(lens)[(np.cumsum(sizes) - sizes)[inverse] + rows[:, P.DOC]]
        return rows[:, P.STOP] < doc_len

    @staticmethod
    def _by_unit(rows: np.ndarray, units: np.ndarray | None = None, inverse: np.ndarray | None = None):
        """``((source, epoch, unit), the indices of its rows)`` for each unit ``rows`` reference
        (``units`` and ``inverse``: their ``unique_rows``, if the caller has it): one sort, not a
        scan of all rows per unit (a step at thousands of ranks holds pieces of hundreds of units)."""
        if not len(rows):
            return
        if units is None:
            units, inverse = P.unique_rows(P.units(rows), return_inverse=True)
        order, bounds = P.grouped(inverse, len(units))
        for k, key in enumerate(units.tolist()):
            yield tuple(key), order[bounds[k] : bounds[k + 1]]

    def keep_lengths(self, key: tuple[int, int, int], lengths: np.ndarray, masked: np.ndarray | None) -> None:
        """A unit's document lengths (and masked runs) for as long as planned pieces may reference it."""
        self.doc_lengths[key] = np.asarray(lengths, dtype=np.int64)
        if masked is not None:
            self.masked[key] = np.asarray(masked, dtype=np.int64)

    def loss_tokens(self, rows: np.ndarray) -> tuple[int, int]:
        """Labels of a step's pieces that are not -100, as (shifted, hf) labels count them: per
        piece its length less one, plus its last token's where the document goes on (shifted; HF
        models shift themselves: the length less one), less the targets the loss ignores."""
        return self.loss_tokens_of([rows])[0]

    def loss_tokens_of(self, steps: list[np.ndarray]) -> list[tuple[int, int]]:
        """:meth:`loss_tokens` of each step of a window (its rows ``steps[k]``), counted for all
        of them at once: per step, a unique over its units and a gather cost more than the
        counting itself at a few hundred ranks."""
        rows = np.concatenate(steps) if len(steps) > 1 else steps[0]
        step = np.repeat(np.arange(len(steps)), [len(r) for r in steps])
        cut = np.bincount(step[self.cut(rows)], minlength=len(steps))
        masked = [np.zeros(len(steps), np.int64)] * 2
        for j, per_row in enumerate(self._masked(rows)):
            if per_row is not None:  # (whole numbers well under 2**53: exact as float64 weights)
                masked[j] = np.bincount(step, weights=per_row, minlength=len(steps)).astype(np.int64)
        out = []
        for k, r in enumerate(steps):
            n_tokens, n_pieces = int(P.lengths(r).sum()), len(r)
            out.append((n_tokens - n_pieces + int(cut[k]) - int(masked[0][k]), n_tokens - n_pieces - int(masked[1][k])))
        return out

    def masked_targets(self, rows: np.ndarray) -> tuple[int, int]:
        """How many of the pieces' label targets the loss ignores, as (shifted, hf) labels count
        them: a piece's shifted labels target its positions ``start + 1`` up to its stop (and the
        document's next token past it), HF's those of ``start + 1 .. stop - 1``."""
        shifted, hf = self._masked(rows)
        return (0, 0) if shifted is None else (int(shifted.sum()), int(hf.sum()))

    def _masked(self, rows: np.ndarray) -> tuple[np.ndarray | None, np.ndarray | None]:
        """Per row, :meth:`masked_targets`'s two counts (None, None where no unit masks any)."""
        if not self.masked or not len(rows):
            return None, None
        shifted, hf = np.zeros(len(rows), np.int64), np.zeros(len(rows), np.int64)
        for key, at in self._by_unit(rows):
            r = self.masked.get(key)
            if r is None:
                continue
            lens = self.doc_lengths[key]
            docs, start, stop = rows[at, P.DOC], rows[at, P.START], rows[at, P.STOP]
            shifted[at] = masked_runs.masked_in(r, len(lens), docs, start + 1, np.minimum(stop + 1, lens[docs]))
            hf[at] = masked_runs.masked_in(r, len(lens), docs, start + 1, stop)
        return shifted, hf
