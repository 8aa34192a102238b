"""kvtier's log level from the environment: ``KVTIER_LOG_LEVEL``.

Owns the ``kvtier`` logger's level and handler when ``KVTIER_LOG_LEVEL`` is set (debug, info,
warning, error, critical; any case), applied once at ``import kvtier``: kvtier's records at that
level and above go to stderr through a handler of its own, and no longer to the root logger
(so an application's root handler does not print them twice). Without the variable kvtier
leaves logging to the application, as a library should. It must never touch another logger,
and a bad value is a warning naming it, never an import error.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping

LOG_LEVEL_VAR = "KVTIER_LOG_LEVEL"
LEVELS = ("debug", "info", "warning", "error", "critical")
FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def apply_log_level(environ: Mapping[str, str] = os.environ) -> int | None:
    """Set the ``kvtier`` logger from ``KVTIER_LOG_LEVEL``; the level set, or None."""
    value = environ.get(LOG_LEVEL_VAR, "").strip()
    if not value:
        return None
    logger = logging.getLogger("kvtier")
    if value.lower() not in LEVELS:
        logger.warning(
            "%s=%r is not a log level: expected one of %s; kvtier's logging is left as it is",
            LOG_LEVEL_VAR, value, ", ".join(LEVELS),
        )
        return None
    level = getattr(logging, value.upper())
    logger.setLevel(level)
    if not any(getattr(h, "kvtier_env", False) for h in logger.handlers):
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(FORMAT))
        handler.kvtier_env = True
        logger.addHandler(handler)
    logger.propagate = False
    return level
