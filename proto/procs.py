"""Whether a peer process is alive: both sides watch each other by pid on the same host."""
from __future__ import annotations


def alive(pid: int) -> bool:
    """False for a pid that is gone or a zombie (dead, not yet reaped by its parent)."""
    return start_time(pid) != 0


def start_time(pid: int) -> int:
    """When `pid` started (clock ticks since boot), or 0 when it is gone or a zombie: a pid and
    its start time name one process, whereas a pid alone may be reused by a later one."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return 0 if fields[0] in ("Z", "X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return 0
