"""The declarative data plane: what a user declares for a run, validated.

One module per part of a plan: ``plan`` (the root model), ``source`` (a source, its preparation
and pool), ``topology``, ``balance``, ``cost`` (the cost model, declared or learned), ``loading``
(read-ahead, load units, pools' autoscaler), ``checkpoint``, ``mixing`` (a mixing controller),
``evaluation`` (held-out data), ``schedule`` (weights over steps, curriculum stages), ``text``
(the tokenizer a plan names), ``formats`` (which formats a plan may name); ``io`` reads and writes
plans (YAML, dicts) with errors that name the file and field, ``versions`` holds a running
plan's live updates, and ``source_plan`` is one source's slice of a plan (what a load task
carries). Nothing here depends on the rest of the package but the error classes.
"""

from .balance import Balance
from .checkpoint import Checkpoint
from .cost import CostModel, LearnCost
from .evaluation import Evaluation
from .io import load_plan, plan_from_dict, plan_to_dict
from .loading import Autoscale, Loading
from .mixing import Mixing
from .plan import Plan
from .schedule import Context, Schedule, Stage
from .source import Pool, Prepare, Source
from .source_plan import SourcePlan
from .text import Tokenizer
from .topology import Topology

__all__ = [
    "Autoscale",
    "Balance",
    "Checkpoint",
    "Context",
    "CostModel",
    "Evaluation",
    "LearnCost",
    "Loading",
    "Mixing",
    "Plan",
    "Pool",
    "Prepare",
    "Schedule",
    "Source",
    "SourcePlan",
    "Stage",
    "Tokenizer",
    "Topology",
    "load_plan",
    "plan_from_dict",
    "plan_to_dict",
]
