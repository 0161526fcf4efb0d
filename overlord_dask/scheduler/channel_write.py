"""A consumer channel's batch of messages written to its Dask comm at once, without a coroutine.

Dask's ``TCP.write`` is a coroutine (it may serialize a large message in a thread), so every
batch a channel sends costs a task on the scheduler's event loop, and its serialization walks
Dask's protocol (a frame list, a search for out-of-band objects, a header per frame). A
channel's messages are small and plain (descriptors, errors: strings, numbers, lists), so
:func:`write_now` packs them with msgpack the way Dask's ``dumps`` does (Dask's own default
for sets and enums), frames them as Dask's ``TCP.write`` does (``trainer.comm.frame``: one frame behind its prelude),
and appends them to the comm's Tornado stream, which is all Dask's write does after
serializing. Whoever reads the channel (``trainer/comm.py``, or Dask's comms under TLS) reads
the same bytes as before.

A batch holding anything msgpack cannot pack alone (an object Dask would serialize out of
band), or a comm without a Tornado stream (Dask's in-process transport), is declined: it goes
Dask's way (``batched.BatchedWriter``).
"""

from __future__ import annotations

import msgpack
from distributed.protocol.serialize import msgpack_encode_default
from tornado.iostream import StreamClosedError

from ..errors import ConnectionClosed
from ..trainer.comm import frame  # the one framing of Dask's TCP messages spoken without distributed


def write_now(comm, batch: list) -> bool:
    """Write ``batch`` to ``comm`` (a Dask TCP or TLS comm) now; False if it is not written here
    (not plain msgpack, or no stream to append to). A closed stream raises
    ``errors.ConnectionClosed`` (an ``OSError``) and aborts the comm, as Dask's write does."""
    stream = getattr(comm, "stream", None)
    if stream is None or not hasattr(stream, "write"):
        return False
    try:
        body = msgpack.packb(batch, default=msgpack_encode_default, use_bin_type=True)
    except (TypeError, ValueError, OverflowError):
        return False
    try:
        stream.write(frame(body))
    except StreamClosedError as err:
        comm.abort()
        raise ConnectionClosed(f"{comm!r} closed: {err}") from None
    except Exception as err:  # what was written is unknown: the stream cannot go on (as Dask's write aborts)
        comm.abort()
        raise ConnectionClosed(f"{comm!r} aborted after a failed write: {type(err).__name__}: {err}") from None
    return True
