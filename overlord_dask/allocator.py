"""Keep freed batch memory in the process for the next batch instead of returning it to the OS.

Consumers and workers allocate batch-sized buffers all the time and free them steps later: a
consumer decodes every micro-batch into fresh arrays (three 16k-token int64 arrays are 128 KiB
each, the size at which glibc serves an allocation with its own ``mmap``); a worker reads units,
packs micro-batches, and pickles and receives blocks and built chunks. Where glibc returns such
memory to the OS at once, every new buffer pays a page fault per 4 KiB page it writes, and
decoding costs far more than on reused memory (``tests/test_control_path.py`` counts the page
faults per decode). That is the case in any process
started with ``MALLOC_TRIM_THRESHOLD_`` set: Dask's nanny sets it for every worker it starts
(``distributed.nanny.pre-spawn-environ``, 64 KiB), and in the process that starts a
``LocalCluster``, so trainers launched from a script that embeds the service inherit it.

:func:`keep_freed_memory` raises glibc's mmap threshold to 4 MiB and its trim threshold to 64
MiB with ``mallopt``: batch-sized buffers come from the heap, and up to 64 MiB of freed heap
stays mapped for reuse (per process; Dask's setting exists to return memory to the OS promptly,
and a data-loading worker's buffers are reused within milliseconds; ``benchmarks/throughput.py``
reports the service's CPU per step). ``RankStream`` calls
it once per process, ``worker.keep_memory.KeepFreedMemory`` on every worker of a service;
``OVERLORD_KEEP_FREED_MEMORY=0`` opts out. Elsewhere than glibc (macOS, musl) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameters (malloc.h)
MMAP_THRESHOLD = 4 << 20
TRIM_THRESHOLD = 64 << 20
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Tune this process's allocator as the module docstring says (once); True if it was."""
    global _done
    if _done is None:
        _done = False
        if os.environ.get("OVERLORD_KEEP_FREED_MEMORY", "1") != "0":
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                mallopt = libc.mallopt
            except (OSError, AttributeError):  # not glibc
                return False
            mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
            _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done
