"""The tests' shared harness.

- ``run_ranks``: one function per trainer rank in threads, the first failure re-raised in the
  test's thread.
- The save/restore harness every resume test uses (as torchdata's ``run_test_save_load_state``):
  :func:`consume` runs ranks of a service to a step (loading states first, saving states on the
  way) and records what each (rank, step) received; :func:`assert_same_stream` compares two such
  records key by key; :func:`assert_exactly_once` checks that no piece came twice over several;
  :class:`Served` is a service in a process of its own (``overlord serve``) that a test can
  SIGKILL; :func:`planner_stream` does the same as :func:`consume` for a planner without a
  cluster.
- ``same_fields``: two batches' fields equal in value and dtype.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import yaml

from overlord_dask import connect
from overlord_dask.observe.figures import delivered_identities, delivered_record

ROOT = Path(__file__).resolve().parents[1]


def run_ranks(fn: Callable[[object], None], ranks: Iterable, timeout: float = 300) -> None:
    errors: list[BaseException] = []

    def guarded(rank) -> None:
        try:
            fn(rank)
        except BaseException as err:  # re-raised below, in the test's thread
            errors.append(err)

    threads = [threading.Thread(target=guarded, args=(r,)) for r in ranks]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=timeout)
    if errors:
        raise errors[0]


def same_fields(a: dict, b: dict) -> None:
    """Same keys, and every array equal in value and dtype."""
    assert set(a) == set(b)
    for k, v in a.items():
        if isinstance(v, np.ndarray):
            assert b[k].dtype == v.dtype, k
            np.testing.assert_array_equal(b[k], v, err_msg=k)
        else:
            assert b[k] == v, k


# ---- the save/restore harness -------------------------------------------------------------------
def identities(batch: dict) -> list[tuple]:
    """The pieces a step's batch holds, as sorted ``(source, epoch, sample id, start, length)``."""
    return sorted(map(tuple, delivered_identities(delivered_record(batch)).tolist()))


def token_digest(batch: dict) -> str:
    """A hash of everything a model sees of a step's batch (tokens, labels, positions, ids)."""
    h = hashlib.sha256()
    for mb in batch["micro_batches"]:
        for k in ("input_ids", "labels", "position_ids", "cu_seqlens", "sample_ids"):
            h.update(np.ascontiguousarray(mb[k]).astype(np.int64).tobytes())
    return h.hexdigest()


@dataclass
class Consumed:
    """What ranks received: per ``(rank, step)`` the piece identities and the token digest; each
    rank's ``state_dict()`` at the end; the states saved on the way, by ``(rank, next step)``."""

    ids: dict = field(default_factory=dict)
    digests: dict = field(default_factory=dict)
    waits: list = field(default_factory=list)  # every rank's seconds in next_batch(), per step
    states: dict = field(default_factory=dict)
    saved: dict = field(default_factory=dict)

    def steps(self, rank: int | None = None) -> list:
        return sorted(k for k in self.ids if rank is None or k[0] == rank)

    def delivered(self, before: int | None = None) -> list[np.ndarray]:
        """The identities received (of steps before ``before``), as ``figures.exactly_once`` takes them."""
        return [as_array(v) for (_, s), v in self.ids.items() if before is None or s < before]


def as_array(ids: list[tuple]) -> np.ndarray:
    """Piece identities as an int64 ``[n, 4]`` array."""
    return np.array(ids, dtype=np.int64).reshape(-1, 4)


def consume(
    address: str,
    ranks: Iterable[int],
    *,
    steps: int | None = None,
    until: int | None = None,
    dp: int | None = None,
    states: dict | None = None,
    save_at: Iterable[int] = (),
    on_batch: Callable[[int, dict], None] | None = None,
    save_final: bool = True,
    close: bool = True,
    timeout: float = 120,
    **options,
) -> Consumed:
    """Each rank (a thread with a stream of its own) loads ``states[rank]`` if given, then takes
    ``steps`` steps, or steps up to ``until`` (exclusive); it saves its state where its next
    step is one of ``save_at``, calls ``on_batch(rank, batch)`` after each step, commits and
    (``save_final``) saves its final state. ``options``: the streams' (``StreamOptions``)."""
    out, save_at = Consumed(), set(save_at)

    def run(r):
        s = connect(address, r, dp, timeout=timeout, **options)
        try:
            if states is not None:
                s.load_state_dict(states[r])
            taken = 0
            while True:
                if s.next_step in save_at:
                    out.saved[(r, s.next_step)] = s.state_dict()
                if (steps is not None and taken >= steps) or (until is not None and s.next_step >= until):
                    break
                b = s.next_batch()
                taken += 1
                out.ids[(r, b["step"])] = identities(b)
                out.digests[(r, b["step"])] = token_digest(b)
                if on_batch is not None:
                    on_batch(r, b)
            out.waits.extend(s.wait_s)
            s.commit()
            if save_final:
                out.states[r] = s.state_dict()
        finally:
            if close:
                s.close()

    run_ranks(run, list(ranks))
    return out


