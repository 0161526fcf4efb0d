"""Mixing controllers: the mix set during training from what the trainers report.

A controller sees, per reported step and rank, each source's token-weighted loss (and any other
metric the trainer reports), and every ``mixing.interval`` reported steps proposes shares. The
planner keeps them within the declared bounds and the maximum change per decision
(:func:`project`) and records them in the timeline from a step at least ``mixing.lag`` ahead
(``timeline.py``), with the controller's reason and state: a resumed run continues from the
state, a replay from the recorded decisions delivers the identical stream.

Write one as a class (``mixing: {controller: mypkg.mix:MyController, options: {...}}``)::

    class MyController(Controller):
        def observe(self, step, losses, extra): ...       # losses: {source: (loss sum, tokens)}
        def propose(self, step, current): return shares, "why"   # or None to keep the mix
        def state_dict(self): ...; def load_state_dict(self, state): ...

Built in: :class:`ODM`.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from ..errors import PlanError
from ..plan import Mixing
from ..plan.base import import_callable


class Controller:
    """The interface (and a controller that never changes the mix)."""

    def __init__(self, sources: list[str], **options):
        self.sources = list(sources)
        if options:
            raise PlanError(f"mixing controller {type(self).__name__} takes no options (got {sorted(options)})")

    def observe(self, step: int, losses: dict[str, tuple[float, float]], extra: dict) -> None:
        """One rank's reports up to ``step`` since its last acknowledgement (the rank adds them up:
        ``trainer/reporting.aggregate``): per source ``(sum of token losses, tokens)``, and the
        other metrics it reported, each averaged over its reports."""

    def propose(self, step: int, current: dict[str, float]) -> tuple[dict[str, float], str] | None:
        """Shares for the coming steps and why, given the shares in force (``current``); None keeps them."""
        return None

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass


class ODM(Controller):
    """Online Data Mixing (Albalak et al., 2023, "Efficient Online Data Mixing For Language Model
    Pre-Training", arXiv:2312.02406): each source is an arm of an EXP3 bandit; the policy is the
    softmax of the arms' smoothed rewards ``R̂ ← α·R̂ + (1-α)·r`` (``smoothing`` α), mixed with an
    exploration share ``ε_t = min(1/K, sqrt(ln K / (K·t)))`` (or ``exploration``).

    Every step draws from every source, so every arm's reward is observed at each decision (the
    full-information form of the update, without ODM's importance weights). The reward is, by
    default (``reward: progress``), a source's *learning progress*: the fall of its smoothed
    loss since the last decision per token drawn from it, the learning-speed signal of ADO (Jiang
    et al., 2024, "Adaptive Data Optimization", arXiv:2410.11820), because ODM's own reward, the
    loss itself (``reward: loss``), favours a source whose loss cannot fall at all (noise).
    Rewards are scaled by their largest magnitude each round, so ``eta`` (the softmax's inverse
    temperature) is unitless."""

    def __init__(
        self,
        sources: list[str],
        eta: float = 2.0,
        smoothing: float = 0.5,
        exploration: float | None = None,
        reward: str = "progress",
    ):
        super().__init__(sources)
        if reward not in ("progress", "loss"):
            raise PlanError(f"odm: reward must be 'progress' or 'loss', got {reward!r}")
        if not 0 <= smoothing < 1:
            raise PlanError(f"odm: smoothing must be in [0, 1), got {smoothing}")
        if not (isinstance(eta, (int, float)) and math.isfinite(eta) and eta > 0):
            raise PlanError(f"odm: eta (the softmax's inverse temperature) must be finite and > 0, got {eta!r}")
        k = len(sources)
        if exploration is not None and not (
            isinstance(exploration, (int, float)) and 0 <= exploration <= 1 / max(k, 1)
        ):
            raise PlanError(f"odm: exploration must be in [0, 1/{k}] (one share per source), got {exploration!r}")
        self.eta, self.smoothing, self.exploration, self.reward = float(eta), float(smoothing), exploration, reward
        k = len(self.sources)
        self.rewards = np.zeros(k)  # smoothed (scaled) rewards
        self.loss = np.zeros(k)  # this interval's loss sums and tokens
        self.tokens = np.zeros(k)
        self.level = np.full(k, np.nan)  # each source's loss at the last decision (smoothed)
        self.rounds = 0

    def observe(self, step, losses, extra):
        for name, (total, n) in losses.items():
            if name in self.sources and n > 0:
                i = self.sources.index(name)
                self.loss[i] += total
                self.tokens[i] += n

    def propose(self, step, current):
        seen = self.tokens > 0
        if not seen.any():
            return None
        mean = np.where(seen, self.loss / np.maximum(self.tokens, 1), np.nan)
        prev = self.level.copy()
        self.level = np.where(
            np.isnan(prev), mean, np.where(seen, self.smoothing * prev + (1 - self.smoothing) * mean, prev)
        )
        if self.reward == "loss":
            r = np.where(seen, mean, 0.0)
        else:  # the fall of the smoothed loss per token of the source (a source not drawn earns nothing)
            fall = np.where(seen & ~np.isnan(prev), prev - self.level, 0.0)
            r = fall / np.maximum(self.tokens, 1) * self.tokens.sum()
        self.loss[:], self.tokens[:] = 0, 0
        if self.reward == "progress" and np.isnan(prev).all():
            return None  # the first interval only sets the levels
        self.rounds += 1
        top = np.abs(r).max()
        self.rewards = self.smoothing * self.rewards + (1 - self.smoothing) * (r / top if top > 0 else r)
        k = len(self.sources)
        eps = (
            self.exploration if self.exploration is not None else min(1 / k, math.sqrt(math.log(k) / (k * self.rounds)))
        )
        p = np.exp(self.eta * (self.rewards - self.rewards.max()))
        p = (1 - k * eps) * p / p.sum() + eps
        why = ", ".join(
            f"{n}: {'loss' if self.reward == 'loss' else 'progress'} {x:+.3g}" for n, x in zip(self.sources, r)
        )
        return dict(zip(self.sources, map(float, p))), f"odm round {self.rounds} (eps {eps:.3f}; {why})"

    def state_dict(self):
        return {
            "rewards": self.rewards.tolist(),
            "level": [None if np.isnan(x) else float(x) for x in self.level],
            "rounds": self.rounds,
        }

    def load_state_dict(self, state):
        self.rewards = np.asarray(state["rewards"], np.float64)
        self.level = np.array([np.nan if x is None else x for x in state["level"]], np.float64)
        self.rounds = int(state["rounds"])


BUILT_IN = {"odm": ODM}


def make_controller(mixing: Mixing, sources: list[str]) -> Controller:
    """The plan's controller over ``sources`` (a clear error naming it if it cannot be made)."""
    name = mixing.controller
    try:
        cls = BUILT_IN.get(name) or import_callable(name)
        ctl = cls(sources, **mixing.options)
    except PlanError:
        raise
    except TypeError as err:
        raise PlanError(f"mixing controller {name!r} cannot be made with options {mixing.options}: {err}") from None
    except Exception as err:  # its module cannot be imported, or its constructor raised
        raise PlanError(
            f"mixing controller {name!r} cannot be made with options {mixing.options}: {type(err).__name__}: {err}"
        ) from None
    if not isinstance(ctl, Controller):
        raise PlanError(f"mixing controller {name!r} is not a overlord_dask.planner.mixing.Controller")
    return ctl


def checked_proposal(name: str, got, sources: list[str]) -> tuple[np.ndarray, str]:
    """A controller's ``propose()`` result as shares over ``sources`` and its reason; a PlanError
    naming the controller for anything else (a share outside [0, 1] or for an unknown source
    would otherwise be clipped or dropped without a word)."""
    if not (isinstance(got, tuple) and len(got) == 2 and isinstance(got[0], dict)):
        raise PlanError(f"mixing controller {name!r}: propose() must return (shares, reason) or None, got {got!r:.200}")
    shares, why = got
    unknown = sorted(set(shares) - set(sources))
    if unknown:
        raise PlanError(f"mixing controller {name!r} proposed shares for unknown sources {unknown}; sources: {sources}")
    bad = {
        k: v
        for k, v in shares.items()
        if isinstance(v, bool) or not isinstance(v, numbers.Real) or not (math.isfinite(v) and 0 <= v <= 1)
    }
    if bad:
        raise PlanError(f"mixing controller {name!r} proposed shares outside [0, 1]: {bad}")
    target = np.array([float(shares.get(n, 0.0)) for n in sources])
    if target.sum() <= 0:
        raise PlanError(f"mixing controller {name!r} proposed no positive share: {shares}")
    return target, str(why)


def project(target: np.ndarray, prev: np.ndarray, lo: np.ndarray, hi: np.ndarray, max_change: float) -> np.ndarray:
    """Shares closest to ``target`` (a shift ``clip(target + λ)``) that sum to 1, stay within
    ``[lo, hi]`` and within ``max_change`` of ``prev``; where the bounds and the step limit
    cannot both hold, the bounds win."""
    a, b = np.maximum(lo, prev - max_change), np.minimum(hi, prev + max_change)
    if a.sum() > 1 or b.sum() < 1 or (a > b).any():
        a, b = lo, hi
    if a.sum() > 1 or b.sum() < 1:
        raise PlanError(
            f"mixing bounds cannot hold: minimum shares sum to {lo.sum():.3g}, maximum shares to {hi.sum():.3g}"
        )
    left, right = -1.0 - target.max(), 1.0 - target.min() + 1.0
    for _ in range(100):
        mid = (left + right) / 2
        if np.clip(target + mid, a, b).sum() > 1:
            right = mid
        else:
            left = mid
    x = np.clip(target + (left + right) / 2, a, b)
    return x / x.sum()
