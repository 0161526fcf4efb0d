"""The trainer talks back: each rank's compute time per step and the metrics it reports, sent
one-way to the planner (``planner/feedback.py``: a learned cost model, a mixing controller).

What is measured, without the trainer doing anything: the time from a step's hand-over to the
trainer's next request (its compute), not counting the time it waited for a batch nor the time
spent in ``commit()``/``state_dict()``. Iterating micro-batches (``for mb in stream``), the
time of each micro-batch is measured the same way. A GPU trainer's Python runs ahead of its
device (kernels are queued, not run), so it calls :meth:`Reporting.step_done` after its
synchronisation point (``loss.item()``, an optimizer step that syncs, ``torch.cuda.synchronize()``),
or passes the seconds its CUDA events measured; from the first call on, the stream reports those
instead of its own measurements.

Metrics: ``stream.report(step, loss_by_source={...}, **extra)``, with per-source losses from
:func:`loss_by_source` (a batch's ``source_ids``/``cu_seqlens`` and the per-token losses).

Reports wait in a bounded buffer and leave with the acknowledgements (batched on the process's
channel, a few ms apart): nothing is sent per step, nothing waits for an answer, and a trainer
that never reports costs nothing. What leaves together is aggregated here, on the trainer's side
(:func:`aggregate`): the steps' compute times as columns of one item, and the loss reports as one
item per source's ``(sum of token losses, tokens)`` summed and the other metrics averaged. The
scheduler's event loop and the planner then handle an item or two per rank and chunk, not one
per rank and step (at thousands of ranks, every rank reports every step).
"""

from __future__ import annotations

import math
import numbers
import time
from collections import deque

import numpy as np

MAX_BUFFERED = 4096  # reports kept while none can be sent (the oldest go first)


def loss_by_source(batch: dict, token_losses, sources: list[str] | None = None) -> dict:
    """Per source ``(sum of token losses, tokens)`` of one micro-batch: ``token_losses[i]`` is the
    loss of the prediction scored against ``batch["labels"][i]`` (the shape of ``labels``: what
    ``cross_entropy(..., reduction="none")`` gives with the batch's labels); positions whose label
    is ``-100`` (masked, padding) do not count. Keys are source names with ``sources`` (the run's,
    ``stream.info["sources"]``), else source indices."""
    if hasattr(token_losses, "detach"):
        token_losses = token_losses.detach().float().cpu().numpy()
    losses = np.asarray(token_losses, np.float64).reshape(-1)
    labels = _numpy(batch["labels"]).reshape(-1)
    cu = _numpy(batch["cu_seqlens"]).astype(np.int64)
    src = _numpy(batch["source_ids"]).astype(np.int64)
    n = min(len(src), len(cu) - 1)
    if len(losses) != len(labels):
        raise ValueError(f"token_losses has {len(losses)} values but the batch has {len(labels)} labels")
    per_token = np.full(len(labels), -1, np.int64)
    per_token[: cu[n]] = np.repeat(src[:n], np.diff(cu[: n + 1]))
    keep = (labels != -100) & (per_token >= 0)
    k = per_token[keep]
    sums = np.bincount(k, weights=losses[keep], minlength=0)
    counts = np.bincount(k, minlength=len(sums))
    out = {}
    for i in np.flatnonzero(counts):
        out[sources[i] if sources is not None else int(i)] = (float(sums[i]), int(counts[i]))
    return out


def _number(v) -> float | None:
    """A plain float from a Python or numpy number or a one-element tensor/array; None otherwise."""
    if not isinstance(v, numbers.Real) and hasattr(v, "item"):
        try:
            v = v.item()  # a 0-d tensor (loss.detach()), a numpy scalar or one-element array
        except (ValueError, RuntimeError):  # more than one element
            return None
    if isinstance(v, bool) or not isinstance(v, numbers.Real):
        return None
    return float(v)


