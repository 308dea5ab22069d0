"""``kvserve bench serve``: load-test an OpenAI-compatible server, as ``vllm bench serve`` does.

Streams ``--num-prompts`` requests (random dataset, ``kvserve.bench.datasets``) to
``--base-url`` + ``--endpoint`` with at most ``--max-concurrency`` in flight, sent at time 0
(``--request-rate inf``) or at Poisson arrival times (gamma with ``--burstiness`` != 1) whose
total span is normalised to ``num_prompts / request_rate``, and reports vLLM's table.

Per request (client clock, ``time.perf_counter``):

    TTFT    = first streamed chunk carrying text - request sent
    ITL     = gaps between consecutive chunks carrying text (one per gap, all requests pooled)
    E2EL    = last chunk carrying text - request sent
    TPOT    = (E2EL - TTFT) / (output tokens - 1), requests with more than one output token
    output tokens = ``usage.completion_tokens`` of the stream (``stream_options.include_usage``),
                    else the number of chunks carrying text

Throughputs divide by the benchmark duration (first send to last response). A request is failed
when the HTTP status is not 200, the stream carries an ``error`` object, it ends with no text
chunk, or the connection breaks. The server should honour ``ignore_eos`` (vLLM, SGLang do; on by
default here, unlike vLLM) so every request generates ``max_tokens``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, AsyncIterator, Callable

from kvserve.bench.datasets import DATASETS, SampleRequest

ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
METRICS = ("ttft", "tpot", "itl", "e2el")
_HEADERS = {"ttft": ("TTFT", "Time to First Token"), "tpot": ("TPOT", "Time per Output Token (excl. 1st token)"),
            "itl": ("ITL", "Inter-token Latency"), "e2el": ("E2EL", "End-to-end Latency")}


class ServerUnreachable(RuntimeError):
    """The server could not be connected to."""


@dataclass
class RequestResult:
    success: bool = False
    error: str = ""
    prompt_len: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    latency: float = 0.0
    itl: list[float] = field(default_factory=list)
    start_time: float = 0.0
    generated_text: str = ""
    connect_error: bool = False


# --------------------------------------------------------------------------- argument checks


def _positive_int(name: str, v: Any, lo: int = 1) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < lo:
        raise ValueError(f"{name} {v!r} is invalid: expected an integer >= {lo}")
    return v


def parse_int_list(name: str, text: str) -> list[int]:
    """``"1,2,4,8"`` -> ``[1, 2, 4, 8]`` (each >= 1)."""
    out = []
    for part in str(text).split(","):
        part = part.strip()
        try:
            v = int(part)
        except ValueError:
            v = None
        if v is None or v < 1:
            raise ValueError(f"{name} {text!r} is invalid: expected a comma-separated list of integers >= 1 "
                             f"(e.g. 1,2,4,8); {part!r} is not one")
        out.append(v)
    return out


def parse_percentiles(text: str) -> list[float]:
    out = []
    for part in str(text).split(","):
        try:
            p = float(part)
        except ValueError:
            p = float("nan")
        if not 0 < p < 100:
            raise ValueError(f"--metric-percentiles {text!r} is invalid: expected comma-separated numbers "
                             f"in (0, 100), e.g. 50,90,99")
        out.append(p)
    return out


def parse_metrics(text: str) -> list[str]:
    out = [m.strip() for m in str(text).split(",") if m.strip()]
    bad = [m for m in out if m not in METRICS]
    if bad or not out:
        raise ValueError(f"--percentile-metrics {text!r} is invalid: expected a comma-separated subset of "
                         f"{','.join(METRICS)}")
    return out


def _parse_headers(items: list[str] | None) -> dict[str, str]:
    out = {}
    for it in items or []:
        k, sep, v = it.partition("=")
        if not sep or not k:
            raise ValueError(f"--header {it!r} is invalid: expected KEY=VALUE")
        out[k.strip()] = v.strip()
    return out


def validate_args(args: argparse.Namespace) -> None:
    """Raise ValueError naming a bad value and what is accepted."""
    if not args.base_url or not str(args.base_url).startswith(("http://", "https://")):
        raise ValueError(f"--base-url {args.base_url!r} is invalid: expected an http:// or https:// URL "
                         f"such as http://127.0.0.1:8000")
    if args.endpoint not in ENDPOINTS:
        raise ValueError(f"--endpoint {args.endpoint!r} is not supported: expected one of {', '.join(ENDPOINTS)}")
    if args.dataset_name not in DATASETS:
        raise ValueError(f"--dataset {args.dataset_name!r} is not supported: expected one of {', '.join(DATASETS)}")
    _positive_int("--num-prompts", args.num_prompts)
    _positive_int("--input-len", args.input_len)
    _positive_int("--output-len", args.output_len)
    if not 0 <= args.range_ratio < 1:
        raise ValueError(f"--range-ratio {args.range_ratio!r} is invalid: expected a number in [0, 1)")
    if not args.request_rate > 0 or math.isnan(args.request_rate):
        raise ValueError(f"--request-rate {args.request_rate!r} is invalid: expected a number > 0 or inf")
    if not args.burstiness > 0 or math.isnan(args.burstiness):
        raise ValueError(f"--burstiness {args.burstiness!r} is invalid: expected a number > 0 "
                         f"(1 = Poisson process)")
    if args.max_concurrency is not None:
        _positive_int("--max-concurrency", args.max_concurrency)
    if args.sweep_concurrency is not None:
        args.sweep_concurrency = (args.sweep_concurrency if isinstance(args.sweep_concurrency, list)
                                  else parse_int_list("--sweep-concurrency", args.sweep_concurrency))
        if args.max_concurrency is not None:
            raise ValueError("--max-concurrency and --sweep-concurrency are exclusive: the sweep sets the "
                             "concurrency of each run")
    if args.plot and args.sweep_concurrency is None:
        raise ValueError(f"--plot {args.plot!r} needs --sweep-concurrency (e.g. --sweep-concurrency 1,2,4,8)")
    if args.num_warmups < 0:
        raise ValueError(f"--num-warmups {args.num_warmups!r} is invalid: expected an integer >= 0")
    if args.ready_check_timeout_sec < 0:
        raise ValueError(f"--ready-check-timeout-sec {args.ready_check_timeout_sec!r} is invalid: "
                         f"expected a number >= 0 (0 = fail at once)")
    if args.temperature is not None and args.temperature < 0:
        raise ValueError(f"--temperature {args.temperature!r} is invalid: expected a number >= 0")
    args.selected_percentiles = parse_percentiles(args.metric_percentiles)
    args.selected_metrics = parse_metrics(args.percentile_metrics)
    args.extra_headers = _parse_headers(args.header)
    if args.extra_body is not None:
        try:
            body = json.loads(args.extra_body) if isinstance(args.extra_body, str) else args.extra_body
        except json.JSONDecodeError as e:
            raise ValueError(f"--extra-body {args.extra_body!r} is invalid: expected a JSON object ({e})") from None
        if not isinstance(body, dict):
            raise ValueError(f"--extra-body {args.extra_body!r} is invalid: expected a JSON object")
        args.extra_body = body


# --------------------------------------------------------------------------- one request


def build_payload(endpoint: str, model: str, req: SampleRequest, ignore_eos: bool, temperature: float | None,
                  extra_body: dict[str, Any] | None) -> dict[str, Any]:
    """The streaming request body for one sample (completions or chat)."""
    body: dict[str, Any] = {"model": model, "max_tokens": req.expected_output_len, "stream": True,
                            "stream_options": {"include_usage": True}}
    if endpoint.endswith("/chat/completions"):
        prompt = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": prompt}]
        body["max_completion_tokens"] = req.expected_output_len
    else:
        body["prompt"] = req.prompt
    if temperature is not None:
        body["temperature"] = temperature
    if ignore_eos:
        body["ignore_eos"] = True
    if extra_body:
        body.update(extra_body)
    return body


def _chunk_text(choice: dict[str, Any], chat: bool) -> str:
    if not chat:
        return choice.get("text") or ""
    delta = choice.get("delta") or {}
    return (delta.get("content") or "") + (delta.get("reasoning_content") or delta.get("reasoning") or "")


def _error_text(obj: Any) -> str:
    if isinstance(obj, dict):
        err = obj.get("error", obj)
        if isinstance(err, dict):
            return str(err.get("message") or err)
        return str(err)
    return str(obj)


class _SSEMessages:
    """Splits a byte stream into server-sent-event messages (blank-line separated) across reads, as
    vLLM's client does: one network read may hold several events or part of one; an event the stream
    leaves unterminated is not dispatched (the SSE rule)."""

    def __init__(self) -> None:
        self._buf = b""

    def feed(self, chunk: bytes) -> list[str]:
        self._buf += chunk
        *messages, self._buf = self._buf.replace(b"\r\n", b"\n").split(b"\n\n")
        return [m.decode("utf-8") for m in messages if m.strip()]


async def _sse_data(resp: Any) -> AsyncIterator[tuple[float, str]]:
    """(arrival time, payload) of each ``data:`` line of a streamed response; the events of one
    network read share its time."""
    sse = _SSEMessages()
    async for data_bytes in resp.content.iter_any():
        messages = sse.feed(data_bytes)
        if not messages:
            continue
        now = time.perf_counter()
        for message in messages:
            for line in message.split("\n"):
                line = line.strip()
                if line.startswith("data:"):  # not SSE comments or event names
                    yield now, line[5:].strip()


async def send_request(client: Any, url: str, headers: dict[str, str], payload: dict[str, Any],
                       req: SampleRequest, chat: bool) -> RequestResult:
    """Stream one request (aiohttp, as vLLM's client); parse ``data:`` events until ``[DONE]``; time
    every text chunk (events that arrive in one read share its time, as in vLLM's client)."""
    import aiohttp

    out = RequestResult(prompt_len=req.prompt_len)
    st = time.perf_counter()
    out.start_time = st
    last = st
    chunks = 0
    usage_tokens = None
    text_parts: list[str] = []
    try:
        async with client.post(url, json=payload, headers=headers) as resp:
            if resp.status != 200:
                body = (await resp.read()).decode("utf-8", "replace")
                try:
                    detail = _error_text(json.loads(body))
                except (json.JSONDecodeError, ValueError):
                    detail = body.strip()
                out.error = f"HTTP {resp.status}: {detail[:300]}"
                return out
            async with contextlib.aclosing(_sse_data(resp)) as events:
                async for now, data in events:
                    if data == "[DONE]":
                        break
                    try:
                        obj = json.loads(data)
                    except json.JSONDecodeError:
                        out.error = f"bad stream chunk: {data[:200]!r}"
                        return out
                    if not isinstance(obj, dict):
                        continue
                    if "error" in obj and not obj.get("choices"):
                        out.error = f"stream error: {_error_text(obj)[:300]}"
                        return out
                    usage = obj.get("usage")
                    if isinstance(usage, dict):
                        if usage.get("completion_tokens") is not None:
                            usage_tokens = int(usage["completion_tokens"])
                        if not req.exact_prompt_len and usage.get("prompt_tokens"):
                            out.prompt_len = int(usage["prompt_tokens"])
                    choices = obj.get("choices") or []
                    if not choices:
                        continue
                    text = _chunk_text(choices[0], chat)
                    if not text:
                        continue  # role-only / finish-only chunks carry no token
                    if chunks == 0:
                        out.ttft = now - st
                    else:
                        out.itl.append(now - last)
                    last = now
                    chunks += 1
                    text_parts.append(text)
    except aiohttp.ClientConnectorError as e:
        out.error = f"cannot connect: {e or type(e).__name__}"
        out.connect_error = True
        return out
    except (aiohttp.ClientError, asyncio.TimeoutError) as e:
        out.error = f"{type(e).__name__}: {e}"
        return out
    out.generated_text = "".join(text_parts)
    if chunks == 0:
        out.error = "the stream carried no text chunk (no TTFT); request counted as failed"
        return out
    out.output_tokens = usage_tokens if usage_tokens else chunks
    out.latency = last - st
    out.success = True
    return out


# --------------------------------------------------------------------------- arrivals and metrics


def arrival_times(n: int, request_rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Send offsets (s) from the benchmark start: all 0 for an infinite rate, else cumulative gamma
    (Poisson for burstiness 1) gaps, rescaled so the last one is ``n / request_rate`` (vLLM)."""
    if request_rate == float("inf"):
        return [0.0] * n
    import numpy as np

    rng = np.random.default_rng([seed, 1])
    if burstiness == float("inf"):
        gaps = np.full(n, 1.0 / request_rate)
    else:
        gaps = rng.gamma(shape=burstiness, scale=1.0 / (request_rate * burstiness), size=n)
    t = np.cumsum(gaps)
    if t[-1] > 0:
        t *= (n / request_rate) / t[-1]
    return [float(x) for x in t]


def calculate_metrics(outputs: list[RequestResult], duration: float, percentiles: list[float]) -> dict[str, Any]:
    """vLLM's BenchmarkMetrics as a flat dict of plain numbers (times in ms)."""
    import numpy as np

    ok = [o for o in outputs if o.success]
    ttfts = [o.ttft for o in ok]
    e2els = [o.latency for o in ok]
    tpots = [(o.latency - o.ttft) / (o.output_tokens - 1) for o in ok if o.output_tokens > 1]
    itls = [x for o in ok for x in o.itl]
    total_in = sum(o.prompt_len for o in ok)
    total_out = sum(o.output_tokens for o in ok)
    m: dict[str, Any] = {
        "duration": duration,
        "completed": len(ok),
        "failed": len(outputs) - len(ok),
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / duration,
        "output_throughput": total_out / duration,
        "total_token_throughput": (total_in + total_out) / duration,
    }
    peak_tok, peak_conc = 0.0, 0
    if ok:
        t0 = min(o.start_time for o in ok)
        nsec = int(math.ceil(max(o.start_time + o.latency for o in ok) - t0)) + 1
        tok = np.zeros(nsec)
        for o in ok:
            t = o.start_time + o.ttft
            times = [t]
            for g in o.itl:
                t += g
                times.append(t)
            for x in times:
                b = int(x - t0)
                if 0 <= b < nsec:
                    tok[b] += 1
        # most requests in flight at one instant (sweep over send / last-token events; vLLM counts
        # requests active in the same 1 s bucket, which overstates short runs)
        events = sorted([(o.start_time, 1) for o in ok] + [(o.start_time + o.latency, -1) for o in ok],
                        key=lambda e: (e[0], e[1]))
        live = 0
        for _, d in events:
            live += d
            peak_conc = max(peak_conc, live)
        peak_tok = float(tok.max())
    m["max_output_tokens_per_s"] = peak_tok
    m["max_concurrent_requests"] = peak_conc
    for name, xs in (("ttft", ttfts), ("tpot", tpots), ("itl", itls), ("e2el", e2els)):
        arr = np.asarray(xs or [0.0], dtype=float) * 1000.0
        m[f"mean_{name}_ms"] = float(arr.mean())
        m[f"median_{name}_ms"] = float(np.median(arr))
        m[f"std_{name}_ms"] = float(arr.std())
        for p in percentiles:
            m[f"p{_pword(p)}_{name}_ms"] = float(np.percentile(arr, p))
    return m


def _pword(p: float) -> str:
    return str(int(p)) if int(p) == p else str(p)


def format_result(res: dict[str, Any], metrics: list[str], percentiles: list[float]) -> str:
    """vLLM's printed table."""
    lines = ["{s:{c}^{n}}".format(s=" Serving Benchmark Result ", n=50, c="=")]

    def row(label: str, v: Any, fmt: str = "") -> None:
        lines.append(("{:<40} {:<10" + fmt + "}").format(label, v))

    row("Successful requests:", res["completed"])
    row("Failed requests:", res["failed"])
    if res.get("max_concurrency") is not None:
        row("Maximum request concurrency:", res["max_concurrency"])
    if res.get("request_rate") not in (None, "inf"):
        row("Request rate configured (RPS):", res["request_rate"], ".2f")
    row("Benchmark duration (s):", res["duration"], ".2f")
    row("Total input tokens:", res["total_input_tokens"])
    row("Total generated tokens:", res["total_output_tokens"])
    row("Request throughput (req/s):", res["request_throughput"], ".2f")
    row("Output token throughput (tok/s):", res["output_throughput"], ".2f")
    row("Peak output token throughput (tok/s):", res["max_output_tokens_per_s"], ".2f")
    row("Peak concurrent requests:", res["max_concurrent_requests"], ".2f")  # vLLM prints it as a float
    row("Total Token throughput (tok/s):", res["total_token_throughput"], ".2f")
    for name in METRICS:
        if name not in metrics:
            continue
        short, header = _HEADERS[name]
        lines.append("{s:{c}^{n}}".format(s=header, n=50, c="-"))
        row(f"Mean {short} (ms):", res[f"mean_{name}_ms"], ".2f")
        row(f"Median {short} (ms):", res[f"median_{name}_ms"], ".2f")
        for p in percentiles:
            row(f"P{_pword(p)} {short} (ms):", res[f"p{_pword(p)}_{name}_ms"], ".2f")
    lines.append("=" * 50)
    return "\n".join(lines)


# --------------------------------------------------------------------------- the benchmark


@dataclass
class Target:
    base_url: str
    endpoint: str
    model: str
    headers: dict[str, str]
    ignore_eos: bool = True
    temperature: float | None = 0.0
    extra_body: dict[str, Any] | None = None

    @property
    def url(self) -> str:
        return self.base_url.rstrip("/") + self.endpoint

    @property
    def chat(self) -> bool:
        return self.endpoint.endswith("/chat/completions")

    def payload(self, req: SampleRequest) -> dict[str, Any]:
        return build_payload(self.endpoint, self.model, req, self.ignore_eos, self.temperature, self.extra_body)


def _client(max_concurrency: int | None) -> Any:
    """One aiohttp session for the run (vLLM's client: a 6-hour total timeout, a connection pool of
    the concurrency, keep-alive)."""
    import aiohttp

    connector = aiohttp.TCPConnector(limit=max_concurrency or 0, limit_per_host=max_concurrency or 0,
                                     keepalive_timeout=60)
    return aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=6 * 3600, connect=10.0))


def _unreachable(base_url: str, err: str) -> ServerUnreachable:
    return ServerUnreachable(f"cannot reach the server at {base_url} ({err}); is it running? "
                             f"(--ready-check-timeout-sec N waits up to N s for it)")


async def resolve_model(base_url: str, headers: dict[str, str], timeout_s: float = 0.0) -> str:
    """The first model id of ``GET /v1/models`` (used when --model is not given)."""
    import aiohttp

    deadline = time.monotonic() + timeout_s
    url = base_url.rstrip("/") + "/v1/models"
    async with _client(1) as client:
        while True:
            try:
                async with client.get(url, headers=headers) as r:
                    status, body = r.status, await r.read()
                break
            except aiohttp.ClientConnectorError as e:
                if time.monotonic() >= deadline:
                    raise _unreachable(base_url, str(e) or type(e).__name__) from None
                await asyncio.sleep(1.0)
            except (aiohttp.ClientError, asyncio.TimeoutError) as e:
                raise _unreachable(base_url, f"{type(e).__name__}: {e}") from None
    try:
        data = json.loads(body)["data"]
        return str(data[0]["id"])
    except Exception:  # noqa: BLE001
        raise RuntimeError(f"--model is not given and GET {url} returned no model list "
                           f"(HTTP {status}); pass --model NAME") from None


async def ready_check(target: Target, req: SampleRequest, timeout_s: float) -> None:
    """vLLM's initial single-prompt test run; raise a clear error when it fails."""
    deadline = time.monotonic() + timeout_s
    async with _client(1) as client:
        while True:
            out = await send_request(client, target.url, target.headers, target.payload(req), req, target.chat)
            if out.success:
                return
            if not out.connect_error:
                raise RuntimeError(f"initial test request to {target.url} failed: {out.error}. "
                                   f"Check --base-url, --endpoint and --model")
            if time.monotonic() >= deadline:
                raise _unreachable(target.base_url, out.error)
            await asyncio.sleep(1.0)


async def benchmark(target: Target, requests: list[SampleRequest], *, request_rate: float = float("inf"),
                    burstiness: float = 1.0, max_concurrency: int | None = None, seed: int = 0,
                    percentiles: list[float] | None = None, num_warmups: int = 0, disable_tqdm: bool = True,
                    log: Callable[[str], None] = print) -> tuple[dict[str, Any], list[RequestResult]]:
    """Run one benchmark; returns (metrics dict, per-request results)."""
    percentiles = percentiles or [99.0]
    offsets = arrival_times(len(requests), request_rate, burstiness, seed)
    sem = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    pbar = None
    if not disable_tqdm:
        from tqdm import tqdm

        pbar = tqdm(total=len(requests), file=sys.stderr)

    async with _client(max_concurrency) as client:
        async def one(req: SampleRequest) -> RequestResult:
            if sem is None:
                out = await send_request(client, target.url, target.headers, target.payload(req), req, target.chat)
            else:
                async with sem:
                    out = await send_request(client, target.url, target.headers, target.payload(req), req,
                                             target.chat)
            if pbar is not None:
                pbar.update(1)
            return out

        if num_warmups:
            log(f"Warming up with {num_warmups} requests...")
            await asyncio.gather(*(one(requests[0]) for _ in range(num_warmups)))
            if pbar is not None:
                pbar.reset()
            log("Warmup run completed.")
        log("Starting main benchmark run...")
        log(f"Traffic request rate: {request_rate}")
        dist = "Poisson process" if burstiness == 1.0 else "Gamma distribution"
        log(f"Burstiness factor: {burstiness} ({dist})")
        log(f"Maximum request concurrency: {max_concurrency}")
        t0 = time.perf_counter()
        tasks = []
        for req, off in zip(requests, offsets):
            wait = t0 + off - time.perf_counter()
            if wait > 0:
                await asyncio.sleep(wait)
            tasks.append(asyncio.create_task(one(req)))
        outputs = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
    if pbar is not None:
        pbar.close()
    return calculate_metrics(outputs, duration, percentiles), outputs


# --------------------------------------------------------------------------- CLI


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``kvserve bench serve`` (``bench`` with a nested ``serve``) on argparse subparsers."""
    bench = subparsers.add_parser("bench", help="benchmarks (serve: load-test an OpenAI-compatible server)")
    bsub = bench.add_subparsers(dest="bench_command", required=True)
    p = bsub.add_parser("serve", help="load-test an OpenAI-compatible server (like `vllm bench serve`)",
                        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter,
                        epilog=__doc__.split("\n\n", 1)[1])
    g = p.add_argument_group("server")
    g.add_argument("--base-url", default="http://127.0.0.1:8000",
                   help="server root URL (default http://127.0.0.1:8000)")
    g.add_argument("--endpoint", default="/v1/completions", help=f"one of {', '.join(ENDPOINTS)}")
    g.add_argument("--model", default=None, help="model name sent in requests (default: first of GET /v1/models)")
    g.add_argument("--api-key", default=None, help="bearer token (default: $OPENAI_API_KEY if set)")
    g.add_argument("--header", metavar="KEY=VALUE", nargs="*", default=None, help="extra HTTP headers")
    g.add_argument("--ready-check-timeout-sec", type=float, default=0.0,
                   help="wait up to this long for the server to accept connections (default 0: fail at once)")
    g = p.add_argument_group("dataset")
    g.add_argument("--dataset-name", "--dataset", dest="dataset_name", default="random",
                   help=f"one of {', '.join(DATASETS)}")
    g.add_argument("--input-len", "--random-input-len", dest="input_len", type=int, default=1024)
    g.add_argument("--output-len", "--random-output-len", dest="output_len", type=int, default=128)
    g.add_argument("--range-ratio", "--random-range-ratio", dest="range_ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from len * [1 - r, 1 + r], 0 <= r < 1")
    g.add_argument("--num-prompts", type=int, default=1000)
    g.add_argument("--seed", type=int, default=0, help="seeds the prompts and the arrival times")
    g.add_argument("--tokenizer", default=None,
                   help="HF tokenizer folder or name: prompts become decoded text of exact token length "
                        "(default: token-id prompts for /v1/completions, word prompts for chat)")
    g = p.add_argument_group("load")
    g.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second (default inf: all sent at once); finite: Poisson arrivals")
    g.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the arrival gaps (1 = Poisson)")
    g.add_argument("--max-concurrency", type=int, default=None, help="most requests in flight (default: no limit)")
    g.add_argument("--num-warmups", type=int, default=0, help="warm-up requests before the measured run")
    g.add_argument("--sweep-concurrency", default=None, metavar="N,N,...",
                   help="run once per concurrency (e.g. 1,2,4,8) and report each")
    g.add_argument("--plot", default=None, metavar="PNG",
                   help="with --sweep-concurrency: chart of throughput and median TTFT/TPOT vs concurrency")
    g = p.add_argument_group("request")
    g.add_argument("--ignore-eos", action=argparse.BooleanOptionalAction, default=True,
                   help="send ignore_eos so every request generates its max_tokens (default on)")
    g.add_argument("--temperature", type=float, default=0.0, help="sampling temperature sent (default 0.0, greedy)")
    g.add_argument("--extra-body", default=None, help="JSON object merged into every request body")
    g = p.add_argument_group("output")
    g.add_argument("--percentile-metrics", default="ttft,tpot,itl,e2el",
                   help="metrics whose statistics are printed (default ttft,tpot,itl,e2el)")
    g.add_argument("--metric-percentiles", default="99", help="comma-separated percentiles (default 99)")
    g.add_argument("--json", action="store_true", help="print one JSON object of results on stdout (no table)")
    g.add_argument("--result-file", default=None, help="write the JSON results to this file")
    g.add_argument("--save-detailed", action="store_true",
                   help="add per-request lists (input/output lens, ttfts, itls, errors) to the JSON")
    g.add_argument("--disable-tqdm", action="store_true", help="no progress bar")
    p.set_defaults(func=run)
    return p


def _result_record(args: argparse.Namespace, model: str, metrics: dict[str, Any], outputs: list[RequestResult],
                   max_concurrency: int | None) -> dict[str, Any]:
    rec: dict[str, Any] = {
        "date": datetime.now().strftime("%Y%m%d-%H%M%S"),
        "endpoint_type": "openai-chat" if args.endpoint.endswith("/chat/completions") else "openai",
        "base_url": args.base_url,
        "endpoint": args.endpoint,
        "model_id": model,
        "tokenizer_id": args.tokenizer,
        "dataset_name": args.dataset_name,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "range_ratio": args.range_ratio,
        "seed": args.seed,
        "request_rate": args.request_rate if args.request_rate < float("inf") else "inf",
        "burstiness": args.burstiness,
        "max_concurrency": max_concurrency,
    }
    rec.update(metrics)
    if args.save_detailed:
        rec["input_lens"] = [o.prompt_len for o in outputs]
        rec["output_lens"] = [o.output_tokens for o in outputs]
        rec["ttfts"] = [o.ttft for o in outputs]
        rec["itls"] = [o.itl for o in outputs]
        rec["errors"] = [o.error for o in outputs]
    return rec


async def _main(args: argparse.Namespace, log: Callable[[str], None]) -> list[dict[str, Any]]:
    from kvserve.bench.datasets import load_tokenizer, random_requests

    api_key = args.api_key if args.api_key is not None else os.environ.get("OPENAI_API_KEY")
    headers = dict(args.extra_headers)
    if api_key:
        headers.setdefault("Authorization", f"Bearer {api_key}")
    model = args.model or await resolve_model(args.base_url, headers, args.ready_check_timeout_sec)
    chat = args.endpoint.endswith("/chat/completions")
    tokenizer = load_tokenizer(args.tokenizer)
    requests = random_requests(args.num_prompts, args.input_len, args.output_len, args.range_ratio, args.seed,
                               tokenizer, chat=chat)
    target = Target(args.base_url, args.endpoint, model, headers, args.ignore_eos, args.temperature, args.extra_body)
    log("Starting initial single prompt test run...")
    await ready_check(target, requests[0], args.ready_check_timeout_sec)
    log("Initial test run completed.")
    records = []
    for conc in args.sweep_concurrency or [args.max_concurrency]:
        metrics, outputs = await benchmark(
            target, requests, request_rate=args.request_rate, burstiness=args.burstiness, max_concurrency=conc,
            seed=args.seed, percentiles=args.selected_percentiles, num_warmups=args.num_warmups,
            disable_tqdm=args.disable_tqdm, log=log)
        rec = _result_record(args, model, metrics, outputs, conc)
        errors = [o.error for o in outputs if not o.success]
        if errors:
            print(f"kvserve bench: {len(errors)} of {len(outputs)} requests failed; first error: {errors[0]}",
                  file=sys.stderr)
        if not args.json:
            print(format_result(rec, args.selected_metrics, args.selected_percentiles), flush=True)
        records.append(rec)
    return records


def run(args: argparse.Namespace) -> int:
    """``kvserve bench serve``: 0 when the run(s) finished (failed requests are reported in the table,
    as vLLM does), 1 when every request of a run failed."""
    validate_args(args)
    log: Callable[[str], None] = (lambda s: print(s, file=sys.stderr)) if args.json else print
    if args.plot:
        from kvserve.bench.plot import check_plot_path

        check_plot_path(args.plot)
    records = asyncio.run(_main(args, log))
    doc: dict[str, Any] = records[0] if args.sweep_concurrency is None else {
        "sweep_concurrency": args.sweep_concurrency, "results": records}
    text = json.dumps(doc, allow_nan=False)
    if args.json:
        print(text, flush=True)
    if args.result_file:
        with open(args.result_file, "w") as f:
            f.write(text + "\n")
        log(f"results written to {args.result_file}")
    if args.sweep_concurrency is not None and not args.json:
        print(format_sweep(records), flush=True)
    if args.plot:
        from kvserve.bench.plot import plot_sweep

        plot_sweep(records, args.plot)
        log(f"chart written to {args.plot}")
    return 0 if all(r["completed"] > 0 for r in records) else 1


def format_sweep(records: list[dict[str, Any]]) -> str:
    """One line per concurrency of a sweep."""
    head = (f"{'concurrency':>11}  {'req/s':>8}  {'out tok/s':>10}  {'med TTFT ms':>11}  {'med TPOT ms':>11}  "
            f"{'med ITL ms':>10}  {'failed':>6}")
    lines = ["{s:{c}^{n}}".format(s=" Concurrency Sweep ", n=len(head), c="="), head]
    for r in records:
        lines.append(f"{r['max_concurrency']:>11}  {r['request_throughput']:>8.2f}  {r['output_throughput']:>10.2f}  "
                     f"{r['median_ttft_ms']:>11.2f}  {r['median_tpot_ms']:>11.2f}  {r['median_itl_ms']:>10.2f}  "
                     f"{r['failed']:>6}")
    return "\n".join(lines)
