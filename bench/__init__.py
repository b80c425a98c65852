"""PolyKV benchmarks (not tests): `python -m bench.run_all`, or one of them by module.

Every benchmark writes ``bench/results/<name>.json`` (raw numbers and medians) and its table
into ``docs/performance.md`` between ``<!-- bench:<name>:start -->`` and
``<!-- bench:<name>:end -->`` (never into the front page). Shared pieces live in
:mod:`bench.harness`.
"""
