"""A rank's payload fetched once per host: its tensor- and pipeline-parallel replicas in other
processes of the host read it from shared memory.

Why: every replica of a data-parallel rank receives the same batches. Replicas in one process
already share a transfer (``fetch.fetch_shared``); under torchrun each GPU is a process, so the
eight replicas of a tp-8 rank on a host each fetched the same chunk from its worker: eight
transfers, and eight times the worker's serving, for one payload.

How: the processes of a host already reach the service through one relay (``relay.py``). A
process with a relay asks it (``fetch`` message) for its rank's batches; where the relay holds
more than one consumer of that (rank, cp rank), it fetches the rank's whole chunk once (any
replica's later request for any of its steps is served from it), writes it to a file in
``/dev/shm`` (memory, readable only by the user) and answers with its path and each step's
place in it; the process reads its steps and says it is done. A file goes when every consumer
of the rank on the host has taken all its steps (or after ``KEEP_S``), or when the relay
closes; a relay killed with its files is swept up after by the host's next relay. Anything
else (the rank's only consumer on the host, no ``/dev/shm``, a worker that did not answer with
the batches, a relay gone) is answered ``direct`` or not at all, and the process fetches from
the worker itself.
"""

from __future__ import annotations

import asyncio
import itertools
import os
import time

from ..client import fetch
from ..wire import Payload
from .fetch import fetch_shared

SHM = "/dev/shm"
KEEP_S = 60.0  # a chunk's file is removed this long after it was written, whoever has not read it
ASK_TIMEOUT_S = 30.0  # a process waits this long for the relay's answer, then fetches itself


class _Chunk:
    """One rank's chunk of a constructor task, as the relay wrote it to shared memory."""

    __slots__ = ("path", "offsets", "readers", "expected", "taken", "written_at")

    def __init__(self, path: str, offsets: dict[int, tuple[int, int]], expected: int):
        self.path, self.offsets, self.expected = path, offsets, expected
        self.readers: set[tuple] = set()  # (local process, its request id) reading it now
        self.taken: dict[int, set] = {}  # replica -> the steps it was handed
        self.written_at = time.monotonic()

    def read_by_all(self) -> bool:
        """Every consumer of the rank on the host took every step, and nobody reads it now."""
        whole = sum(len(s) == len(self.offsets) for s in self.taken.values())
        return not self.readers and whole >= self.expected


class SharedPayloads:
    """(the relay's side, on its IO loop) Chunks fetched once and handed to the host's processes."""

    def __init__(self, io, consumers_of):
        self.io = io
        self.consumers_of = consumers_of  # (rank, cp rank) -> consumers the relay holds for it
        self.chunks: dict[tuple, _Chunk] = {}  # (worker, key, rank, cp rank) -> the chunk
        self.fetching: dict[tuple, asyncio.Future] = {}
        self._names = itertools.count()

    def serve(self, local, msg: dict) -> None:
        asyncio.ensure_future(self._serve(local, msg))

    async def _serve(self, local, msg: dict) -> None:
        rid = msg["id"]
        try:
            reply = await self._answer(local, msg)
        except Exception as err:  # the worker went away, the file could not be written: the process fetches
            reply = {"direct": f"{type(err).__name__}: {err}"}
        local.send({"op": "fetched", "id": rid, **reply})

    async def _answer(self, local, msg: dict) -> dict:
        rank, cp_rank = msg["rank"], msg.get("cp_rank")
        expected = self.consumers_of((rank, cp_rank or 0))
        if expected <= 1:
            return {"direct": "no other consumer of this rank on the host"}
        if not os.path.isdir(SHM):
            return {"direct": f"no {SHM} on this host"}
        self._sweep()
        ck = (msg["address"], msg["key"], rank, cp_rank)
        chunk = self.chunks.get(ck)
        if chunk is None or any(s not in chunk.offsets for s in msg["steps"]):
            chunk = await self._fetch(ck, msg["chunk_steps"], expected)
            if isinstance(chunk, dict):
                return chunk
        chunk.readers.add((local, msg["id"]))
        chunk.taken.setdefault(msg.get("replica", 0), set()).update(msg["steps"])
        return {"path": chunk.path, "at": [chunk.offsets[s] for s in msg["steps"]]}

    async def _fetch(self, ck: tuple, steps: list[int], expected: int):
        """The rank's chunk fetched once (concurrent requests share it) and written to a file."""
        fut = self.fetching.get(ck)
        if fut is None:
            fut = self.fetching[ck] = asyncio.ensure_future(self._fetch_and_write(ck, steps, expected))
            fut.add_done_callback(lambda f: self.fetching.pop(ck, None))
        return await asyncio.shield(fut)

    async def _fetch_and_write(self, ck: tuple, steps: list[int], expected: int):
        address, key, rank, cp_rank = ck
        resp = await fetch_shared(
            self.io, address, (key, rank, cp_rank, tuple(steps)), lambda rpc: fetch(rpc, key, rank, steps, cp_rank)
        )
        if not isinstance(resp, dict) or resp.get("status") != "OK" or not isinstance(resp.get("payload"), Payload):
            return {"direct": f"the worker answered {resp.get('status') if isinstance(resp, dict) else resp!r}"}
        frames = [memoryview(f).cast("B") for f in resp["payload"].frames]
        path = os.path.join(SHM, f"overlord-payload-{os.getuid()}-{os.getpid()}-{next(self._names)}")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            for f in frames:
                view = f
                while len(view):
                    view = view[os.write(fd, view) :]
        except BaseException:  # /dev/shm full (a container's is small, say): no half-written file stays
            _unlink(path)
            raise
        finally:
            os.close(fd)
        offsets, at = {}, 0
        for s, f in zip(steps, frames):
            offsets[s] = (at, len(f))
            at += len(f)
        old = self.chunks.pop(ck, None)
        if old is not None:
            _unlink(old.path)
        chunk = self.chunks[ck] = _Chunk(path, offsets, expected)
        return chunk

    def done(self, local, msg: dict) -> None:
        """A process read the steps it asked for (``fetch_done``)."""
        for ck, chunk in list(self.chunks.items()):
            if (local, msg["id"]) in chunk.readers:
                chunk.readers.discard((local, msg["id"]))
                self._maybe_remove(ck, chunk)
                return

    def left(self, local) -> None:
        """A local process went away: what it was reading is read."""
        for ck, chunk in list(self.chunks.items()):
            chunk.readers = {r for r in chunk.readers if r[0] is not local}
            self._maybe_remove(ck, chunk)

    def _maybe_remove(self, ck: tuple, chunk: _Chunk) -> None:
        if chunk.read_by_all():
            self.chunks.pop(ck, None)
            _unlink(chunk.path)

    def _sweep(self) -> None:
        now = time.monotonic()
        for ck, chunk in list(self.chunks.items()):
            if now - chunk.written_at > KEEP_S:
                self.chunks.pop(ck, None)
                _unlink(chunk.path)

    def close(self) -> None:
        for chunk in self.chunks.values():
            _unlink(chunk.path)
        self.chunks.clear()


