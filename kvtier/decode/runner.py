"""The generation loop: greedy decoding with the model's KV in a TieredPool over the model's own tensors.

Owns the life of a request the way a serving engine runs it: match the prompt's page keys,
load the hit pages (device hits stay where they are, host and remote hits are copied in and
waited for layer by layer, just before attention reads them), allocate pages for the rest,
prefill, commit the full prompt pages (the write policy then pushes them down), decode in
batches with the Triton kernel, commit the full generated pages, release. It also keeps the
books: tokens/s, hits per tier, bytes moved, and where the time went.
It must never touch page bytes outside the model's own writes and never reach into the
pool's internals: everything goes through TieredPool's public calls.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from kvtier import MatchResult, TieredPool, prefix_keys
from kvtier.decode.model import PagedKV, TinyDecoder


@dataclass(frozen=True)
class Request:
    """A prompt (token ids) and how many tokens to generate after it (>= 1)."""

    prompt: tuple[int, ...]
    max_new_tokens: int

    def __post_init__(self) -> None:
        if len(self.prompt) < 1:
            raise ValueError("Request.prompt must hold at least one token, got an empty prompt")
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise ValueError(f"Request.max_new_tokens must be an int >= 1, got {self.max_new_tokens!r}")


@dataclass
class Completion:
    """What one request produced: its tokens, the prompt's hits, its time to first token (from
    the match to the first token on the host) and, when kept, each token's logits."""

    request: Request
    tokens: list[int]
    hit: MatchResult
    ttft_s: float
    logits: list[torch.Tensor] = field(default_factory=list)


@dataclass
class RunStats:
    """Totals of one `DecodeRunner.run`.

    pool_s: host time inside pool calls (on the CPU twin the copies run inside them).
    stall_s: device time the compute stream stood at `wait_layer` (CUDA only).
    compute_s: the rest of the wall time, the model's work.
    """

    requests: int = 0
    prompt_tokens: int = 0
    prefill_tokens: int = 0
    generated_tokens: int = 0
    wall_s: float = 0.0
    pool_s: float = 0.0
    stall_s: float = 0.0

    @property
    def compute_s(self) -> float:
        return self.wall_s - self.pool_s

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.wall_s if self.wall_s else 0.0


class _Sequence:
    def __init__(self, request: Request, slots: list[int], hit: MatchResult, tail: torch.Tensor) -> None:
        self.request = request
        self.tokens = list(request.prompt)
        self.slots = slots
        self.hit = hit
        self.tail = tail
        self.committed = 0  # leading pages committed (hits count as committed)
        self.ttft_s = 0.0
        self.logits: list[torch.Tensor] = []

    @property
    def done(self) -> bool:
        return len(self.tokens) - len(self.request.prompt) >= self.request.max_new_tokens


