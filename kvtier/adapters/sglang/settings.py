"""The keys of ``--hicache-storage-backend-extra-config`` that the kvtier backend reads.

Owns turning that dictionary into ``BackendSettings``. It speaks ``kvtier.config``'s vocabulary
and lets ``kvtier.config`` read and check it (one vocabulary, one reader): ``remote`` (the store
directory), ``remote_capacity_bytes`` (``"500GiB"``), any RemoteStore option as
``remote_<option>`` (``remote_timeout_s``, ``remote_backend``, ``remote_backend_params``, ...),
``cluster`` and ``cluster_<setting>`` (the cluster tier on Mooncake Store behind the store),
``config`` (a kvtier TOML / YAML / JSON file, read first; inline keys override it, and
``KVTIER_*`` variables override the file as they do for ``kvtier.config``), and
``namespace_tag``. The pool keys of such a file (``device``, ``host_bytes``, ``format``,
``write_policy``, ...) are checked and then left to SGLang, whose own flags decide its device and
host tiers; they are named once in the log. The keys of earlier releases keep working: ``path``
(= ``remote``), ``capacity_gb`` (GiB, = ``remote_capacity_bytes``), ``nixl_backend``,
``nixl_backend_params``, ``timeout_s`` (= ``remote_backend``, ``remote_backend_params``,
``remote_timeout_s``); giving one beside its new name with another value is an error.

It runs twice: in the launcher, when the plugin rewrites ``--hicache-storage-backend kvtier``
(so a bad key stops the server before any process starts), and in each scheduler when SGLang
constructs the backend. It must never open the store or touch SGLang's pools; an unknown key or
a wrong value raises ``ValueError`` naming the key, the closest valid keys and what was expected.

Keys SGLang itself leaves in the dictionary when it reaches a ``dynamic`` backend (sglang
0.5.23, paths under ``sglang/srt/``): ``backend_name``, ``module_path``, ``class_name``
(``mem_cache/storage/backend_factory.py:142``), ``interface_v1``
(``managers/cache_controller.py:664``) and ``allocator`` (``mem_cache/pool_host/common.py:131``).
``tp_lcm_size`` and the prefetch keys are popped before the backend sees the dictionary
(``managers/cache_controller.py:777``, ``mem_cache/hybrid_cache/hybrid_cache_controller.py:404``).
"""

from __future__ import annotations

import difflib
import math
import os
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

from kvtier.config import ConfigError, pool_options, store_kwargs, store_options

SGLANG_KEYS = frozenset({"backend_name", "module_path", "class_name", "interface_v1", "allocator"})
NIXL_BACKENDS = ("POSIX", "GDS", "GDS_MT", "OBJ")
OWN_KEYS = ("config", "namespace_tag")
# Keys of earlier releases and the kvtier.config key each one stands for.
LEGACY_KEYS = {
    "path": "remote",
    "capacity_gb": "remote_capacity_bytes",
    "nixl_backend": "remote_backend",
    "nixl_backend_params": "remote_backend_params",
    "timeout_s": "remote_timeout_s",
}
FLAG = "--hicache-storage-backend-extra-config"


