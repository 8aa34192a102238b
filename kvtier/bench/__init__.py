"""Benchmarks that ship with kvtier (run through the `kvtier` command)."""
