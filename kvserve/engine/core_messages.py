"""What crosses the process boundary between a front end and the engine core (msgspec msgpack,
as vLLM v1): requests one way (add, abort / finish, utility calls, shutdown), each core step's
outputs the other, plus the start-up and the engine's death notice. Frames: ``[type byte,
payload]`` to the core; ``[payload]`` from it (``ENGINE_CORE_DEAD`` alone: the core is gone). With
several front ends (``--api-server-count``) each message to the core names its client index, and
each front end gets its own requests' outputs and every change of the scheduler's stats."""

from __future__ import annotations

import enum
from typing import Any

import msgspec

from kvserve.engine.core import CoreOutput
from kvserve.engine.request import RequestStatus
from kvserve.engine.sampling import SamplingParams

ENGINE_CORE_DEAD = b"ENGINE_CORE_DEAD"  # vLLM's frame


class RequestType(bytes, enum.Enum):
    """The first frame of a message to the core (vLLM's ``EngineCoreRequestType`` bytes)."""

    ADD = b"\x00"
    ABORT = b"\x01"
    UTILITY = b"\x03"
    SHUTDOWN = b"\x06"


class AddRequest(msgspec.Struct, array_like=True, gc=False):
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    # decoding a SamplingParams runs its __post_init__, which rebuilds this set from
    # stop_token_ids alone: the EOS ids the front end added travel beside it
    all_stop_token_ids: list[int]
    client_index: int = 0  # which front end sent it: its outputs go back there (--api-server-count)


class FinishRequests(msgspec.Struct, array_like=True, gc=False):
    request_ids: list[str]
    status: RequestStatus = RequestStatus.FINISHED_ABORTED
    client_index: int = 0  # a front end finishes only its own requests


class UtilityCall(msgspec.Struct, array_like=True, gc=False):
    call_id: int
    method: str  # a method of ``EngineCoreProc`` named in its ``UTILITIES``
    args: list[Any] = []
    client_index: int = 0  # where the answer goes


class SchedulerStats(msgspec.Struct, array_like=True, gc=False):
    num_running: int = 0
    num_waiting: int = 0
    num_free_blocks: int = 0
    num_total_blocks: int = 0
    num_preemptions: int = 0  # cumulative


class CoreOutputs(msgspec.Struct, array_like=True, gc=False):
    """One core step's outputs (or a utility call's answer, or the ready message)."""

    outputs: list[CoreOutput] = []
    stats: SchedulerStats | None = None
    # a step that failed: the requests it aborted and why (the others keep running)
    failed_request_ids: list[str] = []
    error: str | None = None
    utility_call_id: int | None = None
    utility_result: Any = None
    utility_error: str | None = None
    ready: dict[str, Any] | None = None  # the first message: the core is up (its facts for the front end)


def params_of(msg: AddRequest) -> SamplingParams:
    params = msg.params
    params.all_stop_token_ids = set(msg.all_stop_token_ids)
    return params


ENCODER = msgspec.msgpack.Encoder()
REQUEST_DECODERS = {
    RequestType.ADD: msgspec.msgpack.Decoder(AddRequest),
    RequestType.ABORT: msgspec.msgpack.Decoder(FinishRequests),
    RequestType.UTILITY: msgspec.msgpack.Decoder(UtilityCall),
}
OUTPUTS_DECODER = msgspec.msgpack.Decoder(CoreOutputs)