@dataclass(frozen=True)
class BackendSettings:
    """What the extra config asks of kvtier.

    - ``path``: the store directory (or ``file:///dir``), shared by every process that should
      share pages; required.
    - ``store_kwargs``: RemoteStore keyword arguments (``capacity_bytes``, ``backend``,
      ``backend_params``, ``timeout_s``, ...); what is absent takes RemoteStore's default.
    - ``namespace_tag``: a free string folded into every namespace, for deployments that reuse
      a model name for other weights.
    - ``cluster``: the cluster tier (Mooncake Store) behind each store: ``cluster`` (the
      mooncake_master address) and ``cluster_<setting>`` keys, folded as kvtier.config folds them
      (a mapping of ClusterSettings fields or an address); None for none.
    - ``left_to_sglang``: pool keys the configuration set that SGLang's own flags decide.
    """

    path: str
    store_kwargs: Mapping[str, Any] = field(default_factory=dict)
    namespace_tag: Optional[str] = None
    cluster: Any = None
    left_to_sglang: tuple[str, ...] = ()

    @classmethod
    def from_extra_config(cls, extra: Optional[Mapping[str, Any]]) -> "BackendSettings":
        """Check ``extra`` (SGLang's parsed extra config) and return kvtier's part of it."""
        if extra is None:
            extra = {}
        if not isinstance(extra, Mapping):
            raise ValueError(f"{FLAG} must be a JSON object, got {type(extra).__name__}")
        if not extra.get("interface_v1"):
            raise ValueError(
                f"kvtier needs \"interface_v1\": 1 in {FLAG} (got {extra.get('interface_v1')!r}): without it "
                "SGLang copies every page through its generic path instead of handing kvtier the host pool's memory"
            )
        vocabulary = {**pool_options(), **store_options()}
        inline: dict[str, Any] = {}
        for key, value in extra.items():
            if key in SGLANG_KEYS or key in OWN_KEYS:
                continue
            if key in LEGACY_KEYS:
                new = LEGACY_KEYS[key]
                value = _legacy_value(key, value)
                if value is None:
                    continue
                if new in extra and extra[new] != value:
                    raise ValueError(f"{FLAG}: {key!r}={extra[key]!r} and {new!r}={extra[new]!r} disagree; "
                                     f"give {new!r} alone ({key!r} is its older name)")
                inline[new] = value
            elif key in vocabulary or key == "format":
                inline[key] = value
            else:
                known = sorted(SGLANG_KEYS | set(OWN_KEYS) | set(LEGACY_KEYS) | set(vocabulary) | {"format"})
                near = difflib.get_close_matches(str(key), known, n=3, cutoff=0.6)
                hint = f" (did you mean {' or '.join(repr(n) for n in near)}?)" if near else ""
                raise ValueError(f"unknown key {key!r} in {FLAG} for kvtier{hint}; keys: {known}")
        config = extra.get("config")
        if config is not None and (not isinstance(config, str) or not config):
            raise ValueError(f"{FLAG}: \"config\" must be the path of a kvtier TOML, YAML or JSON file, got {config!r}")
        tag = extra.get("namespace_tag")
        if tag is not None and not isinstance(tag, str):
            raise ValueError(f"{FLAG}: \"namespace_tag\" must be a string or absent, got {tag!r}")
        if "format" in inline:  # a format table given inline is read as a configuration's own
            if config is not None:
                raise ValueError(f"{FLAG}: \"format\" is given inline and in the \"config\" file; give it once")
            config = {"format": inline.pop("format")}
        try:
            store, others = store_kwargs(config, **inline)
        except ConfigError as err:
            raise ValueError(f"{FLAG} for kvtier: {err}") from None
        location = store.pop("remote")
        if location is None or not isinstance(location, (str, os.PathLike)) or not os.fspath(location):
            raise ValueError(
                f"kvtier needs \"remote\" (the store directory; \"path\" in earlier releases) in {FLAG}, "
                f"in its \"config\" file or in KVTIER_REMOTE, got {location!r}"
            )
        if "timeout_s" in store and not store["timeout_s"] > 0:
            raise ValueError(f"{FLAG}: \"remote_timeout_s\" must be > 0 seconds, got {store['timeout_s']!r}")
        backend = store.get("backend", "POSIX")
        if backend not in NIXL_BACKENDS:
            raise ValueError(f"{FLAG}: \"remote_backend\" (\"nixl_backend\") must be one of {NIXL_BACKENDS}, "
                             f"got {backend!r}")
        cluster = others.pop("cluster", None)
        return cls(path=os.fspath(location), store_kwargs=store, namespace_tag=tag, cluster=cluster,
                   left_to_sglang=tuple(sorted(others)))


def _legacy_value(key: str, value: Any) -> Any:
    """A value of an earlier release's key, in the unit of the key that replaced it."""
    if key == "capacity_gb":
        if value is None:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{FLAG}: \"capacity_gb\" (GiB) must be a number > 0 or absent, got {value!r}; "
                             "or give \"remote_capacity_bytes\" as a size such as \"500GiB\"")
        return int(value * (1 << 30))
    if key == "timeout_s" and (isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0):
        raise ValueError(f"{FLAG}: \"timeout_s\" must be a number of seconds > 0, got {value!r}")
    if key == "nixl_backend_params" and not (
        isinstance(value, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in value.items())
    ):
        raise ValueError(f"{FLAG}: \"nixl_backend_params\" must be an object of string values, got {value!r}")
    return value
