"""structlog setup: readable lines on a terminal, one JSON object per line otherwise."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(log_format: str = "auto", level: int = logging.INFO) -> None:
    """`log_format` is auto (console on a TTY, else JSON), console or json."""
    use_console = log_format == "console" or (log_format == "auto" and sys.stderr.isatty())
    if use_console:
        tail = [structlog.dev.ConsoleRenderer()]
    else:
        tail = [structlog.processors.format_exc_info, structlog.processors.JSONRenderer()]
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            *tail,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )
