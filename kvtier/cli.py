"""The `kvtier` command: argparse subcommands over kvtier's tools.

    kvtier --version
    kvtier bench [options]            offload / reload bandwidth per copy path (CPU twin without CUDA)
    kvtier config [FILE]              the pool settings a config file and KVTIER_* variables make
    kvtier store check PATH [...]     verify a remote page store
    kvtier store rebuild PATH [...]   rebuild a remote page store's index from its segment files

Owns argument parsing and dispatch only; each subcommand's work lives in its own module,
imported when that subcommand runs, so `kvtier --help` needs neither CUDA nor NIXL. `kvtier
store ...` is handed to the store tool whole, so its own parser answers `--help` at every level
(`kvtier store check --help` lists every flag, with or without a PATH). `python -m kvtier`
runs the same command. It must
never measure, read a store or build a pool itself. Exit codes: 0 done, 1 the tool found a
problem, 2 bad usage or a tool that cannot run here.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Sequence

import kvtier

STORE_TOOL = "kvtier.tiers.remote.tool"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="kvtier: a hierarchical KV-cache page store (GPU -> pinned host -> remote)."
    )
    parser.add_argument("--version", action="version", version=f"kvtier {kvtier.__version__}")
    commands = parser.add_subparsers(dest="command", metavar="command", required=True)

    from kvtier.bench import offload_bandwidth

    bench = commands.add_parser(
        "bench",
        help="offload / reload bandwidth of the copy paths against the PCIe limits (CPU twin without CUDA)",
        description=offload_bandwidth.__doc__.split("\n")[0] + " Without CUDA it runs the CPU twin and says so.",
    )
    offload_bandwidth.add_arguments(bench)
    bench.set_defaults(run=_bench)

    config = commands.add_parser(
        "config",
        help="print the pool settings a config file and the KVTIER_* variables make, or the first error",
        description="Read a JSON, TOML or YAML config (or KVTIER_CONFIG), apply the KVTIER_* environment, check "
        "every key, and print the TieredPool keyword arguments it makes as JSON.",
    )
    config.add_argument(
        "file", nargs="?", default=None, help="the config file (default: $KVTIER_CONFIG, else the environment alone)"
    )
    config.set_defaults(run=_config)

    store = commands.add_parser(
        "store", help="check or rebuild a remote page store", description="Tools for a remote page store."
    )
    actions = store.add_subparsers(dest="action", metavar="action", required=True)
    for action, text in (
        ("check", "check a store's index against its segment files and report what is wrong"),
        ("rebuild", "rebuild the store's index from its segment files"),
    ):
        sub = actions.add_parser(action, help=text, description=text[0].upper() + text[1:] + ".")
        sub.add_argument("path", help="the store's directory or file:// URL")
        sub.add_argument("options", nargs=argparse.REMAINDER, help=f"options: see kvtier store {action} --help")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else list(argv)
    if not argv:
        parser.print_help(sys.stderr)
        return 2
    if argv[0] == "store":
        return _store(argv[1:])
    try:
        args = parser.parse_args(argv)
    except SystemExit as done:  # --help, --version and usage errors: argparse has printed them
        return int(done.code or 0)
    return args.run(args)


def _bench(args: argparse.Namespace) -> int:
    from kvtier.bench import offload_bandwidth

    return offload_bandwidth.run(offload_bandwidth.resolve_args(args))


def _config(args: argparse.Namespace) -> int:
    from kvtier.config import ENV_CONFIG, ENV_FORMAT_PREFIX, ConfigError, MissingFormat, pool_kwargs

    try:
        kwargs = pool_kwargs(args.file)
    except MissingFormat:
        fields = f"{ENV_FORMAT_PREFIX}NUM_LAYERS, _NUM_KV_HEADS, _HEAD_DIM, _PAGE_SIZE and _DTYPE"
        file = args.file or os.environ.get(ENV_CONFIG)
        if file is None:
            hint = (f"nothing to read: pass a config file (kvtier config kvtier.toml, with a [format] table), "
                    f"or set {ENV_CONFIG}=/path/to/kvtier.toml, or give the page format with {fields}")
        else:
            hint = (f"{file} has no [format] table: add one (num_layers, num_kv_heads, head_dim, page_size, dtype), "
                    f"or give the page format with {fields}")
        print(f"kvtier config: {hint}", file=sys.stderr)
        return 2
    except ConfigError as err:
        print(f"kvtier config: {err}", file=sys.stderr)
        return 2
    fmt = kwargs.pop("fmt")
    shown = {"format": {"describe": fmt.describe(), "fingerprint": fmt.fingerprint, **_format_fields(fmt)}, **kwargs}
    print(json.dumps(shown, indent=2, default=str))
    return 0


def _format_fields(fmt) -> dict:
    import dataclasses

    return {f.name: getattr(fmt, f.name) for f in dataclasses.fields(fmt) if f.init}


def _store(argv: list[str]) -> int:
    import importlib

    try:
        tool = importlib.import_module(STORE_TOOL)
    except ModuleNotFoundError as err:
        if err.name == STORE_TOOL:
            print(f"kvtier store: this kvtier has no store tool ({STORE_TOOL} is missing)", file=sys.stderr)
        else:
            print(f"kvtier store: the store tool cannot import {err.name}; the remote tier needs "
                  "pip install 'kvtier[nixl]' (CUDA 13) or 'kvtier[nixl-cu12]' (CUDA 12)", file=sys.stderr)
        return 2
    try:
        return tool.main(argv)
    except SystemExit as done:  # --help and usage errors: the tool's argparse has printed them
        return int(done.code or 0)


if __name__ == "__main__":
    raise SystemExit(main())
