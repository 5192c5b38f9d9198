"""The engine's errors, as its clients see them: one small hierarchy, no flags.

    EngineError
    ├── RequestRejectedError      the engine did not take the request; nothing of it ran
    │   ├── QueueFullError        the waiting queue is at a bound: retry later
    │   └── InvalidRequestError   it can never run as sent
    └── EngineDeadError           the engine process exited or failed; its requests end with this
        └── EngineShutDownError   ... because it was shut down on purpose (the server is stopping)

A driver maps these to its own seam's errors (`drivers.native`); nothing here knows about HTTP.
"""

from __future__ import annotations


class EngineError(Exception):
    """Base of every error an engine or its client raises about a request."""


class RequestRejectedError(EngineError):
    """The engine refused the request when it was added."""


class QueueFullError(RequestRejectedError):
    """The waiting queue is at its bound (requests or tokens); the caller should retry later."""


class InvalidRequestError(RequestRejectedError):
    """The request can never run as sent (empty prompt, too long, token ids out of range, ...)."""


class EngineDeadError(EngineError):
    """The engine process is gone (crashed, killed, failed to start); requests on it end with this."""


class EngineShutDownError(EngineDeadError):
    """The engine was shut down on purpose; the requests still on it end with this."""
