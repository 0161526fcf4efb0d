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
it once per process; ``OVERLORD_KEEP_FREED_MEMORY=0`` opts out. Elsewhere than glibc (macOS,
musl) it does nothing. The planner of large steps raises the threshold further in its process
(:func:`keep_large_arrays`: its arrays are tens of MiB).

:func:`worker.allocator_setup.tune_service_process` is the service's own processes' setting
(its workers, through that module's ``AllocatorSetup``; the process of ``overlord serve``; the
process whose threads are the workers with ``--in-process``). Besides keeping freed memory it

- caps glibc's malloc arenas at :data:`SERVICE_ARENAS` (:func:`cap_arenas`): glibc gives
  threads that allocate at once arenas of their own, up to eight per core, and each keeps its
  freed memory; a service process runs a dozen threads (Dask's event loop and offload threads,
  a worker's task threads, the planner, Arrow's reader threads), most of them only bookkeeping,
  and its Python code allocates under the GIL (a thread rarely waits for an arena);
- reads through Arrow's system allocator instead of its bundled mimalloc, which keeps a heap per
  thread that read once: a loader reads a unit's row groups and keeps numpy arrays, not Arrow
  buffers, so the memory Arrow holds between reads is waste.

Arrow's C++ code (file reads, decompression, compute kernels) allocates from the default pool
Arrow chose from ``ARROW_DEFAULT_MEMORY_POOL`` when pyarrow was imported; ``pa.set_memory_pool``
changes only the pool pyarrow's Python functions pass. So the setting has to be in the
environment before pyarrow is imported: a worker process the service starts gets both from its
start through its environment (:func:`service_environ`), and the ``overlord`` command sets
Arrow's in its own process before it imports pyarrow (:func:`arrow_pool_from_start`; a script
that embeds the service and reads in its own process, ``in_process=True``, does the same by
setting the variable before its imports). Set ``MALLOC_ARENA_MAX`` or
``ARROW_DEFAULT_MEMORY_POOL`` and the process keeps yours; ``OVERLORD_SERVICE_ALLOCATOR=0``
leaves both alone (:func:`service_sets`; ``benchmarks/memory.py`` measures the difference).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD, M_ARENA_MAX = -1, -3, -8  # glibc's mallopt parameters
MMAP_THRESHOLD = 4 << 20
PLANNER_MMAP_THRESHOLD = 32 << 20  # glibc's own ceiling for the threshold it adjusts itself (64-bit)
TRIM_THRESHOLD = 64 << 20
SERVICE_ARENAS = 2
_done: bool | None = None
_arenas_capped: bool | None = None


def _glibc(name: str, argtypes: list):
    """glibc's function ``name`` (returning an int), or None elsewhere."""
    try:
        fn = getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc
        return None
    fn.argtypes, fn.restype = argtypes, ctypes.c_int
    return fn


def _mallopt():
    """glibc's ``mallopt``, or None elsewhere."""
    return _glibc("mallopt", [ctypes.c_int, ctypes.c_int])


def give_back_freed() -> bool:
    """Return the freed memory glibc keeps (``malloc_trim``) to the OS now; False elsewhere than
    glibc. For a moment after a process freed much that it will not need soon (a loader that
    just wrote its block to disk: ``loading.block_store``), where :func:`keep_freed_memory`
    would otherwise keep up to ``TRIM_THRESHOLD`` of it."""
    trim = _glibc("malloc_trim", [ctypes.c_size_t])
    if trim is None:
        return False
    trim(0)
    return True


def service_sets(variable: str) -> bool:
    """Whether the service's allocator setting that ``variable`` names is ours to make: not if
    the user set the variable, nor where ``OVERLORD_SERVICE_ALLOCATOR=0`` opts out."""
    return os.environ.get("OVERLORD_SERVICE_ALLOCATOR", "1") != "0" and variable not in os.environ


def keep_freed_memory() -> bool:
    """Tune this process's allocator as the module docstring says (once); True if it was."""
    global _done
    if _done is None:
        _done = False
        if os.environ.get("OVERLORD_KEEP_FREED_MEMORY", "1") != "0" and (mallopt := _mallopt()) is not None:
            _done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
            _done = _done and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _done


def keep_large_arrays() -> bool:
    """Serve allocations up to ``PLANNER_MMAP_THRESHOLD`` from the heap in this process, where
    :func:`keep_freed_memory` fixed the threshold lower (True if it raised it). For the planner
    of large steps (``scheduler/planner_thread.py``): a window's piece rows and their copies are
    tens of MiB at thousands of ranks, and served by ``mmap`` each faulted in its pages anew on
    every window (a fifth of planning at dp 4,096 × 4k tokens; ``benchmarks/balance.py
    --scaling``). glibc adjusts an unset threshold up to this itself: a process
    :func:`keep_freed_memory` left alone is left alone here too."""
    if not _done or (mallopt := _mallopt()) is None:
        return False
    return bool(mallopt(M_MMAP_THRESHOLD, PLANNER_MMAP_THRESHOLD))


def cap_arenas() -> bool:
    """Cap this process's malloc arenas at :data:`SERVICE_ARENAS` (once; best before its threads
    start: glibc fixes the limit when the ninth arena is made). True if it was; the user's
    ``MALLOC_ARENA_MAX`` or ``OVERLORD_SERVICE_ALLOCATOR=0`` leaves it alone."""
    global _arenas_capped
    if _arenas_capped is None:
        _arenas_capped = False
        if service_sets("MALLOC_ARENA_MAX") and (mallopt := _mallopt()) is not None:
            _arenas_capped = bool(mallopt(M_ARENA_MAX, SERVICE_ARENAS))
    return _arenas_capped


def arrow_pool_from_start() -> bool:
    """``ARROW_DEFAULT_MEMORY_POOL=system`` in this process's environment, if pyarrow is not
    imported yet (Arrow reads the variable then) and the setting is ours to make; True if it
    was set. For the ``overlord`` command's process (the service's scheduler, its planner and,
    with ``--in-process``, its loaders); the processes it starts inherit it."""
    pool = service_environ().get("ARROW_DEFAULT_MEMORY_POOL")
    if "pyarrow" in sys.modules or pool is None:
        return False
    os.environ["ARROW_DEFAULT_MEMORY_POOL"] = pool
    return True


def service_environ() -> dict[str, str]:
    """Environment variables that give a worker process the service's arena cap
    and Arrow pool from its first allocation (a Nanny's ``env``); none where the user set them or
    opted out."""
    env = {"MALLOC_ARENA_MAX": str(SERVICE_ARENAS), "ARROW_DEFAULT_MEMORY_POOL": "system"}
    return {k: v for k, v in env.items() if service_sets(k)}
