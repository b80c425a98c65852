"""The CPU budget read from /proc and /sys (pure parsing, on trees laid out like a host's, a
container's and a pod's; tests/engine/http/test_cpu_limit.py runs the real thing)."""

from __future__ import annotations

from pathlib import Path

from polykv_engine.llama.cpus import (
    CpuBudget,
    cgroup_quota,
    physical_cores,
    throttled_seconds,
)


def _proc(tmp: Path, cgroup: str, mountinfo: list[str]) -> Path:
    proc = tmp / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(cgroup)
    (proc / "self" / "mountinfo").write_text("\n".join(mountinfo) + "\n")
    return proc


def _write(path: Path, **files: str) -> None:
    path.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (path / name.replace("__", ".")).write_text(text + "\n")


V2_MOUNT = "30 23 0:26 {root} {point} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate"
V1_CPU_MOUNT = "32 31 0:29 {root} {point} rw,relatime - cgroup cgroup rw,cpu,cpuacct"
V1_MEM_MOUNT = "33 31 0:30 / {point} rw,relatime - cgroup cgroup rw,memory"


def test_v2_the_tightest_limit_on_the_path_wins(tmp_path: Path) -> None:
    fs = tmp_path / "cg"
    proc = _proc(tmp_path, "0::/kubepods/pod1/ctr\n", [V2_MOUNT.format(root="/", point=fs)])
    _write(fs / "kubepods", cpu__max="max 100000")
    _write(fs / "kubepods" / "pod1", cpu__max="150000 100000")  # the pod: 1.5 CPUs
    _write(fs / "kubepods" / "pod1" / "ctr", cpu__max="400000 100000")  # looser than its pod
    assert cgroup_quota(proc) == 1.5


def test_v2_no_limit_anywhere_and_unreadable_files(tmp_path: Path) -> None:
    fs = tmp_path / "cg"
    proc = _proc(tmp_path, "0::/a/b\n", [V2_MOUNT.format(root="/", point=fs)])
    _write(fs / "a" / "b", cpu__max="max 100000")
    _write(fs / "a", cpu__max="garbage")
    assert cgroup_quota(proc) is None
    assert throttled_seconds(proc) is None  # no cpu.stat


def test_v2_inside_a_container_with_a_cgroup_namespace(tmp_path: Path) -> None:
    """The container sees its own cgroup as "/", mounted at the mount point."""
    fs = tmp_path / "cg"
    proc = _proc(tmp_path, "0::/\n", [V2_MOUNT.format(root="/", point=fs)])
    _write(fs, cpu__max="200000 100000", cpu__stat="usage_usec 10\nthrottled_usec 2500000")
    assert cgroup_quota(proc) == 2.0
    assert throttled_seconds(proc) == 2.5


def test_v1_container_mount_root_is_its_own_cgroup(tmp_path: Path) -> None:
    """Without a cgroup namespace /proc/self/cgroup shows the host path, and the mount's root
    is that same path: the limit file is at the mount point itself."""
    cpu, mem = tmp_path / "cpu", tmp_path / "memory"
    proc = _proc(
        tmp_path,
        "5:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n",
        [
            V1_CPU_MOUNT.format(root="/docker/abc", point=cpu),
            V1_MEM_MOUNT.format(point=mem),
        ],
    )
    _write(
        cpu,
        cpu__cfs_quota_us="50000",
        cpu__cfs_period_us="100000",
        cpu__stat="nr_periods 4\nnr_throttled 2\nthrottled_time 1500000000",
    )
    assert cgroup_quota(proc) == 0.5
    assert throttled_seconds(proc) == 1.5


def test_v1_host_path_and_an_unlimited_quota(tmp_path: Path) -> None:
    cpu = tmp_path / "cpu"
    proc = _proc(
        tmp_path, "3:cpu,cpuacct:/system.slice/x\n", [V1_CPU_MOUNT.format(root="/", point=cpu)]
    )
    _write(cpu / "system.slice" / "x", cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    _write(cpu / "system.slice", cpu__cfs_quota_us="300000", cpu__cfs_period_us="100000")
    _write(cpu, cpu__cfs_quota_us="-1", cpu__cfs_period_us="100000")
    assert cgroup_quota(proc) == 3.0


def test_no_cgroup_files_at_all(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    proc.mkdir()
    assert cgroup_quota(proc) is None and throttled_seconds(proc) is None


def test_hyperthreads_count_once_and_unknown_topology_counts_cpus(tmp_path: Path) -> None:
    sys_root = tmp_path / "sys"
    for cpu, core in ((0, 0), (1, 1), (2, 0), (3, 1)):  # 2 cores x 2 threads
        _write(
            sys_root / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology",
            physical_package_id="0",
            core_id=str(core),
        )
    assert physical_cores({0, 1, 2, 3}, sys_root) == 2
    assert physical_cores({0, 2}, sys_root) == 1  # a CPU set of one core's two threads
    assert physical_cores({0, 1, 7}, sys_root) == 3  # cpu7 unknown: count CPUs


def test_threads_are_the_physical_cores_capped_by_the_limit() -> None:
    assert CpuBudget(allowed=8, physical=4, quota=None).threads == 4
    assert CpuBudget(allowed=64, physical=32, quota=2.0).threads == 2
    assert CpuBudget(allowed=64, physical=32, quota=1.5).threads == 1  # floor: never throttled
    assert CpuBudget(allowed=64, physical=32, quota=0.25).threads == 1
    budget = CpuBudget(allowed=4, physical=4, quota=2.5)
    assert budget.fits(2) and not budget.fits(3)
    assert not CpuBudget(allowed=2, physical=2, quota=None).fits(3)
    assert "CPU limit 2.5 CPUs" in budget.describe()
