"""What ``Service.start`` refuses before it needs a cluster, in one place, so that ``overlord
validate`` refuses the same plans: held-out units (holdout patterns that match no file, or leave
no unit for training), the tokenizers (the plan's, which pads every micro-batch, and each text,
chat or multimodal source's), and the mixing controller (import, construction, options). Each
error names the source, tokenizer or controller; none comes out as a traceback."""

from __future__ import annotations

from ..errors import PlanError
from ..plan import Plan
from ..plan.versions import PlanVersions
from ..planner.mixing import make_controller
from ..sources.tokenizers import TokenizerError, load_tokenizer
from ..sources.units import LoadUnit
from . import holdout


def _tokenizer(plan: Plan, spec, whose: str):
    try:  # a constructor that raised, a file its library cannot read: a TokenizerError naming it
        return load_tokenizer(spec, plan.base_dir)
    except (TokenizerError, PlanError) as err:
        raise PlanError(f"{whose}: {err}") from None


def preflight(plan: Plan, timeline: PlanVersions, indexed: dict[str, list[LoadUnit]]) -> tuple[dict, int]:
    """The training units of each source (held-out ones taken out) and the pad id, or a PlanError."""
    units = holdout.training(plan.seed, timeline.source, indexed)
    pad_id = _tokenizer(plan, plan.tokenizer, "the plan's tokenizer").pad_id
    for s in plan.sources:
        if s.text_field or s.messages_field or s.image_placeholders:
            _tokenizer(plan, plan.tokenizer_of(s), f"source {s.name!r}")
    if plan.mixing.controller:
        make_controller(plan.mixing, timeline.source_names)  # import, construction, options
    return units, pad_id
