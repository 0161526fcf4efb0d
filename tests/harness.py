"""Test harness: run one function per trainer rank in threads (each thread has its own Dask
client through `connect`), and re-raise the first failure in the test's thread; compare two
batches' fields."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable

import numpy as np


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
