"""/v1/completions and /v1/chat/completions: request -> SamplingParams -> AsyncLLM -> OpenAI JSON
or SSE chunks. Bad input raises ``OpenAIError`` (turned into vLLM's error body by the app)."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from typing import Any, AsyncIterator, Awaitable, Callable

import msgspec

from kvserve.engine.async_llm import AsyncLLM, EngineDeadError
from kvserve.engine.outputs import CompletionOutput, RequestOutput
from kvserve.engine.sampling import SamplingParams
from kvserve.entrypoints.openai.async_tokenizer import AsyncMicrobatchTokenizer
from kvserve.entrypoints.openai.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    now,
    random_uuid,
)
from kvserve.logger import init_logger

_PARAM_NAMES = (
    "n presence_penalty frequency_penalty repetition_penalty temperature top_p top_k min_p "
    "max_tokens min_tokens logprobs prompt_logprobs stop_token_ids stop seed"
).split()

logger = init_logger(__name__)


class OpenAIError(Exception):
    def __init__(self, message: str, status: int = 400, type: str = "BadRequestError",
                 param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.status, self.type, self.param = message, status, type, param

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.status}}


def bad_request(e: Exception, rename: dict[str, str] | None = None) -> OpenAIError:
    """SamplingParams / Engine errors name their field first ("temperature must be ...")."""
    msg = str(e)
    param = None
    m = re.match(r"^(\w+) must|^(\w+) cannot", msg)
    if m and (m.group(1) or m.group(2)) in _PARAM_NAMES:
        param = m.group(1) or m.group(2)
    elif msg.startswith("Requested sample logprobs"):
        param = "logprobs"
    elif "stop_token_ids" in msg:
        param = "stop_token_ids"
    if param and rename:
        param = rename.get(param, param)
    return OpenAIError(msg, param=param)


def _clamp(lp: float) -> float:
    return max(lp, -9999.0)  # JSON has no -inf (vLLM's clamp)


_JSON = msgspec.json.Encoder()
SSE_DONE = b"data: [DONE]\n\n"


def sse_event(body: Any) -> bytes:
    """One server-sent event of ``body`` as compact UTF-8 JSON, as vLLM's chunks are (pydantic's
    ``model_dump_json``: no spaces, non-ASCII as is); a sixth of ``json.dumps``'s CPU per chunk."""
    return b"data: " + _JSON.encode(body) + b"\n\n"


def _error_event(e: Exception) -> bytes:
    """A stream's error event: a RuntimeError (the engine failed the request) is a 500, else a 400."""
    internal = isinstance(e, RuntimeError)
    return sse_event(OpenAIError(str(e), 500 if internal else 400,
                                 "InternalServerError" if internal else "BadRequestError").body())


class ClientDisconnected(OpenAIError):
    """The client went away before its (non-streaming) response; nobody reads this 499."""

    def __init__(self) -> None:
        super().__init__("Client disconnected", 499, "ClientDisconnected")


async def merge_streams(iters: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleave several requests' outputs as (prompt index, output); closing aborts them all."""
    if len(iters) == 1:
        async for out in iters[0]:
            yield 0, out
        return
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, it: AsyncIterator[RequestOutput]) -> None:
        try:
            async for out in it:
                await q.put((i, out))
        except BaseException as e:  # noqa: BLE001
            await q.put((i, e))
            return
        await q.put((i, None))

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iters)]
    try:
        remaining = len(tasks)
        while remaining:
            i, item = await q.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)  # before closing what they iterate
        for it in iters:
            await it.aclose()  # type: ignore[attr-defined]


# vLLM ModelConfig.get_diff_sampling_param: what a generation_config.json may set as defaults.
_GENERATION_CONFIG_PARAMS = ("repetition_penalty", "temperature", "top_k", "top_p", "min_p", "max_new_tokens")


