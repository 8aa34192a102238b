"""kvtier's SGLang plugin: ``--hicache-storage-backend kvtier`` and the KV-format recorder.

Owns the entry point of group ``sglang.srt.plugins`` (``register``) and the two hooks it
installs through SGLang's ``HookRegistry``. It must never change an argument list that does not
select kvtier, act or log in a server that does not use kvtier, and never fail a model runner
because recording its KV format failed (the backend then refuses an fp8 pool at start, naming
the cause).

Facts from sglang 0.5.23 (paths under ``sglang/srt/``):
- ``--hicache-storage-backend`` is a closed list of choices (``arg_groups/fields/memory.py:148``)
  and ``StorageBackendFactory.register_backend`` alone ends in ``Unknown built-in backend``
  (``mem_cache/storage/backend_factory.py:220``); the ``dynamic`` backend loads any class named
  in the extra config (``backend_factory.py:119,134``).
- ``load_plugins`` runs every entry point of group ``sglang.srt.plugins`` (zero-argument
  callables, filtered by ``SGLANG_PLUGINS``) and then ``HookRegistry.apply_hooks``
  (``plugins/__init__.py:103``). The launcher calls it before parsing arguments
  (``launch_server.py:79``, ``cli/serve.py:207``), each scheduler process at its start
  (``managers/scheduler.py:6323``).
- A BEFORE hook receives the target's arguments and may return new ``(args, kwargs)``
  (``plugins/hook_registry.py:361``); an AFTER hook receives the result, then the arguments
  (``hook_registry.py:373``).

Hook 1, BEFORE ``sglang.srt.server_args.prepare_server_args(argv)``: when the effective
``--hicache-storage-backend`` is ``kvtier``, it becomes ``dynamic`` and the extra config gets
``backend_name``, ``module_path``, ``class_name`` and ``interface_v1: 1``; kvtier's settings are
checked there, so a bad key stops the launcher. A ``--config`` YAML file is expanded first the
way SGLang does (``utils/server_args_config_parser.py:75``), an ``@file`` extra config is read
(JSON, TOML, YAML) and passed on inline.

Hook 2, AFTER ``ModelRunner.configure_kv_cache_dtype`` (it runs after the weights and their k/v
scales are loaded, ``model_executor/model_runner.py:715,735``): records the runner's KV dtype and
scale fingerprint (``namespace.record_kv_format``), only when the runner's server arguments select
kvtier (``selects_kvtier``): a server with another backend gets no record and no log line from
kvtier. It is registered only in processes that have
imported SGLang's scheduler module (schedulers, data-parallel controllers, an in-process Engine),
so the launcher and tokenizer processes do not import the model runner for nothing.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from typing import Optional

from kvtier.adapters.sglang import BACKEND_CLASS, BACKEND_MODULE, BACKEND_NAME
from kvtier.adapters.sglang.settings import BackendSettings

logger = logging.getLogger(__name__)

BACKEND_FLAG = "--hicache-storage-backend"
EXTRA_FLAG = "--hicache-storage-backend-extra-config"
PREPARE_TARGET = "sglang.srt.server_args.prepare_server_args"
RECORD_TARGET = "sglang.srt.model_executor.model_runner.ModelRunner.configure_kv_cache_dtype"
SCHEDULER_MODULE = "sglang.srt.managers.scheduler"
FIXED_KEYS = {
    "backend_name": BACKEND_NAME,
    "module_path": BACKEND_MODULE,
    "class_name": BACKEND_CLASS,
    "interface_v1": 1,
}


def register() -> None:
    """Entry point (group ``sglang.srt.plugins``, name ``kvtier``): install the hooks."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    HookRegistry.register(PREPARE_TARGET, _rewrite_before_prepare, HookType.BEFORE)
    if SCHEDULER_MODULE in sys.modules:
        HookRegistry.register(RECORD_TARGET, _record_after_configure, HookType.AFTER)


def _rewrite_before_prepare(*args, **kwargs):
    """BEFORE ``prepare_server_args(argv)``: new arguments when argv selects kvtier, else None."""
    argv = args[0] if args else kwargs.get("argv")
    if argv is None:
        return None
    rewritten = rewrite_argv(list(argv))
    if rewritten is None:
        return None
    if args:
        return (rewritten, *args[1:]), kwargs
    return args, {**kwargs, "argv": rewritten}


