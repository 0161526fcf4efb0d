"""``/overlord`` and ``/overlord.json`` on the scheduler's dashboard server, through Dask's
documented route extension: this module is listed in ``distributed.scheduler.http.routes``.
The clusters ``service/deploy.py`` makes list it; for a scheduler started otherwise, add it to
that setting (``DASK_DISTRIBUTED__SCHEDULER__HTTP__ROUTES``, or the scheduler's config file).

The page is a static document whose script polls the JSON (``page.py``); the JSON is the
dashboard snapshot the planner thread refreshes (``dashboard.py``): a view never touches the
planner's state.
"""

from __future__ import annotations

from distributed.http.utils import RequestHandler

from .dashboard import PLUGIN


def _snapshot(scheduler):
    plugin = scheduler.plugins.get(PLUGIN) if scheduler is not None else None
    return getattr(plugin, "observed", None)


class OverlordPage(RequestHandler):
    def get(self):
        from .page import page

        if _snapshot(self.server) is None:
            self.set_status(404)
            self.write("no overlord run on this scheduler")
            return
        self.set_header("Content-Type", "text/html; charset=utf-8")
        self.write(page())


class OverlordJson(RequestHandler):
    def get(self):
        from .page import as_json

        snap = _snapshot(self.server)
        if snap is None:
            self.set_status(404)
            self.write("no overlord run on this scheduler")
            return
        self.set_header("Content-Type", "application/json")
        self.write(as_json(snap))


routes: list[tuple] = [("overlord", OverlordPage, {}), ("overlord.json", OverlordJson, {})]