def _loss(name: str, v) -> tuple[float, float]:
    """A source's reported loss: a mean token loss, or ``(sum of token losses, tokens)``."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"report: loss of source {name!r} must be a mean or (sum, tokens), got {v!r}")
        total, n = _number(v[0]), _number(v[1])
        if total is None or n is None or not (math.isfinite(total) and math.isfinite(n)):
            raise ValueError(f"report: loss of source {name!r} must be finite numbers (sum, tokens), got {v!r}")
        if n < 0 or n != int(n) or (n == 0 and total != 0):
            raise ValueError(
                f"report: loss of source {name!r}: tokens must be a whole number >= 0, and a loss sum needs tokens "
                f"(got sum {total}, tokens {n})"
            )
        return total, n
    x = _number(v)
    if x is None or not math.isfinite(x):
        raise ValueError(f"report: loss of source {name!r} must be a finite number, got {v!r}")
    return x, 1.0


def aggregate(items: list[dict]) -> list[dict]:
    """The reports of one drain as at most two items: the compute times as columns
    (``{"s": newest, "steps": [...], "t": [...], "mb": [...]}``) and the loss reports merged
    (``{"s": newest, "loss": {source: [sum, tokens]}, "extra": {name: mean}, "n": reports}``:
    sums of token losses and tokens add up exactly; a metric is averaged over the reports that
    carry it)."""
    times = [it for it in items if "t" in it]
    reports = [it for it in items if "t" not in it]
    out = []
    if times:
        steps = [it["s"] for it in times]
        out.append({"s": max(steps), "steps": steps, "t": [it["t"] for it in times], "mb": [it["mb"] for it in times]})
    if reports:
        loss: dict[str, list[float]] = {}
        sums: dict[str, list[float]] = {}
        for it in reports:
            for name, (total, n) in it["loss"].items():
                acc = loss.setdefault(name, [0.0, 0.0])
                acc[0] += total
                acc[1] += n
            for k, v in it["extra"].items():
                acc = sums.setdefault(k, [0.0, 0])
                acc[0] += v
                acc[1] += 1
        extra = {k: total / n for k, (total, n) in sums.items()}
        out.append({"s": max(it["s"] for it in reports), "loss": loss, "extra": extra, "n": len(reports)})
    return out


def _numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


class Reporting:
    """The stream's side of the feedback: measured compute times and reported metrics (mixed
    into ``RankStream``; every method runs on the trainer's thread but :meth:`_drain_reports`)."""

    def _init_reports(self) -> None:
        self._reports: deque = deque(maxlen=MAX_BUFFERED)
        self._handed_at: float | None = None  # when the step in the trainer's hands was handed over
        self._handed_step: int | None = None
        self._mb_times: list[float] | None = None  # that step's micro-batch times (micro-batch iteration)
        self._excluded = 0.0  # seconds of that step spent in commit()/state_dict()
        self._explicit = False  # the trainer reports its own times (step_done)
        self._newest_handed = -1  # the newest step this rank was handed: no report may be ahead of it

    def _requested(self) -> None:
        """The trainer asks for the next step: the one it held took this long."""
        if self._handed_step is not None and not self._explicit:
            mb, self._mb_times = self._mb_times, None
            total = sum(mb) if mb else time.perf_counter() - self._handed_at - self._excluded
            self._reports.append({"s": self._handed_step, "t": max(total, 0.0), "mb": mb})
        self._handed_step = None

    def _iterated(self, times: list[float]) -> None:
        """The trainer went through the step's micro-batches in these times (unless part of the
        step went to the stream's own calls: then the step's total without them is reported)."""
        self._mb_times = times if self._excluded == 0 else None

    def _handed(self, step: int) -> None:
        self._newest_handed = max(self._newest_handed, step)
        self._handed_step, self._handed_at, self._excluded, self._mb_times = step, time.perf_counter(), 0.0, None

    def _excluding(self, t0: float) -> None:
        """Time since ``t0`` (spent in the stream's own calls) is not the trainer's compute."""
        self._excluded += time.perf_counter() - t0

    def step_done(self, seconds: float | None = None) -> None:
        """The step in hand is computed (call after the trainer's synchronisation point), or
        took ``seconds`` (measured by the trainer, e.g. with CUDA events). From the first call
        on, the stream reports these instead of measuring."""
        self._explicit = True
        if self._handed_step is None:
            return
        if seconds is None:
            seconds = time.perf_counter() - self._handed_at - self._excluded
        if not (isinstance(seconds, (int, float)) and math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"step_done: seconds must be a finite number >= 0, got {seconds!r}")
        self._reports.append({"s": self._handed_step, "t": float(seconds), "mb": None})

    def report(self, step: int, loss_by_source: dict | None = None, **extra) -> None:
        """Report metrics of ``step`` (one-way): ``loss_by_source`` maps a source (name or index)
        to its mean token loss, or to ``(sum of token losses, tokens)`` (:func:`loss_by_source`);
        ``extra`` any other numbers (``loss=2.1``, ``grad_norm=0.8``; 0-d tensors and numpy
        scalars too). Checked here, at the call: ``step`` is one this rank was handed (a report
        ahead of the stream would schedule a decision for a step it may never reach), every value
        is finite, and a loss sum comes with the tokens it is over."""
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or not 0 <= step <= self._newest_handed:
            got = "no step yet" if self._newest_handed < 0 else f"steps 0..{self._newest_handed}"
            raise ValueError(f"report: step must be a step this rank was handed ({got}), got {step!r}")
        names = list(self.info.get("sources", []))
        losses = {}
        for key, v in (loss_by_source or {}).items():
            name = names[key] if isinstance(key, (int, np.integer)) and 0 <= key < len(names) else key
            if name not in names:
                raise ValueError(f"report: unknown source {key!r}; the run's sources are {names}")
            losses[name] = _loss(name, v)
        values = {}
        for k, v in extra.items():
            x = _number(v)
            if x is None or not math.isfinite(x):
                raise ValueError(f"report: metric {k!r} must be a finite number, got {v!r}")
            values[k] = x
        self._reports.append({"s": int(step), "loss": {k: [a, b] for k, (a, b) in losses.items()}, "extra": values})

    def loss_by_source(self, batch: dict, token_losses) -> dict:
        """:func:`loss_by_source` keyed by this run's source names."""
        return loss_by_source(batch, token_losses, list(self.info.get("sources", [])))

    def _drain_reports(self, rio) -> None:
        """(IO loop) Send what was reported, on the rank's channel (replica 0 only: the others
        report the same work)."""
        if not self._reports or rio is None or rio.channel is None:
            return
        items = []
        while self._reports:
            try:
                items.append(self._reports.popleft())
            except IndexError:
                break
        if rio.replica != 0:
            return
        try:
            rio.channel.send(
                {
                    "op": "feedback",
                    "rank": rio.rank,
                    "cp_rank": rio.cp_rank or 0,
                    "replica": 0,
                    "items": aggregate(items),
                }
            )
        except Exception:  # the channel is down (the stream reconnects): they go with a later acknowledgement
            self._reports.extendleft(reversed(items))
