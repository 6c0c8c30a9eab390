"""The agent's log output: readable text for people, or one JSON object per line for machines.

Why it exists: the agent changes other processes' devices as root, so its log is the audit
trail; in a cluster it is collected by a log shipper that wants structured lines
(``--log-format json``). Both styles carry the same fields, including the ``extra`` values the
code attaches (``request_id``, ``pid``, ``hotplug_action``...).
"""

from __future__ import annotations

import json
import logging
from datetime import UTC, datetime
from typing import Any, Final

from .settings import LogStyle

__all__ = ["JsonFormatter", "TextFormatter", "logging_config"]

# Attributes every LogRecord has; anything else was passed through ``extra=``.
_STANDARD: Final = frozenset(
    vars(logging.LogRecord("", 0, "", 0, "", None, None)).keys() | {"message", "asctime"}
)
_LOGGERS: Final = ("jupyter_gpu_hotplug", "tornado", "AgentApp")


def _extras(record: logging.LogRecord) -> dict[str, Any]:
    return {key: value for key, value in vars(record).items() if key not in _STANDARD}


class JsonFormatter(logging.Formatter):
    """``{"time", "level", "logger", "message", ...extra, "exception"?}`` on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        entry.update(_extras(record))
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


class TextFormatter(logging.Formatter):
    """``time level logger: message [key=value ...]``, traceback below."""

    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)-7s %(name)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        text = super().format(record)
        extras = _extras(record)
        if not extras:
            return text
        head, newline, tail = text.partition("\n")
        fields = " ".join(f"{key}={value}" for key, value in sorted(extras.items()))
        return f"{head} [{fields}]{newline}{tail}"


def logging_config(*, level: int | str, style: LogStyle) -> dict[str, Any]:
    """A ``logging.config.dictConfig`` for the agent's loggers, to stderr."""
    formatter = JsonFormatter if style is LogStyle.JSON else TextFormatter
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"agent": {"()": f"{formatter.__module__}.{formatter.__name__}"}},
        "handlers": {
            "stderr": {
                "class": "logging.StreamHandler",
                "formatter": "agent",
                "stream": "ext://sys.stderr",
            }
        },
        "loggers": {
            name: {"level": level, "handlers": ["stderr"], "propagate": False} for name in _LOGGERS
        },
    }
