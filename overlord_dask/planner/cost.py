"""The cost model: how long a document keeps a rank busy, from its length alone.

Attention is quadratic in a document's length and packed documents do not attend to each other,
so a micro-batch's cost is the sum over its documents of ``a·L² + b·L + c``. This is what makes
"equal tokens" unequal work, and what the balancer evens out across ranks.
"""

from __future__ import annotations

import numpy as np

from ..plan.models import CostModel


def doc_costs(lengths: np.ndarray, model: CostModel) -> np.ndarray:
    """Vectorised cost of documents (float64)."""
    L = np.asarray(lengths, dtype=np.float64)
    return model.attention * L * L + model.linear_coef * L + model.constant * (L > 0)


def doc_cost(length: int, model: CostModel) -> float:
    L = float(length)
    return model.attention * L * L + model.linear_coef * L + (model.constant if length > 0 else 0.0)
