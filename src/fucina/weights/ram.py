"""How much memory this process can still take, for the load-time copies that would turn a
model's mapped (evictable) file pages into its own memory."""
from __future__ import annotations

# the cgroup's limit and usage files (v2, then v1) under the container's own root
_CGROUP_FILES = (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                 ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes"))


def _read_int(path: str) -> int | None:
    try:
        with open(path) as fh:
            text = fh.read().strip()
        return None if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def available_ram() -> int | None:
    """Bytes available now: Linux's MemAvailable, less where a cgroup's limit minus its usage
    is tighter; None where neither is readable."""
    avail = None
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    avail = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    for limit_path, usage_path in _CGROUP_FILES:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < (1 << 60):
            room = max(0, limit - usage)
            avail = room if avail is None else min(avail, room)
            break
    return avail
