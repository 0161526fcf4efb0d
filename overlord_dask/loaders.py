"""Source-loader tasks: the functions Dask runs on workers to load units.

``load_block`` reads one unit and keeps the resulting ``SampleBlock`` on the worker; only
``block_lengths`` (int64 bytes, ~8 bytes per document) travels back, to the planner. Task keys are
deterministic (run, source, epoch, unit) so a recomputation after a lost worker produces the same
block under the same name.
"""

from __future__ import annotations

from .plan.loading import plan_from_dict
from .sources import load_unit
from .sources.blocks import SampleBlock
from .sources.units import LoadUnit

_PLAN_CACHE: dict[str, object] = {}


def _plan(plan_dict: dict, cache_key: str):
    plan = _PLAN_CACHE.get(cache_key)
    if plan is None:
        plan = _PLAN_CACHE[cache_key] = plan_from_dict(plan_dict, where="<service plan>")
    return plan


def load_block(plan_dict: dict, cache_key: str, unit: dict) -> SampleBlock:
    """Load one unit; ``cache_key`` names the plan version (run id and version) that defines the
    unit's source, so a worker validates each version's plan once."""
    plan = _plan(plan_dict, cache_key)
    u = LoadUnit.from_dict(unit)
    return load_unit(plan.source(u.source), plan, u)


def block_lengths(block: SampleBlock) -> dict:
    """What the planner learns of a loaded unit: document lengths, and image tokens per document
    for a multimodal source (little-endian int64 bytes)."""
    vision = block.vision_tokens()
    return {"lengths": block.lengths().astype("<i8").tobytes(), "vision": None if vision is None else vision.astype("<i8").tobytes()}


def load_key(run_id: str, source: str, epoch: int, unit: int) -> str:
    return f"overlord-load-{run_id}-{source}-e{epoch}-u{unit}"


def lengths_key(run_id: str, source: str, epoch: int, unit: int) -> str:
    return f"overlord-lengths-{run_id}-{source}-e{epoch}-u{unit}"


def batch_key(run_id: str, step: int, rank: int) -> str:
    return f"overlord-batch-{run_id}-{step}-{rank}"
