"""``kvserve bench serve`` against an in-process stub OpenAI-compatible server with known delays."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import json
import socket
import threading
import time
from typing import Any

import pytest

fastapi = pytest.importorskip("fastapi")
uvicorn = pytest.importorskip("uvicorn")
from fastapi.responses import JSONResponse, StreamingResponse  # noqa: E402

from kvserve.bench import add_parser, run  # noqa: E402
from kvserve.bench.datasets import TOKEN_ID_HIGH, TOKEN_ID_LOW, random_requests  # noqa: E402
from kvserve.bench.serve import (  # noqa: E402
    RequestResult,
    _SSEMessages,
    ServerUnreachable,
    arrival_times,
    calculate_metrics,
    format_result,
)

TTFT_S = 0.020  # stub: delay before the first token
ITL_S = 0.005  # stub: delay between tokens
CHAT_TEMPLATE_TOKENS = 5


class StubState:
    def __init__(self) -> None:
        self.reset()

    def reset(self, *, usage: bool = True, fail_every: int = 0, tokens_per_chunk: int = 1) -> None:
        self.usage = usage
        self.fail_every = fail_every  # every fail_every-th request (1-based) answers HTTP 500
        self.tokens_per_chunk = tokens_per_chunk
        self.count = 0
        self.inflight = 0
        self.max_inflight = 0
        self.bodies: list[dict[str, Any]] = []
        self.auth: list[str | None] = []
        self.arrivals: list[float] = []
        self.lock = threading.Lock()


STATE = StubState()


def _make_app() -> Any:
    app = fastapi.FastAPI()

    @app.get("/v1/models")
    async def models() -> Any:
        return {"object": "list", "data": [{"id": "stub-model", "object": "model"}]}

    async def _serve(body: dict[str, Any], chat: bool) -> Any:
        with STATE.lock:
            STATE.count += 1
            n = STATE.count
            STATE.bodies.append(body)
            STATE.arrivals.append(time.perf_counter())
        if STATE.fail_every and n % STATE.fail_every == 0:
            return JSONResponse({"error": {"message": "stub failure", "type": "InternalServerError"}}, 500)
        max_tokens = int(body.get("max_completion_tokens") or body.get("max_tokens") or 16)
        if chat:
            prompt_tokens = len(body["messages"][-1]["content"].split()) + CHAT_TEMPLATE_TOKENS
        else:
            p = body["prompt"]
            prompt_tokens = len(p) if isinstance(p, list) else len(p.split())
        include_usage = bool((body.get("stream_options") or {}).get("include_usage")) and STATE.usage

        def chunk(text: str, finish: str | None) -> str:
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish}
            if chat:
                choice["delta"] = {"content": text}
            else:
                choice["text"] = text
            return "data: " + json.dumps({"id": f"r{n}", "model": "stub-model", "choices": [choice]}) + "\n\n"

        async def gen() -> Any:
            with STATE.lock:
                STATE.inflight += 1
                STATE.max_inflight = max(STATE.max_inflight, STATE.inflight)
            try:
                if chat:  # the role chunk comes at once and carries no token: not the first token
                    yield "data: " + json.dumps({"choices": [{"index": 0, "delta": {"role": "assistant",
                                                                                   "content": ""}}]}) + "\n\n"
                await asyncio.sleep(TTFT_S)
                sent = 0
                while sent < max_tokens:
                    if sent:
                        await asyncio.sleep(ITL_S)
                    k = min(STATE.tokens_per_chunk, max_tokens - sent)
                    sent += k
                    yield chunk(" tok" * k, "length" if sent == max_tokens else None)
                if include_usage:
                    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": sent,
                             "total_tokens": prompt_tokens + sent}
                    yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
                yield "data: [DONE]\n\n"
            finally:
                with STATE.lock:
                    STATE.inflight -= 1

        return StreamingResponse(gen(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(request: fastapi.Request) -> Any:
        STATE.auth.append(request.headers.get("authorization"))
        return await _serve(await request.json(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: fastapi.Request) -> Any:
        return await _serve(await request.json(), chat=True)

    return app


@pytest.fixture(scope="module")
def stub_url() -> Any:
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_make_app(), log_level="error", lifespan="off"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.time() + 10
    while not server.started:
        assert time.time() < deadline, "stub server did not start"
        time.sleep(0.02)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(timeout=5)
    sock.close()


@pytest.fixture(autouse=True)
def _reset_stub() -> None:
    STATE.reset()


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="kvserve")
    add_parser(parser.add_subparsers(dest="command", required=True))
    return parser.parse_args(["bench", "serve", *argv])


def _bench(url: str, *extra: str, json_out: bool = True) -> tuple[int, Any, str]:
    argv = ["--base-url", url, "--disable-tqdm", *(["--json"] if json_out else []), *extra]
    args = _parse(argv)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = args.func(args)
    text = out.getvalue()
    return rc, (json.loads(text) if json_out else text), err.getvalue()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- benchmarks against the stub


def test_completions_counts_timings_and_payload(stub_url: str) -> None:
    rc, r, _ = _bench(stub_url, "--input-len", "16", "--output-len", "10", "--num-prompts", "8",
                      "--max-concurrency", "4")
    assert rc == 0
    assert (r["completed"], r["failed"]) == (8, 0)
    assert r["total_input_tokens"] == 8 * 16
    assert r["total_output_tokens"] == 8 * 10
    assert r["model_id"] == "stub-model"  # from GET /v1/models
    # known delays: TTFT >= 20 ms, TPOT / ITL >= 5 ms, e2e >= 20 + 9 * 5 ms (upper bounds generous)
    assert 19.0 <= r["median_ttft_ms"] < 500
    assert 4.5 <= r["median_tpot_ms"] < 100
    assert 4.5 <= r["median_itl_ms"] < 100
    assert r["mean_e2el_ms"] >= 19.0 + 9 * 4.5
    assert r["mean_e2el_ms"] > r["mean_ttft_ms"]
    assert r["p99_ttft_ms"] >= r["median_ttft_ms"]
    assert r["output_throughput"] == pytest.approx(80 / r["duration"])
    assert r["request_throughput"] == pytest.approx(8 / r["duration"])
    assert r["total_token_throughput"] == pytest.approx((80 + 128) / r["duration"])
    # 1 ready-check request + 8 measured; token-id prompts, vLLM's streaming fields
    assert len(STATE.bodies) == 9
    body = STATE.bodies[-1]
    assert isinstance(body["prompt"], list) and len(body["prompt"]) == 16
    assert all(TOKEN_ID_LOW <= t < TOKEN_ID_HIGH for t in body["prompt"])
    assert body["max_tokens"] == 10 and body["stream"] is True and body["ignore_eos"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["model"] == "stub-model" and body["temperature"] == 0.0


def test_api_key_header_and_extra_body(stub_url: str, monkeypatch: Any) -> None:
    monkeypatch.setenv("OPENAI_API_KEY", "from-env")
    _bench(stub_url, "--model", "m", "--input-len", "4", "--output-len", "2", "--num-prompts", "2")
    assert set(STATE.auth) == {"Bearer from-env"}
    STATE.reset()
    _bench(stub_url, "--model", "m", "--input-len", "4", "--output-len", "2", "--num-prompts", "2",
           "--api-key", "sk-1", "--no-ignore-eos", "--extra-body", '{"top_p": 0.5}')
    assert set(STATE.auth) == {"Bearer sk-1"}
    assert "ignore_eos" not in STATE.bodies[-1] and STATE.bodies[-1]["top_p"] == 0.5


def test_chat_endpoint_skips_role_chunk_and_uses_usage(stub_url: str) -> None:
    rc, r, _ = _bench(stub_url, "--endpoint", "/v1/chat/completions", "--model", "m", "--input-len", "12",
                      "--output-len", "6", "--num-prompts", "4")
    assert rc == 0 and (r["completed"], r["failed"]) == (4, 0)
    assert r["total_output_tokens"] == 24
    assert r["total_input_tokens"] == 4 * (12 + CHAT_TEMPLATE_TOKENS)  # server usage (template included)
    assert r["median_ttft_ms"] >= 19.0  # the immediate role chunk is not the first token
    body = STATE.bodies[-1]
    assert len(body["messages"][0]["content"].split()) == 12
    assert body["max_completion_tokens"] == 6 and body["max_tokens"] == 6
    assert r["endpoint_type"] == "openai-chat"


def test_output_tokens_from_chunks_without_usage(stub_url: str) -> None:
    STATE.reset(usage=False, tokens_per_chunk=1)
    _, r, _ = _bench(stub_url, "--input-len", "8", "--output-len", "5", "--num-prompts", "3", "--num-warmups", "2")
    assert r["total_output_tokens"] == 15 and r["completed"] == 3
    assert len(STATE.bodies) == 1 + 2 + 3  # ready check, warm-ups (not measured), measured
    # with usage, several tokens per chunk: tokens from usage, ITL per chunk
    STATE.reset(usage=True, tokens_per_chunk=2)
    _, r, _ = _bench(stub_url, "--input-len", "8", "--output-len", "6", "--num-prompts", "3", "--save-detailed")
    assert r["total_output_tokens"] == 18
    assert all(len(itl) == 2 for itl in r["itls"])  # 3 chunks -> 2 gaps
    assert r["output_lens"] == [6, 6, 6]


def test_range_ratio_lengths(stub_url: str) -> None:
    _, r, _ = _bench(stub_url, "--input-len", "20", "--output-len", "8", "--range-ratio", "0.5",
                     "--num-prompts", "10", "--seed", "3", "--save-detailed")
    reqs = random_requests(10, 20, 8, 0.5, seed=3)
    assert r["input_lens"] == [q.prompt_len for q in reqs]
    assert r["output_lens"] == [q.expected_output_len for q in reqs]
    assert all(10 <= n <= 30 for n in r["input_lens"]) and all(4 <= n <= 12 for n in r["output_lens"])
    assert len(set(r["input_lens"])) > 1
    assert r["total_output_tokens"] == sum(r["output_lens"])


def test_concurrency_limit_respected(stub_url: str) -> None:
    _, r, _ = _bench(stub_url, "--input-len", "4", "--output-len", "6", "--num-prompts", "12",
                     "--max-concurrency", "3")
    assert r["completed"] == 12
    assert STATE.max_inflight == 3
    assert r["max_concurrency"] == 3 and r["max_concurrent_requests"] == 3


def test_request_rate_pacing(stub_url: str) -> None:
    # 10 requests at 20 req/s: arrivals rescaled so the last is sent at 10 / 20 = 0.5 s
    _, r, _ = _bench(stub_url, "--input-len", "4", "--output-len", "2", "--num-prompts", "10",
                     "--request-rate", "20", "--seed", "1")
    assert r["completed"] == 10 and r["request_rate"] == 20
    assert 0.5 <= r["duration"] < 2.0
    arr = STATE.arrivals[1:]  # skip the ready check
    assert 0.4 <= arr[-1] - arr[0] <= 1.0
    # unlimited rate: all at once, far quicker
    STATE.reset()
    _, r, _ = _bench(stub_url, "--input-len", "4", "--output-len", "2", "--num-prompts", "10")
    assert r["duration"] < 0.45 and r["request_rate"] == "inf"


def test_sse_messages_split_across_reads() -> None:
    """Events reach the client in reads that cut them anywhere: each event comes out once, whole,
    when its blank line has arrived (LF or CRLF), several per read if a read holds several; an
    unterminated tail waits for the next read."""
    stream = (b'data: {"a": 1}\n\n' b'data: {"b": 2}\r\n\r\n' b": comment\n\n" b"data: [DONE]\n\n")
    whole = ['data: {"a": 1}', 'data: {"b": 2}', ": comment", "data: [DONE]"]
    for cut in range(1, len(stream)):
        for size in (cut, 1):  # two reads at every cut, and one byte a read
            sse, got = _SSEMessages(), []
            pieces = [stream[:cut], stream[cut:]] if size == cut else [stream[i:i + 1] for i in range(len(stream))]
            for piece in pieces:
                got += sse.feed(piece)
            assert got == whole, (cut, size)
    sse = _SSEMessages()
    assert sse.feed(b'data: {"a": 1}\n\ndata: {"b"') == ['data: {"a": 1}']  # the tail is held back
    assert sse.feed(b": 2}\n\n") == ['data: {"b": 2}']


def test_arrival_times_seeded_poisson() -> None:
    a = arrival_times(200, 10.0, seed=7)
    assert a == arrival_times(200, 10.0, seed=7)
    assert a != arrival_times(200, 10.0, seed=8)
    assert a[-1] == pytest.approx(20.0) and all(x < y for x, y in zip(a, a[1:]))
    gaps = [y - x for x, y in zip(a, a[1:])]
    assert 0.05 < sum(gaps) / len(gaps) < 0.15  # mean 1 / rate
    assert max(gaps) > 3 * min(gaps)  # exponential, not uniform
    assert arrival_times(5, float("inf")) == [0.0] * 5
    assert arrival_times(4, 2.0, burstiness=float("inf")) == pytest.approx([0.5, 1.0, 1.5, 2.0])


def test_json_has_all_keys_and_result_file(stub_url: str, tmp_path: Any) -> None:
    f = tmp_path / "res.json"
    rc, r, err = _bench(stub_url, "--input-len", "4", "--output-len", "3", "--num-prompts", "2",
                        "--result-file", str(f), "--metric-percentiles", "50,99")
    assert rc == 0
    keys = ["duration", "completed", "failed", "total_input_tokens", "total_output_tokens", "request_throughput",
            "output_throughput", "total_token_throughput", "max_output_tokens_per_s", "max_concurrent_requests"]
    for m in ("ttft", "tpot", "itl", "e2el"):
        keys += [f"mean_{m}_ms", f"median_{m}_ms", f"std_{m}_ms", f"p50_{m}_ms", f"p99_{m}_ms"]
    for k in keys:
        assert isinstance(r[k], (int, float)) and not isinstance(r[k], bool), k
    assert json.loads(f.read_text()) == r
    assert "Starting main benchmark run..." in err  # progress lines go to stderr with --json


def test_printed_table_layout(stub_url: str) -> None:
    rc, text, _ = _bench(stub_url, "--input-len", "4", "--output-len", "3", "--num-prompts", "2",
                         "--max-concurrency", "2", json_out=False)
    assert rc == 0
    lines = text.splitlines()
    i = lines.index("============ Serving Benchmark Result ============")
    table = lines[i:]
    labels = ["Successful requests:", "Failed requests:", "Maximum request concurrency:", "Benchmark duration (s):",
              "Total input tokens:", "Total generated tokens:", "Request throughput (req/s):",
              "Output token throughput (tok/s):", "Total Token throughput (tok/s):",
              "---------------Time to First Token----------------", "Mean TTFT (ms):", "Median TTFT (ms):",
              "P99 TTFT (ms):", "-----Time per Output Token (excl. 1st token)------", "Mean TPOT (ms):",
              "---------------Inter-token Latency----------------", "Mean ITL (ms):", "P99 ITL (ms):",
              "----------------End-to-end Latency----------------", "Mean E2EL (ms):", "P99 E2EL (ms):"]
    for label in labels:
        assert any(line.startswith(label) for line in table), label
    assert table[-1] == "=" * 50
    row = next(line for line in table if line.startswith("Successful requests:"))
    assert row[41:].strip() == "2"  # value column at 41, as vLLM's "{:<40} {:<10}"
    assert "Traffic request rate: inf" in text and "Maximum request concurrency: 2" in text


def test_sweep_writes_png(stub_url: str, tmp_path: Any) -> None:
    png = tmp_path / "sweep.png"
    res = tmp_path / "sweep.json"
    rc, text, _ = _bench(stub_url, "--input-len", "4", "--output-len", "4", "--num-prompts", "4",
                         "--sweep-concurrency", "1,2,4", "--plot", str(png), "--result-file", str(res),
                         json_out=False)
    assert rc == 0
    assert png.stat().st_size > 1000 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads(res.read_text())
    assert doc["sweep_concurrency"] == [1, 2, 4]
    assert [r["max_concurrency"] for r in doc["results"]] == [1, 2, 4]
    assert all(r["completed"] == 4 for r in doc["results"])
    assert text.count("Serving Benchmark Result") == 3 and "Concurrency Sweep" in text
    # more concurrency, shorter run (requests overlap)
    assert doc["results"][2]["duration"] < doc["results"][0]["duration"]


def test_failed_requests_counted(stub_url: str) -> None:
    STATE.reset(fail_every=3)  # requests 3, 6, 9 (1-based, ready check is 1) answer HTTP 500
    rc, r, err = _bench(stub_url, "--input-len", "4", "--output-len", "3", "--num-prompts", "9",
                        "--save-detailed", "--max-concurrency", "1")
    assert rc == 0
    assert (r["completed"], r["failed"]) == (6, 3)
    assert r["total_output_tokens"] == 18 and r["total_input_tokens"] == 24
    assert sum("HTTP 500" in e and "stub failure" in e for e in r["errors"]) == 3
    assert "3 of 9 requests failed" in err


def test_all_failed_after_ready_check_exits_1(stub_url: str) -> None:
    STATE.reset()
    STATE.fail_every = 1
    with pytest.raises(RuntimeError, match="initial test request .* failed: HTTP 500"):
        _bench(stub_url, "--model", "m", "--input-len", "4", "--output-len", "3", "--num-prompts", "2")


# --------------------------------------------------------------------------- errors


def test_unreachable_server() -> None:
    url = f"http://127.0.0.1:{_free_port()}"
    with pytest.raises(ServerUnreachable, match=f"cannot reach the server at {url}"):
        _bench(url, "--num-prompts", "1")
    with pytest.raises(ServerUnreachable, match="cannot reach"):
        _bench(url, "--model", "m", "--num-prompts", "1")


def test_unreachable_server_through_cli(capsys: Any) -> None:
    from kvserve.entrypoints import cli

    if "bench" not in cli.build_parser()._subparsers._group_actions[0].choices:  # type: ignore[union-attr]
        pytest.skip("bench is not wired into kvserve.entrypoints.cli yet")
    rc = cli.main(["bench", "serve", "--base-url", f"http://127.0.0.1:{_free_port()}", "--num-prompts", "1"])
    err = capsys.readouterr().err
    assert rc != 0 and "kvserve: error: cannot reach the server" in err and "Traceback" not in err


@pytest.mark.parametrize("argv, match", [
    (["--endpoint", "/v1/embeddings"], r"--endpoint '/v1/embeddings' is not supported: expected one of"),
    (["--dataset", "sharegpt"], r"--dataset 'sharegpt' is not supported: expected one of random"),
    (["--range-ratio", "1.5"], r"--range-ratio 1.5 is invalid: expected a number in \[0, 1\)"),
    (["--request-rate", "0"], r"--request-rate 0.0 is invalid: expected a number > 0 or inf"),
    (["--num-prompts", "0"], r"--num-prompts 0 is invalid: expected an integer >= 1"),
    (["--max-concurrency", "0"], r"--max-concurrency 0 is invalid"),
    (["--sweep-concurrency", "1,x"], r"--sweep-concurrency '1,x' is invalid: expected a comma-separated list"),
    (["--plot", "a.png"], r"--plot 'a.png' needs --sweep-concurrency"),
    (["--sweep-concurrency", "1,2", "--plot", "a.svg"], r"--plot 'a.svg' is invalid: expected a .png"),
    (["--percentile-metrics", "ttft,foo"], r"--percentile-metrics 'ttft,foo' is invalid"),
    (["--metric-percentiles", "100"], r"--metric-percentiles '100' is invalid"),
    (["--extra-body", "[1]"], r"--extra-body '\[1\]' is invalid: expected a JSON object"),
    (["--base-url", "localhost:8000"], r"--base-url 'localhost:8000' is invalid: expected an http"),
    (["--tokenizer", "/nonexistent/tok"], r"--tokenizer '/nonexistent/tok' could not be loaded"),
])
def test_bad_arguments(argv: list[str], match: str, stub_url: str) -> None:
    base = ["--base-url", stub_url, "--model", "m", "--num-prompts", "2", "--input-len", "4", "--output-len", "2"]
    args = _parse(base + argv)
    with pytest.raises(ValueError, match=match):
        run(args)


# --------------------------------------------------------------------------- pure parts


def test_metrics_definitions() -> None:
    outs = [RequestResult(success=True, prompt_len=10, output_tokens=5, ttft=0.1, latency=0.5,
                          itl=[0.1, 0.1, 0.1, 0.1], start_time=0.0),
            RequestResult(success=True, prompt_len=20, output_tokens=1, ttft=0.2, latency=0.2, itl=[], start_time=0.0),
            RequestResult(success=False, error="x")]
    m = calculate_metrics(outs, 2.0, [99.0])
    assert (m["completed"], m["failed"], m["total_input_tokens"], m["total_output_tokens"]) == (2, 1, 30, 6)
    assert m["mean_tpot_ms"] == pytest.approx(100.0)  # (0.5 - 0.1) / (5 - 1); 1-token request has no TPOT
    assert m["mean_ttft_ms"] == pytest.approx(150.0) and m["median_e2el_ms"] == pytest.approx(350.0)
    assert m["mean_itl_ms"] == pytest.approx(100.0)
    assert m["request_throughput"] == 1.0 and m["output_throughput"] == 3.0 and m["total_token_throughput"] == 18.0
    text = format_result({**m, "max_concurrency": None, "request_rate": 4.0}, ["ttft"], [99.0])
    assert "Request rate configured (RPS):".ljust(41) + "4.00" in text and "TPOT" not in text


def test_random_dataset_deterministic_and_chat_words() -> None:
    a = random_requests(5, 32, 8, 0.25, seed=11)
    assert [q.prompt for q in a] == [q.prompt for q in random_requests(5, 32, 8, 0.25, seed=11)]
    assert all(isinstance(q.prompt, list) and len(q.prompt) == q.prompt_len for q in a)
    c = random_requests(3, 10, 4, seed=0, chat=True)
    assert all(isinstance(q.prompt, str) and len(q.prompt.split()) == 10 and not q.exact_prompt_len for q in c)
    with pytest.raises(ValueError, match="range_ratio 1 is invalid"):
        random_requests(1, 4, 4, 1)


def test_tokenizer_prompts_are_text_of_exact_length(stub_url: str, tmp_path: Any) -> None:
    from conftest import _build_tokenizer
    from transformers import AutoTokenizer

    _build_tokenizer(tmp_path)
    _, r, _ = _bench(stub_url, "--tokenizer", str(tmp_path), "--input-len", "24", "--output-len", "3",
                     "--num-prompts", "3", "--range-ratio", "0.3")
    tok = AutoTokenizer.from_pretrained(tmp_path)
    prompts = [b["prompt"] for b in STATE.bodies[1:]]
    assert all(isinstance(p, str) for p in prompts)
    lens = [len(tok.encode(p, add_special_tokens=False)) for p in prompts]
    assert sum(lens) == r["total_input_tokens"] and all(16 <= n <= 32 for n in lens)
    assert r["tokenizer_id"] == str(tmp_path)
