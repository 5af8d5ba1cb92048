"""The memory a new replica can have: the node's, or less where a cgroup limit is nearer.

``MemAvailable`` is the host's. A replica in a Kubernetes pod (``ember deploy --k8s`` sets
each pod's memory limit) or any other memory cgroup is killed by its limit long before the
host runs short, so the fit check takes the smaller of the two. A cgroup's headroom is its
limit less its usage, plus the file pages it holds (the page cache it is charged for, which
the kernel reclaims before it kills, as ``MemAvailable`` counts them too); the tightest of
the process's cgroup and its ancestors wins. Both cgroup versions are read: v2's
``memory.max`` / ``memory.current`` and v1's ``memory.limit_in_bytes`` /
``memory.usage_in_bytes``.
"""

from __future__ import annotations

from pathlib import Path

import psutil

PROC_CGROUP = Path("/proc/self/cgroup")
CGROUP_ROOT = Path("/sys/fs/cgroup")
#: v1 writes "no limit" as the largest page-aligned 64-bit value; anything this large is none.
_UNLIMITED = 1 << 60
#: The file counts a cgroup's ``memory.stat`` names for its page cache, by version (v1's
#: ``total_`` ones include the cgroup's children, as its usage does).
_FILE_PAGES = {2: ("active_file", "inactive_file"),
               1: ("total_active_file", "total_inactive_file")}


def available_bytes(*, proc_cgroup: Path | None = None, root: Path | None = None,
                    host_bytes: int | None = None) -> int:
    """Memory a new replica can use now: ``MemAvailable`` or, where it is nearer, the
    headroom of this process's memory cgroup (see the module docstring).

    Example:
        >>> available_bytes(proc_cgroup=Path("/nonexistent"), host_bytes=4096)
        4096
    """
    host = int(psutil.virtual_memory().available) if host_bytes is None else host_bytes
    headroom = cgroup_headroom_bytes(proc_cgroup=proc_cgroup, root=root)
    return host if headroom is None else min(host, headroom)


def cgroup_headroom_bytes(*, proc_cgroup: Path | None = None,
                          root: Path | None = None) -> int | None:
    """The least headroom of this process's memory cgroup and its ancestors; ``None`` where
    none of them has a limit (or there are no cgroups to read). ``proc_cgroup`` and ``root``
    default to :data:`PROC_CGROUP` and :data:`CGROUP_ROOT`."""
    found = memory_cgroup(proc_cgroup or PROC_CGROUP, root or CGROUP_ROOT)
    if found is None:
        return None
    version, folder, top = found
    headrooms = []
    while True:
        headroom = _headroom(version, folder)
        if headroom is not None:
            headrooms.append(headroom)
        if folder == top or top not in folder.parents:
            break
        folder = folder.parent
    return min(headrooms, default=None)


def memory_cgroup(proc_cgroup: Path, root: Path) -> tuple[int, Path, Path] | None:
    """(version, this process's memory cgroup folder, the hierarchy's root folder)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        _, controllers, path = [*line.split(":", 2), "", ""][:3]
        if "memory" in controllers.split(","):
            top = root / "memory"
            return 1, top / path.lstrip("/"), top
    for line in lines:
        if line.startswith("0::") and (root / "cgroup.controllers").exists():
            return 2, root / line[3:].lstrip("/"), root
    return None


def _headroom(version: int, folder: Path) -> int | None:
    limit_name, usage_name = (("memory.max", "memory.current") if version == 2
                              else ("memory.limit_in_bytes", "memory.usage_in_bytes"))
    try:
        raw = (folder / limit_name).read_text().strip()
        if raw == "max" or int(raw) >= _UNLIMITED:
            return None
        usage = int((folder / usage_name).read_text())
        stat = dict(line.split(" ", 1) for line in
                    (folder / "memory.stat").read_text().splitlines() if " " in line)
    except (OSError, ValueError):
        return None
    cached = sum(int(stat.get(name, 0)) for name in _FILE_PAGES[version])
    return max(0, int(raw) - usage + cached)
