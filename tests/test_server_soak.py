"""Soak: hundreds of concurrent requests (completions and chat, streaming and not) against a real
server on the tiny model; 10% are cancelled mid-stream by the client. Every other request must get
exactly its max_tokens, nothing may hang, and afterwards the engine is idle with every KV block free."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from test_server import ServerThread  # noqa: E402  (tests/ is on sys.path under pytest)

openai = pytest.importorskip("openai")

pytestmark = pytest.mark.usefixtures("one_thread")

NUM_REQUESTS = 600
CONCURRENCY = 32
CANCEL_FRACTION = 0.10
OVERALL_TIMEOUT_S = 150


@pytest.fixture(scope="module")
def soak_server(make_tiny_model):
    # 96 blocks (1536 tokens) for 32 concurrent requests of up to ~220 tokens: preemption happens
    srv = ServerThread(make_tiny_model("qwen3"), served_name="tiny", max_model_len=256, max_num_seqs=32,
                       num_gpu_blocks_override=96)
    yield srv
    srv.stop()


def test_soak(soak_server):
    srv = soak_server
    preempted_before = srv.engine.scheduler.num_preemptions
    rng = random.Random(1234)
    aborted_before = srv.aborted()
    plans = []
    for i in range(NUM_REQUESTS):
        plans.append(dict(
            i=i,
            kind=rng.choice(["cmpl", "chat"]),
            stream=rng.random() < 0.7,
            cancel=False,
            prompt=[rng.randrange(3, 512) for _ in range(rng.randint(1, 120))],
            max_tokens=rng.randint(1, 96),
            temperature=rng.choice([0.0, 0.7, 1.0]),
        ))
    for p in rng.sample(plans, int(NUM_REQUESTS * CANCEL_FRACTION)):
        p.update(cancel=True, stream=True, max_tokens=120, cancel_after=rng.randint(1, 4))

    results: dict[int, str] = {}

    async def run_one(client, sem, p) -> None:
        async with sem:
            extra = {"ignore_eos": True, "return_token_ids": True}
            if p["kind"] == "cmpl":
                kw = dict(model="tiny", prompt=p["prompt"], max_tokens=p["max_tokens"],
                          temperature=p["temperature"], extra_body=extra)
                create = client.completions.create
            else:
                text = srv.engine.decoder.decode(p["prompt"][:40])
                kw = dict(model="tiny", messages=[{"role": "user", "content": text}], max_tokens=p["max_tokens"],
                          temperature=p["temperature"], extra_body=extra)
                create = client.chat.completions.create
            if not p["stream"]:
                r = await create(**kw)
                assert r.usage.completion_tokens == p["max_tokens"], p
                assert len(r.choices[0].model_extra["token_ids"]) == p["max_tokens"]
                assert r.choices[0].finish_reason == "length"
                results[p["i"]] = "ok"
                return
            stream = await create(stream=True, stream_options={"include_usage": True}, **kw)
            n_tokens, chunks, usage, finish = 0, 0, None, None
            async for ch in stream:
                if ch.usage is not None:
                    usage = ch.usage
                if not ch.choices:
                    continue
                chunks += 1
                n_tokens += len(ch.choices[0].model_extra.get("token_ids") or [])
                finish = ch.choices[0].finish_reason or finish
                if p["cancel"] and chunks >= p["cancel_after"] + 1:  # +1: the chat role chunk
                    await stream.close()
                    results[p["i"]] = "cancelled"
                    return
            assert not p["cancel"], "a cancelled request ran to completion"
            assert n_tokens == p["max_tokens"], (n_tokens, p)
            assert usage is not None and usage.completion_tokens == p["max_tokens"]
            assert finish == "length"
            results[p["i"]] = "ok"

    async def main() -> None:
        limits = httpx.Limits(max_connections=CONCURRENCY + 8, max_keepalive_connections=CONCURRENCY)
        http = httpx.AsyncClient(limits=limits, timeout=60)
        client = openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, http_client=http)
        sem = asyncio.Semaphore(CONCURRENCY)
        try:
            await asyncio.wait_for(asyncio.gather(*(run_one(client, sem, p) for p in plans)), OVERALL_TIMEOUT_S)
        finally:
            await client.close()

    t0 = time.time()
    asyncio.run(main())
    elapsed = time.time() - t0
    preemptions = srv.engine.scheduler.num_preemptions - preempted_before
    print(f"soak: {NUM_REQUESTS} requests, concurrency {CONCURRENCY}: {elapsed:.1f} s, {preemptions} preemptions")
    assert preemptions > 0  # the small pool really was under pressure
    num_cancel = sum(p["cancel"] for p in plans)
    assert len(results) == NUM_REQUESTS
    assert sum(v == "cancelled" for v in results.values()) == num_cancel
    srv.wait_idle(timeout=10)
    assert srv.aborted() - aborted_before == num_cancel
    assert httpx.get(srv.url + "/health").status_code == 200
