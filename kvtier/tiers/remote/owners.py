"""Who writes to a store: a writer's identity (host, pid, the pid's start time, a token per
open index) and whether that writer is dead, so its reservations can be reclaimed. A pid
reused by another process is told apart by its start time; a writer on another host is
dead only once its lease has passed. It must never touch the index or the files.
"""

from __future__ import annotations

import os
import socket
from typing import Optional


def _process_start_ticks(pid: int) -> Optional[int]:
    """Start time of ``pid`` in clock ticks since boot (Linux), to tell a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    fields = stat[stat.rindex(b")") + 2 :].split()
    if fields[0] == b"Z":
        return -1
    return int(fields[19])


def make_owner(instance_token: str) -> str:
    """Identity of a writer: host, pid, pid start time, and a token unique to one open index."""
    pid = os.getpid()
    return f"{socket.gethostname()}|{pid}|{_process_start_ticks(pid)}|{instance_token}"


def owner_is_dead(owner: str, created: float, now: float, lease_s: float) -> bool:
    """Is the writer ``owner`` (``make_owner``), whose reservation dates from ``created``, gone?"""
    host, pid_text, start_text, _ = owner.split("|")
    if host != socket.gethostname():
        return now - created > lease_s
    pid = int(pid_text)
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass
    start = _process_start_ticks(pid)
    return start == -1 or (start is not None and str(start) != start_text)
