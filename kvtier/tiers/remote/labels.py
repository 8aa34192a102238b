"""Readable names of a store's namespaces: what model, page format and rank a fingerprint stands for.

The index keys pages by a 16-byte fingerprint of the namespace (a hash of model, page format
and rank), which says nothing to a person. A store opened with a ``namespace_label`` (the pool
passes its model, rank and page format) keeps that label as JSON beside the fingerprint in the
index's ``namespace_labels`` table, so a pool can say which other formats a store holds and
``kvtier store check`` can list namespaces decoded. Owns the label's encoding and its one-line
description. It must never decide anything from a label: keys and fingerprints alone decide
what hits; a label is for people only (a namespace written by an older kvtier has none).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Optional

# The fields a description shows, in this order; any others are kept but not shown.
_FORMAT_ORDER = ("dtype", "device_dtype", "page_size", "num_layers", "num_kv_heads", "head_dim", "scale", "layout", "mla")


def encode(label: Mapping[str, Any]) -> str:
    """The label as the index keeps it: JSON with sorted keys (so one label is one text)."""
    if not isinstance(label, Mapping):
        raise TypeError(f"namespace_label must be a mapping, got {type(label).__name__}")
    try:
        return json.dumps(dict(label), sort_keys=True, separators=(",", ":"))
    except (TypeError, ValueError) as err:
        raise ValueError(f"namespace_label {label!r} is not JSON: {err}") from None


def decode(text: Optional[str]) -> dict[str, Any]:
    """The label a namespace was stored with; {} for none or an unreadable one."""
    if not text:
        return {}
    try:
        label = json.loads(text)
    except ValueError:
        return {}
    return label if isinstance(label, dict) else {}


def describe(label: Mapping[str, Any], fingerprint: bytes) -> str:
    """One line for people: "model llama, rank 0, fp8_e4m3 pages of 16 tokens, 32 layers x 8 kv
    heads x 128, scale per_page_head" (or the fingerprint when there is no label)."""
    if not label:
        return f"namespace {fingerprint.hex()[:12]}… (no label: written before kvtier kept one)"
    fmt = label.get("format", {})
    parts = []
    if "model" in label:
        parts.append(f"model {label['model']}")
    if "rank" in label:
        parts.append(f"rank {label['rank']}")
    if fmt:
        dtype = fmt.get("dtype", "?")
        if fmt.get("device_dtype") not in (None, dtype):
            dtype += f"->{fmt['device_dtype']}"
        parts.append(f"{dtype} pages of {fmt.get('page_size', '?')} tokens")
        kind = "mla latent" if fmt.get("mla") else f"{fmt.get('num_kv_heads', '?')} kv heads"
        parts.append(f"{fmt.get('num_layers', '?')} layers x {kind} x {fmt.get('head_dim', '?')}")
        if fmt.get("scale", "none") != "none":
            parts.append(f"scale {fmt['scale']}")
        if fmt.get("layout", "nhd") != "nhd":
            parts.append(f"layout {fmt['layout']}")
    extra = {k: v for k, v in label.items() if k not in ("model", "rank", "format")}
    parts += [f"{k} {v}" for k, v in sorted(extra.items())]
    return ", ".join(parts)


def size(nbytes: int) -> str:
    """Bytes for people: "16384 bytes", "12.5 MiB", "3.2 GiB"."""
    if nbytes < 2**20:
        return f"{nbytes} bytes"
    return f"{nbytes / 2**20:.1f} MiB" if nbytes < 2**30 else f"{nbytes / 2**30:.1f} GiB"


def format_fields(fmt: Any) -> dict[str, Any]:
    """The fields of a PageFormat (or any dataclass-like object) a label records."""
    return {name: getattr(fmt, name) for name in _FORMAT_ORDER if hasattr(fmt, name)}
