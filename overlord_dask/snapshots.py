"""Planner snapshots in object storage: a full base now and then, a tiny delta per committed step.

Layout under the checkpoint URL (any fsspec URL: a local folder by default, ``s3://…``)::

    base-000000000042.msgpack     {"kind": "base", "seq": 42, "state": {...}}
    delta-000000000043.msgpack    {"kind": "delta", "seq": 43, "base": 42, "committed": 118}
    delta-000000000044.msgpack    {..., "committed": 120, "window_step": 120, "window": {...}}

A base holds the planner state at the start of the window that contains the oldest uncommitted
step (``PlannerState.get_state``: per-source positions, waiting pieces, selected tokens, the
window's first step, the committed step, the topology and the plan updates), so it stays small
and topology-free in what matters. A delta moves ``committed`` forward and, when planning moved
to a new window, carries that window's starting state (a few KB at 100 sources). A base is
written every ``base_every_steps`` committed steps or ``base_every_seconds``, and whenever the
topology or the plan versions change (:class:`SnapshotWriter`). Sequence numbers increase
strictly across bases and deltas; ``load`` takes the newest readable base and applies its deltas
in order, and a missing delta in the middle is an error (never a silent skip).

Writes are atomic: a local file is written under a temporary name and renamed; an object store
PUT is atomic per object. ``gc`` keeps the newest ``keep_bases`` bases and their deltas.
"""

from __future__ import annotations

import logging
import re
import uuid

import msgpack
from fsspec.core import url_to_fs

from .errors import OverlordError

logger = logging.getLogger(__name__)
SNAPSHOT_VERSION = 1
_NAME = re.compile(r"^(base|delta)-(\d{12})\.msgpack$")


class SnapshotError(OverlordError):
    """A snapshot chain cannot be restored (gap, corrupt base with no older one, bad version)."""


class SnapshotStore:
    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        self.fs, self.root = url_to_fs(self.url, **(storage_options or {}))
        self.fs.makedirs(self.root, exist_ok=True)
        self._local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    # ---- writing ------------------------------------------------------------------------------
    def _put(self, name: str, payload: dict) -> int:
        data = msgpack.packb({"version": SNAPSHOT_VERSION, **payload}, use_bin_type=True)
        path = f"{self.root}/{name}"
        if self._local:  # write then rename: a crash never leaves a half-written snapshot
            tmp = f"{self.root}/.{name}.{uuid.uuid4().hex}.tmp"
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, path)
        else:  # an object PUT is atomic
            self.fs.pipe_file(path, data)
        return len(data)

    def write_base(self, seq: int, state: dict) -> int:
        return self._put(f"base-{seq:012d}.msgpack", {"kind": "base", "seq": seq, "state": state})

    def write_delta(self, seq: int, base: int, committed: int, window_step: int | None = None, window: dict | None = None) -> int:
        payload = {"kind": "delta", "seq": seq, "base": base, "committed": committed}
        if window is not None:
            payload.update(window_step=window_step, window=window)
        return self._put(f"delta-{seq:012d}.msgpack", payload)

    # ---- reading ------------------------------------------------------------------------------
    def _entries(self) -> list[tuple[str, int, str]]:
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        self.fs.invalidate_cache(self.root)
        out = []
        for n in names:
            m = _NAME.match(n)
            if m:
                out.append((m.group(1), int(m.group(2)), f"{self.root}/{n}"))
        return sorted(out, key=lambda e: e[1])

    def _read(self, path: str) -> dict:
        raw = msgpack.unpackb(self.fs.cat_file(path), raw=False, strict_map_key=False)
        if raw.get("version") != SNAPSHOT_VERSION:
            raise SnapshotError(f"{path}: snapshot version {raw.get('version')!r} is not supported (expected {SNAPSHOT_VERSION})")
        return raw

    def exists(self) -> bool:
        return any(kind == "base" for kind, _, _ in self._entries())

    def load(self) -> tuple[dict, int] | None:
        """(state, last seq) from the newest readable base and its deltas, or None if empty."""
        entries = self._entries()
        bases = [e for e in entries if e[0] == "base"]
        for kind, seq, path in reversed(bases):
            try:
                base = self._read(path)
            except SnapshotError:
                raise
            except Exception as err:  # a corrupt base: fall back to the one before it
                logger.warning("snapshot %s is unreadable (%s); trying an older base", path, err)
                continue
            state = dict(base["state"])
            last = seq
            for dkind, dseq, dpath in entries:
                if dkind != "delta" or dseq <= seq:
                    continue
                if dseq != last + 1:
                    raise SnapshotError(f"snapshot chain at {self.url} has a gap: delta {last + 1} is missing before {dseq}")
                delta = self._read(dpath)
                if delta["base"] != seq:
                    break  # deltas of a newer base that could not be read
                state["committed"] = max(int(state["committed"]), int(delta["committed"]))
                if "window" in delta:
                    state["window_step"], state["window"] = delta["window_step"], delta["window"]
                last = dseq
            return state, last
        if bases:
            raise SnapshotError(f"no readable base snapshot at {self.url}")
        return None

    def gc(self, keep_bases: int = 2) -> int:
        """Delete bases (and their deltas) older than the newest ``keep_bases``; returns count."""
        entries = self._entries()
        bases = [seq for kind, seq, _ in entries if kind == "base"]
        if len(bases) <= keep_bases:
            return 0
        cutoff = bases[-keep_bases]
        old = [path for _, seq, path in entries if seq < cutoff]
        for path in old:
            self.fs.rm_file(path)
        return len(old)


class SnapshotWriter:
    """Decides base or delta for each new planner state and writes it (the plugin and the
    resume benchmark use this one policy).

    A base when none was written yet, when the topology or the plan versions changed (the
    state's shape changes), or after ``base_every_steps`` committed steps or
    ``base_every_seconds``; otherwise a delta, carrying the window state when planning moved to
    a new window since the last snapshot."""

    def __init__(self, store: SnapshotStore, *, keep_bases: int = 2, base_every_steps: int = 1000,
                 base_every_seconds: float = 600.0, seq: int = -1, clock=None):
        import time

        self.store = store
        self.keep_bases = keep_bases
        self.base_every_steps = base_every_steps
        self.base_every_seconds = base_every_seconds
        self.seq = seq
        self.clock = clock or time.monotonic
        self._shape = None  # (topology, number of plan updates) of the last base
        self._base_seq = None
        self._base_committed = 0
        self._base_time = 0.0
        self._window_step = None  # window of the last snapshot written

    def write(self, state: dict) -> tuple[str, int]:
        """Write ``state`` (``PlannerState.get_state()``); returns (kind, bytes)."""
        shape = (tuple(sorted(state["topology"].items())), len(state.get("updates", ())))
        now = self.clock()
        self.seq += 1
        if (self._base_seq is None or shape != self._shape or state["committed"] - self._base_committed >= self.base_every_steps
                or now - self._base_time >= self.base_every_seconds):
            n = self.store.write_base(self.seq, state)
            self._shape, self._base_seq, self._base_committed, self._base_time = shape, self.seq, state["committed"], now
            self._window_step = state["window_step"]
            self.store.gc(self.keep_bases)
            return "base", n
        moved = state["window_step"] != self._window_step
        n = self.store.write_delta(self.seq, self._base_seq, state["committed"],
                                   state["window_step"] if moved else None, state["window"] if moved else None)
        self._window_step = state["window_step"]
        return "delta", n
