"""Prometheus counters of the SGLang backend, exported beside SGLang's own ``sglang:*`` metrics.

Owns two counter families, created once per process in prometheus-client's default registry:
``kvtier_sglang_pages_total{pool, op, result}`` and ``kvtier_sglang_bytes_total{pool, op}``.
SGLang serves ``/metrics`` (``--enable-metrics``) in prometheus-client's multiprocess mode: its
launcher sets ``PROMETHEUS_MULTIPROC_DIR`` before the scheduler processes start, so plain
counters created in a scheduler are summed into the same scrape; a custom collector would not
be. It must never be called per page: the backend adds a batch's counts at once.

``op`` / ``result``: ``read`` hit | miss | failed; ``write`` written | present (already stored,
not rewritten) | skipped (not this rank's to write) | failed; ``exists`` hit | miss | failed.
"""

from __future__ import annotations

from prometheus_client import Counter

PAGES = Counter(
    "kvtier_sglang_pages",
    "Pages the kvtier HiCache backend was asked about, by pool, operation and result",
    ["pool", "op", "result"],
)
BYTES = Counter(
    "kvtier_sglang_bytes",
    "Page bytes the kvtier HiCache backend moved between SGLang's host pool and the store",
    ["pool", "op"],
)


def count(pool: str, op: str, **results: int) -> None:
    """Add a batch's page counts (``result=pages``); zero counts are skipped."""
    for result, pages in results.items():
        if pages:
            PAGES.labels(pool=pool, op=op, result=result).inc(pages)


def count_bytes(pool: str, op: str, nbytes: int) -> None:
    if nbytes:
        BYTES.labels(pool=pool, op=op).inc(nbytes)
