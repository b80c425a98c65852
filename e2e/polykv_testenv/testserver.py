"""A tiny HTTP server that the `polykv/testserver` image maps to, for the harness's tests.

GET /health      200 once --ready-after has passed, 503 before
GET /            JSON: hostname, pid, listen address, argv
GET /env/NAME    the value of an environment variable (404 if unset)
GET /file/PATH   the content of a local file
GET /served      the content of --serve-file (a path argument: volume resolution)
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import FrameType


def _parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="polykv-testserver")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8080)
    p.add_argument("--ready-after", type=float, default=0.0, help="seconds of 503 on /health")
    p.add_argument("--ignore-sigterm", action="store_true", help="to exercise SIGKILL")
    p.add_argument("--serve-file", type=Path, help="file served at /served")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = _parse(argv)
    started = time.monotonic()

    class Handler(BaseHTTPRequestHandler):
        def _send(self, code: int, body: object) -> None:
            data = json.dumps(body).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                ready = time.monotonic() - started >= args.ready_after
                self._send(200 if ready else 503, {"status": "ok" if ready else "starting"})
            elif self.path.startswith("/env/"):
                value = os.environ.get(self.path[len("/env/") :])
                self._send(404 if value is None else 200, {"value": value})
            elif self.path.startswith("/file/") or self.path == "/served":
                if self.path == "/served":
                    path = args.serve_file or Path("/nonexistent")
                else:
                    path = Path("/" + self.path[len("/file/") :].lstrip("/"))
                try:
                    self._send(200, {"path": str(path), "content": path.read_text()})
                except OSError as exc:
                    self._send(404, {"error": str(exc)})
            else:
                self._send(
                    200,
                    {
                        "hostname": os.environ.get("HOSTNAME", ""),
                        "pid": os.getpid(),
                        "host": args.host,
                        "port": args.port,
                        "argv": sys.argv,
                    },
                )

        def log_message(self, format: str, *a: object) -> None:
            sys.stderr.write(f"testserver: {format % a}\n")

    server = ThreadingHTTPServer((args.host, args.port), Handler)

    def on_term(signum: int, frame: FrameType | None) -> None:
        if args.ignore_sigterm:
            print("testserver: ignoring SIGTERM", file=sys.stderr, flush=True)
            return
        print("testserver: SIGTERM, exiting", file=sys.stderr, flush=True)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_term)
    print(f"testserver: listening on {args.host}:{args.port}", file=sys.stderr, flush=True)
    try:
        server.serve_forever()
    finally:
        server.server_close()


if __name__ == "__main__":
    main()
