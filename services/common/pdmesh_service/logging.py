"""structlog JSON logs on stderr, with the request id bound per task (contextvars).

The engine and the kernels log through the standard library (`logging.getLogger(__name__)`: they do
not depend on the services); their records are rendered the same way, at the service's level (the
CPU layer path, weight loading, ...). Other libraries' records show from WARNING up."""

from __future__ import annotations

import logging
import sys
from collections.abc import Callable

import structlog
from structlog.typing import EventDict, WrappedLogger


def configure_logging(service: str, level: str = "INFO", json: bool = True) -> None:
    """Call once at process start (server.py)."""
    renderer = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            _add_service(service),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(
            getattr(logging, level.upper(), logging.INFO)
        ),
        logger_factory=structlog.PrintLoggerFactory(sys.stderr),
        cache_logger_on_first_use=True,
    )
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(
        structlog.stdlib.ProcessorFormatter(
            foreign_pre_chain=[
                structlog.stdlib.add_log_level,
                structlog.stdlib.add_logger_name,
                structlog.stdlib.PositionalArgumentsFormatter(),
                structlog.processors.TimeStamper(fmt="iso", utc=True),
                _add_service(service),
            ],
            processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer],
        )
    )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    for name in STDLIB_LOGGERS:
        logging.getLogger(name).setLevel(getattr(logging, level.upper(), logging.INFO))


STDLIB_LOGGERS = ("pdmesh_engine", "pdmesh_kernels")  # logged at the service's level


def _add_service(service: str) -> Callable[[WrappedLogger, str, EventDict], EventDict]:
    def add(_logger: WrappedLogger, _method: str, event: EventDict) -> EventDict:
        event.setdefault("service", service)
        return event

    return add


def get_logger(name: str) -> structlog.typing.FilteringBoundLogger:
    logger: structlog.typing.FilteringBoundLogger = structlog.get_logger(name)
    return logger


def bind_request_id(request_id: str) -> None:
    """Attach the request id to every log line of the current task."""
    structlog.contextvars.clear_contextvars()
    if request_id:
        structlog.contextvars.bind_contextvars(request_id=request_id)
