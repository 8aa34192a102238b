"""Where a stored page is valid: the namespace of one SGLang host pool on one rank.

Owns the namespace of a pool (a sha256 hex digest of everything that decides what a page's bytes
mean) and the KV formats the model runners of this process recorded (KV dtype and a fingerprint
of their per-layer k/v scales). The namespace is the ``namespace`` of kvtier's ``RemoteStore``,
so a page written under one namespace never hits in another. It must never import SGLang at
module level or read page bytes.

What goes in, and why (sglang 0.5.23, paths under ``sglang/srt/``):
- model name (``HiCacheStorageConfig.model_name``; already tagged with the pool's own storage
  format by ``managers/cache_controller.py:54``) and an optional deployment tag;
- the KV dtype as the model runner resolved it: SGLang keeps fp8 KV as ``uint8`` in its pools
  (``mem_cache/memory_pool.py``, ``store_dtype``), so the pool's dtype cannot tell e4m3 from
  e5m2; SGLang's own backends leave the dtype out of their keys (sglang #33268);
- for fp8, a fingerprint of the per-layer ``k_scale`` / ``v_scale`` SGLang keeps on its attention
  layers, outside the pages (``layers/radix_attention.py:94``, set by
  ``layers/quantization/kv_cache.py:82``): a page quantized under other scales must never hit;
- host layout, page size (physical and logical), layer count and stage range, the pool's head
  geometry (MHA: heads, head dim, V head dim; MLA: ``kv_lora_rank``, ``qk_rope_head_dim``, row
  width), its class and the byte sizes of a page's pieces (``get_page_buffer_meta``);
- ranks: tp rank and size only for rank-sharded pools (MHA; MLA KV is replicated across TP,
  ``HiCacheStorageConfig.is_mla_model``), pp rank and size, attention-CP and DCP rank and size.

Model runners record their KV format through ``record_kv_format`` (the plugin hooks
``ModelRunner.configure_kv_cache_dtype``, which runs after the weights and their scales are
loaded, ``model_executor/model_runner.py:715,735``). The target runner records role ``target``,
a speculative draft runner role ``draft``.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass
from typing import Any, Optional

import torch

NAMESPACE_SCHEME = "kvtier-sglang-1"
ROLES = ("target", "draft")


@dataclass(frozen=True)
class KvFormat:
    """The KV cache format one model runner resolved: its dtype, and for fp8 a fingerprint of the
    per-layer k/v scales (``None`` for wider dtypes, whose pages carry no scale)."""

    kv_dtype: str
    scales: Optional[str]
    attention_layers: int


_recorded: dict[str, KvFormat] = {}
_recorded_lock = threading.Lock()


def is_fp8(dtype: torch.dtype) -> bool:
    return dtype.is_floating_point and dtype.itemsize == 1


def _scale_values(module: torch.nn.Module, which: str) -> list[float]:
    """The scale a layer applies to K (``which="k"``) or V: the float SGLang computed after
    loading if set, else the parameter's values, else 1.0 (what attention uses without one)."""
    value = getattr(module, f"{which}_scale_float", None)
    if value is not None:
        return [float(value)]
    tensor = getattr(module, f"{which}_scale", None)
    if tensor is None:
        return [1.0]
    if isinstance(tensor, torch.Tensor):
        return [float(v) for v in tensor.detach().to("cpu", torch.float64).flatten().tolist()]
    return [float(tensor)]


def kv_scale_fingerprint(model: torch.nn.Module) -> tuple[str, int]:
    """(sha256 hex, number of attention layers) over every attention layer's k/v scales.

    An attention layer is a module with ``layer_id`` and ``k_scale_float`` (SGLang's
    ``RadixAttention``); layers are taken in (layer_id, module name) order, and values are
    hashed exactly (``float.hex``), so any change of any scale changes the fingerprint."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    layers = []
    for name, module in model.named_modules():
        if hasattr(module, "layer_id") and hasattr(module, "k_scale_float"):
            layers.append((int(module.layer_id), name, _scale_values(module, "k"), _scale_values(module, "v")))
    layers.sort(key=lambda item: (item[0], item[1]))
    digest = hashlib.sha256()
    for layer_id, name, k, v in layers:
        digest.update(
            f"{layer_id}|{name}|{','.join(x.hex() for x in k)}|{','.join(x.hex() for x in v)}\n".encode()
        )
    return digest.hexdigest(), len(layers)


def record_kv_format(role: str, model: torch.nn.Module, kv_dtype: torch.dtype) -> KvFormat:
    """Remember the KV format of this process's ``role`` model runner (``target`` or ``draft``)."""
    if role not in ROLES:
        raise ValueError(f"role {role!r}; expected one of {ROLES}")
    if not isinstance(kv_dtype, torch.dtype):
        raise TypeError(f"kv_dtype must be a torch.dtype, got {type(kv_dtype).__name__} {kv_dtype!r}")
    scales, layers = kv_scale_fingerprint(model)
    fmt = KvFormat(kv_dtype=str(kv_dtype), scales=scales if is_fp8(kv_dtype) else None, attention_layers=layers)
    with _recorded_lock:
        _recorded[role] = fmt
    return fmt


