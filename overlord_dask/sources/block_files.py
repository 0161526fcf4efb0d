"""A loaded block's token ids kept in a file on the worker's local disk (``loading.block_store:
disk``), read piece by piece as batches are built.

Why: a source holds up to about twice ``loading.shuffle_units`` loaded units at a time (its
shuffle blocks), and a plan of many sources multiplies that: 100 sources with blocks of 64
units of ~4M tokens hold about 100 GB of token ids on the workers. In memory that is the
workers' RAM; in files it is the page cache, which keeps the pieces being built from in memory
and gives the rest back under pressure, the way MosaicML Streaming and Megatron-Energon read
samples from local shard files. A constructor reads only the pieces of its steps (a ``pread``
each), a small share of a block per chunk.

:class:`FileArray` is the one array-like the block's readers need: ``len``, slices, single
indices and integer (or boolean) index arrays, ``np.asarray`` (the whole array) and pickling
(as its values: a copy on another worker, a shadow or a transfer, goes into a file of that
worker's own). The file lies in Dask's local directory of the worker (Dask's
``temporary-directory`` setting puts it on a local NVMe disk), is removed when the block is
released, and is opened lazily: at most :data:`MAX_OPEN` idle descriptors per process, the
least recently read closed first, so a worker holding thousands of blocks stays under the usual limit
on open files.
"""

from __future__ import annotations

import os
import tempfile
import threading
import weakref
from collections import OrderedDict

import numpy as np

MAX_OPEN = 256  # idle descriptors a process keeps open for block files (reopened when read again)
PREFIX = "overlord-block-"


def block_directory() -> str:
    """Where this process keeps block files: its Dask worker's local directory, else the
    temporary directory (a call outside a worker: tests, a replay)."""
    try:
        from distributed import get_worker

        return get_worker().local_directory
    except (ImportError, ValueError):
        return tempfile.gettempdir()


class _Descriptors:
    """Open descriptors of this process's block files, at most ``limit`` of them idle, the least
    recently used closed first. Constructor tasks read in a worker's threads at once: a
    descriptor being read from is never closed under its reader (:meth:`acquire` /
    :meth:`done`), so no read lands in a file that took its number."""

    def __init__(self, limit: int):
        self.limit = limit
        self._open: OrderedDict[str, list[int]] = OrderedDict()  # path -> [descriptor, readers]
        self._lock = threading.Lock()

    def acquire(self, path: str) -> int:
        """A descriptor of ``path`` to read from, until :meth:`done`."""
        with self._lock:
            entry = self._open.get(path)
            if entry is None:
                entry = self._open[path] = [os.open(path, os.O_RDONLY), 1]
                self._close_idle()
            else:
                self._open.move_to_end(path)
                entry[1] += 1
            return entry[0]

    def done(self, path: str) -> None:
        with self._lock:
            entry = self._open.get(path)
            if entry is not None:
                entry[1] -= 1
            if len(self._open) > self.limit:
                self._close_idle()

    def _close_idle(self) -> None:
        """(lock held) Close the least recently used idle descriptors over the limit."""
        excess = len(self._open) - self.limit
        if excess <= 0:
            return
        for path in [p for p, (_, readers) in self._open.items() if readers == 0][:excess]:
            os.close(self._open.pop(path)[0])

    def release(self, path: str) -> None:
        """``path``'s array is gone (no reader is left): close its descriptor."""
        with self._lock:
            entry = self._open.pop(path, None)
        if entry is not None:
            os.close(entry[0])

    def __len__(self) -> int:
        return len(self._open)


_DESCRIPTORS = _Descriptors(MAX_OPEN)


def _remove(path: str) -> None:
    _DESCRIPTORS.release(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class FileArray:
    """A 1-D array of ``values`` written to a file in ``directory`` (default
    :func:`block_directory`); indexing reads from the file. Immutable."""

    __slots__ = ("dtype", "shape", "path", "_finalizer", "__weakref__")

    def __init__(self, values: np.ndarray, directory: str | None = None):
        values = np.ascontiguousarray(values)
        if values.ndim != 1:
            raise ValueError(f"a block file holds a 1-D array, got shape {values.shape}")
        fd, path = tempfile.mkstemp(prefix=PREFIX, dir=directory or block_directory())
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(memoryview(values).cast("B"))
        except BaseException:
            os.unlink(path)
            raise
        self.dtype, self.shape, self.path = values.dtype, values.shape, path
        self._finalizer = weakref.finalize(self, _remove, path)

    def __len__(self) -> int:
        return self.shape[0]

    @property
    def nbytes(self) -> int:
        """Bytes in the file (none of them held in this process's memory)."""
        return self.shape[0] * self.dtype.itemsize

    def read(self, start: int, stop: int) -> np.ndarray:
        """Elements ``start:stop`` (clipped to the array), as a new (read-only) array."""
        start, stop = max(start, 0), min(stop, len(self))
        size = self.dtype.itemsize
        want = max(stop - start, 0) * size
        if not want:
            return np.empty(0, dtype=self.dtype)
        fd = _DESCRIPTORS.acquire(self.path)
        try:
            data = os.pread(fd, want, start * size)
            while len(data) < want:  # (a read may return fewer bytes than asked for)
                more = os.pread(fd, want - len(data), start * size + len(data))
                if not more:
                    raise OSError(f"block file {self.path} ended {want - len(data)} bytes early")
                data += more
        finally:
            _DESCRIPTORS.done(self.path)
        return np.frombuffer(data, dtype=self.dtype)

    def __getitem__(self, key):
        if type(key) is slice and key.step is None and type(key.start) is int and type(key.stop) is int:
            if key.start >= 0 and key.stop >= 0:  # a piece: the usual read
                return self.read(key.start, key.stop)
        if isinstance(key, slice):
            start, stop, step = key.indices(len(self))
            out = self.read(start, stop) if step > 0 else self.read(stop + 1, start + 1)[::-1]
            return out if abs(step) == 1 else out[:: abs(step)]
        if isinstance(key, (int, np.integer)):
            i = int(key) + (len(self) if key < 0 else 0)
            if not 0 <= i < len(self):
                raise IndexError(f"index {int(key)} is out of bounds for a block file of {len(self)} elements")
            return self.read(i, i + 1)[0]
        idx = np.asarray(key)
        if idx.dtype == bool:
            idx = np.flatnonzero(idx)
        out = np.empty(idx.shape, dtype=self.dtype)
        for k, i in enumerate(idx.ravel().tolist()):  # a read per index: used for a token or two per piece
            out.flat[k] = self[i]
        return out

    def __array__(self, dtype=None, copy=None):
        a = self.read(0, len(self))
        return a if dtype is None else a.astype(dtype, copy=False)

    def __reduce__(self):
        return FileArray, (self.read(0, len(self)),)

    def __repr__(self) -> str:
        return f"FileArray({len(self)} × {self.dtype}, {self.path!r})"
