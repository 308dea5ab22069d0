"""The offline API: ``LLM(model=...).generate(prompts, sampling_params)`` and ``.chat(messages)``."""

from __future__ import annotations

import itertools
from typing import Any, Callable, Sequence

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine, PromptInput
from kvserve.engine.outputs import RequestOutput
from kvserve.engine.sampling import RequestOutputKind, SamplingParams

Message = dict[str, Any]


class LLM:
    """Mirrors ``vllm.LLM`` for the features kvserve has. ``model=None`` serves the default model."""

    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        block_size: int = 16,
        max_model_len: int | None = None,
        max_num_seqs: int | None = None,
        max_num_batched_tokens: int | None = None,
        enable_prefix_caching: bool = True,
        enable_chunked_prefill: bool = True,
        kv_cache_memory: int | None = None,
        gpu_memory_utilization: float = 0.9,
        num_gpu_blocks_override: int | None = None,
        seed: int = 0,
        device: str = "auto",
        attention_backend: str = "auto",
        enforce_eager: bool = False,
        max_cudagraph_capture_size: int | None = None,
        load_format: str = "auto",
        skip_tokenizer_init: bool = False,
        async_scheduling: bool | None = None,
        mamba_cache_mode: str = "none",
        mamba_block_size: int | None = None,
        **kwargs: Any,
    ) -> None:
        if kwargs:
            raise TypeError(f"LLM() got unsupported arguments: {sorted(kwargs)}")
        args = EngineArgs(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            block_size=block_size,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            enable_prefix_caching=enable_prefix_caching,
            enable_chunked_prefill=enable_chunked_prefill,
            kv_cache_memory=kv_cache_memory,
            gpu_memory_utilization=gpu_memory_utilization,
            num_gpu_blocks_override=num_gpu_blocks_override,
            seed=seed,
            device=device,
            attention_backend=attention_backend,
            enforce_eager=enforce_eager,
            max_cudagraph_capture_size=max_cudagraph_capture_size,
            load_format=load_format,
            skip_tokenizer_init=skip_tokenizer_init,
            async_scheduling=async_scheduling,
            mamba_cache_mode=mamba_cache_mode,
            mamba_block_size=mamba_block_size,
        )
        self.llm_engine = Engine.from_engine_args(args)
        self.request_counter = itertools.count()

    def get_tokenizer(self) -> Any:
        """The tokenizer; with ``skip_tokenizer_init=True`` there is none and, as vLLM's
        ``LLMEngine.get_tokenizer``, this raises (``llm.llm_engine.tokenizer`` is then None)."""
        tokenizer = self.llm_engine.tokenizer
        if tokenizer is None:
            raise ValueError("Unable to get tokenizer because `skip_tokenizer_init=True`")
        return tokenizer

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
    ) -> list[RequestOutput]:
        """Run prompts (text, token-id lists or ``{"prompt_token_ids": [...]}``) to completion."""
        if not isinstance(prompts, (list, tuple)) or (
            prompts and all(isinstance(t, int) for t in prompts)
        ):
            prompts = [prompts]  # type: ignore[list-item]  # one prompt; add_request validates it
        prompts = list(prompts)  # type: ignore[arg-type]
        if sampling_params is None:
            sampling_params = SamplingParams()
        params_list = (
            [sampling_params] * len(prompts)
            if isinstance(sampling_params, SamplingParams)
            else list(sampling_params)
        )
        if len(params_list) != len(prompts):
            raise ValueError("The lengths of prompts and params must be the same.")
        engine = self.llm_engine
        added: list[str] = []
        try:
            for prompt, params in zip(prompts, params_list):
                params.output_kind = RequestOutputKind.FINAL_ONLY
                rid = str(next(self.request_counter))
                engine.add_request(rid, prompt, params)
                added.append(rid)
        except Exception:
            engine.abort_request(added)  # nothing half-added stays queued
            raise
        return self._run_engine(len(added), use_tqdm)

    def _run_engine(self, num_requests: int, use_tqdm: bool | Callable[..., Any]) -> list[RequestOutput]:
        pbar = None
        if use_tqdm and num_requests:
            from tqdm.auto import tqdm

            make = use_tqdm if callable(use_tqdm) else tqdm
            pbar = make(
                total=num_requests,
                desc="Processed prompts",
                dynamic_ncols=True,
                postfix=f"est. speed input: {0:.2f} toks/s, output: {0:.2f} toks/s",
            )
        outputs: list[RequestOutput] = []
        in_toks = out_toks = 0
        engine = self.llm_engine
        try:
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if not out.finished:
                        continue
                    outputs.append(out)
                    if pbar is not None:
                        in_toks += len(out.prompt_token_ids)
                        out_toks += sum(len(c.token_ids) for c in out.outputs)
                        elapsed = pbar.format_dict["elapsed"] or 1e-9
                        pbar.postfix = (
                            f"est. speed input: {in_toks / elapsed:.2f} toks/s, "
                            f"output: {out_toks / elapsed:.2f} toks/s"
                        )
                        pbar.update(1)
        except BaseException:
            engine.abort_request(list(engine.states))
            raise
        finally:
            if pbar is not None:
                pbar.close()
        return sorted(outputs, key=lambda o: int(o.request_id))

    def chat(
        self,
        messages: list[Message] | list[list[Message]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool | Callable[..., Any] = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the tokenizer's chat template to each conversation, then generate."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        prompts = [
            {"prompt_token_ids": self.apply_chat_template(
                conv, chat_template, add_generation_prompt, continue_final_message, chat_template_kwargs
            )}
            for conv in conversations  # type: ignore[union-attr]
        ]
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def apply_chat_template(
        self,
        conversation: list[Message],
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[int]:
        tok = self.llm_engine.tokenizer
        if tok is None:  # vLLM's renderer: BaseRenderer.get_tokenizer
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        ids = tok.apply_chat_template(
            conversation,
            chat_template=chat_template,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tokenize=True,
            return_dict=False,
            **(chat_template_kwargs or {}),
        )
        return list(ids)
