"""The planner's routes on the scheduler: one table, name -> handler (:meth:`Routes.table`).

Names come from ``protocol.Route``; callers go through ``client.PlannerClient``. Request/response
unless noted:

- ``overlord_info()``: topology and names a consumer needs to attach.
- ``overlord_attach(rank, cp_rank, replica)``: a consumer joins; answers the first step it gets
  (the one after its last acknowledged step; a new replica starts where its rank is) and its
  new generation. Its subscription then starts with every built batch from that step on, so a
  trainer that restarted (or a second consumer after a first one died) loses and repeats
  nothing. Replicas (tensor- and pipeline-parallel ranks of one data-parallel rank) share the
  rank's stream.
- ``overlord_rewind(rank, cp_rank, replica, step, dp)``: a training job restarted from its
  checkpoint at ``step``, with ``dp`` data-parallel ranks: if the service has handed out past it
  for this rank, or runs another ``dp``, the planner is rebuilt to hand out ``step`` next for
  ``dp`` ranks (``planner/rewind.py``); every attached consumer's stream ends. Idempotent: the
  job's other ranks find it done. Refused, naming the oldest step it can serve, beyond the
  retention (``checkpoint.keep_steps``, ``keep_hours``).
- ``overlord_channel(channel_id, run_id)`` (a stream, one per consumer process and run, or per
  host through a relay: ``trainer/relay.py``): the consumer sends ``{"op":
  "subscribe"|"unsubscribe", rank, cp_rank, replica, generation}``, one-way acknowledgements
  merged per chunk, ``{"op": "acks", rows: [[rank, cp_rank, replica, generation, step,
  durable_step, wait_s, since_s], ...]}`` (``trainer/ack_merge.py``; a single ``{"op": "ack",
  rank, step, cp_rank, replica, generation, durable, wait_s, since_s}`` too) and ``{"op":
  "feedback", rank, cp_rank, replica, items}`` (step times and metrics: ``planner/feedback.py``);
  the scheduler pushes ``{"op": "descriptors", to: [[rank, cp_rank, replica, generation], ...],
  items}`` as batches are built (once per channel), ``{"op": "worker_lost", address}`` and
  ``{"op": "error", rank, cp_rank, replica, generation, message}`` (``rank`` None: every
  consumer of the channel). Both ways batched every few ms (``channels.py``).
- ``overlord_ack(rank, step, cp_rank, durable, wait_s, since_s, replica, generation)``: consumed
  every step up to ``step`` (and, with ``durable``, saved it in the trainer's checkpoint); the
  request/response form, for ``commit()`` and ``state_dict()``, which wait for it.
  ``wait_s``/``since_s``: the trainer's time in ``next()`` and its time since it attached. An ack
  of an attachment that is no longer the newest is refused.
- ``overlord_where(key, timeout, run_id)``: the workers holding a built batch (waits while it is
  rebuilt); ``other_run`` for a descriptor of a run this scheduler no longer serves.
- ``overlord_work(timeout)``: the submitter's long poll: loads and constructor tasks to submit,
  batches and blocks to release, failure, plan version, measured load costs.
- ``overlord_lengths`` (one-way, on a worker's stream): a load task's unit lengths and cost.
- ``overlord_update(plan, at_step, unit_first_ids)``: a live plan update (durable on return
  where the run snapshots).
- ``overlord_skip(start, stop, reason)``: steps ``start..stop`` are not handed out (a skip
  decision in the run's timeline: ``planner/timeline.py``; durable on return where the run
  snapshots, and no step after it goes out before).
- ``overlord_pools(lead_s, report)``: the autoscaler's inputs; with ``report`` its decisions.
- ``overlord_request_stop()``: ask the serving process to stop cleanly.
- ``overlord_fail(message)``: stop the run, telling every rank why.
- ``overlord_status``, ``overlord_metrics(start, stop)``, ``overlord_ledger(start, stop)``,
  ``overlord_plans(decisions)``, ``overlord_snapshots``, ``overlord_loop(reset)``: views.

Whatever reads the planner's state runs in the planner thread (``thread.run``), so a view is never
torn by a planning step; acks (a few list writes) stay on the event loop.
"""

from __future__ import annotations

from ..protocol import Route
from .service_routes import ServiceRoutes
from .trainer_routes import TrainerRoutes


class Routes:
    """The route table of one run (``plugin.PlannerPlugin`` builds it): the trainers' handlers
    (``trainer_routes.py``) and the service's (``service_routes.py``)."""

    def __init__(self, plugin):
        self.trainers = TrainerRoutes(plugin)
        self.service = ServiceRoutes(plugin, self.trainers)

    def table(self) -> dict:
        """Request/response routes (``scheduler.handlers``)."""
        t, s = self.trainers, self.service
        return {
            Route.INFO: t.info,
            Route.ATTACH: t.attach,
            Route.REWIND: t.rewind,
            Route.CHANNEL: t.channel,
            Route.ACK: t.ack,
            Route.WHERE: t.where,
            Route.EVAL: t.evaluation,
            Route.WORK: s.work,
            Route.UPDATE: s.update,
            Route.SKIP: s.skip,
            Route.POOLS: s.pools,
            Route.REQUEST_STOP: s.request_stop,
            Route.FAIL: s.fail,
            Route.STATUS: s.status,
            Route.METRICS: s.metrics,
            Route.LEDGER: s.ledger,
            Route.PLANS: s.plans,
            Route.SNAPSHOTS: s.snapshots,
            Route.LOOP: s.loop,
        }
