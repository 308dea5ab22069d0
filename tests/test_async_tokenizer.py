"""The API server's tokenizer off its event loop (``entrypoints/openai/async_tokenizer.py``, vLLM's
``AsyncMicrobatchTokenizer``): prompts that wait together are encoded in one batched call, each getting
exactly the ids it gets alone; a failing batch fails its prompts only; other tokenizer work runs on
the same worker thread, never on the loop's."""

from __future__ import annotations

import asyncio
import threading

import pytest


@pytest.fixture(scope="module")
def tokenizer(make_tiny_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(make_tiny_model("llama"))


class _Counting:
    """The tokenizer, recording the size of every encode call and the thread it ran on."""

    def __init__(self, tok) -> None:
        self.tok, self.calls, self.threads = tok, [], set()

    def __call__(self, text):
        self.calls.append(len(text) if isinstance(text, list) else 1)
        self.threads.add(threading.current_thread().name)
        if text == "boom" or (isinstance(text, list) and "boom" in text):
            raise ValueError("bad text")
        return self.tok(text)


def test_concurrent_prompts_are_batched_and_get_their_own_ids(tokenizer):
    from kvserve.entrypoints.openai.async_tokenizer import AsyncMicrobatchTokenizer

    texts = [f"hello world {i} " + "the quick brown fox " * (i % 7) for i in range(40)]
    counting = _Counting(tokenizer)
    batcher = AsyncMicrobatchTokenizer(counting, max_batch_size=16, batch_wait_timeout_s=0.05)

    async def main():
        got = await asyncio.gather(*(batcher.encode(t) for t in texts))
        alone = await batcher.encode("just one")
        return got, alone

    got, alone = asyncio.run(main())
    assert got == [list(tokenizer(t).input_ids) for t in texts]
    assert alone == list(tokenizer("just one").input_ids)
    # 40 waiting prompts in batches of at most 16, then the lone one
    assert counting.calls[:-1] == [16, 16, 8] and counting.calls[-1] == 1
    assert counting.threads == {n for n in counting.threads if n.startswith("kvserve-tokenizer")}
    batcher.shutdown()


def test_a_failing_batch_fails_its_prompts_only_and_run_uses_the_worker_thread(tokenizer):
    from kvserve.entrypoints.openai.async_tokenizer import AsyncMicrobatchTokenizer

    batcher = AsyncMicrobatchTokenizer(_Counting(tokenizer), max_batch_size=4, batch_wait_timeout_s=0.05)

    async def main():
        bad = await asyncio.gather(batcher.encode("boom"), batcher.encode("fine"), return_exceptions=True)
        after = await batcher.encode("fine")
        name = await batcher.run(lambda tok: threading.current_thread().name)
        return bad, after, name

    bad, after, name = asyncio.run(main())
    assert all(isinstance(b, ValueError) for b in bad)  # one batch: both prompts get its error
    assert after == list(tokenizer("fine").input_ids)  # the batcher goes on
    assert name.startswith("kvserve-tokenizer") and name != threading.current_thread().name
    batcher.shutdown()