def generation_config_defaults(model_dir: str, generation_config: str = "auto") -> dict[str, Any]:
    """Default sampling params from ``generation_config.json`` (vLLM ``--generation-config``):
    ``auto`` reads the model folder, a path reads that folder, ``vllm`` uses none."""
    if generation_config == "vllm":
        return {}
    folder = Path(model_dir if generation_config == "auto" else generation_config)
    path = folder / "generation_config.json"
    if not path.is_file():
        if generation_config != "auto":
            raise ValueError(f"--generation-config {generation_config!r}: no generation_config.json in that folder")
        return {}
    raw = json.loads(path.read_text())
    out = {k: raw[k] for k in _GENERATION_CONFIG_PARAMS if raw.get(k) is not None}
    if "max_new_tokens" in out:
        out["max_tokens"] = out.pop("max_new_tokens")
    if out:
        logger.warning(
            "Default sampling parameters have been overridden by the model's Hugging Face generation config "
            "recommended from the model creator. If this is not intended, please relaunch vLLM instance with "
            "`--generation-config vllm`."
        )
        logger.info("Using default sampling params from model generation config: %s", out)
    return out


class OpenAIServing:
    def __init__(self, async_llm: AsyncLLM, served_model_name: str, default_sampling: dict[str, Any] | None = None) -> None:
        self.llm = async_llm
        self.model_name = served_model_name
        self.max_model_len = async_llm.max_model_len
        self.default_sampling = dict(default_sampling or {})
        # text prompts and chat templates off the event loop, batched (None: no tokenizer, the engine refuses text)
        self.tokenizer = None if async_llm.tokenizer is None else AsyncMicrobatchTokenizer(async_llm.tokenizer)

    # ---- shared ------------------------------------------------------------------------------
    def check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise OpenAIError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model")

    @staticmethod
    def check_common(req: Any) -> None:
        if req.stream_options is not None and not req.stream:
            raise OpenAIError("Stream options can only be defined when `stream=True`.", param="stream_options")
        extra = req.model_extra or {}
        for name in ("echo", "prompt_logprobs", "suffix", "tools", "response_format", "guided_json"):
            if extra.get(name) not in (None, False, 0, [], {"type": "text"}):
                raise OpenAIError(f"`{name}` is not supported by kvserve.", param=name)
        best_of = extra.get("best_of")
        if best_of is not None and best_of != req.n:
            raise OpenAIError("`best_of` is not supported by kvserve (only best_of == n).", param="best_of")

    def sampling_params(self, req: Any, max_tokens: int | None, logprobs: int | None,
                        rename: dict[str, str] | None = None) -> SamplingParams:
        kw: dict[str, Any] = dict(
            n=req.n,
            presence_penalty=req.presence_penalty,
            frequency_penalty=req.frequency_penalty,
            seed=req.seed,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            max_tokens=max_tokens if max_tokens is not None else self.default_sampling.get("max_tokens"),
            min_tokens=req.min_tokens,
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            spaces_between_special_tokens=req.spaces_between_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
        )
        for name, default in (("temperature", 1.0), ("top_p", 1.0), ("top_k", 0), ("min_p", 0.0),
                              ("repetition_penalty", 1.0)):
            value = getattr(req, name)
            kw[name] = self.default_sampling.get(name, default) if value is None else value
        try:
            return SamplingParams(**kw)
        except (ValueError, TypeError) as e:
            raise bad_request(e, rename) from e

    def check_length(self, num_prompt: int, max_tokens: int | None, param: str) -> None:
        if max_tokens is not None and num_prompt <= self.max_model_len and num_prompt + max_tokens > self.max_model_len:
            raise OpenAIError(
                f"'max_tokens' or 'max_completion_tokens' is too large: {max_tokens}. This model's "
                f"maximum context length is {self.max_model_len} tokens and your request has "
                f"{num_prompt} input tokens ({max_tokens} > {self.max_model_len} - {num_prompt}).",
                param=param,
            )

    async def start(self, rid: str, prompts: list[list[int]], params: SamplingParams,
                    rename: dict[str, str] | None = None) -> tuple[list[str], list[AsyncIterator[RequestOutput]]]:
        """Add every prompt's request (all or nothing) and return their output iterators."""
        iters: list[AsyncIterator[RequestOutput]] = []
        ids = [rid] if len(prompts) == 1 else [f"{rid}-{i}" for i in range(len(prompts))]
        try:
            for sub_id, prompt in zip(ids, prompts):
                iters.append(await self.llm.add_request(sub_id, {"prompt_token_ids": prompt}, params))
        except BaseException as e:
            for sub_id in ids:
                self.llm.abort(sub_id)
            if isinstance(e, (ValueError, TypeError)):
                raise bad_request(e, rename) from e
            raise
        return ids, iters

    async def close(self, ids: list[str], iters: list[AsyncIterator[RequestOutput]]) -> None:
        """Abort whatever is unfinished (idempotent; an iterator never started has no finally)."""
        for sub_id in ids:
            self.llm.abort(sub_id)
        for it in iters:
            await it.aclose()  # type: ignore[attr-defined]

    async def collect(self, iters: list[AsyncIterator[RequestOutput]], n: int,
                      is_disconnected: Callable[[], Awaitable[bool]]) -> list[list[CompletionOutput]]:
        """Gather every choice's full output, aborting everything if the client goes away."""
        results: list[list[CompletionOutput]] = [
            [CompletionOutput(j, "", [], None, None) for j in range(n)] for _ in iters
        ]

        async def consume() -> None:
            async for i, out in merge_streams(iters):
                for c in out.outputs:
                    acc = results[i][c.index]
                    acc.text += c.text
                    acc.token_ids.extend(c.token_ids)
                    if c.logprobs is not None:
                        acc.logprobs = (acc.logprobs or []) + c.logprobs
                    acc.finish_reason, acc.stop_reason = c.finish_reason, c.stop_reason

        task = asyncio.create_task(consume())
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.2)
                if done:
                    try:
                        task.result()
                    except EngineDeadError as e:
                        raise OpenAIError(str(e), 503, "ServiceUnavailableError") from e
                    except (RuntimeError, ValueError) as e:  # a failed engine step
                        raise OpenAIError(str(e), 500, "InternalServerError") from e
                    return results
                if await is_disconnected():
                    raise ClientDisconnected()
        finally:
            if not task.done():
                task.cancel()
                try:
                    await task
                except BaseException:  # noqa: BLE001
                    pass

    def _decode(self, tid: int, lp: Any) -> str:
        if lp is not None and lp.decoded_token is not None:
            return lp.decoded_token
        return self.llm.engine.decoder.decode([tid], skip_special_tokens=False)

    def usage(self, prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens}

    # ---- completions ---------------------------------------------------------------------------
    async def _completion_prompts(self, prompt: Any) -> list[list[int]]:
        if isinstance(prompt, str):
            prompt = [prompt]
        elif prompt and isinstance(prompt[0], int):
            prompt = [prompt]
        if not prompt:
            raise OpenAIError("prompt cannot be empty", param="prompt")
        out: list[list[int]] = []
        for p in prompt:
            if isinstance(p, str):
                if not p:
                    raise OpenAIError("The decoder prompt cannot be empty", param="prompt")
                if self.tokenizer is not None:
                    p = await self.tokenizer.encode(p)
                else:
                    p = (await self.llm.call(lambda eng, p=p: eng.tokenize(p)))[1]
            out.append(list(p))
        return out

    def completion_logprobs(self, c: CompletionOutput, num: int, offset: int) -> dict[str, Any]:
        tokens, token_lps, tops, offsets = [], [], [], []
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            lp = entry.get(tid)
            tok = self._decode(tid, lp)
            tokens.append(tok)
            token_lps.append(_clamp(lp.logprob) if lp is not None else None)
            tops.append({self._decode(t, p): _clamp(p.logprob)
                         for i, (t, p) in enumerate(entry.items()) if num >= i})
            offsets.append(offset)
            offset += len(tok)
        return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}

    async def create_completion(self, req: CompletionRequest,
                                is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any] | AsyncIterator[bytes]:
        self.check_model(req.model)
        self.check_common(req)
        params = self.sampling_params(req, req.max_tokens, req.logprobs)
        prompts = await self._completion_prompts(req.prompt)
        for p in prompts:
            self.check_length(len(p), req.max_tokens, "max_tokens")
        rid = f"cmpl-{req.request_id or random_uuid()}"
        created = now()
        ids, iters = await self.start(rid, prompts, params)
        n = params.n
        if req.stream:
            return self._completion_stream(req, rid, created, prompts, ids, iters, n)
        try:
            results = await self.collect(iters, n, is_disconnected)
        finally:
            await self.close(ids, iters)
        choices, completion_tokens = [], 0
        for i, outs in enumerate(results):
            for c in outs:
                completion_tokens += len(c.token_ids)
                choice: dict[str, Any] = {
                    "index": i * n + c.index,
                    "text": c.text,
                    "logprobs": self.completion_logprobs(c, req.logprobs, 0) if req.logprobs is not None else None,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                }
                if req.return_token_ids:
                    choice["prompt_token_ids"] = prompts[i]
                    choice["token_ids"] = c.token_ids
                choices.append(choice)
        return {
            "id": rid, "object": "text_completion", "created": created, "model": self.model_name,
            "choices": choices,
            "usage": self.usage(sum(len(p) for p in prompts), completion_tokens),
        }

    async def _completion_stream(self, req: CompletionRequest, rid: str, created: int,
                                 prompts: list[list[int]], ids: list[str], iters: list[AsyncIterator[RequestOutput]],
                                 n: int) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        offsets = [[0] * n for _ in prompts]
        completion_tokens = 0
        base = {"id": rid, "object": "text_completion", "created": created, "model": self.model_name}
        try:
            async for i, out in merge_streams(iters):
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    lps = None
                    if req.logprobs is not None:
                        lps = self.completion_logprobs(c, req.logprobs, offsets[i][c.index])
                    offsets[i][c.index] += len(c.text)
                    choice: dict[str, Any] = {"index": i * n + c.index, "text": c.text, "logprobs": lps,
                                              "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
                    if req.return_token_ids:
                        choice["token_ids"] = c.token_ids
                    chunk = dict(base, choices=[choice])
                    if include_usage:
                        chunk["usage"] = None
                    yield sse_event(chunk)
            if include_usage:
                yield sse_event(dict(base, choices=[], usage=self.usage(sum(len(p) for p in prompts), completion_tokens)))
        except (ValueError, RuntimeError) as e:
            yield _error_event(e)
        finally:
            await self.close(ids, iters)
        yield SSE_DONE

    # ---- chat ----------------------------------------------------------------------------------
    @staticmethod
    def _messages(req: ChatCompletionRequest) -> list[dict[str, Any]]:
        msgs = []
        for m in req.messages:
            content = m.content
            if isinstance(content, list):
                parts = []
                for part in content:
                    if part.get("type") != "text" or not isinstance(part.get("text"), str):
                        raise OpenAIError("Only text content parts are supported.", param="messages")
                    parts.append(part["text"])
                content = "\n".join(parts)
            msgs.append({"role": m.role, "content": content or ""})
        return msgs

    async def _chat_prompt(self, req: ChatCompletionRequest) -> list[int]:
        msgs = self._messages(req)
        if req.continue_final_message and req.add_generation_prompt:
            raise OpenAIError("Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                              param="continue_final_message")

        def render(tokenizer: Any) -> list[int]:
            ids = tokenizer.apply_chat_template(
                msgs, add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message, tokenize=True, return_dict=False,
                **(req.chat_template_kwargs or {}),
            )
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            return list(ids)

        try:
            if self.tokenizer is None:
                return await self.llm.call(lambda eng: render(eng.tokenizer))
            return await self.tokenizer.run(render)
        except OpenAIError:
            raise
        except Exception as e:  # jinja errors (roles must alternate, ...), bad kwargs
            raise OpenAIError(f"Error applying the chat template: {e}", param="messages") from e

    def chat_logprobs(self, c: CompletionOutput, top: int) -> dict[str, Any]:
        content = []
        for tid, entry in zip(c.token_ids, c.logprobs or []):
            lp = entry.get(tid)
            tok = self._decode(tid, lp)
            content.append({
                "token": tok, "logprob": _clamp(lp.logprob) if lp is not None else -9999.0,
                "bytes": list(tok.encode("utf-8")),
                "top_logprobs": [
                    {"token": (d := self._decode(t, p)), "logprob": _clamp(p.logprob), "bytes": list(d.encode("utf-8"))}
                    for i, (t, p) in enumerate(entry.items()) if top and i < top
                ],
            })
        return {"content": content}

    async def create_chat_completion(self, req: ChatCompletionRequest,
                                     is_disconnected: Callable[[], Awaitable[bool]]) -> dict[str, Any] | AsyncIterator[bytes]:
        self.check_model(req.model)
        self.check_common(req)
        max_tokens, mt_param = req.max_tokens, "max_tokens"
        if req.max_completion_tokens is not None:
            max_tokens, mt_param = req.max_completion_tokens, "max_completion_tokens"
        top = req.top_logprobs or 0
        if req.top_logprobs and not req.logprobs:
            raise OpenAIError("when using `top_logprobs`, `logprobs` must be set to true.", param="top_logprobs")
        if top < 0:
            raise OpenAIError("`top_logprobs` must be a positive value.", param="top_logprobs")
        rename = {"max_tokens": mt_param, "logprobs": "top_logprobs"}
        params = self.sampling_params(req, max_tokens, top if req.logprobs else None, rename)
        prompt = await self._chat_prompt(req)
        self.check_length(len(prompt), max_tokens, mt_param)
        rid = f"chatcmpl-{req.request_id or random_uuid()}"
        created = now()
        ids, iters = await self.start(rid, [prompt], params, rename)
        n = params.n
        if req.stream:
            return self._chat_stream(req, rid, created, prompt, ids, iters, n, top)
        try:
            results = await self.collect(iters, n, is_disconnected)
        finally:
            await self.close(ids, iters)
        choices, completion_tokens = [], 0
        for c in results[0]:
            completion_tokens += len(c.token_ids)
            choice: dict[str, Any] = {
                "index": c.index,
                "message": {"role": "assistant", "content": c.text, "tool_calls": []},
                "logprobs": self.chat_logprobs(c, top) if req.logprobs else None,
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            }
            if req.return_token_ids:
                choice["token_ids"] = c.token_ids
            choices.append(choice)
        out: dict[str, Any] = {
            "id": rid, "object": "chat.completion", "created": created, "model": self.model_name,
            "choices": choices, "usage": self.usage(len(prompt), completion_tokens),
        }
        if req.return_token_ids:
            out["prompt_token_ids"] = prompt
        return out

    async def _chat_stream(self, req: ChatCompletionRequest, rid: str, created: int, prompt: list[int], ids: list[str],
                           iters: list[AsyncIterator[RequestOutput]], n: int, top: int) -> AsyncIterator[bytes]:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        base = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": self.model_name}
        completion_tokens = 0

        def chunk(choice: dict[str, Any]) -> bytes:
            body = dict(base, choices=[choice])
            if include_usage:
                body["usage"] = None
            return sse_event(body)

        try:
            for j in range(n):
                yield chunk({"index": j, "delta": {"role": "assistant", "content": ""},
                             "logprobs": None, "finish_reason": None})
            async for _, out in merge_streams(iters):
                for c in out.outputs:
                    completion_tokens += len(c.token_ids)
                    if not c.text and not c.token_ids and c.finish_reason is None:
                        continue
                    choice: dict[str, Any] = {
                        "index": c.index, "delta": {"content": c.text} if c.text or c.finish_reason is None else {},
                        "logprobs": self.chat_logprobs(c, top) if req.logprobs else None,
                        "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                    }
                    if req.return_token_ids:
                        choice["token_ids"] = c.token_ids
                    yield chunk(choice)
            if include_usage:
                yield sse_event(dict(base, choices=[], usage=self.usage(len(prompt), completion_tokens)))
        except (ValueError, RuntimeError) as e:
            yield _error_event(e)
        finally:
            await self.close(ids, iters)
        yield SSE_DONE
