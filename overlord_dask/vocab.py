"""Special token ids every part agrees on: a tokenizer ends documents with ``EOS_ID``, constructors
pad micro-batches with ``PAD_ID``, and the wire format and the consumer know both.

A module of its own (no imports) so that the trainer's side (``wire``, ``consumer``) learns two
integers without importing the tokenizers, pyarrow and the source formats the workers need.
"""

PAD_ID = 0
EOS_ID = 2
