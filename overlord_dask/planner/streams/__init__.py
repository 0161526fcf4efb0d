"""Each source's stream: its seeded order of units and documents (``order``), which units to load
next (``lookahead``), its cursor and loaded lengths (``stream``), the numpy-row reader over them
(``rows``) and every source's stream together (``streamset``)."""

from .stream import ClassView, Piece, SourceStream
from .streamset import StreamSet

__all__ = ["ClassView", "Piece", "SourceStream", "StreamSet"]
