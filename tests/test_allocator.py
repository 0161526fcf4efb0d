"""The allocators of the service's processes (``worker.allocator_setup.tune_service_process``): glibc's arenas
capped, Arrow reading through the system allocator, on every worker and in the ``--in-process``
service; the user's own settings kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from overlord_dask import Service

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")

_ARENAS = """
import ctypes, ctypes.util, json, os, sys, tempfile, threading
from overlord_dask.worker.allocator_setup import tune_service_process
tuned = tune_service_process() if sys.argv[1] == "tune" else None
barrier = threading.Barrier(12)
def work():
    held = [bytearray(200_000) for _ in range(4)]  # malloc'd in this thread's arena
    barrier.wait()  # every thread alive at once: none inherits a finished thread's arena
threads = [threading.Thread(target=work) for _ in range(12)]
[t.start() for t in threads]
[t.join() for t in threads]
libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.fopen.restype = ctypes.c_void_p
libc.fopen.argtypes = [ctypes.c_char_p, ctypes.c_char_p]
libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
libc.fclose.argtypes = [ctypes.c_void_p]
path = tempfile.mktemp()
fp = libc.fopen(path.encode(), b"w")
libc.malloc_info(0, fp)
libc.fclose(fp)
arenas = open(path).read().count("<heap nr=")
os.remove(path)
import pyarrow as pa
print(json.dumps({"tuned": tuned, "arenas": arenas, "pool": pa.default_memory_pool().backend_name}))
"""


def _arenas(mode: str, **env) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "ARROW_DEFAULT_MEMORY_POOL")} | env
    out = subprocess.run(
        [sys.executable, "-c", _ARENAS, mode], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    return json.loads(out.stdout)


def test_a_service_process_shares_two_arenas_and_reads_through_the_system_allocator():
    """Twelve threads allocating at once get arenas of their own (glibc's default, up to eight per
    core); in a tuned service process they share two, and Arrow allocates with malloc."""
    plain, tuned = _arenas("plain"), _arenas("tune")
    assert plain["arenas"] >= 8 and plain["pool"] != "system", plain
    assert tuned == {"tuned": True, "arenas": 2, "pool": "system"}, tuned


def test_the_users_allocator_settings_win():
    """``MALLOC_ARENA_MAX`` and ``ARROW_DEFAULT_MEMORY_POOL`` set by the user are kept;
    ``OVERLORD_SERVICE_ALLOCATOR=0`` leaves both alone."""
    from overlord_dask import allocator

    mine = _arenas("tune", MALLOC_ARENA_MAX="4", ARROW_DEFAULT_MEMORY_POOL="mimalloc")
    assert mine == {"tuned": False, "arenas": 4, "pool": "mimalloc"}, mine
    off = _arenas("tune", OVERLORD_SERVICE_ALLOCATOR="0")
    assert not off["tuned"] and off["arenas"] >= 8 and off["pool"] != "system", off
    os.environ["OVERLORD_SERVICE_ALLOCATOR"] = "0"
    try:
        assert allocator.service_environ() == {}
    finally:
        del os.environ["OVERLORD_SERVICE_ALLOCATOR"]


def _worker_allocators() -> dict:
    import pyarrow as pa

    from overlord_dask import allocator

    return {
        "keeps_freed_memory": allocator._done,
        "arena_max": os.environ.get("MALLOC_ARENA_MAX"),
        "pool": pa.default_memory_pool().backend_name,
    }


@pytest.mark.integration
def test_every_worker_of_a_service_gets_the_services_allocators(cluster, small_plan):
    """Worker processes of the embedded cluster from their start (the nanny's environment); any
    worker, a Slurm job's too, through the worker plugin."""
    with Service.start(small_plan(), cluster=cluster) as service:
        got = service.client.run(_worker_allocators)
    assert len(got) == 2, got
    for w in got.values():
        assert w["keeps_freed_memory"] and w["arena_max"] == "2" and w["pool"] == "system", got


_IN_PROCESS = """
import json, sys
import pyarrow as pa
from overlord_dask import Service, load_plan
plan = load_plan(sys.argv[1])
with Service.start(plan, in_process=True, n_workers=2) as service:
    print(json.dumps({"pool": pa.default_memory_pool().backend_name}))
"""


@pytest.mark.integration
def test_an_in_process_service_tunes_its_process_before_its_workers_start(tmp_path, small_plan):
    import yaml

    from overlord_dask.plan import plan_to_dict

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan_to_dict(small_plan())))
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "ARROW_DEFAULT_MEMORY_POOL")}
    out = subprocess.run(
        [sys.executable, "-c", _IN_PROCESS, str(path)], env=env, capture_output=True, text=True, timeout=180
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"pool": "system"}