def assert_same_stream(got: dict, want: dict, *, exact_keys: bool = True) -> None:
    """``got`` holds what ``want`` holds for every ``(rank, step)`` of ``want`` (and, with
    ``exact_keys``, nothing else); the message names the first key that differs."""
    if exact_keys:
        assert sorted(got) == sorted(want), (sorted(set(got) ^ set(want)))[:10]
    for key in sorted(want):
        assert key in got, f"{key} was not received"
        assert got[key] == want[key], f"{key} differs from the uninterrupted stream"


def assert_exactly_once(*records: dict) -> None:
    """No piece identity appears twice over every (rank, step) of ``records``."""
    pieces = [i for rec in records for ids in rec.values() for i in ids]
    assert len(pieces) == len(set(pieces)), f"{len(pieces) - len(set(pieces))} pieces delivered twice"


def plan_file(tmp_path, corpus, checkpoint: str | None = None, commit: str = "ack", **sections) -> Path:
    """The demo plan at a small topology (dp 2, 2 micro-batches of 4k tokens, 4-step windows) over
    the tests' corpus, written as YAML (``checkpoint``: the snapshot folder, if any)."""
    data = yaml.safe_load((ROOT / "overlord_dask" / "service" / "demo_plan.yaml").read_text())
    for s in data["sources"]:
        s["url"] = str(Path(corpus) / s["url"])
    data["topology"] = {"dp": 2, "micro_batches": 2, "tokens_per_micro_batch": 4096}
    data["loading"].update(unit_rows=300, unit_tokens=65536, prefetch_steps=3)
    data["balance"]["window"] = 4
    if checkpoint:
        data["checkpoint"] = {"url": checkpoint, "commit": commit}
    data.update(sections)
    path = tmp_path / ("plan-ck.yaml" if checkpoint else "plan.yaml")
    path.write_text(yaml.safe_dump(data))
    return path


class Served:
    """``overlord serve PLAN`` in a process group of its own, as a job runs it: ``address`` once
    it listens; :meth:`kill` SIGKILLs scheduler, planner, nannies and workers at once. A context
    manager that kills it on the way out."""

    def __init__(self, plan: Path, port: int = 0):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "overlord_dask", "serve", str(plan), "--port", str(port)],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            cwd=ROOT,
            start_new_session=True,
        )
        self.address = json.loads(self.proc.stdout.readline())["address"]

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)

    def __enter__(self) -> Served:
        return self

    def __exit__(self, *exc) -> None:
        self.kill()


def planner_stream(state, until: int, lengths: Callable, *, on_commit=None, hook=None) -> dict[int, tuple]:
    """A planner (``PlannerState``, no cluster) planned up to ``until`` with every rank
    acknowledging at once, every unit's ``lengths(name, epoch, unit)`` loaded as soon as it is
    wanted: ``{step: (pieces, slot)}``. ``hook(state)`` runs first in each round and may return a
    step planning must not pass yet; ``on_commit(state)`` runs after each committed step."""
    out = {}
    while state.next_step < until:
        cap = hook(state) if hook else None
        for name, epoch, unit in state.wanted():
            state.add_lengths(name, epoch, unit, lengths(name, epoch, unit))
        planned, _ = state.plan_steps(min(until, cap if cap is not None else until) - state.next_step)
        for p in planned:
            e = state.ledger[p["step"]]
            out[p["step"]] = (e["pieces"].copy(), e["slot"].copy())
            for r in range(state.topology.dp):
                state.ack(r, p["step"])
            if on_commit:
                on_commit(state)
    return out


def example_plan(name: str, corpus, **over):
    """``pipelines/NAME.yaml`` reading the test corpus instead of ``../demo-data`` (top-level
    sections in ``over`` replace the file's)."""
    from overlord_dask.plan import plan_from_dict

    data = yaml.safe_load((ROOT / "pipelines" / f"{name}.yaml").read_text())
    for s in data["sources"]:
        s["url"] = s["url"].replace("../demo-data/", f"{Path(corpus).resolve()}/")
    data.update(over)
    return plan_from_dict(data, where=f"pipelines/{name}.yaml")
