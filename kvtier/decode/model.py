"""A small decoder-only transformer and the paged KV cache it owns.

Owns the model (random weights from a fixed seed, no downloads: embeddings, RMSNorm, RoPE,
GQA attention, SwiGLU MLP, an LM head) and `PagedKV`, the engine side of the KV cache: the
per-layer K and V page tensors the model allocates itself (as sglang's `k_buffer` /
`v_buffer` lists), the scales beside them when the device keeps fp8, and the code that writes
tokens into pages and reads pages back for attention. Prefill attention runs in torch over the
pages' values; decode attention, and a short turn after cached pages (up to EXTEND_MAX_TOKENS
new tokens, each a row of its own length), is the Triton kernel reading the pages in place.
It must never decide which page lives where: slots, keys and tiers are the pool's, and the
generation loop (kvtier.decode.runner) brings the two together.

How pages are written, and why: a page's fp8 scale covers all of its tokens (per_page_head,
per_tensor), but decode fills a page one token at a time. The cache therefore keeps the
exact bf16 values of each sequence's partly filled last page (its "tail") and re-quantizes the
whole page from them on every write, so a page that fills up is quantized once from exact
values, the same bytes whichever way it was filled. With device_dtype="bf16" (the reload hook
upcasts fp8 records) the device page holds the dequantized values of that quantization: the
pool's quantize-on-offload then reproduces the same fp8 bytes and scales, so a page that went
to the host and came back is bit-identical to one that never left.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvtier.decode.attention import paged_decode_attention
from kvtier.format import PageFormat, dequantize, quantize
from kvtier.format.page_format import FP8_DTYPES

# A prefill after cached pages of at most this many new tokens runs the paged decode kernel, one
# row per new token: it reads the prefix once per new token, in place, where the torch path
# gathers and widens the whole prefix to bf16 once per layer.
EXTEND_MAX_TOKENS = 64
POISON = 0xFF  # NaN in bf16, fp16 and both fp8 dtypes: a page nothing wrote stays NaN


@dataclass(frozen=True)
class DecoderConfig:
    """Shape of the model; the weights are drawn from `seed`."""

    vocab: int = 512
    hidden: int = 256
    layers: int = 4
    q_heads: int = 8
    kv_heads: int = 2
    head_dim: int = 64
    ffn: int = 512
    rope_theta: float = 10000.0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("vocab", "hidden", "layers", "q_heads", "kv_heads", "head_dim", "ffn", "seed"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < (0 if name == "seed" else 1):
                raise ValueError(f"DecoderConfig.{name} must be a positive int, got {value!r}")
        if self.q_heads % self.kv_heads:
            raise ValueError(f"DecoderConfig.q_heads={self.q_heads} must be a multiple of kv_heads={self.kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"DecoderConfig.head_dim must be even for RoPE, got {self.head_dim}")

    def page_format(self, page_size: int, dtype: str = "fp8_e4m3", scale: str = "per_page_head",
                    layout: str = "nhd", device_dtype: str | None = None) -> PageFormat:
        """The PageFormat of this model's KV pages."""
        return PageFormat(
            num_layers=self.layers, num_kv_heads=self.kv_heads, head_dim=self.head_dim, page_size=page_size,
            dtype=dtype, scale=scale if dtype in FP8_DTYPES else "none", layout=layout, device_dtype=device_dtype,
        )


