"""Structured (JSON lines) logging for the gateway process: one object a line, with the request id,
tenant, model and node as fields where a line concerns a request. Prompts are dropped from every line
unless SLUICE_LOG_PROMPTS=1 (debugging); keys and authorization headers are dropped always."""

from __future__ import annotations

import json
import logging
import time

# LogRecord attributes that are not user-supplied `extra` fields.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName", "color_message"}


# `extra` fields that never reach a log line, and those that do only with log_prompts.
_SECRETS = frozenset({"api_key", "key", "authorization", "admin_key", "secret"})
_PROMPTS = frozenset({"prompt", "messages", "prompt_text"})


class JsonFormatter(logging.Formatter):
    def __init__(self, log_prompts: bool = False) -> None:
        super().__init__()
        self._dropped = _SECRETS if log_prompts else _SECRETS | _PROMPTS

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        entry.update({k: v for k, v in vars(record).items() if k not in _STANDARD and k not in self._dropped})
        if record.exc_info:
            entry["exc"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str)


def configure_logging(level: str, log_prompts: bool = False) -> None:
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter(log_prompts))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
