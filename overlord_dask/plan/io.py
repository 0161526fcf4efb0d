"""Loading plans from YAML (or dicts) with errors that name the file, the field path and the fix."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from ..errors import PlanError
from .plan import Plan


def _dotted(loc: tuple) -> str:
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        else:
            out += ("." if out else "") + str(part)
    return out or "<plan>"


def format_validation_error(err: ValidationError, where: str, data: Any = None) -> str:
    """One line per problem: `where: sources[1](web).format: Input should be 'parquet' or 'zarr' (got 'csv')`."""
    lines = []
    errors = err.errors()

    # `weight: -1` fails both branches of `float | Schedule`; report only the branch the user meant
    def branch(e) -> str | None:
        last = e["loc"][-1] if e["loc"] else None
        if last == "float":
            return "float"
        if isinstance(last, str) and "Schedule" in last:
            return "Schedule"
        return None

    for e in errors:
        b = branch(e)
        if b is not None:
            if b != (
                "Schedule"
                if isinstance(e.get("input"), dict) or b == "Schedule" and e["type"] == "value_error"
                else "float"
            ):
                continue
            e = {**e, "loc": e["loc"][:-1]}
        loc = tuple(p for p in e["loc"] if not (isinstance(p, str) and p.startswith("function-")))
        path = _dotted(loc)
        # name the source as well as its index: "sources[1]" alone makes the user count
        if data is not None and len(loc) >= 2 and loc[0] == "sources" and isinstance(loc[1], int):
            try:
                name = data["sources"][loc[1]].get("name")
                if name:
                    path = path.replace(f"sources[{loc[1]}]", f"sources[{loc[1]}]({name})", 1)
            except (KeyError, IndexError, TypeError, AttributeError):
                pass
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field (check the spelling; `overlord schema` lists the fields a plan may have)"
        elif e["type"] == "missing":
            msg = "required field is missing"
        got = e.get("input")
        # the value the user wrote, unless the message says it already (our validators name it)
        said = "(got " in msg or isinstance(got, (dict, list)) or e["type"] == "missing"
        suffix = "" if said else f" (got {got!r})"
        lines.append(f"{where}: {path}: {msg}{suffix}")
    return "invalid plan:\n  " + "\n  ".join(lines)


def plan_from_dict(data: Any, *, where: str = "<dict>", base_dir: str | os.PathLike | None = None) -> Plan:
    """Validate a plain dict (as parsed from YAML/JSON) into a :class:`Plan`."""
    if not isinstance(data, dict):
        raise PlanError(
            f"{where}: a plan must be a mapping with keys like 'sources' and 'topology', got {type(data).__name__}"
        )
    if base_dir is not None and "base_dir" not in data:
        data = {**data, "base_dir": str(base_dir)}
    folder = data.get("base_dir")
    if isinstance(folder, str) and os.path.isdir(folder) and folder not in sys.path:
        sys.path.append(
            folder
        )  # plan-local code (`module:callable` next to the plan) imports; installed modules still win
    try:
        return Plan.model_validate(data)
    except ValidationError as err:
        raise PlanError(format_validation_error(err, where, data)) from None


class _PlanLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping: YAML itself keeps the last
    one, so a second ``sources:`` or ``weight:`` would silently drop the first."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen: dict = {}
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue  # `<<: *anchor` merges are meant to repeat keys
                key = self.construct_object(key_node, deep=True)
                try:
                    first = seen.setdefault(key, key_node.start_mark.line)
                except TypeError:  # an unhashable key: the constructor names it
                    continue
                if first != key_node.start_mark.line:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"key {key!r} given twice (first at line {first + 1})", key_node.start_mark
                    )
        return super().construct_mapping(node, deep)


def load_plan(path: str | os.PathLike) -> Plan:
    """Read and validate a YAML plan. Relative source URLs resolve against the file's folder."""
    p = Path(path)
    try:
        text = p.read_text()
    except FileNotFoundError:
        raise PlanError(f"plan file not found: {p}") from None
    try:
        data = yaml.load(text, Loader=_PlanLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{p}:{mark.line + 1}:{mark.column + 1}" if mark else str(p)
        raise PlanError(f"{where}: not valid YAML: {getattr(err, 'problem', err)}") from None
    return plan_from_dict(data, where=str(p), base_dir=p.resolve().parent)


def plan_to_dict(plan: Plan) -> dict:
    """A plain, YAML/msgpack-friendly dict that :func:`plan_from_dict` turns back into the same plan."""
    return plan.model_dump(mode="json")
