"""Page keys: chained prefix hashes inside a namespace.

Owns how a key is derived from token ids: key_i = sha256(key_{i-1} || tokens of page i),
with key_{-1} = the namespace digest, so every key already depends on the model, the page
format fingerprint and the rank. The per-page token bytes are the ids as little-endian
uint32, as SGLang hashes them; keys are hex strings as SGLang's HiCache passes them.
It must never look at tiers or page contents.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Namespace:
    """Where a page's bytes are valid: one model, one page format, one rank."""

    model: str
    fingerprint: str
    rank: int = 0

    def __post_init__(self) -> None:
        if not self.model:
            raise ValueError("Namespace.model must be a non-empty model id, got ''")
        if len(self.fingerprint) != 64:
            raise ValueError(
                f"Namespace.fingerprint must be a 64-char sha256 hex digest (PageFormat.fingerprint), got {self.fingerprint!r}"
            )
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank < 0:
            raise ValueError(f"Namespace.rank must be an int >= 0, got {self.rank!r}")

    @property
    def digest(self) -> str:
        text = f"kvtier-ns|model={self.model}|format={self.fingerprint}|rank={self.rank}"
        return hashlib.sha256(text.encode()).hexdigest()


def prefix_keys(token_ids, page_size: int, namespace: Namespace, prior: str | None = None) -> list[str]:
    """Keys of the full pages of `token_ids`; a trailing partial page gets no key.

    `prior` continues a chain: the key of the page just before `token_ids[0]`.
    """
    if page_size <= 0:
        raise ValueError(f"page_size must be > 0, got {page_size}")
    tokens = np.asarray(token_ids, dtype=np.int64)
    if tokens.ndim != 1:
        raise ValueError(f"token_ids must be 1-D, got shape {tokens.shape}")
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2**32):
        raise ValueError(f"token ids must lie in [0, 2**32), got range [{tokens.min()}, {tokens.max()}]")
    data = tokens.astype("<u4").tobytes()
    step = page_size * 4
    prev = bytes.fromhex(prior if prior is not None else namespace.digest)
    keys = []
    for start in range(0, (len(tokens) // page_size) * step, step):
        prev = hashlib.sha256(prev + data[start : start + step]).digest()
        keys.append(prev.hex())
    return keys
