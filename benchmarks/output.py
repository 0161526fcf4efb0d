"""How the benchmarks print a flat result: one JSON object (``--json``) or a two-column table."""

from __future__ import annotations

import json


def emit(out: dict, as_json: bool, width: int = 32) -> None:
    if as_json:
        print(json.dumps(out))
        return
    for k, v in out.items():
        print(f"{k:<{width}}{v!s:>14}")
