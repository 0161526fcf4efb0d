"""Where a trainer process sits in its job: data-parallel rank and size, context-parallel rank, and
replica (its coordinate in the tensor- and pipeline-parallel dimensions, which receive the same
batches as the other replicas of their data-parallel rank).

From explicit arguments, from a ``torch.distributed`` ``DeviceMesh`` (the data-parallel
dimensions named in ``dp_dims``, the context-parallel one ``cp_dim``, every other dimension a
replica dimension), or, with neither, from the launcher's environment (``RANK`` and
``WORLD_SIZE``, as torchrun and ``srun`` with the usual wrappers set them: every process its own
data-parallel rank).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from ..errors import RankError

DP_DIMS = ("dp", "dp_replicate", "dp_shard", "data", "fsdp", "ddp")
"""Mesh dimension names read as data-parallel by default (torchtitan's, Megatron-style and common
ones); pass ``dp_dims`` for others."""


@dataclass(frozen=True)
class Place:
    rank: int  # data-parallel rank
    dp: int | None  # data-parallel ranks (None: whatever the service runs)
    cp_rank: int | None
    replica: int


def place(
    rank: int | None = None,
    dp: int | None = None,
    *,
    cp_rank: int | None = None,
    replica: int | None = None,
    device_mesh=None,
    dp_dims: tuple[str, ...] | None = None,
    cp_dim: str = "cp",
) -> Place:
    """This process's place, from the arguments given (see the module docstring)."""
    if device_mesh is not None:
        return _from_mesh(device_mesh, dp_dims, cp_dim, rank, dp, cp_rank, replica)
    if rank is None:
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            raise RankError(
                "pass rank (and dp), a device_mesh, or launch the trainers with torchrun or srun so that RANK and "
                "WORLD_SIZE are set"
            )
        rank, dp = int(os.environ["RANK"]), dp if dp is not None else int(os.environ["WORLD_SIZE"])
    return Place(int(rank), dp, cp_rank, int(replica or 0))


def _from_mesh(mesh, dp_dims, cp_dim, rank, dp, cp_rank, replica) -> Place:
    if any(v is not None for v in (rank, dp, cp_rank, replica)):
        raise RankError("pass either a device_mesh or rank/dp/cp_rank/replica, not both")
    names = tuple(mesh.mesh_dim_names or ())
    if not names:
        raise RankError("the device_mesh has no dimension names: name them (init_device_mesh(..., mesh_dim_names=...))")
    coord = mesh.get_coordinate()
    if coord is None:
        raise RankError("this process is not part of the device_mesh it passed")
    sizes = tuple(mesh.mesh.shape)
    wanted = tuple(dp_dims) if dp_dims is not None else tuple(n for n in names if n in DP_DIMS)
    unknown = [n for n in wanted if n not in names]
    if unknown:
        raise RankError(f"dp_dims {unknown} are not dimensions of the device_mesh {names}")
    dp_idx = [i for i, n in enumerate(names) if n in wanted]
    cp_idx = [i for i, n in enumerate(names) if n == cp_dim]
    rest = [i for i in range(len(names)) if i not in dp_idx and i not in cp_idx]
    r, d = _flat(coord, sizes, dp_idx)
    rep, _ = _flat(coord, sizes, rest)
    return Place(r, d, coord[cp_idx[0]] if cp_idx and sizes[cp_idx[0]] > 1 else None, rep)


def _flat(coord, sizes, idx) -> tuple[int, int]:
    """The row-major index and size of the sub-mesh over dimensions ``idx``."""
    i, n = 0, 1
    for k in idx:
        i, n = i * sizes[k] + coord[k], n * sizes[k]
    return i, n


def check(info: dict, address: str, p: Place) -> int | None:
    """RankError unless the place exists in the service's run (for its dp, or for ``p.dp`` once
    the job's checkpoint re-planned it); returns the cp rank to attach with (None without context
    parallelism)."""
    world, cp = info["dp"], info.get("cp", 1)
    dp = p.dp if p.dp is not None else world
    if not 0 <= p.rank < dp:
        whose = f"the service at {address} has" if dp == world else "the job says it has"
        raise RankError(f"rank {p.rank} does not exist: {whose} dp={dp} ranks (0..{dp - 1})")
    if p.replica < 0:
        raise RankError(f"replica {p.replica} does not exist: replicas are numbered from 0")
    if cp > 1 and p.cp_rank is None:
        raise RankError(f"the service at {address} runs context parallelism cp={cp}: pass cp_rank (0..{cp - 1})")
    if p.cp_rank is not None and not 0 <= p.cp_rank < cp:
        raise RankError(f"cp rank {p.cp_rank} does not exist: the service at {address} has cp={cp} (0..{cp - 1})")
    return p.cp_rank if cp > 1 else None
