"""The CPU every benchmark caption names: the model name alone ("AMD EPYC") covers Zen 3 to
Zen 5, whose kernel paths differ, so the family read from /proc/cpuinfo goes beside it."""

from __future__ import annotations

from bench.report import cpu_family, cpuinfo_fields, environment, machine_name, provenance


def test_the_family_and_model_are_written_in_hex_as_the_vendors_do() -> None:
    assert cpu_family({"cpu family": "26", "model": "2"}) == "family 1Ah model 02h"
    assert cpu_family({"cpu family": "25", "model": "17"}) == "family 19h model 11h"
    assert cpu_family({"cpu family": "6", "model": "143"}) == "family 6h model 8Fh"


def test_a_cpu_without_the_fields_is_named_by_its_model_name_alone() -> None:
    assert cpu_family({}) == ""
    assert cpu_family({"cpu family": "?", "model": "2"}) == ""
    assert machine_name({"cpu": "Test CPU"}) == "Test CPU"
    assert machine_name({"cpu": "Test CPU", "cpu_family": ""}) == "Test CPU"


def test_the_provenance_line_names_the_family_beside_the_model_name() -> None:
    env = {"cpu": "AMD EPYC", "cpu_family": "family 1Ah model 02h", "cpu_count": 2,
           "git_commit": "abc", "date_utc": "now"}  # fmt: skip
    line = provenance("kernel_paths", env)
    assert line.startswith("AMD EPYC (family 1Ah model 02h), 2 cores.")


def test_this_machine_records_a_family_where_proc_cpuinfo_has_one() -> None:
    env = environment()
    with open("/proc/cpuinfo") as f:
        has_family = any(line.startswith("cpu family") for line in f)
    assert bool(env["cpu_family"]) == has_family
    assert env["cpu"] == cpuinfo_fields().get("model name", env["cpu"])
