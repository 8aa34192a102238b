"""Where a long load's link time goes: the copies of one `TieredPool.load` of 4,096 pages in the
prefetched decode step's format (4 layers x 8 kv heads x 128, page 16, fp8 with per-token-head
scales: 132 KiB records, batch 8 x 8k), each copy's submission on the host and its start and end
on the GPU, against the engine alone moving the same pages in one call.

For every `engine.reload` / `engine.reload_layers` call of the load, a CUDA event is recorded on
the reload stream just before and just after it (the stream runs the copies in order, so "start"
is when the copy could begin: the end of the one before it, or its submission if that came
later). Printed per copy: pages, layers, host submission (ms from the load call), GPU start and
end, the link idle before it, and GB/s while it ran. Then: the whole load's bytes over the time
from the load call to the last copy's end, against the engine alone (one `reload` of all pages,
then one `reload_layers` of layer 0 and one of the rest) and the contiguous H2D copy of as many
bytes. Needs CUDA.

    PYTHONPATH=. python scripts/reload_timeline_probe.py [--pages 4096] [--rounds 3] [--json out.json]
        [--plans default,growth=3,first=64,link=55]

--plans: the load's chunk plan variants to run, each a comma-free list of `name=value` joined by
`+` (`first` _FIRST_CHUNK, `growth` _SPLIT_CHUNK_GROWTH (whole numbers), `link` _LINK_BYTES_PER_S in GB/s; see
kvtier/pool/loading.py), rounds of the variants alternating.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
sys.path.insert(0, str(ROOT / "scripts"))

from kvtier import PageFormat  # noqa: E402
from kvtier.index.keys import key_ids  # noqa: E402
from kvtier.pool import loading  # noqa: E402
from load_call_profile import FORMAT, decode_step_pool  # noqa: E402  scripts/load_call_profile.py
from pool_latency import pcie_h2d_gbps  # noqa: E402  benchmarks/pool_latency.py


class Recorder:
    """Wraps an engine's reload calls: events around each on the reload stream, host times."""

    def __init__(self, engine) -> None:
        self.engine, self.rows = engine, []
        self._reload, self._layers = engine.reload, engine.reload_layers
        engine.reload = self.reload
        engine.reload_layers = self.reload_layers
        self.t0 = None

    def _around(self, call, pages: int, layers: int):
        stream = self.engine.reload_stream
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        submitted = time.perf_counter()
        before.record(stream)
        ticket = call()
        after.record(stream)
        self.rows.append(dict(pages=pages, layers=layers, submitted_ms=(submitted - self.t0) * 1e3,
                              events=(before, after)))
        return ticket

    def reload(self, host_slots, device_slots, ready=None):
        n = len(host_slots)
        return self._around(lambda: self._reload(host_slots, device_slots, ready), n, self.engine.fmt.num_layers)

    def reload_layers(self, host_slots, device_slots, layers, ready=None):
        n = len(host_slots)
        return self._around(lambda: self._layers(host_slots, device_slots, layers, ready), n, len(layers))


def engine_alone(pool, host_slots, device_slots) -> dict:
    """One reload of every page; then layer 0 alone and the other layers in one call."""
    engine, fmt, out = pool.engine, pool.fmt, {}
    nbytes = len(host_slots) * fmt.page_bytes
    for name, calls in (("all layers, one call", [range(fmt.num_layers)]),
                        ("layer 0, then the rest", [range(1), range(1, fmt.num_layers)])):
        best = None
        for _ in range(3):
            torch.cuda.synchronize()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record(engine.reload_stream)
            for layers in calls:
                if len(layers) == fmt.num_layers:
                    ticket = engine.reload(host_slots, device_slots)
                else:
                    ticket = engine.reload_layers(host_slots, device_slots, layers)
            end.record(engine.reload_stream)
            ticket.synchronize()
            end.synchronize()
            ms = start.elapsed_time(end)
            best = ms if best is None else min(best, ms)
        out[name] = dict(ms=best, gbps=nbytes / (best * 1e-3) / 1e9)
    return out


_PLAN_NAMES = {"first": "_FIRST_CHUNK", "growth": "_SPLIT_CHUNK_GROWTH", "link": "_LINK_BYTES_PER_S"}
_DEFAULTS = {name: getattr(loading, attr) for name, attr in _PLAN_NAMES.items()}


def apply_plan(plan: str) -> None:
    """Set the load's chunk-plan constants: "default", or `name=value` terms joined by `+`."""
    for name, attr in _PLAN_NAMES.items():
        setattr(loading, attr, _DEFAULTS[name])
    if plan == "default":
        return
    for term in plan.split("+"):
        name, _, value = term.partition("=")
        if name not in _PLAN_NAMES:
            raise SystemExit(f"unknown plan term {term!r}; names: {', '.join(_PLAN_NAMES)}")
        setattr(loading, _PLAN_NAMES[name], float(value) * 1e9 if name == "link" else int(value))


