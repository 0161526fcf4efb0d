"""The balancer on a core of its own: a window's placement (``balance.place_window``) and its
last pass (``Placement.finish``) computed in a child process.

Why: the planner thread shares the scheduler process's GIL with the event loop that serves every
host's descriptors and acknowledgements, and at thousands of ranks placing a window's pieces is
the largest part of planning. In a process of its own it takes no GIL from the event loop, runs
on another core, and costs per token what ``benchmarks/balance.py --scaling`` measures.

Why it changes nothing in the plan: the balancer is a pure function of the window's piece rows,
their costs and the topology, so the child computes exactly what the planner thread would
(tested), and wherever the child cannot answer (still starting, gone, or failing) the thread
computes the same placement itself: a run never waits on the child, and a child killed in the
middle of a window costs that window's placement once more, not a step. The selection of the
pieces, the top-up rounds and the ledger stay in the planner thread; the child keeps only the
last placement, for :meth:`RemotePlacement.finish` (a placement a top-up replaces is never
finished: ``cost_balanced.py``).

The child is ``python -c CHILD SOCKET MEMORY`` (:func:`serve`): one end of a socket pair for
the small messages (``multiprocessing.connection``) and a shared memory file (``memfd``) for the
arrays, which each side writes once and the other reads in place (a window's rows are tens of MB
at thousands of ranks: pickled through the socket they cost the planner thread about what
placing them did). Started as a plain subprocess it never re-imports the user's main module,
which ``multiprocessing``'s spawn would; it exits when its end of the pair closes (the service
stopped, or died).
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import socket
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass
from multiprocessing.connection import Connection

import numpy as np

from .balance import Placement, WindowPlan, place_window

logger = logging.getLogger(__name__)

PROCESS_FROM_BINS = 512  # dp × micro-batches from which the service balances in a child process
ENV = "OVERLORD_BALANCER_PROCESS"  # "0": never; "1": whatever the size (tests); unset: from PROCESS_FROM_BINS
ALIGN = 64  # arrays in the shared memory start at multiples of this
CHILD = f"import sys; from {__name__} import serve; serve(int(sys.argv[1]), int(sys.argv[2]))"


def wanted(bins: int | None) -> bool:
    """Whether a planner of steps of ``bins`` bins balances in a child process: worth its
    start, its memory (a Python process with numpy and the compiled kernels) and the copies of
    each window's rows only for large steps (and only where shared memory files exist: Linux)."""
    if not hasattr(os, "memfd_create"):
        return False
    setting = os.environ.get(ENV, "")
    if setting in ("0", "1"):
        return setting == "1"
    return bins is not None and bins >= PROCESS_FROM_BINS


@dataclass(slots=True)
class RemotePlacement:
    """A placement the child holds (:meth:`BalancerProcess.place`): its pending tokens here,
    the rest there until :meth:`finish`."""

    owner: BalancerProcess
    number: int
    pending: int
    inputs: tuple  # (pieces, costs, keywords): what to place here if the child cannot finish it

    def pending_tokens(self) -> int:
        return self.pending

    def finish(self) -> WindowPlan:
        return self.owner.finish(self)


