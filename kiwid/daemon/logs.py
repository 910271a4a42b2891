"""Operator log lines: ``[LEVEL] message`` on stderr, which journald collects.

The level prefix is part of the product: operators grep for ``[INFO] New TQ =``.
"""

from __future__ import annotations

import logging
import sys


class _Formatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        text = f"[{record.levelname}] {record.getMessage()}"
        if record.exc_info:
            text += "\n" + self.formatException(record.exc_info)
        return text


def setup_logging(level: str = "info") -> None:
    """Send kiwid's log lines to stderr at ``level`` (debug, info, warning, error)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter())
    root = logging.getLogger()
    for old in list(root.handlers):
        root.removeHandler(old)
    root.addHandler(handler)
    set_level(level)


def set_level(level: str) -> None:
    """Change the log level at runtime (on reload)."""
    logging.getLogger().setLevel(level.upper())


def seconds(value: float) -> str:
    """Format seconds as operators write them: ``20``, ``2.5``."""
    return f"{value:g}"
