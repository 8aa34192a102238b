"""The reference paged decoder on kvtier: a Triton decode attention kernel, a small transformer
whose KV lives in a TieredPool over tensors it allocates itself, and the generation loop.

Importing this package on a machine without CUDA switches Triton to its interpreter (see
`kvtier.decode.attention`). It must never be imported by the pool, the tiers or the transfer
engines: it is a consumer of the library, not part of it.
"""

from kvtier.decode.attention import paged_decode_attention, reference_decode_attention

__all__ = ["paged_decode_attention", "reference_decode_attention"]
