"""Planner snapshots in object storage: a full base now and then, a tiny delta per committed step.

Layout under the checkpoint URL (any fsspec URL: a local folder by default, ``s3://…``)::

    base-000000000042.msgpack     {"kind": "base", "seq": 42, "state": {...}}
    delta-000000000043.msgpack    {"kind": "delta", "seq": 43, "base": 42, "committed": 118}
    delta-000000000044.msgpack    {..., "committed": 120, "window_step": 120, "window": {...}}

A base holds the planner state at the start of the window that contains the oldest uncommitted
step (``PlannerState.get_state``: per-source positions, waiting pieces, selected tokens, the
window's first step, the committed step, the topology and the plan updates), so it stays small
and topology-free in what matters. A delta moves ``committed`` forward and, when planning moved
to a new window, carries that window's starting state (a few KB at 100 sources). Both carry a
CRC-32 of each step they commit (``ledger.step_digest``): a restore re-plans the steps from the
window's start to the committed one without handing them out, and checks each against it (a
replay that goes another way, because the data, the code or overlord-dask changed, stops the
run with a ``ReplayError`` naming the step instead of losing or repeating documents). A base is
written every ``base_every_steps`` committed steps or ``base_every_seconds``, and whenever the
topology or the plan versions change (:class:`SnapshotWriter`). Sequence numbers increase
strictly across bases and deltas; ``load`` takes the newest readable base and applies its deltas
in order, and a missing delta in the middle is an error (never a silent skip).

The planner's decisions (``planner/timeline.py``: a controller's shares, a learned cost, a skip,
a dp change) are part of the state, and a run steered every few dozen steps makes thousands. A
base holds only those that can still govern a step the service can re-plan (from the oldest window
start it keeps, in memory or here): the **rule** is that a decision followed by another of its
kind that applies at or before that step, or a skip that ended before it, is *settled*
(``Timeline.settled``). Settled decisions are written once, in the order they were made, to
``decisions-<seq>.msgpack`` (never collected: a replay of the whole run reads them,
``archived_decisions``) and dropped from the planner, so bases stay bounded however long the run.

Writes are atomic: a local file is written under a temporary name and renamed; an object store
PUT is atomic per object. ``gc`` keeps the newest ``keep_bases`` bases and their deltas, and the
bases a training job may still restart from (``checkpoint.keep_steps``, ``keep_hours``):
``window_at`` finds the stored window state a rewind to an older step re-plans from.

Every file carries a CRC-32 of its body (format version 2), checked before the body is decoded:
a file with flipped bits, truncated or altered is *unreadable*, never half-trusted (decoding a
damaged body asked for 112 TiB, or resumed steps late). An unreadable base is skipped for the
one before it, with its own deltas; an unreadable delta ends its chain there (the run resumes
from the last step that chain proves; trainers skip what their own checkpoints hold). Each is
logged as a warning. A location that cannot be written fails the start (``check_writable``).
"""

from __future__ import annotations

import logging
import re
import uuid
import zlib

import msgpack
from fsspec.core import url_to_fs

from .errors import OverlordError
from .planner.ledger import digests_after

logger = logging.getLogger(__name__)
SNAPSHOT_VERSION = 2  # 2: body + CRC-32; 1 (no checksum) is still read
_NAME = re.compile(r"^(base|delta)-(\d{12})\.msgpack$")
_ARCHIVE = re.compile(r"^decisions-(\d{12})\.msgpack$")


class SnapshotError(OverlordError):
    """A snapshot chain cannot be restored (gap, corrupt base with no older one, bad version)."""


