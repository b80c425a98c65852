"""PolyKV benchmarks (not tests): `python -m bench.run_all`, or one of them by module.

Every benchmark writes ``bench/results/<name>.json`` (raw numbers and medians) and
``bench/results/<name>.md`` (the table), and splices that table into README.md between
``<!-- bench:<name>:start -->`` and ``<!-- bench:<name>:end -->``. Shared pieces live in
:mod:`bench.harness`.
"""