class PagedKV:
    """The model's KV cache: per-layer (num_pages, *plane_shape) K and V tensors in the format's device dtype."""

    def __init__(self, fmt: PageFormat, num_pages: int, device: str | torch.device) -> None:
        if fmt.mla:
            raise ValueError("PagedKV holds K and V planes; an MLA format (mla=True) has one latent plane")
        if fmt.device_dtype not in ("bf16", *FP8_DTYPES):
            raise ValueError(f"PagedKV needs bf16 or fp8 device pages, got device_dtype={fmt.device_dtype!r}")
        if isinstance(num_pages, bool) or not isinstance(num_pages, int) or num_pages <= 0:
            raise ValueError(f"PagedKV num_pages must be a positive int, got {num_pages!r}")
        self.fmt = fmt
        self.num_pages = num_pages
        self.device = torch.device(device)

        def poisoned():
            shape = (num_pages, *fmt.plane_shape[:-1], fmt.head_dim * fmt.device_elem_bytes)
            return torch.full(shape, POISON, dtype=torch.uint8, device=self.device).view(fmt.device_torch_dtype)

        self.k = [poisoned() for _ in range(fmt.num_layers)]
        self.v = [poisoned() for _ in range(fmt.num_layers)]
        self.k_scales = self.v_scales = None
        if fmt.device_has_scales:
            scales = (num_pages, *fmt.scale_shape)
            self.k_scales = [torch.full(scales, math.nan, device=self.device) for _ in range(fmt.num_layers)]
            self.v_scales = [torch.full(scales, math.nan, device=self.device) for _ in range(fmt.num_layers)]

    def pool_args(self) -> dict:
        """The keyword arguments that hand these tensors to a TieredPool."""
        args = {"device_kv": (self.k, self.v)}
        if self.k_scales is not None:
            args["device_scales"] = (self.k_scales, self.v_scales)
        return args

    def write_pages(self, layer: int, slots: torch.Tensor, k_vals: torch.Tensor, v_vals: torch.Tensor) -> None:
        """Store whole pages: k_vals / v_vals (n, page_size, kv_heads, head_dim) bf16 into int64 `slots`."""
        fmt = self.fmt
        k_scales = self.k_scales[layer] if self.k_scales is not None else None
        v_scales = self.v_scales[layer] if self.v_scales is not None else None
        for vals, pages, scales in ((k_vals, self.k[layer], k_scales), (v_vals, self.v[layer], v_scales)):
            if fmt.layout == "hnd":
                vals = vals.transpose(1, 2)
            if fmt.dtype not in FP8_DTYPES:
                pages.index_copy_(0, slots, vals.to(pages.dtype))
                continue
            # No finiteness check (a device sync per call, twice a layer): these are the model's
            # own values, and a NaN or Inf among them reads back as NaN, visible in its outputs.
            q, s = quantize(vals, fmt.dtype, fmt.scale, fmt.layout, check_finite=False)
            if fmt.converts:
                pages.index_copy_(0, slots, dequantize(q, s, fmt.scale, fmt.layout, pages.dtype))
            else:
                pages.view(torch.uint8).index_copy_(0, slots, q.view(torch.uint8))
                scales.index_copy_(0, slots, s)

    def read_tokens(self, layer: int, slots: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) of the first `num_tokens` tokens held in `slots`, each (num_tokens, kv_heads, head_dim) bf16."""
        fmt = self.fmt
        out = []
        for pages, scales in ((self.k[layer], self.k_scales), (self.v[layer], self.v_scales)):
            vals = pages.index_select(0, slots)
            if scales is not None:
                vals = dequantize(vals, scales[layer].index_select(0, slots), fmt.scale, fmt.layout, torch.bfloat16)
            if fmt.layout == "hnd":
                vals = vals.transpose(1, 2)
            out.append(vals.reshape(-1, fmt.num_kv_heads, fmt.head_dim)[:num_tokens])
        return out[0], out[1]

    def attend(self, layer: int, q: torch.Tensor, page_table: torch.Tensor, seq_lens: torch.Tensor) -> torch.Tensor:
        """Decode attention of q (batch, q_heads, head_dim) over the pages in place."""
        scales = {}
        if self.k_scales is not None:
            scales = dict(k_scales=self.k_scales[layer], v_scales=self.v_scales[layer], scale=self.fmt.scale)
        return paged_decode_attention(
            q, self.k[layer], self.v[layer], page_table, seq_lens, layout=self.fmt.layout, **scales
        )


class TinyDecoder:
    """A decoder-only transformer with random weights (drawn from config.seed on `device`); matmuls in bf16."""

    def __init__(self, config: DecoderConfig, device: str | torch.device = "cpu") -> None:
        self.config = c = config
        self.device = torch.device(device)
        # Drawn on the device itself (a large model's weights take seconds to draw on a CPU), so
        # one seed gives one model per device type.
        gen = torch.Generator(device=self.device).manual_seed(c.seed)

        def weight(*shape, std=None):
            std = 1.0 / math.sqrt(shape[-1]) if std is None else std
            return (torch.randn(shape, generator=gen, device=self.device) * std).to(torch.bfloat16)

        def norm():
            return (1.0 + 0.1 * torch.randn(c.hidden, generator=gen, device=self.device)).to(torch.bfloat16)

        self.embed = weight(c.vocab, c.hidden, std=1.0)
        self.layers = []
        for _ in range(c.layers):
            self.layers.append({
                "attn_norm": norm(),
                "qkv": weight((c.q_heads + 2 * c.kv_heads) * c.head_dim, c.hidden),
                "o": weight(c.hidden, c.q_heads * c.head_dim),
                "mlp_norm": norm(),
                "gate_up": weight(2 * c.ffn, c.hidden),
                "down": weight(c.hidden, c.ffn),
            })
        self.final_norm = norm()
        self.lm_head = weight(c.vocab, c.hidden)
        half = c.head_dim // 2
        self._inv_freq = 1.0 / (c.rope_theta ** (torch.arange(half, dtype=torch.float64) / half))
        self._cos = self._sin = torch.empty(0)

    # --- pieces ---------------------------------------------------------------------------
    def _rope_tables(self, positions: torch.Tensor, bound: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of `positions`, every one below `bound` (known on the host, so sizing the
        tables never reads the positions back: no device sync inside a forward pass)."""
        need = bound
        if self._cos.shape[0] < need:
            size = max(need, 2 * self._cos.shape[0], 1024)
            angles = torch.arange(size, dtype=torch.float64)[:, None] * self._inv_freq[None, :]
            self._cos = angles.cos().float().to(self.device)
            self._sin = angles.sin().float().to(self.device)
        return self._cos[positions], self._sin[positions]

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x (tokens, heads, head_dim) rotated by its tokens' positions (halves rotated, NeoX style)."""
        x1, x2 = x.float().chunk(2, dim=-1)
        cos, sin = cos[:, None, :], sin[:, None, :]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(torch.bfloat16)

    @staticmethod
    def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16) * weight

    def _qkv(self, layer: dict, x: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor]):
        c = self.config
        qkv = self._rms_norm(x, layer["attn_norm"]) @ layer["qkv"].T
        q, k, v = qkv.split([c.q_heads * c.head_dim, c.kv_heads * c.head_dim, c.kv_heads * c.head_dim], dim=-1)
        cos, sin = rope
        q = self._rope(q.reshape(-1, c.q_heads, c.head_dim), cos, sin)
        k = self._rope(k.reshape(-1, c.kv_heads, c.head_dim), cos, sin)
        return q, k, v.reshape(-1, c.kv_heads, c.head_dim)

    def _finish_layer(self, layer: dict, x: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        x = x + attn.reshape(x.shape[0], -1) @ layer["o"].T
        gate, up = (self._rms_norm(x, layer["mlp_norm"]) @ layer["gate_up"].T).chunk(2, dim=-1)
        return x + (F.silu(gate) * up) @ layer["down"].T

    def logits(self, x: torch.Tensor) -> torch.Tensor:
        """float32 logits of hidden states x (tokens, hidden)."""
        return (self._rms_norm(x, self.final_norm) @ self.lm_head.T).float()

    # --- forward passes -------------------------------------------------------------------
    def prefill(self, kv: PagedKV, tokens: torch.Tensor, start: int, slots: torch.Tensor, tail: torch.Tensor,
                wait_layer=None) -> torch.Tensor:
        """Run `tokens` (the prompt from position `start`, a page boundary) through the model.

        `slots` (int64) are the sequence's pages from its first; pages before `start` already
        hold the prefix, and `wait_layer(i)`, when given, is called before layer i reads them.
        The new tokens' KV is written into pages from `start // page_size` on, and their last
        partial page's exact values into `tail` (layers, 2, page_size, kv_heads, head_dim).
        Returns the float32 logits of the last token.
        """
        c, fmt = self.config, kv.fmt
        page = fmt.page_size
        if start % page:
            raise ValueError(f"prefill must start on a page boundary (page_size {page}), got start={start}")
        n = tokens.shape[0]
        end = start + n
        pages = -(-n // page)
        new_slots = slots[start // page : start // page + pages]
        positions = torch.arange(start, end, device=self.device)
        mask = extend = None
        if start and n <= EXTEND_MAX_TOKENS:
            # A short turn after cached pages: each new token is one row of the paged decode
            # kernel over the pages in place (the sequence's page table, its own length), as an
            # engine's extend kernel reads them, instead of gathering and widening the whole prefix.
            table = slots[: start // page + pages].to(torch.int32)[None, :].expand(n, -1).contiguous()
            extend = (table, (positions + 1).to(torch.int32))
        elif start:
            key_pos = torch.arange(end, device=self.device)
            mask = key_pos[None, :] <= positions[:, None]
        x = self.embed[tokens]
        tail.zero_()
        rope = self._rope_tables(positions, end)
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, rope)
            padded = torch.zeros((2, pages * page, c.kv_heads, c.head_dim), dtype=torch.bfloat16, device=self.device)
            padded[0, :n], padded[1, :n] = k, v
            padded = padded.view(2, pages, page, c.kv_heads, c.head_dim)
            kv.write_pages(i, new_slots, padded[0], padded[1])
            if n % page:
                tail[i] = padded[:, -1]
            if wait_layer is not None:
                wait_layer(i)
            if extend is not None:
                x = self._finish_layer(layer, x, kv.attend(i, q, *extend))
                continue
            keys, values = kv.read_tokens(i, slots[: start // page + pages], end)
            # Query heads get their kv head's copy: SDPA's fused kernels (flash for the causal
            # case) take equal head counts, and its fallback would hold a tokens x tokens matrix.
            group = c.q_heads // c.kv_heads
            keys, values = keys.repeat_interleave(group, dim=1), values.repeat_interleave(group, dim=1)
            attn = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys.transpose(0, 1)[None], values.transpose(0, 1)[None],
                attn_mask=mask, is_causal=mask is None,
            )[0].transpose(0, 1)
            x = self._finish_layer(layer, x, attn)
        return self.logits(x[-1:])[0]

    def decode(self, kv: PagedKV, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor,
               tails: torch.Tensor, wait_layer=None) -> torch.Tensor:
        """One token per sequence: tokens / positions (batch,) int64, page_table int32 (batch, max_pages).

        Each token's KV goes into row `position % page_size` of its sequence's `tails`
        (layers, 2, batch, page_size, kv_heads, head_dim), and the page is re-quantized from it;
        a tail whose page filled is zeroed for the next page. `wait_layer(i)`, when given, is
        called before layer i's attention reads the pages (pages still arriving from a load).
        Returns float32 logits (batch, vocab). The step reads nothing back from the device, so
        its host thread only queues work (kvtier.decode.graphs captures the same segments).
        """
        step = self.decode_head(kv, tokens, positions, page_table)
        for i in range(len(self.layers)):
            self.decode_before_attention(step, i, kv, tails)
            if wait_layer is not None:
                wait_layer(i)
            self.decode_attention_on(step, i, kv)
        return self.decode_tail(step, kv, tails)

    # The segments of `decode`, in order: the head, then per layer the part up to its page write
    # and the part from its attention on, then the tail. `step` carries the tensors between them.
    def decode_head(self, kv: PagedKV, tokens: torch.Tensor, positions: torch.Tensor, page_table: torch.Tensor) -> dict:
        page = kv.fmt.page_size
        batch = tokens.shape[0]
        rows = positions % page
        return {
            "rows": rows,
            "slots": page_table.gather(1, (positions // page)[:, None].to(page_table.dtype)).squeeze(1).long(),
            "seq_lens": (positions + 1).to(torch.int32),
            "index": torch.arange(batch, device=self.device),
            "x": self.embed[tokens],
            # Positions lie below the page table's reach: the rope tables are sized from that.
            "rope": self._rope_tables(positions, page_table.shape[1] * page),
            "page_table": page_table,
        }

    def decode_before_attention(self, step: dict, i: int, kv: PagedKV, tails: torch.Tensor) -> None:
        q, k, v = self._qkv(self.layers[i], step["x"], step["rope"])
        tails[i, 0, step["index"], step["rows"]] = k
        tails[i, 1, step["index"], step["rows"]] = v
        kv.write_pages(i, step["slots"], tails[i, 0], tails[i, 1])
        step["q"] = q

    def decode_attention_on(self, step: dict, i: int, kv: PagedKV) -> None:
        attn = kv.attend(i, step.pop("q"), step["page_table"], step["seq_lens"])
        step["x"] = self._finish_layer(self.layers[i], step["x"], attn)

    def decode_tail(self, step: dict, kv: PagedKV, tails: torch.Tensor) -> torch.Tensor:
        # A page that just filled is done; its sequence's next token starts a fresh tail (a
        # masked fill: indexing by a boolean mask would read the mask back to the host).
        filled = (step["rows"] == kv.fmt.page_size - 1).view(1, 1, -1, 1, 1, 1)
        tails.masked_fill_(filled, 0)
        return self.logits(step["x"])