class SnapshotStore:
    def __init__(self, url: str, storage_options: dict | None = None):
        self.url = url.rstrip("/")
        try:
            self.fs, self.root = url_to_fs(self.url, **(storage_options or {}))
            self.fs.makedirs(self.root, exist_ok=True)
        except Exception as err:  # a missing server, bad credentials, a read-only folder: one clear line
            raise SnapshotError(
                f"checkpoint location {self.url} cannot be used: {type(err).__name__}: {_first_line(err)}"
            ) from None
        self._local = "file" in (self.fs.protocol if isinstance(self.fs.protocol, tuple) else (self.fs.protocol,))

    def check_writable(self) -> None:
        """Write and delete a probe object; raise SnapshotError naming the location if that fails
        (a run must not go on believing it can resume)."""
        name = f".overlord-probe-{uuid.uuid4().hex}"
        try:
            self._write_bytes(name, b"probe")
            self.fs.rm_file(f"{self.root}/{name}")
        except Exception as err:
            raise SnapshotError(
                f"checkpoint location {self.url} is not writable: {type(err).__name__}: {_first_line(err)}"
            ) from None

    # ---- writing ------------------------------------------------------------------------------
    def _put(self, name: str, payload: dict) -> int:
        body = msgpack.packb(payload, use_bin_type=True)
        data = msgpack.packb({"version": SNAPSHOT_VERSION, "crc32": zlib.crc32(body), "body": body}, use_bin_type=True)
        self._write_bytes(name, data)
        return len(data)

    def _write_bytes(self, name: str, data: bytes) -> None:
        path = f"{self.root}/{name}"
        if self._local:  # write then rename: a crash never leaves a half-written snapshot
            tmp = f"{self.root}/.{name}.{uuid.uuid4().hex}.tmp"
            with self.fs.open(tmp, "wb") as f:
                f.write(data)
            self.fs.mv(tmp, path)
        else:  # an object PUT is atomic
            self.fs.pipe_file(path, data)

    def write_base(self, seq: int, state: dict, written_at: float | None = None) -> int:
        payload = {"kind": "base", "seq": seq, "state": state}
        if written_at is not None:
            payload["time"] = written_at  # wall-clock seconds: what keep_hours measures
        return self._put(f"base-{seq:012d}.msgpack", payload)

    def write_delta(self, seq: int, base: int, committed: int, **parts) -> int:
        """A delta moving ``committed``; ``parts`` (``SnapshotWriter.write``): a new window's
        ``window_step`` and ``window``; the planner's decisions made since the last snapshot
        (``decisions_from``, ``decisions``: they only grow, a delta carries the new ones); the
        ``digests`` of the steps it commits (``ledger.pack_digests``)."""
        payload = {"kind": "delta", "seq": seq, "base": base, "committed": committed, **parts}
        return self._put(f"delta-{seq:012d}.msgpack", payload)

    def write_archive(self, seq: int, decisions: list[dict]) -> int:  # settled decisions, in the order made
        return self._put(f"decisions-{seq:012d}.msgpack", {"kind": "decisions", "seq": seq, "decisions": decisions})

    def archived_decisions(self) -> list[dict]:
        """Every archived decision, in the order made (a damaged archive is an error: a replay of
        the whole run would be wrong without it)."""
        names = sorted(n for n in self._names() if _ARCHIVE.match(n))
        try:
            return [d for n in names for d in self._read(f"{self.root}/{n}", kinds=("decisions",))["decisions"]]
        except _Unreadable as err:
            raise SnapshotError(f"archived decisions are unreadable: {err}") from None

    # ---- reading ------------------------------------------------------------------------------
    def _names(self) -> list[str]:
        try:
            names = [p.rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)]
        except FileNotFoundError:
            return []
        self.fs.invalidate_cache(self.root)
        return names

    def _entries(self) -> list[tuple[str, int, str]]:
        out = []
        for n in self._names():
            m = _NAME.match(n)
            if m:
                out.append((m.group(1), int(m.group(2)), f"{self.root}/{n}"))
        return sorted(out, key=lambda e: e[1])

    def _read(self, path: str, kinds: tuple[str, ...] = ("base", "delta")) -> dict:
        """A snapshot's payload; SnapshotError for a version this code cannot read, _Unreadable
        for a damaged file (checksum, framing or decoding)."""
        data = self.fs.cat_file(path)
        try:
            raw = _unpack(data)
        except Exception as err:
            raise _Unreadable(f"{path}: not a snapshot file ({type(err).__name__}: {err})") from None
        version = raw.get("version") if isinstance(raw, dict) else None
        if version == 1:  # written before checksums: as it is
            return raw
        if version != SNAPSHOT_VERSION:
            if isinstance(version, int) and version > SNAPSHOT_VERSION:
                raise SnapshotError(
                    f"{path}: snapshot version {version!r} is newer than this overlord-dask reads ({SNAPSHOT_VERSION})"
                )
            raise _Unreadable(f"{path}: no valid snapshot header")
        body = raw.get("body")
        if not isinstance(body, bytes) or zlib.crc32(body) != raw.get("crc32"):
            raise _Unreadable(f"{path}: checksum mismatch (the file is damaged or was altered)")
        try:
            payload = _unpack(body)
        except Exception as err:
            raise _Unreadable(f"{path}: body does not decode ({type(err).__name__}: {err})") from None
        if not isinstance(payload, dict) or payload.get("kind") not in kinds:
            raise _Unreadable(f"{path}: not a {' or '.join(kinds)}")
        return payload

    def exists(self) -> bool:
        return any(kind == "base" for kind, _, _ in self._entries())

    def load(self) -> tuple[dict, int] | None:
        """(state, last seq) from the newest readable base and its deltas, or None if empty."""
        entries = self._entries()
        bases = [e for e in entries if e[0] == "base"]
        for _kind, seq, path in reversed(bases):
            try:
                base = self._read(path)
                state = dict(base["state"])
                int(state["committed"])  # the one field the chain needs
            except SnapshotError:
                raise
            except Exception as err:  # a damaged base: fall back to the one before it
                logger.warning("snapshot %s is unreadable (%s); trying an older base", path, err)
                continue
            last = seq
            for dkind, dseq, dpath in entries:
                if dkind != "delta" or dseq <= seq:
                    continue
                try:
                    delta = self._read(dpath)
                    committed, dbase = int(delta["committed"]), int(delta["base"])
                except SnapshotError:
                    raise
                except Exception as err:  # the chain ends at its last good delta
                    logger.warning(
                        "snapshot delta %s is unreadable (%s); resuming from step %s of base %s",
                        dpath,
                        err,
                        state["committed"],
                        seq,
                    )
                    break
                if dbase != seq:
                    break  # deltas of a newer base that could not be read
                if dseq != last + 1:
                    raise SnapshotError(
                        f"snapshot chain at {self.url} has a gap: delta {last + 1} is missing before {dseq}"
                    )
                if committed < int(state["committed"]):
                    logger.warning(
                        "snapshot delta %s goes back to step %s from %s; resuming from %s",
                        dpath,
                        committed,
                        state["committed"],
                        state["committed"],
                    )
                    break
                state["committed"] = committed
                if "window" in delta:
                    state["window_step"], state["window"] = delta["window_step"], delta["window"]
                if "decisions" in delta:
                    state["decisions"] = list(state.get("decisions", []))[: int(delta["decisions_from"])] + list(
                        delta["decisions"]
                    )
                if "digests" in delta:
                    state["digests"] = list(state.get("digests", [])) + list(delta["digests"])
                last = dseq
            return state, last
        if bases:
            raise SnapshotError(f"no readable base snapshot at {self.url}")
        return None

    def gc(self, keep_bases: int = 2, keep_from: int | None = None) -> int:
        """Delete bases (and their deltas) older than the newest ``keep_bases`` or, with
        ``keep_from``, older than that sequence number; returns the number of files deleted."""
        entries = self._entries()
        bases = [seq for kind, seq, _ in entries if kind == "base"]
        if keep_from is None and len(bases) <= keep_bases:
            return 0
        cutoff = bases[-keep_bases] if keep_from is None else keep_from
        old = [path for _, seq, path in entries if seq < cutoff]
        for path in old:
            self.fs.rm_file(path)
        return len(old)

    def bases(self) -> list[tuple[int, int, float | None]]:
        """``(seq, committed step, time written)`` of every readable base, oldest first."""
        out = []
        for kind, seq, path in self._entries():
            if kind != "base":
                continue
            try:
                base = self._read(path)
                out.append((seq, int(base["state"]["committed"]), base.get("time")))
            except Exception as err:
                logger.warning("snapshot %s is unreadable (%s)", path, err)
        return out

    def oldest_window_step(self) -> int | None:
        """The first step of the oldest window a stored base can re-plan from."""
        for kind, _seq, path in self._entries():
            if kind == "base":
                try:
                    return int(self._read(path)["state"]["window_step"])
                except SnapshotError:
                    raise
                except Exception:
                    continue
        return None

    def window_at(self, step: int) -> tuple[int, dict, dict] | None:
        """``(window step, window state, topology)`` of the newest stored window start at or
        before ``step`` (a base's, or a later one a delta of it carries); None if none is. A base
        supersedes what older chains recorded past its committed step (a rewind may have planned
        those steps again, on another dp or with steps skipped)."""
        found: list[tuple[int, dict, dict]] = []
        chain_topology, chain_seq = None, None
        for kind, seq, path in self._entries():
            try:
                payload = self._read(path)
            except SnapshotError:
                raise
            except Exception as err:
                logger.warning("snapshot %s is unreadable (%s)", path, err)
                continue
            if kind == "base":
                st = payload["state"]
                chain_topology, chain_seq = st["topology"], seq
                found = [f for f in found if f[0] <= int(st["committed"])]
                found.append((int(st["window_step"]), st["window"], st["topology"]))
            elif "window" in payload and payload.get("base") == chain_seq:
                found.append((int(payload["window_step"]), payload["window"], chain_topology))
        best = None
        for f in found:  # the newest at or before `step` (the later-recorded one of equal steps)
            if f[0] <= step and (best is None or f[0] >= best[0]):
                best = f
        return best