def sweep_dead() -> None:
    """Remove the files a killed relay of this user left (its process is gone); a relay does it
    when it starts."""
    prefix = f"overlord-payload-{os.getuid()}-"
    try:
        names = [n for n in os.listdir(SHM) if n.startswith(prefix)]
    except OSError:
        return
    for n in names:
        try:
            pid = int(n[len(prefix) :].split("-")[0])
        except ValueError:
            continue
        if not _alive(pid):
            _unlink(os.path.join(SHM, n))


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs. A killed process whose parent has not reaped it yet (a
    zombie: the next relay starts while torchrun, or a test, has yet to wait for it) still
    answers ``kill(pid, 0)``, but it holds nothing: dead."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process, say: not ours to judge
        return True
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"  # (the state follows the command's ")")
    except (OSError, IndexError):
        return True


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class HostFetches:
    """(a process's side, on its IO loop) Asking the host's relay for a rank's batches."""

    def __init__(self, send):
        self.send = send  # the channel's send to the relay
        self.waiting: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self.read = 0  # requests served from the host's shared memory (a figure for tests)

    def answered(self, msg: dict) -> None:
        fut = self.waiting.pop(msg.get("id"), None)
        if fut is not None and not fut.done():
            fut.set_result(msg)
        elif "path" in msg:  # its asker gave up meanwhile (a hedge): nothing to read
            self._done(msg["id"])

    def _done(self, rid: int) -> None:
        try:
            self.send({"op": "fetch_done", "id": rid})
        except OSError:
            pass

    def drop(self) -> None:
        """The relay went away: every request waiting for it fetches directly."""
        for fut in self.waiting.values():
            if not fut.done():
                fut.set_result({"direct": "the relay went away"})
        self.waiting.clear()

    async def fetch(self, address: str, desc: dict, consumer: tuple, steps: list[int]):
        """The worker's answer for these steps of ``consumer`` (rank, cp rank, replica), read
        from the host's shared memory; None where the process should fetch from the worker
        itself. (Asked once per fetch, a chunk or a share of one: replicas may attach later.)"""
        rank, cp_rank, replica = consumer
        rid = next(self._ids)
        fut = self.waiting[rid] = asyncio.get_running_loop().create_future()
        msg = {"op": "fetch", "id": rid, "address": address, "key": desc["key"], "rank": rank, "cp_rank": cp_rank}
        try:
            self.send({**msg, "replica": replica, "steps": list(steps), "chunk_steps": list(desc["steps"])})
            reply = await asyncio.wait_for(fut, ASK_TIMEOUT_S)
        except (OSError, asyncio.TimeoutError):
            self.waiting.pop(rid, None)
            return None
        if "direct" in reply:
            return None
        try:
            with open(reply["path"], "rb") as f:
                frames = []
                for at, n in reply["at"]:
                    f.seek(at)
                    frames.append(f.read(n))
        except OSError:  # (its relay closed meanwhile)
            return None
        finally:
            self._done(rid)
        self.read += 1
        return {"status": "OK", "payload": Payload(frames)}
