"""kvserve: a compact LLM inference engine with a precision-aware paged KV cache."""

from kvserve.engine.llm import LLM
from kvserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from kvserve.engine.sampling import RequestOutputKind, SamplingParams

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput", "Logprob", "RequestOutputKind"]
__version__ = "0.1.0"
