"""How the benchmarks print a flat result: one JSON object (``--json``) or a two-column table."""

from __future__ import annotations

import json


def emit(out: dict, as_json: bool, width: int = 32) -> None:
    if as_json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:<{width}}{v!s:>14}")


def print_rows(rows: list[dict], columns: list[str]) -> None:
    """A readable table: one line per row, the given columns."""
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) + 2 for c in columns]
    print("".join(f"{c:>{w}}" for c, w in zip(columns, widths)))
    for r in rows:
        print("".join(f"{r.get(c, '')!s:>{w}}" for c, w in zip(columns, widths)))


def emit_rows(out: dict, as_json: bool, columns: list[str], width: int = 32) -> None:
    """A result with per-row figures (``out["rows"]``): one JSON object, or the rows as a table
    followed by the other keys, one per line."""
    if as_json:
        print(json.dumps(out))
        return
    print_rows(out["rows"], columns)
    for k, v in out.items():
        if k != "rows":
            print(f"{k:<{width}}{v}")
