"""Source formats: finding load units from metadata, and loading one unit into a sample block.

Data flow: plan.Source --discover()--> [LoadUnit, ...] (metadata only, in the service)
           LoadUnit --load()--> SampleBlock (on a worker; stays there) --lengths()--> planner
"""

from __future__ import annotations

from ..errors import SourceError
from ..plan.models import Plan, Source
from . import parquet, zarr_source
from .blocks import SampleBlock
from ..plan.base import import_callable
from .tokenizers import resolve_tokenizer
from .units import LoadUnit

FORMATS = {"parquet": parquet, "zarr": zarr_source}


def discover_units(source: Source, plan: Plan) -> list[LoadUnit]:
    """All load units of a source in canonical order; raises SourceError naming the culprit."""
    try:
        if source.text_field:
            resolve_tokenizer(source.tokenizer, plan.base_dir)
        if source.transform:
            import_callable(source.transform)
    except ValueError as err:
        raise SourceError(f"source {source.name!r}: {err}") from None
    try:
        units = FORMATS[source.format].discover(source, plan)
    except SourceError:
        raise
    except Exception as err:  # an unreachable store, bad credentials, a damaged footer: one line naming the source
        lines = str(err).strip().splitlines()
        raise SourceError(f"source {source.name!r}: cannot read {source.url!r}: {type(err).__name__}: {lines[0] if lines else ''}") from None
    if not units:
        raise SourceError(f"source {source.name!r} is empty: its files hold no documents")
    return units


def load_unit(source: Source, plan: Plan, unit: LoadUnit) -> SampleBlock:
    """Read one unit and apply the source's transform. Runs inside a Dask task on a worker."""
    block = FORMATS[source.format].load(source, plan, unit)
    if source.transform:
        block = import_callable(source.transform)(block)
        if not isinstance(block, SampleBlock):
            raise SourceError(f"source {source.name!r}: transform {source.transform!r} returned {type(block).__name__}, expected SampleBlock")
    return block


__all__ = ["FORMATS", "LoadUnit", "SampleBlock", "discover_units", "load_unit"]
