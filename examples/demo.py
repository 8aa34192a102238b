"""kvtier end to end: a few hundred pages moving through every tier, and what moved.

Simulates an engine serving chats that share a system prompt: each turn allocates device
pages, writes KV into them (random fp8 + scales here), commits them under prefix keys, and
later turns match and reload their history from wherever it went. Every reloaded page is
checked byte for byte against what was written.

    python examples/demo.py [--device cuda] [--remote DIR]
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch

from kvtier import PageFormat, TieredPool, prefix_keys


def write_pages(pool: TieredPool, keys: list[str], gen: torch.Generator, truth: dict) -> None:
    slots = pool.allocate(len(keys))
    idx = torch.as_tensor(slots, device=pool.device_tier.device)
    for layer in range(pool.fmt.num_layers):
        for plane, kv in enumerate(pool.device_kv(layer)):
            values = torch.randn((len(slots), *kv.shape[1:]), generator=gen) * 2
            raw = values.to(kv.dtype).view(len(slots), -1).view(torch.uint8).to(idx.device)
            pool.device_tier.raw_plane(layer, plane).index_copy_(0, idx, raw)
        for scales in pool.device_scales(layer):
            if scales is not None:
                scales[idx] = (torch.rand((len(slots), *scales.shape[1:]), generator=gen) + 0.05).to(idx.device)
    for key, slot in zip(keys, slots):
        truth[key] = page_bytes(pool, slot)
    pool.commit(keys, slots)
    pool.release(slots)


def page_bytes(pool: TieredPool, slot: int) -> bytes:
    dev = pool.device_tier
    data = dev.kv[:, :, slot].contiguous().view(torch.uint8).cpu().numpy().tobytes()
    scales = b"" if dev.scales is None else dev.scales[:, :, slot].cpu().numpy().tobytes()
    return data + scales


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--remote", default=None, help="directory of a remote page store (default: a temp dir)")
    ap.add_argument("--chats", type=int, default=24)
    args = ap.parse_args()
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")  # NIXL's agent start-up lines are not news here

    fmt = PageFormat(num_layers=8, num_kv_heads=4, head_dim=64, page_size=16, dtype="fp8_e4m3", scale="per_page_head")
    print(f"page format: {fmt.describe()}")
    gen = torch.Generator().manual_seed(0)
    truth: dict[str, bytes] = {}
    with tempfile.TemporaryDirectory() as tmp, TieredPool(
        fmt, device=args.device, device_pages=64, host_pages=160, write_policy="write_back",
        model="demo-model", remote=args.remote or tmp,
    ) as pool:
        system = list(range(64))  # 4 pages shared by every chat
        chats = []
        for chat in range(args.chats):
            tokens = system + [1000 + chat * 997 + i for i in range(16 * 10)]
            keys = prefix_keys(tokens, fmt.page_size, pool.namespace)
            hit = pool.match(keys)
            new = keys[hit.total :]
            if new:
                write_pages(pool, new, gen, truth)
            chats.append(keys)
        checked = 0
        for keys in chats:  # every chat comes back for a second turn
            hit = pool.match(keys)
            handle = pool.load(keys[: hit.total])
            handle.wait()
            slots = handle.slots
            for key, slot in zip(keys, slots):
                if page_bytes(pool, slot) != truth[key]:
                    raise SystemExit(f"page {key[:12]} came back different")
            checked += len(slots)
            pool.release(slots)
        pool.flush()
        s = pool.stats()
    print(f"{len(truth)} distinct pages written, {checked} pages reloaded and verified byte for byte")
    print("pages moved:")
    for direction, n in sorted(s["pages_moved"].items()):
        print(f"  {direction:<18} {n:>6} pages  {s['bytes_moved'][direction] / 2**20:8.1f} MiB")
    print(f"evictions: {dict(s['evictions'])}   hits: {dict(s['hits'])}")


if __name__ == "__main__":
    main()
