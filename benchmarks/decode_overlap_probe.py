"""Why layer-wise prefetch costs more than max(compute, transfer): the copies slow under compute.

Times, on one GPU, with queueing kept off the clock (a GPU sleep while the host queues):
  transfer     one reload of 8 layers x 256 pages of 512 KiB (128 MiB), per layer events
  mm8          eight 2048x4096x4096 bf16 matmuls (the synthetic decode loop's compute)
  concurrent   both at once, the matmuls on another stream, no dependency between them
  waits-only   the reload with the current stream waiting on each layer's event
  overlapped   the decode loop: wait_layer(i), then layer i's matmul
If `concurrent` exceeds `transfer`, compute slows the copies themselves, and no ordering
can hide that. Needs CUDA.

    PYTHONPATH=. python3 benchmarks/decode_overlap_probe.py
"""

import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from kvtier.format import PageFormat  # noqa: E402
from kvtier.tiers import DeviceTier, HostTier  # noqa: E402
from kvtier.transfer.cuda_engine import CudaEngine  # noqa: E402

SLEEP_CYCLES = 20_000_000  # about 10 ms: longer than any queueing below


def timed(fn, repeats: int = 10) -> float:
    samples = []
    for i in range(repeats + 2):
        torch.cuda._sleep(SLEEP_CYCLES)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        if i >= 2:
            samples.append(start.elapsed_time(end))
    return statistics.median(samples)


def main() -> None:
    if not torch.cuda.is_available():
        raise SystemExit("decode_overlap_probe needs CUDA")
    fmt, pages = PageFormat(8, 8, 128, 16), 256
    dev, host = DeviceTier(fmt, pages, "cuda"), HostTier(fmt, pages, pin=True)
    host.buffer.copy_(torch.randint(0, 120, host.buffer.shape, dtype=torch.uint8))
    x = torch.randn(2048, 4096, dtype=torch.bfloat16, device="cuda")
    w = torch.randn(4096, 4096, dtype=torch.bfloat16, device="cuda")
    slots = list(range(pages))
    side = torch.cuda.Stream()
    for path in ("copy_engine", "kernel"):
        engine = CudaEngine(dev, host, path=path)

        def reload():
            return engine.reload(slots, slots, ready=engine.record_ready())

        def transfer():
            reload().wait()

        def mm8():
            for _ in range(fmt.num_layers):
                torch.matmul(x, w)

        def concurrent():
            side.wait_stream(torch.cuda.current_stream())
            ticket = reload()
            with torch.cuda.stream(side):
                mm8()
            torch.cuda.current_stream().wait_stream(side)
            ticket.wait()

        def waits_only():
            ticket = reload()
            for layer in range(fmt.num_layers):
                ticket.wait_layer(layer)

        def overlapped():
            ticket = reload()
            for layer in range(fmt.num_layers):
                ticket.wait_layer(layer)
                torch.matmul(x, w)

        times = {name: timed(fn) for name, fn in [("transfer", transfer), ("mm8", mm8), ("concurrent", concurrent),
                                                   ("waits-only", waits_only), ("overlapped", overlapped)]}
        print(path, "  ".join(f"{name} {ms:.3f} ms" for name, ms in times.items()))
        engine.close()
    host.close()


if __name__ == "__main__":
    main()
