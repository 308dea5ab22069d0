"""Engine: the front end of one engine core (vLLM v1's LLMEngine): validates and tokenizes
requests, hands them to the core (scheduler, KV manager, runner) and turns each core step into
``RequestOutput``s with the ``OutputProcessor`` (text, stop strings, n > 1). The core runs in this
process (``EngineCore``; the offline ``LLM``) or in its own (``multiprocess=True``: ``CoreClient``,
``kvserve serve``), where a step is the next batch of outputs the core sent."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvserve.config import EngineArgs, EngineConfig
from kvserve.engine.core import CoreOutput, EngineCore
from kvserve.engine.exceptions import EngineDeadError
from kvserve.engine.output_processor import OutputProcessor
from kvserve.engine.outputs import RequestOutput, RequestState
from kvserve.engine.parallel_sampling import ParentRequest
from kvserve.engine.request import RequestStatus
from kvserve.engine.sampling import SamplingParams
from kvserve.logger import init_logger

if TYPE_CHECKING:
    from kvserve.engine.core_client import CoreAddress, CoreClient
    from kvserve.engine.core_messages import CoreOutputs
    from kvserve.engine.kv_cache import KVCacheManager
    from kvserve.engine.scheduler import Scheduler
    from kvserve.runner.model_runner import ModelRunner

logger = init_logger(__name__)

MAX_LOGPROBS = 20  # vLLM's default --max-logprobs
PromptInput = str | list[int] | dict[str, Any]


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path)


# vLLM's text for text prompts (and chat) without a tokenizer (``InputPreprocessor`` / renderer).
NO_TOKENIZER_TEXT_PROMPT = "You cannot pass text prompts when `skip_tokenizer_init=True`"


def _generation_eos_ids(model_path: str) -> list[int]:
    """EOS ids of the generation config, as vLLM's ``try_get_generation_config``: the folder's
    ``generation_config.json``, else the one transformers derives from ``config.json``
    (``GenerationConfig.from_model_config``, which copies its ``eos_token_id``)."""
    folder = Path(model_path)
    eos = None
    for name in ("generation_config.json", "config.json"):
        path = folder / name
        if path.is_file():
            eos = json.loads(path.read_text()).get("eos_token_id")
            break
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else list(eos)


# multiprocess: how long a step waits for the core's next outputs before the caller gets [] back
# (the engine thread of AsyncLLM then looks at its inbox: adds and aborts wait at most this long)
_OUTPUT_POLL_S = 0.005


class Engine:
    def __init__(self, config: EngineConfig, multiprocess: bool = False,
                 core_address: "CoreAddress | None" = None) -> None:
        """``multiprocess``: the core in its own process, started here, or (``core_address``) one
        the serve launcher started for several API servers."""
        self.config = config
        # skip_tokenizer_init (config.tokenizer is None): no tokenizer, token-id prompts only, no
        # output text (vLLM: the detokenizer is a no-op, the EOS id of the tokenizer is None and
        # only the generation config's EOS ids stop a request, as stop token ids).
        self.tokenizer: Any = None if config.tokenizer is None else load_tokenizer(config.tokenizer)
        # the Rust tokenizer decodes much faster than the Python wrapper; same text
        self.decoder = getattr(self.tokenizer, "backend_tokenizer", None) or self.tokenizer
        if self.tokenizer is None:
            logger.warning("Using None for EOS token id because tokenizer is not initialized")
        self.eos_token_id: int | None = None if self.tokenizer is None else self.tokenizer.eos_token_id
        self.extra_eos_ids = _generation_eos_ids(config.model_config.model)
        self.core: EngineCore | CoreClient
        if multiprocess:
            from kvserve.engine.core_client import CoreClient

            self.core = CoreClient(config, address=core_address)
        else:
            self.core = EngineCore(config)
        self.output_processor = OutputProcessor(self.decoder)
        self._deferred: list[RequestOutput] = []  # outputs held back by a failed step
        self.vocab_size = config.model_config.vocab_size
        if self.tokenizer is not None:
            self.vocab_size = max(self.vocab_size, len(self.tokenizer))

    # the core's parts, for callers that look inside (benchmarks, tests)
    def _local_core(self) -> EngineCore:
        if not isinstance(self.core, EngineCore):
            raise AttributeError("the engine core runs in its own process (multiprocess=True): its runner, "
                                 "scheduler and KV manager are not in this one")
        return self.core

    @property
    def runner(self) -> "ModelRunner":
        return self._local_core().runner

    @property
    def scheduler(self) -> "Scheduler":
        return self._local_core().scheduler

    @property
    def kv_manager(self) -> "KVCacheManager":
        return self._local_core().kv_manager

    @property
    def multiprocess(self) -> bool:
        """Whether the core runs in its own process."""
        return not isinstance(self.core, EngineCore)

    @property
    def async_scheduling(self) -> bool:
        if self.multiprocess:
            return self.config.scheduler_config.async_scheduling
        return self._local_core().async_scheduling

    @async_scheduling.setter
    def async_scheduling(self, value: bool) -> None:
        self._local_core().async_scheduling = value

    def stats(self) -> dict[str, int]:
        """The core's running / waiting requests, free / total KV blocks and preemptions so far (from
        its last step's outputs when it runs in its own process)."""
        if isinstance(self.core, EngineCore):
            return self.core.stats()
        import msgspec

        if not self.has_unfinished_requests() and self.core.dead is None:
            try:  # idle: what is queued is only stats (and tokens of requests already finished here)
                while self.core.get_output(0) is not None:
                    pass
            except EngineDeadError:
                pass  # the last stats stand; the next request gets the error
        return msgspec.structs.asdict(self.core.stats)

    def is_alive(self) -> bool:
        """False once the core's process is gone (always True for an in-process core)."""
        return isinstance(self.core, EngineCore) or self.core.dead is None

    def shutdown(self) -> None:
        """End the core's process (multiprocess); nothing to do for an in-process core."""
        if not isinstance(self.core, EngineCore):
            self.core.shutdown()

    @property
    def states(self) -> dict[str, RequestState]:
        """Live requests' output states (children of n > 1 parents by child id)."""
        return self.output_processor.states

    @property
    def parents(self) -> dict[str, ParentRequest]:
        return self.output_processor.parents

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "Engine":
        return cls(args.create_engine_config())

    # ---- requests -------------------------------------------------------------------------
    def tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        """Prompt text (None for token prompts) and its token ids."""
        text: str | None = None
        ids: Any = prompt
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                text, ids = prompt.get("prompt"), prompt["prompt_token_ids"]
            elif isinstance(prompt.get("prompt"), str):
                ids = prompt["prompt"]
        if isinstance(ids, str):
            if self.tokenizer is None:
                raise ValueError(NO_TOKENIZER_TEXT_PROMPT)
            return ids, list(self.tokenizer(ids).input_ids)
        # every element an int (no bool, no float): the set of their types, built in C (a generator
        # over a long prompt's ids cost ~0.5 ms of the event loop's time per request)
        if isinstance(ids, (list, tuple)) and set(map(type, ids)) <= {int}:
            return text, list(ids)
        raise ValueError(
            f"Invalid prompt {prompt!r}: expected a string, a list of int token ids, or a dict with "
            "'prompt' (str) or 'prompt_token_ids' (list of int)."
        )

    def add_request(self, request_id: str, prompt: PromptInput, params: SamplingParams) -> None:
        """Validate and queue a request; raises ValueError (and changes nothing) on bad input."""
        if request_id in self.states or request_id in self.parents:
            raise ValueError(f"Request id {request_id!r} already exists.")
        prompt_text, ids = self.tokenize(prompt)
        max_len = self.config.model_config.max_model_len
        if not ids:
            raise ValueError("The decoder prompt cannot be empty")
        if min(ids) < 0 or max(ids) >= self.vocab_size:
            bad = max(ids) if max(ids) >= self.vocab_size else min(ids)
            raise ValueError(f"Token id {bad} is out of vocabulary")
        if len(ids) > max_len:
            raise ValueError(
                f"The decoder prompt (length {len(ids)}) is longer than the maximum model length "
                f"of {max_len}. Make sure that `max_model_len` is no smaller than the number of "
                "text tokens."
            )
        for name in ("logprobs", "prompt_logprobs"):
            n = getattr(params, name)
            if n is not None and n > MAX_LOGPROBS:
                kind = "sample" if name == "logprobs" else "prompt"
                raise ValueError(
                    f"Requested {kind} logprobs of {n}, which is greater than max allowed: {MAX_LOGPROBS}"
                )
        bad_stop = [t for t in params.stop_token_ids or [] if t >= self.vocab_size]
        if bad_stop:
            raise ValueError(
                f"token_id(s) {bad_stop} in stop_token_ids contain out-of-vocab token ids. "
                f"Vocabulary size: {self.vocab_size}"
            )
        params = params.clone()
        if params.max_tokens is None:
            params.max_tokens = max_len - len(ids)
        params.update_from_generation_config(self.eos_token_id, self.extra_eos_ids)
        if params.n == 1:
            self._add_child(request_id, prompt_text, ids, params)
            return
        parent = ParentRequest(request_id, params)
        self.parents[request_id] = parent
        for index in range(params.n):
            child_id, child_params = parent.child(index)
            self._add_child(child_id, prompt_text, ids, child_params, index, parent)

    def _add_child(
        self, request_id: str, prompt: str | None, ids: list[int], params: SamplingParams,
        index: int = 0, parent: ParentRequest | None = None,
    ) -> None:
        self.output_processor.add_request(request_id, prompt, ids, params, index, parent)
        self.core.add_request(request_id, ids, params)

    def abort_request(self, request_ids: str | list[str]) -> None:
        ids = self.output_processor.expand([request_ids] if isinstance(request_ids, str) else list(request_ids))
        self.core.finish_requests(ids)
        self.output_processor.drop(ids)

    def has_unfinished_requests(self) -> bool:
        if self.multiprocess:  # what the front end still waits for
            return bool(self.states) or bool(self._deferred)
        return self.core.has_unfinished_requests() or bool(self._deferred)

    def get_num_unfinished_requests(self) -> int:
        if self.multiprocess:
            return len(self.states)
        return self.scheduler.num_running + self.scheduler.num_waiting

    # ---- stepping -------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one core step and return the outputs it produced (with async scheduling, those of
        the step launched one call earlier). A failed step's requests are gone from the core;
        their states are dropped here before the error goes on."""
        if self._deferred:
            out, self._deferred = self._deferred, []
            return out
        if not isinstance(self.core, EngineCore):
            return self._step_remote(self.core)
        try:
            core_outputs = self.core.step()
        except BaseException:
            # the step before the failed one still counts: its outputs come with the next call
            outputs, failed = self.core.take_failure()
            self._deferred = self._process(outputs)
            self.output_processor.drop(failed)
            raise
        return self._process(core_outputs)

    def _step_remote(self, client: "CoreClient") -> list[RequestOutput]:
        """The core's next outputs, if any came within ``_OUTPUT_POLL_S``; a step the core reports
        failed drops its requests here and raises after keeping the outputs of the step before."""
        out = client.get_output(_OUTPUT_POLL_S)
        if out is None:
            return []
        outputs, error = self.process_core_outputs(out)
        if error is not None:
            self._deferred = outputs
            raise RuntimeError(error)
        return outputs

    def process_core_outputs(self, out: "CoreOutputs", start: int = 0, stop: int | None = None
                             ) -> tuple[list[RequestOutput], str | None]:
        """One message of a core in its own process (its outputs ``[start:stop]``, for a caller that
        takes them in chunks): their ``RequestOutput``s, and, with the message's last chunk, the error
        of a step the core reports failed (whose requests are dropped here; the outputs are the step's
        before)."""
        last = stop is None or stop >= len(out.outputs)
        outputs = self._process(out.outputs if not start and last else out.outputs[start:stop])
        if last and out.error is not None:
            self.output_processor.drop(out.failed_request_ids)
            return outputs, out.error
        return outputs, None

    def _process(self, core_outputs: list[CoreOutput]) -> list[RequestOutput]:
        outputs, stopped = self.output_processor.process(core_outputs)
        if stopped:  # a stop string ended them: the core still runs them
            self.core.finish_requests(stopped, RequestStatus.FINISHED_STOPPED)
        return outputs