class SharedArrays:
    """Arrays laid out in a shared memory file, either side growing it (``ftruncate``) and
    mapping it again when it is larger than its map."""

    def __init__(self, fd: int):
        self.fd, self.map = fd, None

    def _mapped(self, nbytes: int) -> mmap.mmap:
        size = os.fstat(self.fd).st_size
        if size < nbytes:
            size = max(nbytes, 2 * size, 1 << 24)
            os.ftruncate(self.fd, size)
        if self.map is None or len(self.map) < size:
            if self.map is not None:
                self.map.close()  # (no view of it outlives a call: every array read is copied or dropped)
            self.map = mmap.mmap(self.fd, size)
        return self.map

    def write(self, arrays: dict[str, np.ndarray], at: int = 0) -> tuple[list, int]:
        """``arrays`` written from offset ``at``: their descriptors, and the offset past them."""
        out, end = [], at
        for name, a in arrays.items():
            a = np.asarray(a)
            start = -(-end // ALIGN) * ALIGN
            end = start + a.nbytes
            out.append((name, start, a.dtype.str, a.shape))
        m = self._mapped(max(end, 1))
        for (_, start, _, _), a in zip(out, arrays.values()):
            a = np.asarray(a)
            np.copyto(np.ndarray(a.shape, a.dtype, m, start), a)
        return out, end

    def close(self) -> None:
        if self.map is not None:
            with contextlib.suppress(BufferError):  # (a placement still copying: the map goes with it)
                self.map.close()
            self.map = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def read(self, descriptors: list, copy: bool) -> dict[str, np.ndarray]:
        """The arrays ``descriptors`` name: copies, or views valid until the next write."""
        end = max(
            (start + int(np.prod(shape)) * np.dtype(dt).itemsize for _, start, dt, shape in descriptors), default=0
        )
        m = self._mapped(max(end, 1))
        out = {name: np.ndarray(shape, np.dtype(dt), m, start) for name, start, dt, shape in descriptors}
        return {k: v.copy() for k, v in out.items()} if copy else out


class BalancerProcess:
    """The child process and the planner's end of its socket. One caller at a time: a second
    thread that plans in this process (a replay in the notebook that embeds the service) waits
    for the lock, and a placement the other's replaced in the child is finished here."""

    def __init__(self) -> None:
        memory = os.memfd_create("overlord-balancer")
        mine, theirs = socket.socketpair()
        try:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", CHILD, str(theirs.fileno()), str(memory)],
                pass_fds=(theirs.fileno(), memory),
                stdin=subprocess.DEVNULL,
            )
        except BaseException:
            mine.close()
            os.close(memory)
            raise
        finally:
            theirs.close()
        self.conn: Connection | None = Connection(mine.detach())
        self.shared = SharedArrays(memory)
        self.ready = False  # the child said it can place (its kernels are loaded)
        self.placed = 0  # placements the child made; the newest is the one it can finish
        self.remote = self.local = 0  # windows placed by the child / here (the views, tests)
        self._inputs_end = 0  # where the newest placement's arrays end in the shared memory
        self._lock = threading.RLock()

    def available(self) -> bool:
        """Whether the child answers now (never waits for it to start)."""
        with self._lock:
            if not self.ready and self.conn is not None:
                try:
                    if self.conn.poll():
                        self.ready = self.conn.recv() == "ready"
                except (EOFError, OSError):
                    self._lost("it exited while starting")
            return self.ready and self.conn is not None

    def wait_ready(self, timeout: float) -> bool:
        """Whether the child answers within ``timeout`` seconds (False also where it is gone).
        For benchmarks and tests that measure the child: the planner never waits for it."""
        deadline = time.monotonic() + timeout
        while not self.available():
            if self.conn is None or time.monotonic() > deadline:
                return False
            time.sleep(0.02)
        return True

    def place(self, pieces: np.ndarray, costs: np.ndarray, **kw) -> Placement | RemotePlacement:
        """``balance.place_window(pieces, costs, **kw)``, in the child where it answers."""
        with self._lock:
            if self.available():
                try:
                    arrays, self._inputs_end = self.shared.write({"pieces": pieces, "costs": costs})
                except OSError as err:  # (the shared memory cannot grow: no room left for it)
                    self._lost(f"its shared memory: {err}")
                    answer = None
                else:
                    answer = self._ask(("place", arrays, kw))
                if answer is not None:
                    self.placed += 1
                    self.remote += 1
                    return RemotePlacement(self, self.placed, int(answer), (pieces, costs, kw))
            self.local += 1
        return place_window(pieces, costs, **kw)

    def finish(self, placement: RemotePlacement) -> WindowPlan:
        """The child's newest placement finished; here, from its inputs, where it cannot."""
        with self._lock:
            if placement.number == self.placed and self.conn is not None:
                answer = self._ask(("finish", self._inputs_end))
                if answer is not None:
                    try:
                        return _window_plan(self.shared.read(answer, copy=True))
                    except OSError as err:
                        self._lost(f"its shared memory: {err}")
        pieces, costs, kw = placement.inputs
        return place_window(pieces, costs, **kw).finish()

    def _ask(self, message: tuple):
        """The child's answer, or None where it has none (it failed: the caller computes the
        same here, and raises the same error if it is one; it is gone, or closed meanwhile:
        used no more)."""
        conn = self.conn
        if conn is None:
            return None
        try:
            conn.send(message)
            kind, value = conn.recv()
        except (EOFError, OSError) as err:
            self._lost(f"{type(err).__name__}: {err}")
            return None
        if kind == "ok":
            return value
        logger.warning("the balancer process failed; the planner thread places this window itself:\n%s", value)
        return None

    def _lost(self, why: str) -> None:
        logger.warning("the balancer process is gone (%s): the planner thread balances from now on", why)
        self.close()

    def close(self) -> None:
        """Stop the child (from any thread: a placement waiting on it wakes and is made here)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        conn, self.conn = self.conn, None
        if conn is not None:
            conn.close()
        with self._lock:  # (a placement talking to the child has heard it is gone)
            self.shared.close()


def _window_arrays(wp: WindowPlan) -> dict[str, np.ndarray]:
    """A window's plan as a few flat arrays (:func:`_window_plan` puts it back together)."""
    return {
        "rows": np.concatenate([r for r, _ in wp.steps]),
        "slots": np.concatenate([s for _, s in wp.steps]),
        "bounds": np.cumsum([0] + [len(r) for r, _ in wp.steps]),
        "pending": wp.pending,
        "bin_costs": np.stack(wp.bin_costs),
    }


