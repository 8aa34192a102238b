"""A decode step of the reference model replayed from CUDA graphs, as serving engines run decode.

Owns capturing `TinyDecoder.decode`'s segments for one batch size and page-table width and
replaying them: one graph for the head (embedding, RoPE, each token's slot), two per layer (up
to the layer's page write; its attention and the rest of the layer) and one for the tail
(finished tails cleared, logits). Between layer i's two graphs the step queues `wait_layer(i)`
eagerly, so pages still landing from a load are waited for on the device exactly as in the
eager step, whose segments these are (same code, same order, same kernels). An eager step
costs the host about 1.5-2 ms a layer of Python and kernel launches (H100 host, 2026-12-06): in
a step whose pages a `load` brings, that host time adds to the load's own, which a serving
engine (whose decode runs from CUDA graphs) does not pay.

The first `step` runs eagerly on the static inputs (compiling the Triton kernels and sizing the
RoPE tables on the way) and then captures; later steps copy their inputs into the static
tensors (device to device, no host wait) and replay. Graphs share one memory pool and are
replayed in the order they were captured. It must never decide which page lives where.
"""

from __future__ import annotations

import torch

from kvtier.decode.model import PagedKV, TinyDecoder


class DecodeGraphs:
    """`TinyDecoder.decode` for `batch` sequences over page tables of `max_pages` columns, from
    CUDA graphs. `tails` is the step's tails tensor (layers, 2, batch, page_size, kv_heads,
    head_dim), the same tensor every step. The logits `step` returns are a static tensor,
    overwritten by the next step."""

    def __init__(self, model: TinyDecoder, kv: PagedKV, tails: torch.Tensor, batch: int, max_pages: int) -> None:
        if model.device.type != "cuda" or kv.device.type != "cuda":
            raise RuntimeError(f"DecodeGraphs needs the model and its pages on a CUDA device, got {model.device} and {kv.device}")
        c, fmt = model.config, kv.fmt
        want = (c.layers, 2, batch, fmt.page_size, c.kv_heads, c.head_dim)
        if tuple(tails.shape) != want or not tails.is_cuda:
            raise ValueError(f"tails must be {want} on the model's CUDA device, got {tuple(tails.shape)} on {tails.device}")
        if batch < 1 or max_pages < 1:
            raise ValueError(f"batch and max_pages must be >= 1, got {batch} and {max_pages}")
        self.model, self.kv, self.tails = model, kv, tails
        self.batch, self.max_pages = batch, max_pages
        device = model.device
        self.tokens = torch.zeros(batch, dtype=torch.int64, device=device)
        self.positions = torch.zeros(batch, dtype=torch.int64, device=device)
        self.page_table = torch.zeros((batch, max_pages), dtype=torch.int32, device=device)
        self._graphs: list[torch.cuda.CUDAGraph] | None = None
        self._logits: torch.Tensor | None = None

    @property
    def captured(self) -> bool:
        return self._graphs is not None

    def step(self, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor, wait_layer=None) -> torch.Tensor:
        """One decode step, as `TinyDecoder.decode(kv, tokens, positions, page_table, tails, wait_layer)`."""
        if tokens.shape != (self.batch,) or positions.shape != (self.batch,) or page_table.shape != (self.batch, self.max_pages):
            raise ValueError(
                f"a step of these graphs takes tokens and positions ({self.batch},) and a page table "
                f"({self.batch}, {self.max_pages}); got {tuple(tokens.shape)}, {tuple(positions.shape)}, {tuple(page_table.shape)}"
            )
        self.tokens.copy_(tokens, non_blocking=True)
        self.positions.copy_(positions, non_blocking=True)
        self.page_table.copy_(page_table, non_blocking=True)
        if self._graphs is None:
            logits = self.model.decode(self.kv, self.tokens, self.positions, self.page_table, self.tails, wait_layer)
            self._capture()
            return logits
        graphs = self._graphs
        graphs[0].replay()
        for i in range(len(self.model.layers)):
            graphs[1 + 2 * i].replay()
            if wait_layer is not None:
                wait_layer(i)
            graphs[2 + 2 * i].replay()
        graphs[-1].replay()
        return self._logits

    def _capture(self) -> None:
        model, kv, tails = self.model, self.kv, self.tails
        torch.cuda.synchronize(model.device)
        pool = torch.cuda.graph_pool_handle()
        graphs = []

        def capture(fn):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                out = fn()
            graphs.append(graph)
            return out

        # Capturing records the kernels without running them: the pages and tails stay as the
        # eager step left them.
        step = capture(lambda: model.decode_head(kv, self.tokens, self.positions, self.page_table))
        for i in range(len(model.layers)):
            capture(lambda: model.decode_before_attention(step, i, kv, tails))
            capture(lambda: model.decode_attention_on(step, i, kv))
        self._logits = capture(lambda: model.decode_tail(step, kv, tails))
        self._step = step  # the tensors the graphs read and write between segments stay alive
        self._graphs = graphs
