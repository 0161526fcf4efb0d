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

# cut_pieces gathers from units of up to this many documents on average (copying ~8k lengths costs
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

    def cut_pieces(self, rows: np.ndarray) -> int:
        """How many of ``rows`` end before their document does (a split document's pieces but
        its last): their last token's label is the document's next token."""
        if not len(rows):
            return 0
        units, inverse = P.unique_rows(P.units(rows), return_inverse=True)
        lens = [self.doc_lengths[key] for key in map(tuple, units.tolist())]
        sizes = np.fromiter(map(len, lens), np.int64, len(lens))
        few_of_large_units = sizes.sum() > GATHER_DOCS_PER_UNIT * len(lens) + GATHER_DOCS_PER_PIECE * len(rows)
        if few_of_large_units:
            return sum(
                int(np.count_nonzero(mine[:, P.STOP] < self.doc_lengths[key][mine[:, P.DOC]]))
                for key, mine in self._by_unit(rows, units, inverse)
            )
        # every piece's document length in one gather from the units' lengths laid end to end
        # (a loop over a step's units cost a sort and three array operations per unit)
        doc_len = np.concatenate(lens)[(np.cumsum(sizes) - sizes)[inverse] + rows[:, P.DOC]]
        return int(np.count_nonzero(rows[:, P.STOP] < doc_len))

    @staticmethod
    def _by_unit(rows: np.ndarray, units: np.ndarray | None = None, inverse: np.ndarray | None = None):
        """``((source, epoch, unit), its rows)`` for each unit ``rows`` reference (``units`` and
        ``inverse``: their ``unique_rows``, if the caller has it): one sort, not a scan of all
        rows per unit (a step at thousands of ranks holds pieces of hundreds of units)."""
        if not len(rows):
            return
        if units is None:
            units, inverse = P.unique_rows(P.units(rows), return_inverse=True)
        order, bounds = P.grouped(inverse, len(units))
        for k, key in enumerate(units.tolist()):
            yield tuple(key), rows[order[bounds[k] : bounds[k + 1]]]

    def keep_lengths(self, key: tuple[int, int, int], lengths: np.ndarray, masked: np.ndarray | None) -> None:
        """A unit's document lengths (and masked runs) for as long as planned pieces may reference it."""
        self.doc_lengths[key] = np.asarray(lengths, dtype=np.int64)
        if masked is not None:
            self.masked[key] = np.asarray(masked, dtype=np.int64)

    def loss_tokens(self, rows: np.ndarray) -> tuple[int, int]:
        """Labels of a step's pieces that are not -100, as (shifted, hf) labels count them: per
        piece its length less one, plus its last token's where the document goes on (shifted; HF
        models shift themselves: the length less one), less the targets the loss ignores."""
        n_tokens, n_pieces = int(P.lengths(rows).sum()), len(rows)
        m_shifted, m_hf = self.masked_targets(rows)
        return n_tokens - n_pieces + self.cut_pieces(rows) - m_shifted, n_tokens - n_pieces - m_hf

    def masked_targets(self, rows: np.ndarray) -> tuple[int, int]:
        """How many of the pieces' label targets the loss ignores, as (shifted, hf) labels count
        them: a piece's shifted labels target its positions ``start + 1`` up to its stop (and the
        document's next token past it), HF's those of ``start + 1 .. stop - 1``."""
        if not self.masked or not len(rows):
            return 0, 0
        shifted = hf = 0
        for key, mine in self._by_unit(rows):
            r = self.masked.get(key)
            if r is None:
                continue
            lens = self.doc_lengths[key]
            docs, start, stop = mine[:, P.DOC], mine[:, P.START], mine[:, P.STOP]
            shifted += int(masked_runs.masked_in(r, len(lens), docs, start + 1, np.minimum(stop + 1, lens[docs])).sum())
            hf += int(masked_runs.masked_in(r, len(lens), docs, start + 1, stop).sum())
        return shifted, hf
