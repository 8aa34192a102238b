"""Real SGLang servers with kvtier on a GPU machine: the end-to-end check and TTFT against
SGLang's own storage backends.

Runs where sglang, a CUDA torch and nixl are importable; ``scripts/sglang_server_check.sh`` sets
that up on the H200 from the carried kit (``make gpu-sglang-kit``) and calls this. Every server is
a real ``python -m sglang.launch_server`` (dummy weights, triton attention, HiCache with page 16,
``page_first``, ``write_through``, ``--hicache-storage-prefetch-policy wait_complete``,
``--enable-metrics``), driven over HTTP.

check: a tiny Llama with bf16 KV and with fp8_e4m3 KV through ``--hicache-storage-backend kvtier``
  (the plugin; extra config in kvtier.config's keys), one through SGLang's ``dynamic`` loader, and
  a tiny MLA model (DeepSeek-V2 layout) where SGLang serves it. A multi-turn client sends NP
  prompts ROUNDS times with ``/flush_cache`` between rounds. A kvtier server fails the check
  unless every round after a flush is served from the storage tier, the text is the same in every
  round, and kvtier's families (``kvtier_sglang_pages_total``) are in SGLang's ``/metrics``.
ttft: a Llama-3-8B-shaped model (32 layers, 32 query heads, 8 kv heads, head dim 128; vocabulary
  512, dummy weights) per KV dtype: TTFT (one output token) for recompute and a host (L2) hit on a
  server without storage, and for a storage (L3) hit through kvtier, SGLang's ``file`` and SGLang's
  ``nixl`` backends (SGLang imports NIXL as ``nixl``; the script bridges ``nixl_cu13`` by a shim
  on that server's path), prompts of 2k / 8k / 32k tokens, each L3 hit with the files in the page
  cache ("warm") and after POSIX_FADV_DONTNEED on every store file ("cold"); medians.
  Servers of other backends must not log a single ``kvtier:`` line.

Writes ``sglang_server.json`` (every request, medians, ratios) and ``logs.tar.xz`` under --out
and prints a table; exit status 0 only if every check that ran passed.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tarfile
import time
import urllib.error
import urllib.request
from pathlib import Path

PAGE = 16
KVTIER_LOG = re.compile(r"\bkvtier: ")
HICACHE = [
    "--load-format", "dummy", "--attention-backend", "triton", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--enable-hierarchical-cache", "--page-size", str(PAGE),
    "--hicache-write-policy", "write_through", "--hicache-mem-layout", "page_first",
    "--hicache-storage-prefetch-policy", "wait_complete", "--enable-metrics", "--skip-server-warmup",
]
LLAMA_8B = {
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "max_position_embeddings": 40960, "rope_theta": 500000.0,
}
DEEPSEEK_TINY = {
    "architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 512,
    "hidden_size": 256, "intermediate_size": 512, "moe_intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 4, "n_shared_experts": 1, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "first_k_dense_replace": 2, "moe_layer_freq": 1, "kv_lora_rank": 512,
    "q_lora_rank": None, "qk_rope_head_dim": 64, "qk_nope_head_dim": 128, "v_head_dim": 128,
    "topk_method": "greedy", "n_group": 1, "topk_group": 1, "routed_scaling_factor": 1.0,
    "scoring_func": "softmax", "norm_topk_prob": False, "hidden_act": "silu", "max_position_embeddings": 4096,
    "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False,
    "tie_word_embeddings": False, "initializer_range": 0.02, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 3, "torch_dtype": "bfloat16", "use_cache": True,
}


class Budget:
    def __init__(self, seconds: float):
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        return self.end - time.monotonic()


def log(*parts) -> None:
    print(time.strftime("%H:%M:%S"), *parts, flush=True)


def model_dir(kit: Path, work: Path, name: str, changes: dict, replace: bool = False) -> Path:
    """A model folder: the kit's tiny Llama tokenizer with a config of ``changes``."""
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    for f in (kit / "tinymodel").iterdir():
        if f.name != "config.json":
            shutil.copy(f, out / f.name)
    config = {} if replace else json.loads((kit / "tinymodel" / "config.json").read_text())
    config.update(changes)
    (out / "config.json").write_text(json.dumps(config, indent=1))
    return out


