"""What runs inside Dask workers: source-loader tasks (``loaders``), data-constructor tasks that
build packed micro-batches (``constructors``) and the handler that serves built batches to the
trainers (``batch_server``).

Data flow: load task --> ``SampleBlock`` kept on the worker (its lengths reported to the
planner) --> constructor task (a chunk of steps for a group of ranks) --> ``BuiltChunk`` kept on
the worker --> ``overlord_fetch`` --> a trainer process, directly (never through the scheduler).
"""
