"""The cost model learned from the trainers' step times (``cost: {learn: true}``).

The declared model (``attention·L² + linear·L + constant`` per document) is a guess: every model,
kernel, sequence length and GPU shifts its coefficients, and a wrong ratio of the quadratic to the
linear term makes the balancer even out the wrong thing. The trainers report how long each
micro-batch (or step) kept them busy; the planner knows what it put there. So each report is one
row of a linear regression::

    seconds = attention·ΣL² + linear·ΣL + constant·documents + encoder·ΣV + fixed

over the pieces of that micro-batch (``balance.sync: micro_batch``) or of the rank's whole step
(``sync: step``; ``fixed`` then counts once per micro-batch of it). The fit is robust (Huber
weights on relative residuals, iterated: a step that also saved a checkpoint or waited on a
straggling collective does not pull it) and non-negative, over a sliding window of the newest
observations. Once its predictions stop moving (``tolerance``, ``patience``), the fitted model
replaces the one in force from a future step, recorded in the timeline as a decision
(``timeline.py``): replay, resume and a change of dp see the same switch at the same step.

The balancer only compares costs, so a learned model's unit does not matter to it; it is
microseconds of trainer compute (``UNIT``), which keeps costs at a scale like the declared ones.
"""

from __future__ import annotations

import numpy as np

from .. import pieces as P
from ..plan import CostModel, LearnCost

TERMS = ("attention", "linear", "constant", "encoder", "fixed")  # one column each: ΣL², ΣL, documents, ΣV, 1
UNIT = 1e6  # a learned model's costs are in microseconds
HUBER_K = 1.345


def features(lengths: np.ndarray, vision: np.ndarray | None, groups: np.ndarray, n_groups: int) -> np.ndarray:
    """``[n_groups, 5]`` regression rows of micro-batches: ΣL², ΣL, pieces, ΣV and 1 (the fixed
    term) of each group (``groups[i]``: the group of piece ``i``). A rank's step is the sum of its
    micro-batches' rows."""
    L = lengths.astype(np.float64)
    out = np.zeros((n_groups, len(TERMS)))
    out[:, 0] = np.bincount(groups, weights=L * L, minlength=n_groups)
    out[:, 1] = np.bincount(groups, weights=L, minlength=n_groups)
    out[:, 2] = np.bincount(groups, minlength=n_groups)
    if vision is not None:
        out[:, 3] = np.bincount(groups, weights=vision.astype(np.float64), minlength=n_groups)
    out[:, 4] = 1.0
    return out


def robust_fit(X: np.ndarray, y: np.ndarray, iterations: int = 30) -> np.ndarray:
    """Non-negative coefficients minimising Huber loss of the *relative* residuals (the noise of a
    step time grows with it); columns that are all zero get 0."""
    beta = np.zeros(X.shape[1])
    cols = np.flatnonzero(np.abs(X).max(axis=0) > 0)
    if len(cols) == 0 or len(y) == 0:
        return beta
    scale = np.abs(X[:, cols]).max(axis=0)
    Z = X[:, cols] / scale
    base = 1.0 / np.maximum(y, 1e-12) ** 2  # squared relative residuals
    w = np.ones(len(y))
    b = np.zeros(len(cols))
    for _ in range(iterations):
        b_new = _nonneg_lstsq(Z, y, base * w)
        r = (y - Z @ b_new) / np.maximum(y, 1e-12)
        s = 1.4826 * np.median(np.abs(r - np.median(r))) or 1e-12
        u = np.abs(r) / (HUBER_K * s)
        w = np.where(u <= 1, 1.0, 1.0 / np.maximum(u, 1e-12))
        done = np.allclose(b_new, b, rtol=1e-7, atol=0)
        b = b_new
        if done:
            break
    beta[cols] = b / scale
    return beta


