"""Request bodies (pydantic, vLLM's field names and defaults) and the error body."""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

_LONG_MIN, _LONG_MAX = -(2**63), 2**63 - 1  # torch.iinfo(torch.long), vLLM's seed bounds
_INT32_MAX = 2**31 - 1
MAX_N = 128  # OpenAI's bound on n (also keeps one request from fanning out without limit)


def random_uuid() -> str:
    return uuid.uuid4().hex


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo


class StreamOptions(BaseModel):
    include_usage: bool | None = False
    continuous_usage_stats: bool | None = False


class _SamplingRequest(BaseModel):
    """The sampling fields shared by both endpoints (OpenAI plus vLLM's extras)."""

    model_config = ConfigDict(extra="allow")  # vLLM accepts (and ignores) unknown fields

    model: str | None = None
    n: int = Field(1, le=MAX_N)
    seed: int | None = Field(None, ge=_LONG_MIN, le=_LONG_MAX)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: str | None = None
    # vLLM extras
    top_k: int | None = Field(None, le=_INT32_MAX)
    min_p: float | None = None
    repetition_penalty: float | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, le=_INT32_MAX)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_token_ids: bool = False
    request_id: str | None = None


class CompletionRequest(_SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None  # deprecated by OpenAI in favour of max_completion_tokens
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = 0
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


def now() -> int:
    return int(time.time())
