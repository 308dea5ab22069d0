"""kvserve: a compact LLM inference engine with a precision-aware paged KV cache."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from kvserve.engine.llm import LLM
    from kvserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
    from kvserve.engine.sampling import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind"]
__version__ = "0.1.0"

_EXPORTS = {
    "LLM": "kvserve.engine.llm",
    "CompletionOutput": "kvserve.engine.outputs",
    "Logprob": "kvserve.engine.outputs",
    "RequestOutput": "kvserve.engine.outputs",
    "RequestOutputKind": "kvserve.engine.sampling",
    "SamplingParams": "kvserve.engine.sampling",
}


def __getattr__(name: str) -> Any:
    """Import the public classes on first use (the CLI's torch-free commands stay fast)."""
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'kvserve' has no attribute {name!r}")
