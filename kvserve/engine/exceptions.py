"""Errors a front end raises when the engine cannot serve any more."""

from __future__ import annotations


class EngineDeadError(RuntimeError):
    """The engine (its loop, or its core process) is gone: no request can be served. The default
    text is vLLM's."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message or "EngineCore encountered an issue. See stack trace (above) for the root cause.")
