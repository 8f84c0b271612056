"""How many cores this process may really run on.

``os.cpu_count()`` is the host's count: in a container limited to 2 CPUs on a
64-core host it says 64, and 64 ggml threads on 2 cores spin at every barrier
(a 3-token completion took over a minute).  What a process may run on is the
smaller of two limits:

- its affinity mask (``taskset``, ``docker --cpuset-cpus``), and
- the CPU quota of its cgroup and of every cgroup above it (``docker
  --cpus``, a Kubernetes CPU limit): ``cpu.max`` in cgroup v2,
  ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us`` in v1.  A quota of 1.5 CPUs
  counts as 2: the half core is still time a second thread can use.

The cgroup files are found the way the kernel describes them: the process's
cgroup paths from ``/proc/self/cgroup``, the mount points from
``/proc/self/mountinfo``.  A file that can't be read, or says "max", limits
nothing.  ``root`` exists for the tests, which lay out real ``/proc`` and
cgroup trees under a temporary folder.
"""

from __future__ import annotations

import math
import os

__all__ = ["usable_cores", "cgroup_cpu_limit"]


def usable_cores() -> int:
    """The number of cores this process may run on: its affinity mask cut to
    its cgroups' CPU quota (at least 1)."""
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        n = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        n = min(n, max(1, math.ceil(limit)))
    return max(1, n)


def cgroup_cpu_limit(root: str = "/") -> float | None:
    """The tightest CPU quota (in CPUs) over this process's cgroup and its
    ancestors, v1 or v2; None when no quota applies or none can be read."""
    groups = _own_cgroups(_read(root, "proc/self/cgroup"))
    if not groups:
        return None
    limits = []
    for mount_root, mount_point, fstype, options in _mounts(_read(root, "proc/self/mountinfo")):
        if fstype == "cgroup2":
            path = groups.get("")
            if path is not None:
                limits += _walk(root, mount_root, mount_point, path, _v2_quota)
        elif fstype == "cgroup" and "cpu" in options:
            path = groups.get("cpu")
            if path is not None:
                limits += _walk(root, mount_root, mount_point, path, _v1_quota)
    return min(limits) if limits else None


def _read(root: str, rel: str) -> str | None:
    try:
        with open(os.path.join(root, rel), encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError:
        return None


def _own_cgroups(text: str | None) -> dict[str, str]:
    """``/proc/self/cgroup``: ``id:controllers:path`` per line.  v2's line has
    no controllers (key ""); a v1 line lists its controllers, and the cpu
    controller's path is the one whose quota counts (key "cpu")."""
    groups: dict[str, str] = {}
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if controllers == "":
            groups[""] = path
        elif "cpu" in controllers.split(","):
            groups["cpu"] = path
    return groups


def _unescape(field: str) -> str:
    """mountinfo writes space, tab, newline and backslash as octal escapes."""
    out, i = [], 0
    while i < len(field):
        c = field[i]
        code = field[i + 1:i + 4]
        if c == "\\" and len(code) == 3 and all(ch in "01234567" for ch in code):
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(c)
            i += 1
    return "".join(out)


def _mounts(text: str | None):
    """(mount root, mount point, fs type, super options) of each cgroup mount.
    A mountinfo line: ``id parent major:minor root point opts [tags...] - type
    source superopts``."""
    for line in (text or "").splitlines():
        left, sep, right = line.partition(" - ")
        if not sep:
            continue
        fields, tail = left.split(), right.split()
        if len(fields) < 5 or not tail or tail[0] not in ("cgroup", "cgroup2"):
            continue
        options = set(tail[2].split(",")) if len(tail) > 2 else set()
        yield _unescape(fields[3]), _unescape(fields[4]), tail[0], options


def _walk(root, mount_root, mount_point, path, quota):
    """Quotas of the cgroup at ``path`` and every ancestor visible under this
    mount.  ``path`` is relative to the hierarchy's root; the mount shows the
    hierarchy from ``mount_root`` down.  In a container whose own cgroup is
    the mount's root, ``path`` may be ``/`` or lie outside ``mount_root``
    (``/../..``, another branch): then the mount point itself is its cgroup."""
    path = os.path.normpath("/" + path)
    mount_root = os.path.normpath("/" + mount_root)
    if path == mount_root:
        rel = ""
    elif path.startswith(mount_root.rstrip("/") + "/"):
        rel = path[len(mount_root.rstrip("/")) + 1:]
    else:
        rel = ""
    found = []
    parts = [p for p in rel.split("/") if p]
    for depth in range(len(parts), -1, -1):
        d = os.path.join(root, mount_point.lstrip("/"), *parts[:depth])
        q = quota(d)
        if q is not None:
            found.append(q)
    return found


def _v2_quota(d: str) -> float | None:
    text = _read(d, "cpu.max")
    if not text:
        return None
    fields = text.split()
    if not fields or fields[0] == "max":
        return None
    try:
        quota = int(fields[0])
        period = int(fields[1]) if len(fields) > 1 else 100000
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None


def _v1_quota(d: str) -> float | None:
    q, p = _read(d, "cpu.cfs_quota_us"), _read(d, "cpu.cfs_period_us")
    try:
        quota, period = int((q or "").strip()), int((p or "").strip())
    except ValueError:
        return None
    return quota / period if quota > 0 and period > 0 else None