class DecodeRunner:
    """Runs requests through `model` with its KV in `kv` (the tensors `pool` manages)."""

    def __init__(self, model: TinyDecoder, kv: PagedKV, pool: TieredPool, keep_logits: bool = False) -> None:
        if pool.fmt != kv.fmt:
            raise ValueError(f"pool format {pool.fmt.describe()} differs from the KV cache's {kv.fmt.describe()}")
        if pool.device_tier.plane(0, 0).data_ptr() != kv.k[0].data_ptr():
            raise ValueError("the pool must manage the model's own KV tensors: build it with **kv.pool_args()")
        self.model = model
        self.kv = kv
        self.pool = pool
        self.keep_logits = keep_logits
        self.page_size = kv.fmt.page_size
        self.stats = RunStats()
        self._cuda = kv.device.type == "cuda"
        self._stall_events: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    def run(self, requests: list[Request], batch_size: int, progress=None) -> list[Completion]:
        """Serve `requests` in waves of `batch_size` (prefill each, then decode the wave together).

        progress, when given, is called after every wave with (requests done, requests, stats).
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        started = time.perf_counter()
        out: list[Completion] = []
        for first in range(0, len(requests), batch_size):
            wave: list[_Sequence] = []
            try:
                for request in requests[first : first + batch_size]:
                    wave.append(self._prefill(request))
                self._decode(wave)
                while wave:
                    seq = wave[0]
                    self._commit(seq, (len(seq.tokens) - 1) // self.page_size)
                    wave.pop(0)
                    self._pool_call(self.pool.release, seq.slots)
                    out.append(
                        Completion(seq.request, seq.tokens[len(seq.request.prompt) :], seq.hit, seq.ttft_s, seq.logits)
                    )
            except BaseException:
                # Pages the wave still holds go back to the pool: a failed wave must not shrink it.
                for seq in wave:
                    self.pool.release(seq.slots)
                raise
            if self._cuda:
                torch.cuda.synchronize(self.kv.device)
            self.stats.wall_s = time.perf_counter() - started
            self._collect_stalls()
            if progress is not None:
                progress(len(out), len(requests), self.stats)
        return out

    # --- one request -------------------------------------------------------------------------
    def _pool_call(self, fn, *args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.stats.pool_s += time.perf_counter() - t0

    def _keys(self, tokens) -> list[bytes]:
        return prefix_keys(torch.as_tensor(tokens, dtype=torch.int64).numpy(), self.page_size, self.pool.namespace)

    def _prefill(self, request: Request) -> _Sequence:
        page, pool, model = self.page_size, self.pool, self.model
        started = time.perf_counter()
        prompt = list(request.prompt)
        # The last prompt token is always computed: its logits give the first new token.
        wanted = self._keys(prompt[:-1])
        hit = self._pool_call(pool.match, wanted)
        handle = self._pool_call(pool.load, wanted[: hit.total])
        total_pages = -(-(len(prompt) + request.max_new_tokens - 1) // page)
        try:
            fresh = self._pool_call(pool.allocate, total_pages - hit.total)
        except BaseException:
            self._pool_call(pool.release, handle.slots)
            raise
        c = model.config
        tail = torch.zeros((c.layers, 2, page, c.kv_heads, c.head_dim), dtype=torch.bfloat16, device=self.kv.device)
        seq = _Sequence(request, handle.slots + fresh, hit, tail)
        seq.committed = hit.total
        start = hit.total * page
        try:
            slots = torch.as_tensor(seq.slots, dtype=torch.int64, device=self.kv.device)
            tokens = torch.as_tensor(prompt[start:], dtype=torch.int64, device=self.kv.device)
            logits = model.prefill(self.kv, tokens, start, slots, tail, wait_layer=self._waiter(handle))
            self._take(seq, int(logits.argmax()), logits)
            seq.ttft_s = time.perf_counter() - started
            self._commit(seq, len(prompt) // page)
        except BaseException:
            self._pool_call(pool.release, seq.slots)
            raise
        self.stats.requests += 1
        self.stats.prompt_tokens += len(prompt)
        self.stats.prefill_tokens += len(prompt) - start
        return seq

    def _waiter(self, handle):
        if not self._cuda:
            return handle.wait_layer

        def wait_layer(layer: int) -> None:
            before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            before.record()
            handle.wait_layer(layer)
            after.record()
            self._stall_events.append((before, after))

        return wait_layer

    def _collect_stalls(self) -> None:
        for before, after in self._stall_events:
            self.stats.stall_s += before.elapsed_time(after) / 1e3
        self._stall_events.clear()

    def _take(self, seq: _Sequence, token: int, logits: torch.Tensor) -> None:
        seq.tokens.append(token)
        if self.keep_logits:
            seq.logits.append(logits.cpu())
        self.stats.generated_tokens += 1

    def _commit(self, seq: _Sequence, full_pages: int) -> None:
        """Commit the sequence's full pages past those already committed.

        After decoding, the newest token has no KV yet: pages are full up to the token before it.
        """
        if full_pages <= seq.committed:
            return
        keys = self._keys(seq.tokens[: full_pages * self.page_size])
        self._pool_call(self.pool.commit, keys[seq.committed :], seq.slots[seq.committed : full_pages])
        seq.committed = full_pages

    # --- a wave of requests ----------------------------------------------------------------------
    def _decode(self, wave: list[_Sequence]) -> None:
        device = self.kv.device
        tails = torch.stack([seq.tail for seq in wave], dim=2)
        while True:
            active = [i for i, seq in enumerate(wave) if not seq.done]
            if not active:
                return
            seqs = [wave[i] for i in active]
            n = len(seqs)
            max_pages = max(len(seq.slots) for seq in seqs)
            # The step's integers (tokens, positions, rows of the wave, page table) go to the
            # device in one copy from pinned memory, which never waits for the device: a copy
            # from pageable memory would wait for every kernel queued before it.
            # Built in numpy, a row of the page table at a time: a Python list of the whole
            # table costs about five times as much at 8 x 512 pages.
            host = np.full(3 * n + n * max_pages, -1, dtype=np.int64)
            host[: 3 * n] = [seq.tokens[-1] for seq in seqs] + [len(seq.tokens) - 1 for seq in seqs] + active
            rows = host[3 * n :].reshape(n, max_pages)
            for row, seq in enumerate(seqs):
                rows[row, : len(seq.slots)] = seq.slots
            ints = torch.from_numpy(host)
            if self._cuda:
                ints = ints.pin_memory()
            ints = ints.to(device, non_blocking=True)
            tokens, positions, index = ints[:n], ints[n : 2 * n], ints[2 * n : 3 * n]
            table = ints[3 * n :].view(n, max_pages).to(torch.int32)
            sub = tails.index_select(2, index)
            logits = self.model.decode(self.kv, tokens, positions, table, sub)
            tails.index_copy_(2, index, sub)
            for row, (seq, token) in enumerate(zip(seqs, logits.argmax(-1).tolist())):
                self._take(seq, token, logits[row])


def shared_prefix_workload(
    num_requests: int,
    system_prompts: int,
    system_tokens: int,
    user_tokens: int,
    max_new_tokens: int,
    vocab: int,
    seed: int = 0,
    skew: float = 0.0,
) -> list[Request]:
    """Requests that reuse a few long system prompts, each with its own user turn.

    skew=0 takes the system prompts round robin; skew > 0 draws them with Zipf weights
    1 / rank**skew, so a few prompts are hot and the rest come back rarely.
    """
    if skew < 0:
        raise ValueError(f"skew must be >= 0, got {skew!r}")
    gen = torch.Generator().manual_seed(seed)
    systems = [torch.randint(vocab, (system_tokens,), generator=gen).tolist() for _ in range(system_prompts)]
    if skew:
        weights = torch.arange(1, system_prompts + 1, dtype=torch.float64) ** -skew
        order = torch.multinomial(weights, num_requests, replacement=True, generator=gen).tolist()
    else:
        order = [i % system_prompts for i in range(num_requests)]
    requests = []
    for app in order:
        user = torch.randint(vocab, (user_tokens,), generator=gen).tolist()
        requests.append(Request(tuple(systems[app] + user), max_new_tokens))
    return requests
