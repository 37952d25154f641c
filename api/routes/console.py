"""The web console: static pages under /console that call the tenant-scoped /v1 routes.

The pages hold no data of their own: the browser sends the API key the user typed (kept in
sessionStorage) on every /v1 request, so a tenant only ever sees what its key may read. Plotly's
built bundle is served from the installed `plotly` wheel, so nothing is fetched at run time.
"""

from importlib import resources
from pathlib import Path

from fastapi import APIRouter, HTTPException
from fastapi.responses import FileResponse, RedirectResponse

router = APIRouter(prefix="/console", include_in_schema=False)

_ASSETS = Path(__file__).resolve().parent.parent / "console"
_FILES = {"index.html": "text/html", "app.js": "text/javascript", "console.css": "text/css"}


def _plotly_bundle() -> Path:
    return Path(str(resources.files("plotly") / "package_data" / "plotly.min.js"))


@router.get("")
def console_root() -> RedirectResponse:
    return RedirectResponse("/console/")


@router.get("/")
def console_index() -> FileResponse:
    return FileResponse(_ASSETS / "index.html", media_type="text/html")


@router.get("/static/{name}")
def console_asset(name: str) -> FileResponse:
    if name == "plotly.min.js":
        return FileResponse(_plotly_bundle(), media_type="text/javascript")
    if name not in _FILES:
        raise HTTPException(status_code=404, detail=f"no console asset {name!r}")
    return FileResponse(_ASSETS / name, media_type=_FILES[name])
