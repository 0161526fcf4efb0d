"""How a rank's stream fetches and shapes its batches: one frozen object, made once where the
trainer's code names the options (``OverlordDataset``, ``RankStream``, ``connect``) and passed
down as it is to the stream's background side (``prefetch.RankIO``) and the evaluation stream.

The options are declared here only; the constructors that take them as keyword arguments build
a :class:`StreamOptions` from them (an unknown name is a ``TypeError`` listing the known ones).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, fields, replace

from .batches import LABELS


@dataclass(frozen=True, slots=True, kw_only=True)
class StreamOptions:
    timeout: float = 600.0
    """Seconds ``next()`` waits for a batch before it raises, naming the step and the service's state."""
    prefetch_steps: int | None = None
    """Steps fetched and decoded ahead of the trainer; default: the plan's ``loading.prefetch_steps``."""
    prefetch_bytes: int = 1 << 30
    """Bytes of batches held ahead of the trainer (at least one step is always allowed)."""
    pin_memory: bool = False
    """Pin torch tensors for fast host-to-GPU copies (ignored with a warning without an accelerator)."""
    reconnect_timeout: float = 120.0
    """Seconds to wait for a restarted service before failing (0: fail at once)."""
    labels: str = "shifted"
    """``shifted`` (``labels[i]`` is the next token) or ``hf`` (unshifted, the model shifts)."""
    loss_mask: bool | None = None
    """Add a float ``loss_mask``; default: where the plan has sources whose loss ignores tokens."""
    batch_dim: bool = False
    """``[1, C]`` token arrays for batch-first models."""
    as_torch: bool = False
    """torch tensors instead of numpy arrays (``OverlordDataset`` sets it)."""
    channel_group: str = ""
    """The streams of a process sharing one connection to the service (default: all of them)."""
    relay: bool | None = None
    """Share one connection to the service among this host's trainer processes (a relay in one
    of them, ``trainer/relay.py``); default: where torchrun started several processes on the
    host (``LOCAL_WORLD_SIZE`` > 1), on Linux."""

    @property
    def use_relay(self) -> bool:
        from .relay import wanted

        return wanted(self.relay)

    def __post_init__(self) -> None:
        if self.labels not in LABELS:
            raise ValueError(f"labels must be one of {LABELS}, got {self.labels!r}")
        for name in ("timeout", "reconnect_timeout"):
            v = getattr(self, name)
            if not (
                isinstance(v, (int, float)) and math.isfinite(v) and v >= (0 if name == "reconnect_timeout" else 1e-9)
            ):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {v!r}")
        if self.prefetch_steps is not None and not (isinstance(self.prefetch_steps, int) and self.prefetch_steps >= 1):
            raise ValueError(f"prefetch_steps must be an int >= 1 or None, got {self.prefetch_steps!r}")
        if not (isinstance(self.prefetch_bytes, int) and self.prefetch_bytes >= 1):
            raise ValueError(f"prefetch_bytes must be an int >= 1, got {self.prefetch_bytes!r}")

    @property
    def batch_options(self) -> dict:
        """What ``batches.shape`` takes: the label convention, the loss mask, the layout."""
        return {"labels": self.labels, "loss_mask": self.loss_mask, "batch_dim": self.batch_dim}

    @classmethod
    def make(cls, options: StreamOptions | None = None, **kwargs) -> StreamOptions:
        """``options`` (default: the defaults) with ``kwargs`` set on top; an unknown name is a
        ``TypeError`` listing the options there are."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(kwargs) - known)
        if unknown:
            raise TypeError(f"unknown stream option(s) {unknown}; the options are {sorted(known)}")
        base = options if options is not None else cls()
        return replace(base, **kwargs) if kwargs else base
