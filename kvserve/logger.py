"""One logger for the package, formatted like vLLM's (level, time, file:line)."""

from __future__ import annotations

import logging
import os
import sys

_FORMAT = "%(levelname)s %(asctime)s [%(filename)s:%(lineno)d] %(message)s"
_configured = False


def init_logger(name: str) -> logging.Logger:
    """Return a child of the ``kvserve`` logger; configures the root handler once."""
    global _configured
    root = logging.getLogger("kvserve")
    if not _configured:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(_FORMAT, datefmt="%m-%d %H:%M:%S"))
        root.addHandler(handler)
        root.setLevel(os.environ.get("KVSERVE_LOGGING_LEVEL", "INFO").upper())
        root.propagate = False
        _configured = True
    return logging.getLogger(name if name.startswith("kvserve") else f"kvserve.{name}")
