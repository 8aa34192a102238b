"""What memory this machine has for a tier, read before a tier allocates.

Owns reading the host's memory figures (``/proc/meminfo``) and a GPU's free memory, and the
check that a tier of a given size fits, raising ``TierSizeError`` that names the pool keyword,
its value, the bytes asked for, the bytes there are and the largest size that fits. It must
never allocate, and never refuse what it cannot measure (no ``/proc/meminfo``: no check).
"""

from __future__ import annotations

import torch

from kvtier.errors import TierSizeError

MEMINFO = "/proc/meminfo"


def host_memory() -> tuple[int, int] | None:
    """(available, total) bytes of host memory from /proc/meminfo (MemAvailable, MemTotal), or
    None where the file or its fields are missing."""
    try:
        with open(MEMINFO, encoding="ascii") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        return int(fields["MemAvailable"].split()[0]) * 1024, int(fields["MemTotal"].split()[0]) * 1024
    except (OSError, KeyError, ValueError, IndexError):
        return None


def gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:.1f} MiB"


def check_fits(key: str, value: object, nbytes: int, per_page: int, device: torch.device) -> None:
    """Raise TierSizeError if ``nbytes`` (pages of ``per_page`` bytes) is more than ``device``
    has free; ``key`` and ``value`` are the pool keyword and value that asked for them."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        where = f"{device} has {gib(free)} free of {gib(total)} (torch.cuda.mem_get_info)"
    else:
        memory = host_memory()
        if memory is None:
            return
        free, total = memory
        where = f"this machine has {gib(free)} available of {gib(total)} ({MEMINFO} MemAvailable)"
    if nbytes <= free:
        return
    fit = free // per_page
    most = f"{fit * per_page} ({gib(fit * per_page)})" if key.endswith("_bytes") else str(fit)
    raise TierSizeError(
        f"{key}={value!r} asks for {gib(nbytes)} ({nbytes // per_page} pages of {per_page} bytes), "
        f"but {where}: set {key} to at most {most}, or free memory first"
    )
