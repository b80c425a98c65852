"""The CPUs this process may really use (pure; no llama_cpp import, so the engine can size its
threads and pick the OpenMP wait policy before libllama loads).

``os.cpu_count()`` is the node's count. In a pod it is wrong twice over: the CPU set
(``sched_getaffinity``) may be smaller, and a CPU limit is a CFS quota, not a set of cores:
a pod limited to 2 CPUs on a 64-core node still sees 64. Compute threads beyond the quota
are throttled together at the end of each period, which stalls every barrier of the graph.
The budget is the smallest of the three: physical cores in the CPU set (hyperthreads share
the core's vector units, which decode saturates; llama.cpp sizes ``-t`` the same way) and the
quota of the process's cgroup and all its ancestors, v1 or v2.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path


@dataclass(frozen=True, slots=True)
class CpuBudget:
    allowed: int  # logical CPUs in this process's affinity mask (the cgroup's cpuset)
    physical: int  # distinct physical cores among them
    quota: float | None  # CFS quota in CPUs (cgroup cpu.max / cpu.cfs_quota_us); None: none

    @property
    def threads(self) -> int:
        """Compute threads that each get a core of their own for the whole period."""
        cores = self.physical
        if self.quota is not None:
            cores = min(cores, math.floor(self.quota))
        return max(1, cores)

    def fits(self, threads: int) -> bool:
        """True when ``threads`` compute threads can all run at once, unthrottled."""
        return threads <= self.allowed and (self.quota is None or threads <= self.quota)

    def describe(self) -> str:
        limit = "none" if self.quota is None else f"{self.quota:g} CPUs"
        return f"{self.allowed} CPUs allowed, {self.physical} physical cores, CPU limit {limit}"


def _read(path: Path) -> str | None:
    try:
        return path.read_text().strip()
    except OSError:
        return None


def _quota_v2(directory: Path) -> float | None:
    """``cpu.max`` is ``"<quota> <period>"`` or ``"max <period>"``."""
    text = _read(directory / "cpu.max")
    if not text:
        return None
    quota, _, period = text.partition(" ")
    if quota == "max" or not period:
        return None
    try:
        return int(quota) / int(period)
    except (ValueError, ZeroDivisionError):
        return None


def _quota_v1(directory: Path) -> float | None:
    quota, period = _read(directory / "cpu.cfs_quota_us"), _read(directory / "cpu.cfs_period_us")
    try:
        q, p = int(quota or "-1"), int(period or "0")
    except ValueError:
        return None
    return q / p if q > 0 and p > 0 else None


@dataclass(frozen=True, slots=True)
class _Mount:
    root: str  # the cgroup path mounted there (the container's own cgroup, or "/")
    point: Path
    v2: bool


def _cpu_mounts(proc: Path) -> list[_Mount]:
    """cgroup2 mounts, and cgroup v1 mounts that carry the ``cpu`` controller."""
    mounts = []
    for line in (_read(proc / "self" / "mountinfo") or "").splitlines():
        left, sep, right = line.partition(" - ")
        fields, after = left.split(), right.split()
        if not sep or len(fields) < 5 or len(after) < 3:
            continue
        fstype, options = after[0], after[2].split(",")
        if fstype == "cgroup2" or (fstype == "cgroup" and "cpu" in options):
            mounts.append(_Mount(fields[3], Path(fields[4]), fstype == "cgroup2"))
    return mounts


def _own_paths(proc: Path) -> tuple[str | None, str | None]:
    """This process's cgroup path in the v2 hierarchy and in v1's ``cpu`` one."""
    v2 = v1 = None
    for line in (_read(proc / "self" / "cgroup") or "").splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            v2 = path
        elif "cpu" in controllers.split(","):
            v1 = path
    return v2, v1


@lru_cache(maxsize=4)
def _own_dirs(proc: Path) -> tuple[tuple[_Mount, Path], ...]:
    """This process's own cgroup directory under each CPU-controlling mount (read once: a
    process does not change cgroups, and every metrics scrape asks for its cpu.stat)."""
    v2_path, v1_path = _own_paths(proc)
    dirs = []
    for mount in _cpu_mounts(proc):
        own = v2_path if mount.v2 else v1_path
        if own is None:
            continue
        # Inside a container the mount's root is the container's cgroup and /proc/self/cgroup
        # shows the path below it (or "/" with a cgroup namespace); outside, the root is "/".
        rel = own
        if mount.root != "/" and (own == mount.root or own.startswith(mount.root + "/")):
            rel = own[len(mount.root) :]
        dirs.append((mount, mount.point / rel.lstrip("/")))
    return tuple(dirs)


def cgroup_quota(proc: Path = Path("/proc")) -> float | None:
    """The tightest CFS quota over this process's cgroup and its ancestors, in CPUs."""
    limits = []
    for mount, directory in _own_dirs(proc):
        reader = _quota_v2 if mount.v2 else _quota_v1
        while True:  # every ancestor up to the mount point caps the ones below it
            quota = reader(directory)
            if quota is not None:
                limits.append(quota)
            if directory == mount.point or mount.point not in directory.parents:
                break
            directory = directory.parent
    return min(limits) if limits else None


def throttled_seconds(proc: Path = Path("/proc")) -> float | None:
    """How long the CFS quota has held this process's cgroup back (``cpu.stat``); None
    where no cgroup reports it."""
    for mount, directory in _own_dirs(proc):
        key, unit = ("throttled_usec", 1e-6) if mount.v2 else ("throttled_time", 1e-9)
        for line in (_read(directory / "cpu.stat") or "").splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value) * unit
    return None


def physical_cores(cpus: set[int], sys: Path = Path("/sys")) -> int:
    """Distinct (package, core) pairs among ``cpus``; their count when topology is unknown."""
    cores = set()
    for cpu in cpus:
        topology = sys / "devices" / "system" / "cpu" / f"cpu{cpu}" / "topology"
        package, core = _read(topology / "physical_package_id"), _read(topology / "core_id")
        if package is None or core is None:
            return len(cpus)
        cores.add((package, core))
    return len(cores) or len(cpus)


def read_budget(proc: Path = Path("/proc"), sys: Path = Path("/sys")) -> CpuBudget:
    try:
        cpus = set(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cpus = set(range(os.cpu_count() or 1))
    return CpuBudget(len(cpus), physical_cores(cpus, sys), cgroup_quota(proc))


@lru_cache(maxsize=1)
def budget() -> CpuBudget:
    """This process's budget, read once (a pod's limits do not change under it)."""
    return read_budget()