def recorded_kv_format(role: str) -> Optional[KvFormat]:
    """What ``record_kv_format`` last stored for ``role`` in this process, if anything."""
    with _recorded_lock:
        return _recorded.get(role)


def resolve_kv_format(role: str, pool_dtype: torch.dtype) -> KvFormat:
    """The KV format of a host pool filled by the ``role`` model runner.

    A pool of a wide float dtype needs no record (its dtype is the KV dtype and its pages carry
    no scale). A pool of bytes (fp8 kept as ``uint8``) needs the runner's record, with at least
    one attention layer's scales; without it this raises, naming the cause, rather than risk
    serving pages quantized under other scales."""
    fmt = recorded_kv_format(role)
    if fmt is not None:
        itemsize = getattr(torch, fmt.kv_dtype.removeprefix("torch.")).itemsize
        if itemsize != pool_dtype.itemsize:
            raise ValueError(
                f"the {role} model runner recorded KV dtype {fmt.kv_dtype} ({itemsize} bytes) but "
                f"the host pool stores {pool_dtype} ({pool_dtype.itemsize} bytes): the pool was not "
                "filled by that runner"
            )
        if fmt.scales is not None and fmt.attention_layers == 0:
            raise ValueError(
                f"the {role} model runner has an fp8 KV cache ({fmt.kv_dtype}) but kvtier found no "
                "attention layer with k/v scales in its model (modules with layer_id and "
                "k_scale_float); kvtier cannot tell pages quantized under other scales apart"
            )
        return fmt
    if pool_dtype.is_floating_point and pool_dtype.itemsize > 1:
        return KvFormat(kv_dtype=str(pool_dtype), scales=None, attention_layers=0)
    raise ValueError(
        f"the host pool stores {pool_dtype} (an fp8 KV cache) but no {role} model runner of this "
        "process recorded its KV dtype and k/v scales; kvtier's sglang plugin records them "
        "(entry point 'kvtier' of group sglang.srt.plugins): check that kvtier is installed in "
        "this environment and not left out of SGLANG_PLUGINS"
    )


def pool_geometry(pool: Any) -> dict:
    """The head geometry of an SGLang host pool (MHA or MLA)."""
    if hasattr(pool, "kv_lora_rank"):
        return {
            "kind": "mla",
            "kv_lora_rank": int(pool.kv_lora_rank),
            "qk_rope_head_dim": int(pool.qk_rope_head_dim),
            "kv_cache_dim": int(pool.kv_cache_dim),
        }
    if hasattr(pool, "head_num") and hasattr(pool, "head_dim"):
        return {
            "kind": "mha",
            "head_num": int(pool.head_num),
            "head_dim": int(pool.head_dim),
            "v_head_dim": int(getattr(pool, "v_head_dim", pool.head_dim)),
        }
    raise ValueError(
        f"host pool {type(pool).__name__} has neither MLA (kv_lora_rank) nor MHA (head_num, head_dim) "
        "geometry; kvtier stores MHA and MLA host pools"
    )


def pool_namespace(
    *,
    pool: Any,
    pool_name: str,
    storage_config: Any,
    kv_format: KvFormat,
    replicated: bool,
    piece_sizes: tuple[int, ...],
    tag: Optional[str] = None,
) -> tuple[str, dict]:
    """(hex digest, the described fields) of the namespace of ``pool`` on this rank.

    ``replicated`` pools (MLA KV) hold the same bytes on every TP rank, so their namespace leaves
    the tp rank out and TP ranks share pages; sharded pools (MHA) keep the tp rank and size."""
    cfg = storage_config
    fields = {
        "scheme": NAMESPACE_SCHEME,
        "pool": str(pool_name),
        "model": cfg.model_name or "",
        "tag": tag,
        "kv_dtype": kv_format.kv_dtype,
        "kv_scales": kv_format.scales,
        "store_dtype": str(pool.dtype),
        "pool_class": type(pool).__name__,
        "layout": pool.layout,
        "page_size": int(pool.page_size),
        "logical_page_size": int(getattr(pool, "logical_page_size", pool.page_size)),
        "layers": int(pool.layer_num),
        "stage_layers": [getattr(pool, "start_layer", None), getattr(pool, "end_layer", None)],
        "geometry": pool_geometry(pool),
        "piece_bytes": list(piece_sizes),
        "tp": None if replicated else [int(cfg.tp_rank), int(cfg.tp_size)],
        "pp": [int(cfg.pp_rank), int(cfg.pp_size)],
        "attn_cp": [int(cfg.attn_cp_rank), int(cfg.attn_cp_size)],
        "dcp": [int(getattr(cfg, "dcp_rank", 0)), int(getattr(cfg, "dcp_size", 1))],
    }
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(text.encode()).hexdigest(), fields
