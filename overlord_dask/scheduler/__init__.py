"""The planner's Dask side: everything that runs inside the scheduler process.

Data flow: trainers' channels and the submitter's long poll --> ``routes`` (one table: name ->
handler) --> the planner thread (``planner_thread``: owns ``planner.PlannerState``) --> handed-out
steps cut into constructor tasks (``chunks``) --> built batches tracked until every rank
acknowledged them (``held``) --> their descriptors pushed to the ranks (``channels``).
``plugin.PlannerPlugin`` is the ``SchedulerPlugin`` that starts and composes these parts and
receives the scheduler's task events; ``snapshot_loop`` writes snapshots in the background;
``watchdog`` measures how late the event loop wakes.
"""