class _Unreadable(Exception):
    """A damaged snapshot file (skipped with a warning, never trusted)."""


def _unpack(data: bytes):
    # bounded by the input: a damaged length field cannot ask for more memory than the file has
    n = len(data)
    return msgpack.unpackb(
        data,
        raw=False,
        strict_map_key=False,
        max_bin_len=n,
        max_str_len=n,
        max_array_len=n,
        max_map_len=n,
        max_ext_len=n,
    )


def _first_line(err: BaseException) -> str:
    text = str(err).strip().splitlines()
    return text[0] if text else ""


class SnapshotWriter:
    """Decides base or delta for each new planner state and writes it (the plugin and the
    resume benchmark use this one policy).

    A base when none was written yet, when the topology or the plan versions changed (the
    state's shape changes), or after ``base_every_steps`` committed steps or
    ``base_every_seconds``; otherwise a delta, carrying the window state when planning moved to
    a new window since the last snapshot, and the planner's decisions made since (a run steered
    by a controller decides every few dozen steps: a base each time would rewrite them all)."""

    def __init__(
        self,
        store: SnapshotStore,
        *,
        keep_bases: int = 2,
        base_every_steps: int = 1000,
        base_every_seconds: float = 600.0,
        seq: int = -1,
        clock=None,
        keep_steps: int = 0,
        keep_hours: float | None = None,
        wall_clock=None,
    ):
        import time

        self.store = store
        self.keep_bases = keep_bases
        self.keep_steps, self.keep_hours = keep_steps, keep_hours
        self.wall_clock = wall_clock or time.time
        self._bases: list[tuple[int, int, float | None]] | None = None  # (seq, committed, time) of the stored bases
        self.base_every_steps = base_every_steps
        self.base_every_seconds = base_every_seconds
        self.seq = seq
        self.clock = clock or time.monotonic
        self._shape = None  # (topology, number of plan updates) of the last base
        self._base_seq = None
        self._base_committed = 0
        self._base_time = 0.0
        self._window_step = None  # window of the last snapshot written
        self._committed = None  # committed step of the last snapshot written
        self._decisions = 0  # the planner's decisions the chain holds

    def write(self, state: dict) -> tuple[str, int]:
        """Write ``state`` (``PlannerState.get_state()``); returns (kind, bytes). A state whose
        committed step went back (a training job rewound the run) is always a base: a chain's
        deltas only move forward."""
        shape = (tuple(sorted(state["topology"].items())), len(state.get("updates", ())))
        decisions = state.get("decisions", [])
        now = self.clock()
        self.seq += 1
        went_back = self._committed is not None and state["committed"] < self._committed
        before, self._committed = self._committed, state["committed"]
        if (
            self._base_seq is None
            or shape != self._shape
            or went_back
            or state["committed"] - self._base_committed >= self.base_every_steps
            or now - self._base_time >= self.base_every_seconds
            or len(decisions) < self._decisions
        ):
            written_at = self.wall_clock()
            n = self.store.write_base(self.seq, state, written_at)
            self._shape, self._base_seq, self._base_committed, self._base_time = (
                shape,
                self.seq,
                state["committed"],
                now,
            )
            self._window_step = state["window_step"]
            self._decisions = len(decisions)
            self._collect(self.seq, state["committed"], written_at)
            return "base", n
        moved = state["window_step"] != self._window_step
        parts = {"window_step": state["window_step"], "window": state["window"]} if moved else {}
        if len(decisions) > self._decisions:
            parts.update(decisions_from=self._decisions, decisions=decisions[self._decisions :])
        if digests := digests_after(state.get("digests", ()), before):
            parts["digests"] = digests
        n = self.store.write_delta(self.seq, self._base_seq, state["committed"], **parts)
        self._window_step, self._decisions = state["window_step"], len(decisions)
        return "delta", n

    def _collect(self, seq: int, committed: int, written_at: float) -> None:
        """Garbage-collect the store: keep ``keep_bases`` bases, and every base a training job
        may restart from: the newest base at or before ``committed - keep_steps`` and those
        after it, and the bases of the last ``keep_hours`` hours."""
        if self._bases is None:
            self._bases = [b for b in self.store.bases() if b[0] != seq]
        self._bases.append((seq, committed, written_at))
        seqs = [s for s, _, _ in self._bases]
        cutoff = seqs[-self.keep_bases] if len(seqs) >= self.keep_bases else seqs[0]
        if self.keep_steps:
            covering = [s for s, c, _ in self._bases if c <= committed - self.keep_steps]
            cutoff = min(cutoff, covering[-1] if covering else seqs[0])
        if self.keep_hours is not None:
            recent = [s for s, _, t in self._bases if t is not None and t >= written_at - 3600 * self.keep_hours]
            cutoff = min(cutoff, recent[0] if recent else seq)
        self.store.gc(keep_from=cutoff)
        self._bases = [b for b in self._bases if b[0] >= cutoff]