def _nonneg_lstsq(Z: np.ndarray, y: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Weighted least squares with the most negative coefficient dropped until none is negative."""
    active = list(range(Z.shape[1]))
    sw = np.sqrt(w)
    while True:
        b = np.zeros(Z.shape[1])
        if not active:
            return b
        sol, *_ = np.linalg.lstsq(Z[:, active] * sw[:, None], y * sw, rcond=None)
        b[active] = sol
        if (sol >= 0).all():
            return b
        active.pop(int(np.argmin(sol)))


def median_rel_error(pred: np.ndarray, y: np.ndarray) -> float:
    return float(np.median(np.abs(pred - y) / np.maximum(y, 1e-12))) if len(y) else float("nan")


def declared_row(cost: CostModel) -> np.ndarray:
    """A cost model's coefficients as a regression row (no fixed term)."""
    return np.array([cost.attention, cost.linear_coef, cost.constant, cost.encoder, 0.0])


class CostLearner:
    """The sliding window of (features, seconds), the fit, and when to switch (planner thread)."""

    def __init__(self, config: LearnCost, declared: CostModel):
        self.config, self.declared = config, declared
        self._X = np.zeros(
            (config.window, len(TERMS))
        )  # a ring of the newest observations (their order does not matter)
        self._y = np.zeros(config.window)
        self._n = self._pos = 0
        self.fitted: np.ndarray | None = None  # seconds per unit of each term
        self.settled_fits = 0  # fits in a row within tolerance of the one before
        self.fits = 0
        self.new_steps = 0  # steps reported since the last fit (counted when the step reported changes)
        self._last_step: int | None = None
        self.settled_at: int | None = None  # the reported step at which the fit first settled
        self.error_fitted = self.error_declared = float("nan")
        self.declared_scaled: np.ndarray | None = (
            None  # the declared model at its best scale over the last fit's window
        )

    def observe(self, rows: np.ndarray, seconds: np.ndarray, step: int) -> None:
        """One rank's report of ``step``: its rows (micro-batches, or its step) and their seconds."""
        ok = np.isfinite(seconds) & (seconds > 0)
        rows, seconds = rows[ok][-len(self._y) :], seconds[ok][-len(self._y) :]
        at = (self._pos + np.arange(len(seconds))) % len(self._y)
        self._X[at], self._y[at] = rows, seconds
        self._pos = (self._pos + len(seconds)) % len(self._y)
        self._n = min(self._n + len(seconds), len(self._y))
        if step != self._last_step:
            self._last_step = step
            self.new_steps += 1

    def refit(self, step: int) -> bool:
        """Fit again if enough new steps came in; True if it did."""
        if self._n < self.config.min_observations or self.new_steps < self.config.every:
            return False
        self.new_steps = 0
        X, y = self.window()
        beta = robust_fit(X, y)
        pred = X @ beta
        if self.fitted is not None and median_rel_error(X @ self.fitted, pred) < self.config.tolerance:
            self.settled_fits += 1
        else:
            self.settled_fits = 0
        self.fitted, self.fits = beta, self.fits + 1
        if self.settled and self.settled_at is None:
            self.settled_at = step
        self.error_fitted = median_rel_error(pred, y)
        self.declared_scaled = self._scaled(declared_row(self.declared), X, y)
        self.error_declared = median_rel_error(X @ self.declared_scaled, y)
        return True

    def window(self) -> tuple[np.ndarray, np.ndarray]:
        """The observations in the window: rows ``[n, terms]`` and their seconds."""
        return self._X[: self._n], self._y[: self._n]

    @property
    def settled(self) -> bool:
        return self.fitted is not None and self.settled_fits >= self.config.patience

    @staticmethod
    def _scaled(row: np.ndarray, X: np.ndarray, y: np.ndarray) -> np.ndarray:
        """``row`` (a model's shape) at the scale, with the fixed term, that best predict ``y``
        (its unit in seconds; a cost model has no fixed term, the trainer's times do)."""
        A = np.stack([X @ row, X[:, -1]], axis=1)
        s, f = _nonneg_lstsq(A / np.maximum(y, 1e-12)[:, None], np.ones(len(y)), np.ones(len(y)))
        out = row * s
        out[-1] = f
        return out

    def proposal(self, in_force: CostModel) -> dict | None:
        """(Right after :meth:`refit`.) The fitted coefficients as a cost model's fields, if
        settled and its median relative error over the window beats the model in force (at that
        model's best scale) by more than ``refit_change``; else None."""
        if not self.settled:
            return None
        X, y = self.window()
        theirs = median_rel_error(X @ self._scaled(declared_row(in_force), X, y), y)
        if theirs - self.error_fitted <= self.config.refit_change:
            return None
        a, b, c, e, _ = self.fitted * UNIT
        return {"attention": float(a), "linear": float(b), "constant": float(c), "encoder": float(e)}

    def status(self) -> dict:
        """Declared (at their best scale, in seconds) vs fitted coefficients and their errors."""
        out = {
            "observations": self._n,
            "fits": self.fits,
            "settled": self.settled,
            "settled_at": self.settled_at,
            "error_fitted": self.error_fitted,
            "error_declared": self.error_declared,
        }
        if self.fitted is not None:
            out["fitted"] = dict(zip(TERMS, map(float, self.fitted)))
            out["declared"] = dict(zip(TERMS, map(float, self.declared_scaled)))
        return out


def step_features(
    pieces: np.ndarray, slot: np.ndarray, vision: np.ndarray | None, dp: int, micro_batches: int
) -> np.ndarray:
    """A planned step's regression rows, ``[dp, micro_batches, 5]``."""
    g = P.flat_slots(slot, micro_batches)
    return features(P.lengths(pieces), vision, g, dp * micro_batches).reshape(dp, micro_batches, len(TERMS))