def selects_kvtier(server_args) -> bool:
    """Whether SGLang's parsed ``server_args`` use kvtier as the storage backend: ``kvtier``, or
    ``dynamic`` with kvtier's module in the extra config (the plugin's rewrite, or by hand)."""
    backend = getattr(server_args, "hicache_storage_backend", None)
    if backend == BACKEND_NAME:
        return True
    if backend != "dynamic":
        return False
    extra = getattr(server_args, "hicache_storage_backend_extra_config", None)
    try:
        config = extra if isinstance(extra, dict) else _load_extra(extra) if isinstance(extra, str) else {}
    except (OSError, ValueError):
        return False
    return config.get("module_path") == BACKEND_MODULE


def _record_after_configure(result, runner, *args, **kwargs):
    from kvtier.adapters.sglang.namespace import record_kv_format

    if not selects_kvtier(getattr(runner, "server_args", None)):
        return None
    role = "draft" if getattr(runner, "is_draft_worker", False) else "target"
    try:
        fmt = record_kv_format(role, runner.model, runner.kv_cache_dtype)
        logger.info("kvtier: recorded the %s KV format: %s, %d attention layers, scales %s",
                    role, fmt.kv_dtype, fmt.attention_layers, (fmt.scales or "n/a")[:16])
    except Exception:
        logger.exception("kvtier: could not record the %s model runner's KV format; an fp8 host pool "
                         "will be refused by the kvtier backend", role)
    return None


def _flag_values(argv: list[str], flag: str) -> list[tuple[int, bool, str]]:
    """Occurrences of ``flag``: (index of the token holding the value, joined with '=', value)."""
    found = []
    for i, token in enumerate(argv):
        if token == flag and i + 1 < len(argv):
            found.append((i + 1, False, argv[i + 1]))
        elif token.startswith(flag + "="):
            found.append((i, True, token[len(flag) + 1 :]))
    return found


def _load_extra(value: str) -> dict:
    """Parse an extra-config value as SGLang does: inline JSON, or ``@file`` in JSON/TOML/YAML
    (``mem_cache/hybrid_cache/hybrid_cache_controller.py:378``)."""
    if value.startswith("@"):
        path = value[1:]
        ext = os.path.splitext(path)[1].lower()
        if ext == ".json":
            with open(path) as f:
                config = json.load(f)
        elif ext == ".toml":
            import tomllib

            with open(path, "rb") as f:
                config = tomllib.load(f)
        elif ext in (".yaml", ".yml"):
            import yaml

            with open(path) as f:
                config = yaml.safe_load(f)
        else:
            raise ValueError(f"{EXTRA_FLAG} file {path!r} has extension {ext!r}; expected .json, .toml, .yaml or .yml")
    else:
        try:
            config = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{EXTRA_FLAG} is not valid JSON ({exc}): {value!r}") from None
    if not isinstance(config, dict):
        raise ValueError(f"{EXTRA_FLAG} must hold a JSON object, got {type(config).__name__}")
    return config


def _expand_config_file(argv: list[str]) -> list[str]:
    import argparse

    from sglang.srt.server_args import ServerArgs
    from sglang.srt.utils.server_args_config_parser import ConfigArgumentMerger

    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return ConfigArgumentMerger(parser).merge_config_with_args(argv)


def rewrite_argv(argv: list[str]) -> Optional[list[str]]:
    """``argv`` with ``--hicache-storage-backend kvtier`` turned into SGLang's ``dynamic`` form,
    or None when the effective backend (the last occurrence wins, as in argparse) is not kvtier.

    Raises ValueError naming the key for a bad extra config, or when it names another class."""
    if "--config" in argv:
        argv = _expand_config_file(argv)
    backends = _flag_values(argv, BACKEND_FLAG)
    if not backends or backends[-1][2] != BACKEND_NAME:
        return None
    extras = _flag_values(argv, EXTRA_FLAG)
    config = _load_extra(extras[-1][2]) if extras else {}
    for key, value in FIXED_KEYS.items():
        if key in config and config[key] != value and not (key == "interface_v1" and bool(config[key])):
            raise ValueError(
                f"{EXTRA_FLAG} sets {key!r}={config[key]!r}, but --hicache-storage-backend kvtier "
                f"uses {value!r}; remove it, or use --hicache-storage-backend dynamic"
            )
    config = {**config, **FIXED_KEYS}
    BackendSettings.from_extra_config(config)
    out = list(argv)
    index, joined, _ = backends[-1]
    out[index] = f"{BACKEND_FLAG}=dynamic" if joined else "dynamic"
    encoded = json.dumps(config, separators=(",", ":"))
    if extras:
        index, joined, _ = extras[-1]
        out[index] = f"{EXTRA_FLAG}={encoded}" if joined else encoded
    else:
        out += [EXTRA_FLAG, encoded]
    return out

