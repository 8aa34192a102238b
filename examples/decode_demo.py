"""kvtier under a real decode loop: a small transformer generating greedily with its KV in a TieredPool.

The model allocates its own per-layer K and V page tensors (as a serving engine does) and hands
them to the pool, which is too small on the device for the workload: many requests reuse a few
long system prompts, so prompt pages are committed, pushed down to the host and remote tiers under
pressure, and loaded back layer by layer before attention reads them. Decode attention is the
Triton paged kernel reading the pages in place (fp8 pages with scales by default; `--path bf16`
keeps fp8 + scales in host and remote and upcasts to bf16 on reload). On a machine without CUDA
the kernel runs in Triton's interpreter at small sizes.

At the end the same requests run again with every page resident on the device (`--no-check`
skips it), and the tokens must match exactly.

    python examples/decode_demo.py [--device cuda|cpu] [--path fp8|bf16] [--remote DIR | --no-remote]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import tempfile
import time

import torch

from kvtier import TieredPool
from kvtier.decode.model import DecoderConfig, PagedKV, TinyDecoder
from kvtier.decode.runner import DecodeRunner, RunStats, shared_prefix_workload

# (model, workload, tiers) per machine. On the CPU every attention call runs in Triton's
# interpreter, one program (a Python loop over numpy tiles) per (token row, kv head): a short turn
# after cached pages is one row per new token, so the user turns and the generated tokens are what
# the CPU run's time grows with; the tiers stay small enough that prompts still go through host
# and remote and come back from both.
SIZES = {
    "cpu": dict(
        model=DecoderConfig(vocab=512, hidden=256, layers=4, q_heads=8, kv_heads=2, head_dim=64, ffn=512),
        page_size=16, requests=9, batch=2, system_prompts=3, system_tokens=128, user_tokens=8, new_tokens=4,
        skew=0.0, device_pages=20, host_pages=16,
    ),
    "cuda": dict(
        model=DecoderConfig(vocab=32000, hidden=2048, layers=8, q_heads=16, kv_heads=4, head_dim=128, ffn=5632),
        page_size=16, requests=96, batch=16, system_prompts=48, system_tokens=2048, user_tokens=256, new_tokens=32,
        skew=1.0, device_pages=2560, host_pages=3072,
    ),
}


def build(model: TinyDecoder, sizes: dict, path: str, device: str, device_pages: int, host_pages: int, remote, scale: str):
    fmt = model.config.page_format(
        sizes["page_size"], dtype="fp8_e4m3", scale=scale, layout="nhd", device_dtype="bf16" if path == "bf16" else None
    )
    kv = PagedKV(fmt, device_pages, device)
    pool = TieredPool(
        fmt, host_pages=host_pages, write_policy="write_through", model="kvtier-decode-demo",
        remote=remote, registry=None, **kv.pool_args(),
    )
    return kv, pool


def show_progress(done: int, total: int, stats: RunStats) -> None:
    print(
        f"  {done:>4}/{total} requests  {stats.generated_tokens:>6} tokens  {stats.wall_s:6.1f} s  "
        f"prefill computed {stats.prefill_tokens}/{stats.prompt_tokens} prompt tokens",
        flush=True,
    )


def report(stats: RunStats, pool_stats: dict, cuda: bool) -> None:
    hits = pool_stats["hits"]
    print(f"\ngenerated {stats.generated_tokens} tokens for {stats.requests} requests in {stats.wall_s:.1f} s: "
          f"{stats.tokens_per_s:.1f} tokens/s")
    print(f"prompt tokens {stats.prompt_tokens}, computed by prefill {stats.prefill_tokens} "
          f"({1 - stats.prefill_tokens / stats.prompt_tokens:.0%} served from the pool)")
    print(f"hits (pages): device {hits.get('device', 0)}, host {hits.get('host', 0)}, remote {hits.get('remote', 0)}; "
          f"misses {pool_stats['misses']}")
    print("bytes moved:")
    for direction in ("device_to_host", "host_to_device", "host_to_remote", "remote_to_host", "device_to_device"):
        moved = pool_stats["bytes_moved"].get(direction, 0)
        pages = pool_stats["pages_moved"].get(direction, 0)
        print(f"  {direction:<17} {pages:>7} pages {moved / 2**20:10.1f} MiB")
    where = "the CPU twin copies inside them" if not cuda else "host time; copies run on their own streams"
    lines = [("compute (model and attention kernel)", stats.compute_s), (f"pool calls ({where})", stats.pool_s)]
    if cuda:
        lines.append(("  of which the compute stream waited at wait_layer (device)", stats.stall_s))
    print("time:")
    for label, seconds in lines:
        print(f"  {label:<58} {seconds:8.3f} s")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--path", choices=("fp8", "bf16"), default="fp8",
                    help="fp8: fp8 pages + scales on the device; bf16: upcast on reload")
    ap.add_argument("--scale", default="per_page_head", choices=("per_tensor", "per_page_head", "per_token_head"))
    ap.add_argument("--remote", default=None, help="directory of a remote page store (default: a temp dir)")
    ap.add_argument("--no-remote", action="store_true", help="host tier only")
    ap.add_argument("--requests", type=int, default=None, help="override the number of requests")
    ap.add_argument("--no-check", action="store_true", help="skip the all-resident rerun")
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's agent start-up lines are not news here
    cuda = torch.device(args.device).type == "cuda"
    sizes = dict(SIZES["cuda" if cuda else "cpu"])
    if args.requests is not None:
        sizes["requests"] = args.requests
    model = TinyDecoder(sizes["model"], args.device)
    requests = shared_prefix_workload(
        sizes["requests"], sizes["system_prompts"], sizes["system_tokens"], sizes["user_tokens"],
        sizes["new_tokens"], sizes["model"].vocab, skew=sizes["skew"],
    )
    if not args.no_remote and importlib.util.find_spec("nixl_cu13") is None:
        print("remote tier off: nixl_cu13 is not installed (pip install kvtier[nixl])")
        args.no_remote = True
    with tempfile.TemporaryDirectory() as tmp:
        remote = None if args.no_remote else (args.remote or tmp)
        kv, pool = build(
            model, sizes, args.path, args.device, sizes["device_pages"], sizes["host_pages"], remote, args.scale
        )
        print(f"model: {sizes['model']}")
        print(f"pages: {pool.fmt.describe()}")
        print(f"tiers: device {kv.num_pages} pages, host {sizes['host_pages']} pages, "
              f"remote {'off' if remote is None else remote}; {'CUDA' if cuda else 'CPU, Triton interpreter'}")
        pick = f"Zipf-drawn (skew {sizes['skew']})" if sizes["skew"] else "round robin"
        print(f"workload: {len(requests)} requests in waves of {sizes['batch']}, {sizes['system_prompts']} system "
              f"prompts of {sizes['system_tokens']} tokens ({pick}), {sizes['user_tokens']} user tokens, "
              f"{sizes['new_tokens']} new tokens each")
        with pool:
            runner = DecodeRunner(model, kv, pool)
            done = runner.run(requests, sizes["batch"], progress=show_progress)
            report(runner.stats, pool.stats(), cuda)
    if args.no_check:
        return
    pages = max(sizes["device_pages"], len(requests) * (-(-(len(requests[0].prompt) + sizes["new_tokens"]) // sizes["page_size"])))
    print(f"\nrerun with all {pages} pages resident on the device ...", flush=True)
    t0 = time.perf_counter()
    kv, pool = build(model, sizes, args.path, args.device, pages, pages, None, args.scale)
    with pool:
        resident = DecodeRunner(model, kv, pool).run(requests, sizes["batch"])
        evicted = pool.stats()["evictions"].get("device", 0)
    # A request whose prefix both runs served from the pool computed the same prefill, so its
    # tokens must match exactly. Where the offloaded run lost pages (no remote tier: host
    # evictions drop them) it recomputed more of the prompt, in other chunks: float rounding may
    # then differ, so those requests are counted apart and not held to identical tokens.
    same_hits = [(a, b) for a, b in zip(done, resident) if a.hit.total == b.hit.total]
    same = sum(a.tokens == b.tokens for a, b in same_hits)
    print(f"  {time.perf_counter() - t0:.1f} s, {evicted} device evictions; tokens identical for {same}/{len(same_hits)} "
          f"requests with the same pool hits ({len(done) - len(same_hits)} recomputed more of their prompt offloaded)")
    if same != len(same_hits) or evicted:
        sys.exit("offloaded and resident runs differ")


if __name__ == "__main__":
    main()
