"""structlog setup: console renderer on a TTY, JSON lines otherwise."""

from __future__ import annotations

import logging
import sys

import structlog


def configure_logging(log_format: str = "auto", level: int = logging.INFO) -> None:
    use_console = log_format == "console" or (log_format == "auto" and sys.stderr.isatty())
    renderer = structlog.dev.ConsoleRenderer() if use_console else structlog.processors.JSONRenderer()
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(level),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=True,
    )
