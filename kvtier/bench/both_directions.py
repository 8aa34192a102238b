"""Offload and reload at once, per pairing of copy mechanisms: the both-directions panel.

Owns timing one offload and one reload of disjoint pages queued together, where the two
directions take: both the SM kernel (as `copy_path="kernel"`), both the copy engines, one
each way round (a copy-engine direction beside a kernel direction), the kernel both ways
with the offload held to a share of the SMs, and `auto` (which pairs them itself while both
directions are in flight: kvtier.transfer.cuda.path_choice). Each pairing runs two engines
over the same tiers, one per direction, so each direction's path and grid are set apart.
Rows go to kvtier.bench.offload_bandwidth's Results under the section "offload+reload at
once"; bandwidth counts both directions' bytes. It must never choose paths for the library.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

from kvtier.tiers import DeviceTier, HostTier

SECTION = "offload+reload at once"


@dataclass(frozen=True)
class Pairing:
    """Paths (and offload grid as a share of the SMs, 1.0: all) of one row of the panel."""

    label: str
    offload: str
    reload: str
    offload_sm_share: float = 1.0


def pairings(paths: list[str]) -> list[Pairing]:
    """The pairings this machine can run, from the copy paths it has."""
    have_kernel, have_engines = "kernel" in paths, "copy_engine" in paths
    rows = []
    if have_kernel:
        rows.append(Pairing("kernel+kernel", "kernel", "kernel"))
        rows += [Pairing(f"kernel/{share:g}+kernel", "kernel", "kernel", share) for share in (0.25, 0.5)]
    if have_engines:
        rows.append(Pairing("ce+ce", "copy_engine", "copy_engine"))
    if have_kernel and have_engines:
        rows += [Pairing("ce+kernel", "copy_engine", "kernel"), Pairing("kernel+ce", "kernel", "copy_engine")]
    rows.append(Pairing("auto", "auto", "auto"))
    return rows


def measure(results, time_cuda, dev: DeviceTier, host: HostTier, slots: tuple[list, list, list, list], paths: list[str],
            repeats: int) -> None:
    """One row per pairing: offload dev slots a -> host slots a beside reload host slots b -> dev slots b."""
    import torch

    from kvtier.transfer.cuda_engine import CudaEngine

    sm_count = torch.cuda.get_device_properties(dev.device).multi_processor_count
    dslots, hslots, dslots_b, hslots_b = slots
    fmt = dev.fmt
    pages = len(dslots)
    for pairing in pairings(paths):
        try:
            if pairing.offload == "auto":
                offloader = reloader = CudaEngine(dev, host, path="auto")
            else:
                blocks = max(1, round(sm_count * pairing.offload_sm_share))
                offloader = CudaEngine(dev, host, path=pairing.offload, max_blocks=blocks)
                reloader = CudaEngine(dev, host, path=pairing.reload)
        except (RuntimeError, ValueError) as error:
            print(f"# {SECTION} {pairing.label}: not run: {error}", file=sys.stderr)
            continue
        taken = []

        def both():
            offload = offloader.offload(dslots, hslots, ready=offloader.record_ready())
            off_path = offloader.last_path
            reload = reloader.reload(hslots_b, dslots_b, ready=reloader.record_ready())
            taken.append((off_path, reloader.last_path))
            return [offload, reload]

        timing = time_cuda(both, repeats, 2)
        seen = sorted(set(taken))
        note = (f"offload on {', '.join(o for o, _ in seen)}, reload on {', '.join(r for _, r in seen)}; "
                f"offload <= {offloader.max_blocks} blocks; queued in {timing.submit_s * 1e3:.2f} ms")
        results.add(SECTION, pairing.label, fmt.page_bytes, pages, timing.device_s, 2 * pages * fmt.page_bytes, note,
                    timing.device_runs)
        offloader.close()
        if reloader is not offloader:
            reloader.close()
