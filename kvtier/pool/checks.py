"""Input checks of the pool's public calls: every argument is checked before any state changes.

Owns the rules for counts and slot lists and the error messages that name the offending value.
Key checks live with the key contract (kvtier.index.keys.key_ids). It must never look at
page states.
"""

from __future__ import annotations

import difflib
import operator
from collections.abc import Iterable

from kvtier.errors import SettingError

COPY_PATHS = ("auto", "kernel", "copy_engine", "staged", "torch")
# The copy paths that move bytes with CUDA (kernels, copy engines); "torch" and "auto" run anywhere.
CUDA_COPY_PATHS = ("kernel", "copy_engine", "staged")


def check_count(n: object, what: str = "page count") -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 0:
        raise ValueError(f"{what} must be an int >= 0, got {n!r}")
    return n


def check_slots(slots: Iterable[object], capacity: int) -> list[int]:
    """Device slots as a list of ints in range, without repeats.

    Slots are indexes: ints and integer types (numpy, torch scalars) are accepted through
    `operator.index`; floats, strings and bools are refused, never truncated.
    """
    if isinstance(slots, (str, bytes)):
        raise TypeError(f"slots must be a sequence of ints, got {type(slots).__name__} {slots!r}")
    if type(slots) is list and len(slots) >= 64 and set(map(type, slots)) == {int}:  # a long batch, in C
        if min(slots) < 0 or max(slots) >= capacity:
            bad = min(slots) if min(slots) < 0 else max(slots)
            raise ValueError(f"device slot {bad} out of range [0, {capacity})")
        if len(set(slots)) != len(slots):
            raise ValueError("slots must not repeat within one call")
        return list(slots)
    out = []
    for slot in slots:
        if type(slot) is int and 0 <= slot < capacity:  # the common case, checked fast
            out.append(slot)
            continue
        if isinstance(slot, bool):
            raise TypeError(f"device slot must be an int, got bool {slot!r}")
        try:
            value = operator.index(slot)
        except TypeError:
            raise TypeError(f"device slot must be an int, got {type(slot).__name__} {slot!r}") from None
        if not 0 <= value < capacity:
            raise ValueError(f"device slot {value} out of range [0, {capacity})")
        out.append(value)
    if len(set(out)) != len(out):
        raise ValueError("slots must not repeat within one call")
    return out


REPEATED_KEYS = "keys must not repeat within one call"


def check_unique(ids: list[bytes]) -> None:
    if len(set(ids)) != len(ids):
        raise ValueError(REPEATED_KEYS)


def check_positive(value: object, what: str, integer: bool = False) -> int | float:
    kinds = (int,) if integer else (int, float)
    if isinstance(value, bool) or not isinstance(value, kinds) or value <= 0:
        kind = "an int" if integer else "a number"
        raise ValueError(f"{what} must be {kind} > 0, got {value!r}")
    return value


def check_copy_path(copy_path: object) -> str:
    if copy_path not in COPY_PATHS:
        near = difflib.get_close_matches(copy_path, COPY_PATHS, 1, 0.6) if isinstance(copy_path, str) else []
        hint = f" (did you mean {near[0]!r}?)" if near else ""
        raise SettingError(f"copy_path={copy_path!r}: expected one of {list(COPY_PATHS)}{hint}")
    return copy_path


def check_copy_path_runs(copy_path: str, engine: str, device) -> None:
    """Refuse a CUDA copy path that the pool's engine would never use (engine "auto" on a CPU
    device, or "torch"), where it would otherwise be ignored without a word."""
    if copy_path not in CUDA_COPY_PATHS or engine == "cuda" or engine == "auto" and device.type == "cuda":
        return
    why = f"device is {str(device)!r}" if engine == "auto" else f"engine={engine!r} copies with torch"
    raise SettingError(
        f"copy_path={copy_path!r} moves bytes with CUDA, but {why}, so it would never be used: "
        "use copy_path='auto' (or 'torch'), or a CUDA device (device='cuda') and engine 'auto' or 'cuda'"
    )


def check_host_size(host_pages: object, host_bytes: object) -> None:
    """host_pages and host_bytes both size the host tier: one would be ignored, so refuse both."""
    if host_pages is not None and host_bytes is not None:
        raise SettingError(
            f"host_pages={host_pages!r} and host_bytes={host_bytes!r} both size the host tier; give one: "
            "host_bytes for a size, host_pages for a page count"
        )
