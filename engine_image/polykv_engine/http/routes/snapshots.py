"""``/polykv/snapshots/{digest}``: a replica's stored KV snapshots, for its peers (admin)."""

from __future__ import annotations

from aiohttp import web

from polykv_engine.http.app_context import ctx_of
from polykv_engine.http.auth import require_admin
from polykv_engine.http.errors import ApiError
from polykv_engine.persist.store import DIGEST_RE


async def get_snapshot(request: web.Request) -> web.StreamResponse:
    """The file as stored, streamed (sendfile): the reader checks its header and sha256."""
    require_admin(request)
    ctx = ctx_of(request)
    ctx.require_ready()
    store = ctx.engine.snapshots
    if store is None:
        raise ApiError(
            404, "this engine keeps no KV snapshots", "not_found_error", reason="snapshots_disabled"
        )
    digest = request.match_info["digest"]
    if not DIGEST_RE.fullmatch(digest):
        raise ApiError(400, f"a snapshot digest is 64 lowercase hex characters, got {digest!r}")
    path = store.path(digest)
    if store.size_of(digest) is None or not path.is_file():
        raise ApiError(404, f"no snapshot {digest}", "not_found_error", reason="snapshot_not_found")
    return web.FileResponse(path, headers={"Content-Type": "application/octet-stream"})


def add_routes(app: web.Application) -> None:
    app.router.add_get("/polykv/snapshots/{digest}", get_snapshot)
