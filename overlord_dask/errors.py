"""Exception classes. Each one names its culprit (file, field, source, rank) in its message.

They subclass ``Exception`` (never ``StopIteration``) so that a failure inside a generator is never
mistaken for the end of the stream.
"""


class OverlordError(Exception):
    """Base class of every error raised by overlord-dask."""


class PlanError(OverlordError, ValueError):
    """A plan is malformed: the message names the file (when there is one), the dotted field path,
    the value and what was expected."""


class SourceError(OverlordError):
    """A source cannot be read: missing or corrupt file, missing column, schema mismatch, empty
    source. The message names the source and the file."""


class RankError(OverlordError, ValueError):
    """A consumer asked for a rank the service does not have."""


class ServiceError(OverlordError):
    """The service failed or went away while a consumer was waiting; the message carries the cause."""


class ReplayError(OverlordError):
    """A restored or rewound planner re-planned a step it had handed out before differently: the
    run cannot go on exactly (documents would be lost or repeated). The message names the step,
    what can cause it (the sources' data, the plan's code or the overlord-dask version changed
    since the step was planned) and the way out."""


class ConnectionClosed(OSError):
    """A connection to the service (its scheduler or a worker) closed or could not be opened. An
    ``OSError``, as Dask's own ``CommClosedError`` is: callers that catch ``OSError`` handle both
    (the trainer's own TCP comms and Dask's, which it uses for TLS)."""
