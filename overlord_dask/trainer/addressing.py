"""Who a channel message is for: the one reading of a message's addressing, for a process's
channel (its streams, ``connection.Channel``) and a host's relay (its processes, ``relay.py``).

A message names its consumers in ``to`` (``[rank, cp rank, replica, generation]`` each: a built
chunk's descriptor), or one consumer (``rank``, ``cp_rank``, ``replica``, and the attachment's
``generation`` where it concerns one), or nobody in particular (``rank`` None: every stream).
A table maps each consumer to its attachments: consumer -> generation -> target.
"""

from __future__ import annotations


def named(table: dict, to) -> dict:
    """The targets a message's ``to`` entries (``[rank, cp rank, replica, generation]``) name in
    ``table`` (consumer -> generation -> target), each with its entries, in their order."""
    out: dict = {}
    for entry in to:
        rank, cp_rank, replica, gen = entry
        target = table.get((rank, cp_rank, replica), {}).get(gen)
        if target is not None:
            out.setdefault(target, []).append(entry)
    return out


def of_consumer(table: dict, msg: dict) -> list:
    """The targets in ``table`` (consumer -> generation -> target) holding the attachment a
    message for one consumer names (every attachment where it names no generation), each once."""
    gens = table.get((msg["rank"], msg.get("cp_rank", 0), msg.get("replica", 0)), {})
    gen = msg.get("generation")
    targets = list(gens.values()) if gen is None else [gens[gen]] if gen in gens else []
    return list({id(t): t for t in targets}.values())
