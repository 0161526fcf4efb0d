"""The cost model: how long a document keeps a rank busy, from its length alone.

Attention is quadratic in a document's length and packed documents do not attend to each other,
so a micro-batch's cost is the sum over its documents of ``a·L² + b·L + c``. This is what makes
"equal tokens" unequal work, and what the balancer evens out across ranks.
"""

from __future__ import annotations

import numpy as np

from ..plan import CostModel


def doc_costs(lengths: np.ndarray, model: CostModel) -> np.ndarray:
    """Vectorised cost of documents (float64); a plan's `cost.function` replaces the formula."""
    if model.function:
        from ..plan.base import import_callable

        out = np.asarray(import_callable(model.function)(np.asarray(lengths, dtype=np.int64)), dtype=np.float64)
        if out.shape != np.shape(lengths):
            raise ValueError(
                f"cost function {model.function!r} returned shape {out.shape} for {np.shape(lengths)} lengths"
            )
        return out
    L = np.asarray(lengths, dtype=np.float64)
    return model.attention * L * L + model.linear_coef * L + model.constant * (L > 0)
