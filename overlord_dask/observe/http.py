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


def link_from_dask_dashboard(scheduler) -> None:
    """Add ``overlord`` to the navigation bar of Dask's own pages (``/status``, ``/workers``...),
    so that a user who opens Dask's dashboard finds the run's page. Dask has no hook for this: the
    bar lists ``template_variables(scheduler)["pages"]``, computed once per scheduler and shared
    by every page, so the name is appended there. A Dask that renders its bar otherwise only loses
    the link (``/overlord`` itself is a documented route). A scheduler without Dask's pages
    (``dashboard=False``) is left as it is: importing them would load Bokeh for nothing."""
    import sys

    if "distributed.dashboard.scheduler" not in sys.modules:
        return
    try:
        from distributed.dashboard.scheduler import template_variables

        pages = template_variables(scheduler)["pages"]
    except Exception:  # no bokeh (no Dask pages to link from), or another Dask layout
        return
    if isinstance(pages, list) and "overlord" not in pages:
        pages.append("overlord")


routes: list[tuple] = [("overlord", OverlordPage, {}), ("overlord.json", OverlordJson, {})]