def _window_plan(a: dict[str, np.ndarray]) -> WindowPlan:
    b = a["bounds"].tolist()
    steps = [(a["rows"][b[k] : b[k + 1]], a["slots"][b[k] : b[k + 1]]) for k in range(len(b) - 1)]
    return WindowPlan(steps, a["pending"], list(a["bin_costs"]))


_active: BalancerProcess | None = None


def use(process: BalancerProcess | None) -> None:
    """The process this process's planner balances in from now on (None: in its own thread)."""
    global _active
    _active = process


def stop_using(process: BalancerProcess) -> None:
    """``process`` is closed: no planner uses it any more (another's, started since, stays)."""
    global _active
    if _active is process:
        _active = None


def place(pieces: np.ndarray, costs: np.ndarray, **kw) -> Placement | RemotePlacement:
    """``balance.place_window``, in the balancer process where one is in use."""
    if _active is not None:
        return _active.place(pieces, costs, **kw)
    return place_window(pieces, costs, **kw)


def serve(sock: int, memory: int) -> None:
    """The child: load the kernels, say so, then place and finish windows until the parent
    closes its end."""
    from ...allocator import keep_freed_memory, keep_large_arrays
    from . import kernels

    conn, shared = Connection(sock), SharedArrays(memory)
    # a window's arrays (tens of MB) from the heap, kept for the next window: the parent's
    # environment may say otherwise (Dask sets MALLOC_TRIM_THRESHOLD_ for the processes it
    # starts, and a process that starts a LocalCluster has it too), and every window would fault
    # in its pages afresh
    keep_freed_memory()
    keep_large_arrays()
    kernels.warm(None)
    conn.send("ready")
    placement: Placement | None = None
    while True:
        try:
            message = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if message[0] == "place":
                _, arrays, kw = message
                placement = None  # (its views of the shared memory go before the memory may be mapped again)
                a = shared.read(arrays, copy=False)  # views: the placement keeps them until it is finished
                placement = place_window(a.pop("pieces"), a.pop("costs"), **kw)
                answer = placement.pending_tokens()
            else:
                wp, placement = placement.finish(), None
                answer, _ = shared.write(_window_arrays(wp), at=message[1])
        except Exception:
            placement = None
            conn.send(("error", traceback.format_exc()))
            continue
        conn.send(("ok", answer))
