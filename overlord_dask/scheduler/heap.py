"""The scheduler process's long-lived objects, kept out of the cyclic garbage collector's way.

A full collection walks every tracked object of the process and holds the event loop while it
does: imports, Dask's state, the plan, the balancer's compiled kernels (numba's type registries
alone are tens of thousands of objects). The control_plane benchmark's longest loop blocks at
thousands of ranks were such collections. Freezing what is alive once the service is up moves
those objects out of sight: later collections walk only what was created since. Nothing is lost
but cyclic garbage among the frozen objects (they are the process's long-lived ones); objects
freed by reference counting are freed as before.
"""

from __future__ import annotations

import gc


def freeze() -> None:
    """Collect, then freeze every object alive now."""
    gc.collect()
    gc.freeze()
