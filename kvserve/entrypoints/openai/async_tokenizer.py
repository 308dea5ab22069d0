"""The API server's tokenizer off its event loop (vLLM's ``AsyncMicrobatchTokenizer``): text prompts
waiting at the same moment are encoded in one batched call of the fast tokenizer on one worker
thread (the Rust encoder releases the GIL, so the loop goes on streaming meanwhile), and every other
use of the tokenizer by the server (chat templates) runs on that same thread, one at a time.

A batch is what arrived within ``batch_wait_timeout_s`` of its first prompt, at most
``max_batch_size`` (vLLM's defaults: 2 ms, 32). A batched encode gives each prompt the ids it gets
alone (no padding, no truncation)."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

T = TypeVar("T")


class AsyncMicrobatchTokenizer:
    def __init__(self, tokenizer: Any, max_batch_size: int = 32, batch_wait_timeout_s: float = 0.002) -> None:
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.batch_wait_timeout_s = batch_wait_timeout_s
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvserve-tokenizer")
        self._queue: asyncio.Queue | None = None
        self._batcher: asyncio.Task | None = None

    async def encode(self, text: str) -> list[int]:
        """``tokenizer(text).input_ids`` (special tokens added as the tokenizer's default)."""
        loop = asyncio.get_running_loop()
        if self._batcher is None or self._batcher.done() or self._batcher.get_loop() is not loop:
            self._queue = asyncio.Queue()
            self._batcher = loop.create_task(self._batch_encode(self._queue), name="kvserve-tokenizer-batcher")
        done: asyncio.Future = loop.create_future()
        self._queue.put_nowait((text, done))
        return await done

    async def run(self, fn: Callable[[Any], T]) -> T:
        """``fn(tokenizer)`` on the tokenizer's thread (e.g. a chat template)."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, fn, self.tokenizer)

    async def _batch_encode(self, queue: asyncio.Queue) -> None:
        loop = asyncio.get_running_loop()
        while True:
            batch = [await queue.get()]
            deadline = loop.time() + self.batch_wait_timeout_s
            while len(batch) < self.max_batch_size:
                if queue.empty():
                    left = deadline - loop.time()
                    if left <= 0:
                        break
                    try:
                        batch.append(await asyncio.wait_for(queue.get(), left))
                    except asyncio.TimeoutError:
                        break
                else:
                    batch.append(queue.get_nowait())
            texts = [t for t, _ in batch]
            try:
                ids = await loop.run_in_executor(self._executor, self._encode_batch, texts)
            except Exception as e:  # a bad text fails its batch alone
                for _, done in batch:
                    if not done.done():
                        done.set_exception(e)
                continue
            for (_, done), one in zip(batch, ids):
                if not done.done():  # (its request may have been cancelled meanwhile)
                    done.set_result(one)

    def _encode_batch(self, texts: list[str]) -> list[list[int]]:
        if len(texts) == 1:
            return [list(self.tokenizer(texts[0]).input_ids)]
        return [list(ids) for ids in self.tokenizer(texts).input_ids]

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
