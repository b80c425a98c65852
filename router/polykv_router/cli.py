"""``polykv-router``: parse the settings, set up logging, serve until SIGTERM (then finish
the requests in flight, up to the shutdown timeout)."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence

from aiohttp import web

from polykv_api import tracing

from . import config, logs
from .app import RouterApp


def main(argv: Sequence[str] | None = None) -> int:
    cfg = config.parse(sys.argv[1:] if argv is None else argv, os.environ)
    logs.setup(cfg.log_format, cfg.verbose)
    traced = tracing.setup("polykv-router")
    app = RouterApp(cfg, dict(os.environ)).application()
    web.run_app(
        app,
        host=cfg.host,
        port=cfg.port,
        access_log=None,
        handler_cancellation=True,  # a client that hangs up cancels its upstream request
        shutdown_timeout=cfg.shutdown_timeout_s,
        print=None,
    )
    if traced:
        tracing.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
