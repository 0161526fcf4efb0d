"""The built-in byte tokenizer's special ids, and the padding of a plan that names no tokenizer:
a tokenizer ends documents with ``EOS_ID``, constructors pad micro-batches with ``PAD_ID`` unless
the plan's tokenizer declares its own pad (then every batch carries it, ``pad_id``).

A module of its own (no imports) so that the trainer's side (``wire``, ``consumer``) learns these
integers without importing the tokenizers, pyarrow and the source formats the workers need.
"""

PAD_ID = 0
BOS_ID = 1
EOS_ID = 2
