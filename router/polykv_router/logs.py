"""Structured logs: one JSON object per line (``--log-format json``) or ``msg key=value``.

Call sites pass their fields as ``extra={"fields": {...}}``; they become top-level keys of the
JSON object. Prompts never reach a log line; session ids do (they are how an operator follows
one agent through the fleet), but never a metric label.
"""

from __future__ import annotations

import json
import logging
import sys
from typing import Any


def _fields(record: logging.LogRecord) -> dict[str, Any]:
    fields = getattr(record, "fields", None)
    return dict(fields) if isinstance(fields, dict) else {}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
            **_fields(record),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        extra = " ".join(f"{k}={v}" for k, v in _fields(record).items())
        return f"{line} {extra}" if extra else line


def setup(fmt: str, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if fmt == "json" else TextFormatter())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if verbose else logging.INFO)
    logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
