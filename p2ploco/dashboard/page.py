"""The dashboard's page and what it loads, served as they are from the package (``static/``): HTML, its script and
style, and uPlot (1.6.32, MIT: ``static/uPlot.LICENSE``), vendored so that a page needs no network but the node's.
"""

from __future__ import annotations

from importlib.resources import files

from p2ploco.swarm.status import Answer, Route, constant

PAGE_PATH = "/"
# path -> (file in static/, media type)
FILES = {
    PAGE_PATH: ("index.html", "text/html; charset=utf-8"),
    "/static/dashboard.js": ("dashboard.js", "text/javascript; charset=utf-8"),
    "/static/dashboard.css": ("dashboard.css", "text/css; charset=utf-8"),
    "/static/uPlot.iife.min.js": ("uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "/static/uPlot.min.css": ("uPlot.min.css", "text/css; charset=utf-8"),
}


def page_routes() -> dict[str, Route]:
    """The page and its files, each read once, as routes of a status server."""
    static = files("p2ploco.dashboard") / "static"
    return {path: constant(Answer(200, (static / name).read_bytes(), media_type))
            for path, (name, media_type) in FILES.items()}