class Server:
    """One ``sglang.launch_server`` process group, its store directory and its log."""

    def __init__(self, name: str, model: Path, port: int, backend: str, work: Path, extra: list[str],
                 kv_dtype: str = "auto", nixl_shim: Path | None = None):
        self.name, self.port, self.backend, self.kv_dtype = name, port, backend, kv_dtype
        self.store = work / "stores" / name
        shutil.rmtree(self.store, ignore_errors=True)
        self.store.mkdir(parents=True)
        self.log_path = work / "logs" / f"{name}.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self.env = dict(os.environ)
        if backend == "kvtier":
            storage = ["--hicache-storage-backend", "kvtier", "--hicache-storage-backend-extra-config",
                       json.dumps({"remote": str(self.store), "remote_capacity_bytes": "40GiB"})]
        elif backend == "dynamic":
            storage = ["--hicache-storage-backend", "dynamic", "--hicache-storage-backend-extra-config", json.dumps({
                "backend_name": "kvtier", "module_path": "kvtier.adapters.sglang.backend",
                "class_name": "KvtierHiCacheStorage", "interface_v1": 1, "remote": str(self.store)})]
        elif backend == "file":
            storage = ["--hicache-storage-backend", "file"]
            self.env["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = str(self.store)
        elif backend == "nixl":
            storage = ["--hicache-storage-backend", "nixl"]
            self.env["SGLANG_HICACHE_NIXL_BACKEND_STORAGE_DIR"] = str(self.store)
            self.env["PYTHONPATH"] = f"{nixl_shim}:{self.env.get('PYTHONPATH', '')}"
        elif backend == "none":
            storage = []
        else:
            raise ValueError(f"backend {backend!r}")
        self.cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", str(model), *HICACHE,
                    "--kv-cache-dtype", kv_dtype, "--host", "127.0.0.1", "--port", str(port), *storage, *extra]
        self.proc: subprocess.Popen | None = None
        self.started = 0.0
        self.healthy_after: float | None = None
        self.pages_written = 0.0  # kvtier's write counter when the last prompt was stored

    def start(self) -> None:
        log(f"start {self.name}:", " ".join(self.cmd[1:]))
        self.started = time.monotonic()
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT, env=self.env,
                                         start_new_session=True)

    def call(self, path: str, data=None, method=None, timeout=300):
        req = urllib.request.Request(f"http://127.0.0.1:{self.port}{path}", method=method,
                                     data=None if data is None else json.dumps(data).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return r.status, r.read()

    def wait_healthy(self, budget: Budget, limit_s: float) -> bool:
        deadline = min(time.monotonic() + limit_s, budget.end)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                log(f"{self.name}: exited with {self.proc.returncode} before it was healthy")
                return False
            try:
                if self.call("/health", timeout=5)[0] == 200:
                    self.healthy_after = time.monotonic() - self.started
                    log(f"{self.name}: healthy after {self.healthy_after:.0f} s")
                    return True
            except (OSError, urllib.error.URLError):
                pass
            time.sleep(2)
        log(f"{self.name}: not healthy in time")
        return False

    def generate(self, prompt, max_new: int) -> dict:
        body = {"sampling_params": {"max_new_tokens": max_new, "temperature": 0}}
        body["input_ids" if isinstance(prompt, list) else "text"] = prompt
        t = time.perf_counter()
        out = json.loads(self.call("/generate", body)[1])
        seconds = time.perf_counter() - t
        meta = out.get("meta_info", {})
        details = meta.get("cached_tokens_details") or {}
        return {"s": seconds, "prompt_tokens": meta.get("prompt_tokens"), "cached": meta.get("cached_tokens"),
                "device": details.get("device", 0), "host": details.get("host", 0),
                "storage": details.get("storage", 0), "text": out.get("text"),
                "output_ids": out.get("output_ids")}

    def flush(self) -> None:
        for _ in range(30):
            try:
                if self.call("/flush_cache", method="POST", timeout=60)[0] == 200:
                    time.sleep(0.5)
                    return
            except urllib.error.HTTPError:
                pass
            time.sleep(1)
        raise RuntimeError(f"{self.name}: /flush_cache did not succeed in 30 tries")

    def metrics(self) -> str:
        return self.call("/metrics", timeout=30)[1].decode(errors="replace")

    def store_bytes(self) -> int:
        return sum(f.stat().st_blocks * 512 for f in self.store.rglob("*") if f.is_file())

    def drop_store_cache(self) -> int:
        """POSIX_FADV_DONTNEED on every store file: the next read comes from the disk."""
        count = 0
        for f in self.store.rglob("*"):
            if f.is_file():
                fd = os.open(f, os.O_RDONLY)
                try:
                    os.fsync(fd)
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                    count += 1
                finally:
                    os.close(fd)
        return count

    def kvtier_lines(self) -> list[str]:
        return [line for line in self.log_path.read_text(errors="replace").splitlines() if KVTIER_LOG.search(line)]

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            os.killpg(self.proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            return
        for _ in range(20):
            if self.proc.poll() is not None:
                break
            time.sleep(0.5)
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait()


def kvtier_counter(text: str, op: str, result: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if line.startswith("kvtier_sglang_pages_total{") and f'op="{op}"' in line and f'result="{result}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


# --------------------------------------------------------------------------------------- check
def run_check(server: Server, prompts: int, rep: int, rounds: int, problems: list[str]) -> dict:
    texts = [" ".join([f"the cache storage backend page block token {j}"] * rep) for j in range(prompts)]
    first: dict[int, str] = {}
    per_round = []
    for rnd in range(rounds):
        total = {"prompt": 0, "cached": 0, "device": 0, "host": 0, "storage": 0, "s": []}
        for j, text in enumerate(texts):
            r = server.generate(text, 8)
            if first.setdefault(j, r["text"]) != r["text"]:
                problems.append(f"{server.name}: round {rnd} prompt {j}: text differs from round 0")
            total["prompt"] += r["prompt_tokens"] or 0
            total["cached"] += r["cached"] or 0
            for k in ("device", "host", "storage"):
                total[k] += r[k] or 0
            total["s"].append(round(r["s"], 4))
        per_round.append(total)
        log(f"{server.name} round {rnd}: {json.dumps(total)}")
        if rnd + 1 < rounds:
            time.sleep(3)  # write-through reaches the storage tier
            server.flush()
    if server.backend != "none":
        for rnd, total in enumerate(per_round[1:], start=1):
            if total["storage"] < total["prompt"] // 2:
                problems.append(f"{server.name}: round {rnd} after a flush took only {total['storage']} of "
                                f"{total['prompt']} prompt tokens from storage")
    metrics = server.metrics()
    found = {"read_hit": kvtier_counter(metrics, "read", "hit"), "write_written": kvtier_counter(metrics, "write", "written"),
             "families": sorted(set(re.findall(r"^(kvtier_[a-z_]+)", metrics, re.M))),
             "sglang_families": len({m.group(1) for m in re.finditer(r"^(sglang:\w+)", metrics, re.M)})}
    if server.backend in ("kvtier", "dynamic") and not (found["read_hit"] > 0 and found["write_written"] > 0):
        problems.append(f"{server.name}: kvtier's counters missing from SGLang's /metrics: {found}")
    return {"rounds": per_round, "metrics": found, "store_bytes": server.store_bytes()}


# ---------------------------------------------------------------------------------------- ttft
def prompt_ids(seed: int, length: int) -> list[int]:
    """Random token ids in the tokenizer's ordinary range (4..504), one sequence per seed."""
    state = (seed * 0x9E3779B97F4A7C15 + 1) & (2**64 - 1)
    out = []
    for _ in range(length):
        state ^= (state << 13) & (2**64 - 1)
        state ^= state >> 7
        state ^= (state << 17) & (2**64 - 1)
        out.append(4 + state % 500)
    return out


def stored_pages(server: Server) -> float:
    text = server.metrics()
    return kvtier_counter(text, "write", "written") + kvtier_counter(text, "write", "present")


def wait_stored(server: Server, length: int, budget: Budget, limit_s: float = 90.0) -> float:
    """Seconds until the storage tier holds a prompt of ``length`` tokens: kvtier's write counter
    reaches its pages, else the store directory stops growing at about the prompt's bytes."""
    t0 = time.monotonic()
    pages = length // PAGE - 1
    last, stable = -1, 0
    while time.monotonic() - t0 < limit_s and budget.left() > 10:
        if server.backend == "kvtier":
            if stored_pages(server) >= server.pages_written + pages:
                break
        else:
            size = server.store_bytes()
            stable = stable + 1 if size == last and size > 0 else 0
            last = size
            if stable >= 3 or (size == 0 and time.monotonic() - t0 > 20):
                break
        time.sleep(0.5)
    if server.backend == "kvtier":
        server.pages_written = stored_pages(server)
    return time.monotonic() - t0


def host_rows(server: Server, length: int, repeats: int, device_tokens: int, budget: Budget) -> list[dict]:
    """Recompute and host (L2) hits on a server without storage: A, two fillers of half the device
    pool and 512 tokens each (together they need A's room and more, and A is the least recently
    used, so SGLang evicts all of A from the device; write-through kept it in the host pool), A."""
    rows = []
    for rep in range(repeats):
        if budget.left() < 30:
            break
        server.flush()
        a = prompt_ids(10_000 + 1000 * length + rep, length)
        first = server.generate(a, 1)
        for k in range(2):
            server.generate(prompt_ids(20_000 + 1000 * length + 10 * rep + k, device_tokens // 2 + 512), 1)
        again = server.generate(a, 1)
        rows.append({"recompute": first, "l2": again})
        log(f"{server.name} {length}: recompute {first['s']:.3f} s, L2 {again['s']:.3f} s "
            f"(host {again['host']}, device {again['device']})")
    return rows


def storage_rows(server: Server, prompt: list[int], first: dict, repeats: int, budget: Budget) -> dict:
    """Storage (L3) hits of a prompt already written through: per repeat a flush and the prompt
    ("warm": store files in the page cache), a flush, DONTNEED on the files and the prompt ("cold")."""
    stored_s = wait_stored(server, len(prompt), budget)
    rows = {"first": first, "stored_s": stored_s, "warm": [], "cold": []}
    for _ in range(repeats):
        if budget.left() < 20:
            break
        server.flush()
        rows["warm"].append(server.generate(prompt, 1))
        server.flush()
        server.drop_store_cache()
        rows["cold"].append(server.generate(prompt, 1))
        log(f"{server.name} {len(prompt)}: L3 warm {rows['warm'][-1]['s']:.3f} s (storage "
            f"{rows['warm'][-1]['storage']}), cold {rows['cold'][-1]['s']:.3f} s (storage {rows['cold'][-1]['storage']}); "
            f"stored after {stored_s:.1f} s")
    return rows


def ttft_group(group: dict, lengths: list[int], repeats: int, device_tokens: int, budget: Budget,
               results: dict, save) -> None:
    """Per prompt length: the prompt's first request on every storage server (recompute, written
    through), the host-tier rows while those writes land, then each storage server's hits in turn
    (one server on the GPU at a time)."""
    storage = [s for b, s in group.items() if b != "none"]
    for length in lengths:
        if budget.left() < 60:
            results.setdefault("skipped", []).append(f"{length} tokens: {budget.left():.0f} s left")
            break
        prompt = prompt_ids(1000 * length, length)
        firsts = {s.backend: s.generate(prompt, 1) for s in storage}
        if "none" in group:
            results.setdefault("none", {})[length] = host_rows(group["none"], length, repeats, device_tokens, budget)
        for s in storage:
            results.setdefault(s.backend, {})[length] = storage_rows(s, prompt, firsts[s.backend], repeats, budget)
        save()


def median_s(rows: list[dict]) -> float | None:
    values = [r["s"] for r in rows]
    return round(statistics.median(values), 4) if values else None


def summarize(ttft: dict) -> dict:
    """Medians per (dtype, length) and the issue's ratios."""
    table = {}
    for dtype, servers in ttft.items():
        for length in sorted({k for name, rows in servers.items() if name != "skipped" for k in rows}):
            row = {}
            host = servers.get("none", {}).get(length) or []
            row["recompute"] = median_s([r["recompute"] for r in host])
            row["l2"] = median_s([r["l2"] for r in host])
            for backend in ("kvtier", "file", "nixl"):
                got = servers.get(backend, {}).get(length)
                if got:
                    row[f"{backend}_warm"] = median_s(got["warm"])
                    row[f"{backend}_cold"] = median_s(got["cold"])
                    row[f"{backend}_storage_tokens"] = min((r["storage"] for r in got["warm"] + got["cold"]), default=None)
            for temp in ("warm", "cold"):
                k = row.get(f"kvtier_{temp}")
                if k:
                    if row.get("recompute"):
                        row[f"recompute/kvtier_{temp}"] = round(row["recompute"] / k, 2)
                    for peer in ("file", "nixl"):
                        if row.get(f"{peer}_{temp}"):
                            row[f"{peer}/kvtier_{temp}"] = round(row[f"{peer}_{temp}"] / k, 2)
                    if row.get("l2"):
                        row[f"kvtier_{temp}/l2"] = round(k / row["l2"], 2)
            table[f"{dtype} {length}"] = row
    return table


def print_table(table: dict) -> None:
    cols = ["recompute", "l2", "kvtier_warm", "kvtier_cold", "file_warm", "file_cold", "nixl_warm", "nixl_cold",
            "recompute/kvtier_cold", "file/kvtier_cold", "nixl/kvtier_cold", "kvtier_cold/l2"]
    print("| shape | " + " | ".join(cols) + " |")
    print("|---|" + "---:|" * len(cols))
    for name, row in table.items():
        print(f"| {name} | " + " | ".join("" if row.get(c) is None else str(row[c]) for c in cols) + " |")


# ----------------------------------------------------------------------------------------- main
def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("mode", choices=["check", "ttft", "all"])
    ap.add_argument("--kit", type=Path, default=Path(".gpu-sglang"))
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/out")))
    ap.add_argument("--work", type=Path, default=Path("/tmp/sglang-server"))
    ap.add_argument("--budget-s", type=float, default=560)
    ap.add_argument("--dtypes", default="bf16,fp8_e4m3", help="KV dtypes of the TTFT servers, in order")
    ap.add_argument("--lengths", default="2048,8192,32768")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--no-mla", action="store_true")
    ap.add_argument("--nixl-shim", type=Path, default=Path("/tmp/nixl-shim"))
    ap.add_argument("--hold-until", type=Path, default=None,
                    help="start the servers at once but measure TTFT only once this file exists (the GPU "
                         "is busy with other work until then)")
    args = ap.parse_args()
    budget = Budget(args.budget_s)
    args.out.mkdir(parents=True, exist_ok=True)
    args.work.mkdir(parents=True, exist_ok=True)
    lengths = [int(x) for x in args.lengths.split(",")]
    report: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "host": platform.node(),
                    "argv": sys.argv, "versions": versions(), "check": {}, "ttft": {}, "problems": [],
                    "skipped": [], "silent": {}}
    problems = report["problems"]
    servers: list[Server] = []
    port = iter(range(30100, 30200))

    def save():
        (args.out / "sglang_server.json").write_text(json.dumps(report, indent=1, default=str))

    tiny = args.kit / "tinymodel"
    llama8b = model_dir(args.kit, args.work, "llama3-8b-shape", LLAMA_8B)
    tiny_small = ["--mem-fraction-static", "0.9", "--max-total-tokens", "16384", "--hicache-size", "1"]
    ttft_args = lambda tokens, host_gb: ["--mem-fraction-static", "0.9", "--max-total-tokens", str(tokens),
                                         "--hicache-size", str(host_gb), "--context-length", "40960"]
    device_tokens = max(lengths) + 4096
    try:
        check: list[Server] = []
        if args.mode in ("check", "all"):
            first = Server("tiny-kvtier-bf16", tiny, next(port), "kvtier", args.work, tiny_small)
            first.start()
            servers.append(first)
            check.append(first)
            if not first.wait_healthy(budget, 300):
                problems.append("tiny-kvtier-bf16 did not start (see logs)")
                raise SystemExit
            more = [Server("tiny-kvtier-fp8", tiny, next(port), "kvtier", args.work, tiny_small, "fp8_e4m3"),
                    Server("tiny-dynamic-fp8", tiny, next(port), "dynamic", args.work, tiny_small, "fp8_e4m3")]
            if not args.no_mla:
                mla = model_dir(args.kit, args.work, "deepseek-v2-shape", DEEPSEEK_TINY, replace=True)
                more.append(Server("tiny-mla-kvtier-bf16", mla, next(port), "kvtier", args.work,
                                   tiny_small + ["--trust-remote-code"]))
            for s in more:
                s.start()
            servers += more
            check += more
        ttft_servers: dict[str, dict[str, Server]] = {}
        dtypes = args.dtypes.split(",") if args.mode in ("ttft", "all") else []

        def start_ttft(dtype):
            group = {}
            for backend in ("none", "kvtier", "file", "nixl"):
                host_gb = 2 * device_tokens * 128 * 1024 // (1 << 30) + 2 if backend == "none" else 8
                s = Server(f"8b-{backend}-{dtype}", llama8b, next(port), backend, args.work,
                           ttft_args(device_tokens, host_gb), dtype, args.nixl_shim)
                s.start()
                group[backend] = s
                servers.append(s)
            ttft_servers[dtype] = group

        if dtypes:
            start_ttft(dtypes[0])
        for s in check:
            if s is not check[0] and not s.wait_healthy(budget, 240):
                (report["skipped"] if "mla" in s.name else problems).append(f"{s.name} did not start")
                continue
            own: list[str] = []
            try:
                report["check"][s.name] = run_check(s, 3, 60, 3, own)
            except Exception as err:  # a server that fails mid-check is a failed check
                own.append(f"{s.name}: {err!r}")
            report["check"].setdefault(s.name, {})["problems"] = own
            (report["skipped"] if "mla" in s.name and own else problems).extend(own)
            s.stop()
            save()
        for i, dtype in enumerate(dtypes):
            if dtype not in ttft_servers:
                if budget.left() < 200:
                    report["skipped"].append(f"ttft {dtype}: {budget.left():.0f} s left")
                    continue
                start_ttft(dtype)
            group = ttft_servers[dtype]
            results = report["ttft"].setdefault(dtype, {})
            ready = {}
            for backend, s in group.items():
                if s.wait_healthy(budget, 300):
                    s.generate(prompt_ids(99, 2048), 1)  # first-request kernel compiles
                    ready[backend] = s
                else:
                    problems.append(f"{s.name} did not start")
            while args.hold_until is not None and not args.hold_until.exists() and budget.left() > 60:
                time.sleep(1)
            report.setdefault("measured_from_s", {})[dtype] = round(args.budget_s - budget.left(), 1)
            try:
                ttft_group(ready, lengths, args.repeats, device_tokens, budget, results, save)
            except Exception as err:
                problems.append(f"ttft {dtype}: {err!r}")
            for backend, s in group.items():
                if backend not in ("kvtier",):
                    lines = s.kvtier_lines()
                    report["silent"][s.name] = lines[:5]
                    if lines:
                        problems.append(f"{s.name} (backend {backend}) logged kvtier lines: {lines[:2]}")
                s.stop()
                shutil.rmtree(s.store, ignore_errors=True)
            save()
        report["table"] = summarize(report["ttft"])
    except SystemExit:
        pass
    finally:
        for s in servers:
            s.stop()
        report["healthy_after_s"] = {s.name: s.healthy_after for s in servers}
        save()
        with tarfile.open(args.out / "logs.tar.xz", "w:xz") as tar:
            tar.add(args.work / "logs", arcname="logs")
    print_table(report.get("table", {}))
    for name, res in report["check"].items():
        print(name, "rounds:", [(r["prompt"], r["storage"]) for r in res.get("rounds", [])], "metrics:", res.get("metrics"))
    print("skipped:", report["skipped"])
    print("RESULT", "ok" if not problems else "FAIL: " + "; ".join(problems[:6]))
    return 1 if problems else 0


def versions() -> dict:
    out = {"python": platform.python_version()}
    for name in ("torch", "sglang", "sgl_kernel", "triton", "kvtier", "nixl_cu13"):
        try:
            module = __import__(name)
            out[name] = getattr(module, "__version__", "?")
        except Exception as err:  # reported, not fatal: the servers say the rest
            out[name] = f"not importable: {err.__class__.__name__}"
    try:
        out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                                       capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        pass
    return out


if __name__ == "__main__":
    sys.exit(main())
