"""Reading sources: finding load units from metadata, and loading one unit into a sample block.

Data flow: plan.Source --Format.discover()--> [LoadUnit, ...] (metadata only, in the service)
           LoadUnit --Format.read()--> records --prepare, tokenize--> SampleBlock (on a worker;
           stays there) --lengths()--> planner
Formats are classes behind names (``formats.py``, ``plan/formats.py``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import SourceError
from ..plan import Source, SourcePlan
from ..plan.base import import_callable
from . import integrity
from .blocks import SampleBlock
from .formats import UNKNOWN_BASE, Format, get_format
from .records import to_block
from .tokenizers import image_token_id, load_tokenizer
from .units import LoadUnit


def discover_units(source: Source, plan: SourcePlan) -> list[LoadUnit]:
    """All load units of a source in canonical order; raises SourceError naming the culprit."""
    fmt = get_format(source.format)
    try:
        fmt.check(source)
        check_text(source, plan)
        if source.transform:
            import_callable(source.transform)
    except ValueError as err:
        raise SourceError(f"source {source.name!r}: {err}") from None
    try:
        units = fmt.discover(source, plan)
    except SourceError:
        raise
    except Exception as err:  # an unreachable store, bad credentials, a damaged footer: one line naming the source
        lines = str(err).strip().splitlines()
        raise SourceError(
            f"source {source.name!r}: cannot read {source.url!r}: {type(err).__name__}: {lines[0] if lines else ''}"
        ) from None
    if not units:
        raise SourceError(f"source {source.name!r} is empty: its files hold no documents")
    return units


def check_text(source: Source, plan: SourcePlan) -> None:
    """What a text, chat or multimodal source needs of its tokenizer, checked where the plan is
    loaded (a ValueError naming the source, the tokenizer and the plan field that fixes it)."""
    if source.text_field or source.messages_field:
        loaded = load_tokenizer(plan.tokenizer_of(source), plan.base_dir)
        loaded.document_boundaries(source.add_bos, source.add_eos, bool(source.messages_field), source.name)
        if source.messages_field:
            from .chat import compile_template

            compile_template(loaded.template(plan.base_dir, source.name))
        if source.image_placeholders:
            from .documents import placeholder_pattern

            placeholder_pattern(loaded, source.name)
    if source.images_field:
        image_token_id(source, plan)


@dataclass(slots=True)
class LoadedUnit:
    """A loaded unit: its block, and how many of its records the source's prepare steps dropped."""

    block: SampleBlock
    dropped: int = 0


def read_unit(source: Source, plan: SourcePlan, unit: LoadUnit) -> LoadedUnit:
    """Read one unit, prepare and tokenize its records, apply the source's transform. Runs inside
    a Dask task on a worker."""
    fmt = get_format(source.format)
    integrity.check(source, plan, unit)  # a unit indexed with a digest: its bytes must be those
    out = fmt.read(source, plan, unit)
    loaded = LoadedUnit(*to_block(source, plan, unit, out)) if fmt.records else LoadedUnit(out)
    if not isinstance(loaded.block, SampleBlock):
        raise SourceError(
            f"format {source.format!r} read {unit.describe()} as {type(out).__name__}, expected a SampleBlock"
        )
    if unit.n_docs is not None and len(loaded.block) != unit.n_docs:
        raise SourceError(
            f"{unit.describe()}: read {len(loaded.block)} documents, the index found {unit.n_docs} "
            "(the file changed since the source was indexed?)"
        )
    if source.transform:
        block = import_callable(source.transform)(loaded.block, **source.transform_kwargs)
        if not isinstance(block, SampleBlock):
            raise SourceError(
                f"source {source.name!r}: transform {source.transform!r} returned {type(block).__name__}, expected "
                "SampleBlock"
            )
        try:
            block.validate()  # a transform may have changed the block's arrays after it checked itself
        except ValueError as err:
            raise SourceError(
                f"source {source.name!r}: transform {source.transform} returned a bad block: "
                f"{str(err).removeprefix(f'source {source.name!r}: ')}"
            ) from None
        loaded.block = block
    return loaded


def load_unit(source: Source, plan: SourcePlan, unit: LoadUnit) -> SampleBlock:
    """The block of one unit (``read_unit`` without the count of dropped records)."""
    return read_unit(source, plan, unit).block


def layout_warnings(source: Source, plan: SourcePlan) -> list[str]:
    """The format's advice on the source's files (``overlord validate``)."""
    return get_format(source.format).warnings(source, plan)


__all__ = [
    "UNKNOWN_BASE",
    "Format",
    "LoadUnit",
    "LoadedUnit",
    "SampleBlock",
    "discover_units",
    "layout_warnings",
    "load_unit",
    "read_unit",
]