def one_load(pool, keys, recorder, fmt, bound_ms: float) -> dict:
    """Evict `keys` from the device, load them back, and time every copy of the load."""
    pool.evict(tier="device", keys=keys)
    torch.cuda.synchronize()
    recorder.rows = []
    mark = torch.cuda.Event(enable_timing=True)
    recorder.t0 = time.perf_counter()
    mark.record(pool.engine.reload_stream)
    handle = pool.load(keys)
    call_ms = (time.perf_counter() - recorder.t0) * 1e3
    handle.synchronize()
    torch.cuda.synchronize()
    pool.release(handle.slots)
    rows, last_end, idle = [], 0.0, 0.0
    for row in recorder.rows:
        before, after = row.pop("events")
        start, end = mark.elapsed_time(before), mark.elapsed_time(after)
        gap = max(0.0, start - last_end)
        idle += gap
        moved = row["pages"] * fmt.page_bytes * row["layers"] / fmt.num_layers
        rows.append(dict(row, start_ms=start, end_ms=end, idle_before_ms=gap,
                         gbps=moved / max(1e-9, (end - start) * 1e-3) / 1e9))
        last_end = max(last_end, end)
    moved_pages = sum(row["pages"] * row["layers"] for row in rows) / fmt.num_layers
    return dict(call_ms=call_ms, last_end_ms=last_end, idle_ms=idle, pages_moved=moved_pages,
                x_bound=bound_ms / last_end, copies=rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--json", default=None)
    ap.add_argument("--plans", default="default")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    plans = args.plans.split(",")
    for plan in plans:
        apply_plan(plan)  # fails early on a bad name
    apply_plan("default")
    fmt = PageFormat(**FORMAT)
    n = args.pages
    nbytes = n * fmt.page_bytes
    pcie = pcie_h2d_gbps(torch.device("cuda"), nbytes)
    print(f"{torch.cuda.get_device_name()}: {n} pages of {fmt.page_bytes} B ({nbytes / 1e6:.0f} MB), "
          f"contiguous H2D {pcie:.1f} GB/s -> bound {nbytes / pcie / 1e6:.2f} ms", flush=True)
    result = {"gpu": torch.cuda.get_device_name(), "pages": n, "page_bytes": fmt.page_bytes, "h2d_gbps": pcie,
              "loads": []}
    for layer_ordered in (True, False):
        pool, keys = decode_step_pool(n, "cuda", layer_ordered)
        with pool:
            recorder = Recorder(pool.engine)
            for r in range(args.rounds + 1):
                for plan in (plans if layer_ordered else ["default"]):
                    apply_plan(plan)
                    load = one_load(pool, keys, recorder, fmt, nbytes / pcie / 1e6)
                    apply_plan("default")
                    if not r:
                        continue  # warm-up
                    load.update(layer_ordered=layer_ordered, plan=plan, round=r)
                    result["loads"].append(load)
                    print(f"-- layer_ordered={layer_ordered} plan {plan} round {r}: load call {load['call_ms']:.2f} ms, "
                          f"last copy ends {load['last_end_ms']:.2f} ms (bound / that = {load['x_bound']:.2f}), link idle "
                          f"{load['idle_ms']:.2f} ms over {len(load['copies'])} copies, {load['pages_moved']:.0f} pages moved",
                          flush=True)
                    if r == args.rounds:
                        for row in load["copies"]:
                            print(f"   {row['pages']:5d} pages x {row['layers']} layers: submitted {row['submitted_ms']:6.2f}"
                                  f"  start {row['start_ms']:6.2f}  end {row['end_ms']:6.2f}  idle before "
                                  f"{row['idle_before_ms']:5.2f}  {row['gbps']:5.1f} GB/s", flush=True)
            if layer_ordered:
                pool.evict(tier="device", keys=keys)
                host = [pool._host.lookup(kid) for kid in key_ids(keys)]
                dev = pool.allocate(n)
                alone = engine_alone(pool, host, dev)
                pool.release(dev)
                result["engine_alone"] = alone
                for name, v in alone.items():
                    print(f"engine alone, {name}: {v['ms']:.2f} ms, {v['gbps']:.1f} GB/s ({v['gbps'] / pcie:.2f}x)",
                          flush=True)
    for lo, plan in sorted({(x["layer_ordered"], x["plan"]) for x in result["loads"]}):
        ends = [x["last_end_ms"] for x in result["loads"] if x["layer_ordered"] == lo and x["plan"] == plan]
        calls = [x["call_ms"] for x in result["loads"] if x["layer_ordered"] == lo and x["plan"] == plan]
        print(f"layer_ordered={lo} plan {plan}: last copy end median {statistics.median(ends):.2f} ms "
              f"(all {', '.join(f'{e:.2f}' for e in ends)}), load call median {statistics.median(calls):.2f} ms")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