_COMMAND = """
import json, sys
from overlord_dask.service.cli import main
main(["preview", sys.argv[1], "--source", "web", "-n", "50", "--json"])  # reads a parquet unit in this process
import pyarrow as pa
print(json.dumps({"mimalloc": pa.mimalloc_memory_pool().max_memory(), "system": pa.system_memory_pool().max_memory()}))
"""


def test_the_overlord_command_reads_through_the_system_allocator_in_arrows_own_code_too(tmp_path, small_plan):
    """``pa.set_memory_pool`` changes the pool pyarrow's Python functions pass, not the one Arrow's
    C++ code (file reads, decompression) takes, which Arrow chose from the environment when pyarrow
    was imported: the ``overlord`` command sets the variable before that, so its reads never touch
    mimalloc, whose cached pages stayed in the process (a fifth of an in-process service's
    memory). Without it (``OVERLORD_SERVICE_ALLOCATOR=0``) they do."""
    import yaml

    from overlord_dask.plan import plan_to_dict

    path = tmp_path / "plan.yaml"
    path.write_text(yaml.safe_dump(plan_to_dict(small_plan())))
    env = {k: v for k, v in os.environ.items() if k not in ("MALLOC_ARENA_MAX", "ARROW_DEFAULT_MEMORY_POOL")}

    def pools(**extra) -> dict:
        out = subprocess.run(
            [sys.executable, "-c", _COMMAND, str(path)], env=env | extra, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-3000:]
        return json.loads(out.stdout.strip().splitlines()[-1])

    ours, off = pools(), pools(OVERLORD_SERVICE_ALLOCATOR="0")
    assert ours["mimalloc"] == 0 and ours["system"] > 0, ours
    assert off["mimalloc"] > 0, off


_LARGE = """
import json, resource
import numpy as np
from numpy._core.multiarray import _set_madvise_hugepage
from overlord_dask.allocator import keep_freed_memory, keep_large_arrays

_set_madvise_hugepage(False)  # (a page per fault: numpy's huge pages fault 2 MiB at a time where free ones exist)

def faults_per_array():
    np.ones(2 << 20)  # (the first one faults in the heap's pages either way)
    f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(20):
        a = np.empty(2 << 20)  # 16 MiB, written whole: a window's piece rows at thousands of ranks
        a[:] = 1.0
        del a
    return (resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0) / 20

alone = keep_large_arrays()  # glibc still adjusts its threshold itself here: left alone
pinned = keep_freed_memory()
before = faults_per_array()
raised = keep_large_arrays()
print(json.dumps({"alone": alone, "pinned": pinned, "before": before, "raised": raised, "after": faults_per_array()}))
"""


def test_a_large_planner_takes_its_arrays_from_the_heap_where_the_threshold_was_fixed():
    """A service process fixes glibc's mmap threshold at 4 MiB (``keep_freed_memory``), so every
    array over it is mapped anew and faulted in page by page; the planner of large steps raises
    it (``keep_large_arrays``), after which a freed 16 MiB array is reused. A process whose
    threshold glibc adjusts itself is left alone."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run(
        [sys.executable, "-c", _LARGE], env=env, capture_output=True, text=True, timeout=120, check=True
    )
    got = json.loads(out.stdout)
    assert got["alone"] is False and got["pinned"] is True and got["raised"] is True, got
    # its pages every time (at least one per 2 MiB, should the kernel give huge pages anyway), then none
    assert got["before"] >= 8 and got["after"] <= 1, got


def test_the_planner_raises_the_threshold_only_for_large_steps(monkeypatch):
    """``planner_thread.warm`` raises it where a step has the bins the compiled kernels are for
    (or when asked without a size), not for a few ranks, whose arrays are small."""
    from overlord_dask.planner.policies import kernels
    from overlord_dask.scheduler import planner_thread

    raised = []
    monkeypatch.setattr(kernels, "warm", lambda bins=None: False)
    monkeypatch.setattr(planner_thread, "keep_large_arrays", lambda: raised.append(True))
    planner_thread.warm(8)
    assert not raised
    planner_thread.warm(kernels.COMPILE_FROM_BINS)
    planner_thread.warm(None)
    assert len(raised) == 2
