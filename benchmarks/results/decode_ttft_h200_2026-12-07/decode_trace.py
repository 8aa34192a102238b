"""decode_ttft.py with the pool engine's launches capped at $BLOCKS blocks (0: default) and, for
the last load of each batch-8 run, a per-call trace of the engine's reload submissions: host ms
from the load's start at entry and exit, and the GPU ms (events on the reload lane's stream) when
each submission finished."""
import os, sys, time, json
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import decode_ttft as D
from kvtier.pool import loading as _loading
if os.environ.get('GROWTH'):
    _loading._SPLIT_CHUNK_GROWTH = int(os.environ['GROWTH'])
import torch
TRACES = []
orig = D.make_pool
def make_pool(*a, **k):
    kv, pool = orig(*a, **k)
    eng = pool.engine
    blocks = int(os.environ.get("BLOCKS", "0"))
    if blocks and getattr(eng, "kernels", None) is not None:
        eng.kernels.max_blocks = blocks
        eng.max_blocks = blocks
    if getattr(eng, "reload_lane", None) is None:
        return kv, pool
    stream = eng.reload_lane.stream
    state = {"t0": None, "ev0": None, "rows": None}
    def wrap(name, fn):
        def inner(host_slots, device_slots, *args, **kw):
            t_in = time.perf_counter()
            out = fn(host_slots, device_slots, *args, **kw)
            t_out = time.perf_counter()
            try:
                if state["rows"] is not None:
                    ev = torch.cuda.Event(enable_timing=True); ev.record(stream)
                    layers = args[0] if (args and name == "layers") else kw.get("layers")
                    state["rows"].append((name, len(host_slots), None if layers is None else (layers.start, layers.stop), t_in, t_out, ev))
            except Exception as exc:
                print("trace error", repr(exc), flush=True)
            return out
        return inner
    eng.reload = wrap("reload", eng.reload)
    eng.reload_layers = wrap("layers", eng.reload_layers)
    real_load = pool.load
    def load(keys, *a, **kw):
        if state["rows"] is not None:
            TRACES.append(state)
        ev0 = torch.cuda.Event(enable_timing=True); ev0.record()
        new = {"t0": time.perf_counter(), "ev0": ev0, "rows": []}
        state.update(new)
        out = real_load(keys, *a, **kw)
        state["t_ret"] = time.perf_counter()
        return out
    pool.load = load
    def dump():
        torch.cuda.synchronize()
        st = state
        if not st["rows"]:
            return
        rows = []
        for name, n, layers, t_in, t_out, ev in st["rows"]:
            rows.append(dict(call=name, pages=n, layers=layers, host_in=(t_in - st["t0"]) * 1e3, host_out=(t_out - st["t0"]) * 1e3,
                             gpu_end=st["ev0"].elapsed_time(ev)))
        print("TRACE", json.dumps(dict(blocks=blocks, growth=_loading._SPLIT_CHUNK_GROWTH, load_return=(st["t_ret"] - st["t0"]) * 1e3, rows=rows)), flush=True)
    pool._trace_dump = dump
    real_close = pool.close
    def close(*a, **kw):
        try:
            dump()
        except Exception as exc:
            print("dump error", repr(exc), flush=True)
        return real_close(*a, **kw)
    pool.close = close
    return kv, pool
D.make_pool = make_pool
sys.exit(D.main(sys.argv[1:]))
