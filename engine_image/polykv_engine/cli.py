"""``polykv-engine``: llama-server's command line, plus the PolyKV flags.

A user's llama-server command keeps working: ``-m``, ``-c``, ``-np``, ``--kv-unified``,
``-b``, ``-ub``, ``-t``, ``-ngl``, ``--host``, ``--port``, ``--api-key``, ``--metrics``,
``--context-shift``; environment variables follow llama-server's ``LLAMA_ARG_*`` names.
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

from polykv_api import tracing
from polykv_api.agent_headers import (
    AGENT_HEADERS,
    FINAL_HEADERS,
    PARENT_HEADERS,
    SESSION_HEADERS,
    SessionHeaders,
    header_names,
)
from polykv_api.limits import MAX_DRAFT
from polykv_engine.chat.template import ChatRenderer, ChatTemplateError
from polykv_engine.core.config import EngineConfig
from polykv_engine.core.engine import Engine
from polykv_engine.core.tasks import SpecParams
from polykv_engine.http.app import serve
from polykv_engine.http.app_context import ServerSettings
from polykv_engine.http.tenants import KeyEntry, KeyFileError, assign_tenants, parse_key_file
from polykv_engine.llama.runtime import CACHE_TYPES, RuntimeConfig
from polykv_engine.policy.step_time import CEILING_CURVES


class JsonFormatter(logging.Formatter):
    """One JSON object per line: easy to ship to any log pipeline."""

    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, Any] = {
            "ts": round(record.created, 3),
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False)


# How often a stream's held tokens go out together (see http.routes.inference.QueueSink).
# Measured on 2 cores (bench model, 5 paired runs): 8 streams 519-527 tok/s at 0 (every
# token wakes the loop), 539 at 20, 551-565 at 50, 565 at 100; the first token goes at once.
STREAM_INTERVAL_MS = 50
MAX_SNAPSHOT_MIB = 1 << 24  # 16 TiB: a typo's extra digits are refused, not allocated for
MAX_SESSION_SAVE_S = 3600.0  # no grace period is longer (and nan is refused)
MAX_CHAT_TEMPLATE_BYTES = 1 << 20  # models' own templates are tens of KB


def _env(name: str, default: Any) -> Any:
    return os.environ.get(f"LLAMA_ARG_{name}", default)


def _header_names(text: str) -> tuple[str, ...]:
    try:
        return header_names(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _env_int(name: str) -> int | None:
    value = os.environ.get(name)
    return None if value is None else int(value)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="polykv-engine",
        description="llama.cpp server with first-class shared-prefix KV pools (PolyKV)",
    )
    p.add_argument("-m", "--model", type=Path, default=_env("MODEL", None), help="GGUF model path")
    p.add_argument("-a", "--alias", default=_env("ALIAS", None), help="model name in responses")
    p.add_argument(
        "--chat-template-file",
        type=Path,
        default=_env("CHAT_TEMPLATE_FILE", None),
        help="Jinja chat template to use instead of the model file's (for a file without one)",
    )
    p.add_argument(
        "-c",
        "--ctx-size",
        type=int,
        default=int(_env("CTX_SIZE", 4096)),
        help="KV cache size in tokens (0 = the model's training context)",
    )
    p.add_argument(
        "-n",
        "--n-predict",
        type=int,
        default=int(_env("N_PREDICT", -1)),
        help="the most tokens one request may generate, whatever it asks (-1: no cap; "
        "llama-server's -n): agent clients ask for up to 128000",
    )
    p.add_argument(
        "-np",
        "--parallel",
        type=int,
        default=int(_env("N_PARALLEL", 1)),
        help="decoding slots (concurrent sessions)",
    )
    unified = p.add_mutually_exclusive_group()
    unified.add_argument(
        "-kvu",
        "--kv-unified",
        dest="kv_unified",
        action="store_true",
        default=True,
        help="one KV buffer shared by all sequences (default; pools need it)",
    )
    unified.add_argument(
        "-no-kvu",
        "--no-kv-unified",
        dest="kv_unified",
        action="store_false",
        help="one KV stream per slot, as llama-server with -np (refused with pools)",
    )
    p.add_argument(
        "-b",
        "--batch-size",
        type=int,
        default=int(_env("BATCH", 2048)),
        help="tokens one decode step may carry (logical batch)",
    )
    p.add_argument(
        "-ub",
        "--ubatch-size",
        type=int,
        default=int(_env("UBATCH", 512)),
        help="tokens llama.cpp computes at once within a step (physical batch)",
    )
    p.add_argument(
        "-t",
        "--threads",
        type=int,
        default=int(_env("THREADS", 0)),
        help="CPU threads for decoding (0: the physical cores of the CPU set, capped by the "
        "cgroup's CPU limit)",
    )
    p.add_argument(
        "-tb",
        "--threads-batch",
        type=int,
        default=int(_env("THREADS_BATCH", 0)),
        help="CPU threads for prompt batches (0: as -t)",
    )
    p.add_argument(
        "-ngl",
        "--n-gpu-layers",
        "--gpu-layers",
        type=int,
        default=int(_env("N_GPU_LAYERS", 0)),
        help="layers offloaded to a GPU backend, where the build has one",
    )
    p.add_argument(
        "-fa",
        "--flash-attn",
        choices=["on", "off", "auto"],
        default=_env("FLASH_ATTN", "auto"),
        help="auto: on where layers run on the CPU (its kernel skips other sessions' masked "
        "cells in the unified cache); with layers offloaded, llama.cpp decides",
    )
    p.add_argument(
        "-ctk",
        "--cache-type-k",
        choices=sorted(CACHE_TYPES),
        default="f16",
        help="KV cache type for K (f32 makes batched and solo logits agree to ~1e-6)",
    )
    p.add_argument(
        "-ctv",
        "--cache-type-v",
        choices=sorted(CACHE_TYPES),
        default="f16",
        help="KV cache type for V (a quantized V needs flash attention)",
    )
    p.add_argument("--host", default=_env("HOST", "127.0.0.1"), help="address to listen on")
    p.add_argument("--port", type=int, default=int(_env("PORT", 8080)), help="port to listen on")
    p.add_argument(
        "--api-key",
        action="append",
        default=[],
        help="key for every route but /health and /metrics (repeatable)",
    )
    p.add_argument(
        "--api-key-file",
        type=Path,
        help="file with one API key per line, each its own tenant, or 'TENANT: KEY' lines "
        "(keys of one tenant share its sessions; '#' comments and blank lines ignored)",
    )
    p.add_argument(
        "--metrics",
        action="store_true",
        default=bool(_env("ENDPOINT_METRICS", "")),
        help="enable the Prometheus /metrics endpoint",
    )
    p.add_argument(
        "--context-shift",
        action="store_true",
        help="when a session fills its context, discard old tokens and go on",
    )
    p.add_argument(
        "--polykv-max-pools",
        type=int,
        default=16,
        help="sequence ids reserved for pools above the slots",
    )
    p.add_argument(
        "--polykv-admin-key",
        action="append",
        default=[],
        help="key for mutating /polykv routes, and to see every tenant's sessions (default: "
        "the API key, when all API keys are one tenant's)",
    )
    p.add_argument(
        "--polykv-admin-key-file",
        type=Path,
        help="file with one admin key per line (also: the POLYKV_ADMIN_KEY variable)",
    )
    p.add_argument(
        "--polykv-router-key",
        action="append",
        default=[],
        help="the router's key: a request carrying it in X-PolyKV-Router-Key may mark itself "
        "re-homed or overcommitted (also: the POLYKV_ROUTER_KEY variable)",
    )
    p.add_argument(
        "--polykv-pool-grace-ms",
        type=int,
        default=10_000,
        help="an idle, unpinned pool survives KV pressure this long after last use",
    )
    p.add_argument(
        "--polykv-kv-debug",
        action="store_true",
        help="report llama.cpp's own used-cell count in /polykv/pools (for tests; slower)",
    )
    p.add_argument(
        "--polykv-stream-interval-ms",
        type=int,
        default=int(os.environ.get("POLYKV_STREAM_INTERVAL_MS", STREAM_INTERVAL_MS)),
        help="a stream's tokens go out together at most this often, the first at once; each "
        "token stays its own SSE event (0: every token as it comes)",
    )
    p.add_argument(
        "--polykv-tps-interval-ms",
        type=int,
        default=500,
        help="cadence of the /polykv/tps SSE stream",
    )
    p.add_argument(
        "--no-polykv-auto-share",
        dest="auto_share",
        action="store_false",
        help="do not share a prompt's prefix with other sessions' cells (pools still do)",
    )
    p.add_argument(
        "--polykv-park-mib",
        type=int,
        default=1024,
        help="host memory (MiB) for idle sessions' caches moved out of the KV cache while "
        "other sessions decode, put back for their next turn (0: keep them resident)",
    )
    p.add_argument(
        "--polykv-snapshot-dir",
        type=Path,
        default=os.environ.get("POLYKV_SNAPSHOT_DIR") or None,
        help="directory for pools' KV snapshots: a pool is saved there once built, and a "
        "later create of the same prefix (after a restart) restores it instead of prefilling "
        "(default: none, no snapshots; also POLYKV_SNAPSHOT_DIR)",
    )
    p.add_argument(
        "--polykv-snapshot-mib",
        type=int,
        default=int(os.environ.get("POLYKV_SNAPSHOT_MIB", 4096)),
        help="the most the snapshot directory holds; the least recently used snapshots go "
        "first, and one larger than this is not written (also POLYKV_SNAPSHOT_MIB)",
    )
    p.add_argument(
        "--polykv-session-save-mib",
        type=int,
        default=int(os.environ.get("POLYKV_SESSION_SAVE_MIB", 1024)),
        help="on SIGTERM, after the drain, write up to this much of the sessions' KV caches "
        "into the snapshot directory, most recently used first, for the next process to "
        "restore at each session's next turn (0: none; also POLYKV_SESSION_SAVE_MIB)",
    )
    p.add_argument(
        "--polykv-session-save-s",
        type=float,
        default=float(os.environ.get("POLYKV_SESSION_SAVE_S", 5.0)),
        help="seconds writing sessions' caches may take after the drain; keep "
        "--shutdown-timeout plus this under the pod's termination grace period (also "
        "POLYKV_SESSION_SAVE_S)",
    )
    p.add_argument(
        "--no-polykv-pause-aware-admission",
        dest="pause_aware_admission",
        action="store_false",
        help="admission projects from the sessions decoding now only, not also those "
        "between turns (for workloads without tool-call pauses, and for comparison)",
    )
    p.add_argument(
        "--polykv-admission-ceiling",
        choices=CEILING_CURVES,
        default="cycle",
        help="which measured step time caps admission's projection: token-to-token time of "
        "every step (cycle, the default), decode-only steps (step), or none (for comparison)",
    )
    p.add_argument(
        "--polykv-prefill-budget",
        type=int,
        default=0,
        help="prompt tokens one step may carry while sessions decode (a fixed chunked-prefill "
        "budget); 0: sized so each step keeps the tightest floor of the sessions decoding",
    )
    p.add_argument(
        "--polykv-prefill-floor-tps",
        type=float,
        default=0.0,
        help="the floor prompt pacing keeps for decoding sessions whose pool sets none (0: "
        "such sessions do not pace prompts)",
    )
    p.add_argument(
        "--spec-type",
        choices=["none", "ngram", "draft"],
        default="none",
        help="speculative decoding for requests that do not choose (speculative.type): "
        "ngram drafts the next tokens from the session's own context (prompt lookup), draft "
        "with the draft model (-md)",
    )
    p.add_argument(
        "-md",
        "--spec-draft-model",
        "--model-draft",
        type=Path,
        help="a smaller GGUF of the same vocabulary, for speculative.type draft",
    )
    p.add_argument(
        "--spec-draft-n-max",
        type=int,
        default=16,
        help=f"most tokens drafted a step per session (1..{MAX_DRAFT})",
    )
    p.add_argument(
        "--spec-draft-n-min",
        type=int,
        default=0,
        help="fewest tokens worth drafting",
    )
    p.add_argument(
        "--polykv-max-queue",
        type=int,
        default=None,
        help="requests that may wait for a slot; more get 503 + Retry-After (default 8 x -np)",
    )
    p.add_argument(
        "--polykv-max-body-bytes",
        type=int,
        default=_env_int("POLYKV_MAX_BODY_BYTES"),
        help="largest request body; a bigger one is refused (413) before it is read "
        "(default: 64 bytes per context token + 2 MiB; also POLYKV_MAX_BODY_BYTES)",
    )
    for kind, what, defaults in (
        ("session", "name the session (the first one a request carries wins)", SESSION_HEADERS),
        ("agent", "qualify the session per agent (<session>:<agent>)", AGENT_HEADERS),
        ("parent", "name the parent session of a sub-agent", PARENT_HEADERS),
        ("final", 'mark a session\'s last turn ("true"): its cache is released', FINAL_HEADERS),
    ):
        p.add_argument(
            f"--polykv-{kind}-headers",
            type=_header_names,
            default=",".join(defaults),  # argparse parses a string default with ``type``
            help=f"comma-separated headers that {what}",
        )
    p.add_argument(
        "--polykv-kept-prefixes",
        type=int,
        default=8,
        help="prefixes each tenant may keep for its cache_control breakpoints (Anthropic "
        "Messages); past it the least recently used goes (0: breakpoints keep nothing)",
    )
    p.add_argument(
        "--polykv-kept-ttl-max-s",
        type=float,
        default=3600.0,
        help='the longest a kept prefix lives (a breakpoint asks 5 minutes, or "1h")',
    )
    p.add_argument(
        "--sse-ping-interval",
        type=float,
        default=10.0,
        help="seconds between SSE keep-alive comments while a stream has nothing to send",
    )
    p.add_argument(
        "-to",
        "--timeout",
        type=float,
        default=600.0,
        help="seconds a client may take to read a response chunk before it is dropped",
    )
    p.add_argument(
        "--shutdown-timeout",
        type=float,
        default=20.0,
        help="seconds in-flight requests get to finish on SIGTERM",
    )
    p.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the boot-time test decode (a model that cannot run then fails on the "
        "first request instead of at boot)",
    )
    p.add_argument(
        "--swa-full",
        action="store_true",
        default=bool(_env("SWA_FULL", "")),
        help="sliding-window models: a full-size SWA cache (more memory, more prompt reuse); "
        "always on with pools (--polykv-max-pools > 0), which need every cell kept",
    )
    p.add_argument(
        "--no-repack",
        action="store_true",
        default=bool(_env("NO_REPACK", "")),
        help="keep weights in their file layout (no CPU-specific repacking)",
    )
    p.add_argument(
        "--log-format",
        choices=["text", "json"],
        default="text",
        help="json: one object per line",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    return p


def _read_keys(path: Path | None, flag: str, parser: argparse.ArgumentParser) -> list[KeyEntry]:
    if path is None:
        return []
    try:
        return parse_key_file(path.read_text())
    except (OSError, KeyFileError) as exc:
        parser.error(f"{flag}: {exc}")


def _chat_template(path: Path | None, parser: argparse.ArgumentParser) -> str | None:
    """--chat-template-file, read and compiled at start: a bad template fails here, not on
    the first chat request."""
    if path is None:
        return None
    try:
        if path.stat().st_size > MAX_CHAT_TEMPLATE_BYTES:
            parser.error(f"--chat-template-file: over {MAX_CHAT_TEMPLATE_BYTES} bytes")
        text = path.read_text(encoding="utf-8")
        ChatRenderer(text, "", "")
    except (OSError, UnicodeDecodeError, ChatTemplateError) as exc:
        parser.error(f"--chat-template-file: {exc}")
    return text


def _keys(
    given: list[str], env: str, path: Path | None, flag: str, parser: argparse.ArgumentParser
) -> list[KeyEntry]:
    """Keys from flags, an environment variable and a file (files and env keep secrets out
    of the process's argv, which anyone in the pod can read with ps)."""
    keys = [KeyEntry(k, None) for k in given if k]
    if os.environ.get(env):
        keys.append(KeyEntry(os.environ[env], None))
    return keys + _read_keys(path, flag, parser)


def config_from_args(
    argv: list[str] | None = None,
) -> tuple[EngineConfig, ServerSettings, argparse.Namespace]:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.model is None:
        parser.error("a model is required: -m/--model PATH.gguf")
    if not args.model.is_file():
        parser.error(f"model file not found: {args.model}")
    for name, value, low in (
        ("--parallel", args.parallel, 1),
        ("--batch-size", args.batch_size, 1),
        ("--ubatch-size", args.ubatch_size, 1),
        ("--ctx-size", args.ctx_size, 0),
        ("--polykv-max-pools", args.polykv_max_pools, 0),
        ("--threads", args.threads, 0),
        ("--port", args.port, 0),
        ("--polykv-pool-grace-ms", args.polykv_pool_grace_ms, 0),
        ("--polykv-max-queue", args.polykv_max_queue or 0, 0),
        (
            "--polykv-max-body-bytes",
            1 if args.polykv_max_body_bytes is None else args.polykv_max_body_bytes,
            1,
        ),
        ("--polykv-park-mib", args.polykv_park_mib, 0),
        ("--polykv-prefill-budget", args.polykv_prefill_budget, 0),
        ("--polykv-kept-prefixes", args.polykv_kept_prefixes, 0),
        ("--polykv-kept-ttl-max-s", args.polykv_kept_ttl_max_s, 0),
        ("--polykv-snapshot-mib", args.polykv_snapshot_mib, 1),
        ("--polykv-session-save-mib", args.polykv_session_save_mib, 0),
        ("--polykv-session-save-s", args.polykv_session_save_s, 0),
    ):
        if value < low:
            parser.error(f"{name} must be >= {low}, got {value}")
    for name, mib in (
        ("--polykv-snapshot-mib", args.polykv_snapshot_mib),
        ("--polykv-session-save-mib", args.polykv_session_save_mib),
    ):
        if mib > MAX_SNAPSHOT_MIB:
            parser.error(f"{name} must be <= {MAX_SNAPSHOT_MIB}")
    if not args.polykv_session_save_s <= MAX_SESSION_SAVE_S:
        parser.error(f"--polykv-session-save-s must be <= {MAX_SESSION_SAVE_S}")
    if args.polykv_max_pools > 0 and not args.kv_unified:
        parser.error(
            "pools need a unified KV cache: llama.cpp aborts on a partial copy between the "
            "streams of a split cache. Drop --no-kv-unified or pass --polykv-max-pools 0."
        )
    if args.flash_attn == "off" and args.cache_type_v not in ("f16", "f32"):
        parser.error(
            f"--cache-type-v {args.cache_type_v} needs flash attention (llama.cpp keeps a "
            "quantized V cache only with it): drop -fa off or use -ctv f16"
        )
    if not 1 <= args.spec_draft_n_max <= MAX_DRAFT or not 0 <= args.spec_draft_n_min <= MAX_DRAFT:
        parser.error(f"--spec-draft-n-max must be 1..{MAX_DRAFT}, -n-min 0..{MAX_DRAFT}")
    if args.spec_draft_model is not None and not args.spec_draft_model.is_file():
        parser.error(f"draft model file not found: {args.spec_draft_model}")
    if args.spec_type == "draft" and args.spec_draft_model is None:
        parser.error("--spec-type draft needs a draft model: -md/--spec-draft-model PATH")
    if not 0 <= args.polykv_prefill_floor_tps <= 10_000:
        parser.error("--polykv-prefill-floor-tps must be between 0 and 10000")
    if args.sse_ping_interval <= 0 or args.timeout <= 0:
        parser.error("--sse-ping-interval and --timeout must be > 0 seconds")
    if not 0 <= args.polykv_stream_interval_ms <= 1000:
        parser.error("--polykv-stream-interval-ms must be between 0 and 1000")
    if not 50 <= args.polykv_tps_interval_ms <= 60_000:
        parser.error("--polykv-tps-interval-ms must be between 50 and 60000")
    chat_template = _chat_template(args.chat_template_file, parser)
    entries = _keys(args.api_key, "LLAMA_API_KEY", args.api_key_file, "--api-key-file", parser)
    key_tenants = assign_tenants(entries)
    api_keys = tuple(key for key, _ in key_tenants)
    admin_keys = tuple(
        e.key
        for e in _keys(
            args.polykv_admin_key,
            "POLYKV_ADMIN_KEY",
            args.polykv_admin_key_file,
            "--polykv-admin-key-file",
            parser,
        )
    )
    router_keys = tuple(
        e.key for e in _keys(args.polykv_router_key, "POLYKV_ROUTER_KEY", None, "", parser)
    )
    n_tenants = len({tenant for _, tenant in key_tenants})
    if n_tenants > 1 and not admin_keys:
        # Without an admin key every inference key used to be the admin's: with several
        # tenants that would let each see and manage the others' sessions and pools.
        parser.error(
            f"the API keys name {n_tenants} tenants and no --polykv-admin-key is set: pass "
            "an admin key (POLYKV_ADMIN_KEY), or put the keys under one tenant in "
            "--api-key-file ('NAME: KEY' lines)"
        )
    runtime = RuntimeConfig(
        model_path=args.model,
        n_ctx=args.ctx_size,
        n_batch=args.batch_size,
        n_ubatch=args.ubatch_size,
        n_threads=args.threads,
        n_threads_batch=args.threads_batch,
        n_gpu_layers=args.n_gpu_layers,
        kv_unified=args.kv_unified,
        flash_attn=args.flash_attn,
        cache_type_k=args.cache_type_k,
        cache_type_v=args.cache_type_v,
        kv_debug=args.polykv_kv_debug,
        repack=not args.no_repack,
        swa_full=args.swa_full,
    )
    engine_cfg = EngineConfig(
        runtime=runtime,
        n_parallel=args.parallel,
        max_pools=args.polykv_max_pools,
        context_shift=args.context_shift,
        pool_grace_s=args.polykv_pool_grace_ms / 1e3,
        kv_debug=args.polykv_kv_debug,
        warmup=not args.no_warmup,
        auto_share=args.auto_share,
        park_mib=args.polykv_park_mib,
        snapshot_dir=args.polykv_snapshot_dir,
        snapshot_mib=args.polykv_snapshot_mib,
        session_save_mib=args.polykv_session_save_mib,
        session_save_s=args.polykv_session_save_s,
        pause_aware_admission=args.pause_aware_admission,
        admission_ceiling=args.polykv_admission_ceiling,
        prefill_budget=args.polykv_prefill_budget,
        prefill_floor_tps=args.polykv_prefill_floor_tps,
        spec=SpecParams(args.spec_type, args.spec_draft_n_max, args.spec_draft_n_min),
        draft_model=args.spec_draft_model,
        max_queue=(
            args.polykv_max_queue if args.polykv_max_queue is not None else 8 * args.parallel
        ),
    )
    settings = ServerSettings(
        host=args.host,
        port=args.port,
        api_keys=api_keys,
        admin_keys=admin_keys or api_keys,  # one tenant (or none): its keys are the admin's
        key_tenants=key_tenants,
        router_keys=router_keys,
        metrics=args.metrics,
        model_alias=args.alias,
        chat_template=chat_template,
        tps_stream_interval_ms=args.polykv_tps_interval_ms,
        stream_interval_s=args.polykv_stream_interval_ms / 1e3,
        shutdown_timeout_s=args.shutdown_timeout,
        sse_ping_interval_s=args.sse_ping_interval,
        write_timeout_s=args.timeout,
        max_body_bytes=args.polykv_max_body_bytes,
        n_predict=args.n_predict,
        kept_prefixes=args.polykv_kept_prefixes,
        kept_ttl_max_s=args.polykv_kept_ttl_max_s,
        session_headers=SessionHeaders(
            session=args.polykv_session_headers,
            agent=args.polykv_agent_headers,
            parent=args.polykv_parent_headers,
            final=args.polykv_final_headers,
        ),
    )
    return engine_cfg, settings, args


def setup_logging(fmt: str, verbose: bool) -> None:
    handler = logging.StreamHandler(sys.stderr)
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        formatter = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")
        formatter.converter = time.gmtime
        handler.setFormatter(formatter)
    logging.basicConfig(level=logging.DEBUG if verbose else logging.INFO, handlers=[handler])


def main(argv: list[str] | None = None) -> int:
    engine_cfg, settings, args = config_from_args(argv)
    setup_logging(args.log_format, args.verbose)
    # A crash inside llama.cpp (SIGSEGV, SIGILL, SIGABRT from a GGML_ASSERT) kills the process
    # without a Python traceback; faulthandler prints the fatal signal and every thread's stack.
    faulthandler.enable(all_threads=True)
    if not settings.api_keys:
        logging.getLogger("polykv").warning(
            "no --api-key given: every route is open; pass a key outside local development"
        )
    if tracing.setup("polykv-engine"):
        logging.getLogger("polykv").info("tracing on: spans go to OTEL_EXPORTER_OTLP_*")
    try:
        return asyncio.run(serve(Engine(engine_cfg), settings))
    finally:
        if tracing.enabled():
            tracing.shutdown()
