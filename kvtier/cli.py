"""The `kvtier` command: `kvtier bench [options]` runs the offload bandwidth benchmark.

Owns argument dispatch only; each subcommand's work lives in its own module.
"""

from __future__ import annotations

import sys

USAGE = """usage: kvtier <command> [options]

commands:
  bench    offload / reload bandwidth of the copy paths against the PCIe limits
           (CPU twin without CUDA); `kvtier bench --help` lists its options
"""


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, end="")
        return 0 if argv else 2
    command, rest = argv[0], argv[1:]
    if command == "bench":
        from kvtier.bench.offload_bandwidth import main as bench

        return bench(rest)
    print(f"kvtier: unknown command {command!r}\n\n{USAGE}", end="", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
