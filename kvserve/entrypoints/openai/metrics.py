"""Prometheus metrics under vLLM's names, one ``CollectorRegistry`` per app (several servers can
live in one process). Updated where ``AsyncLLM`` processes outputs (its observer hooks).

With several API server processes (``--api-server-count``, ``PROMETHEUS_MULTIPROC_DIR`` set by the
launcher), the request counters and histograms live in that directory and any server's ``/metrics``
sums them over the servers (prometheus_client's multiprocess mode, as vLLM); the engine's gauges and
preemption count come from the core's stats, which every server receives."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest, multiprocess
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from kvserve.engine.async_llm import AsyncLLM

# vLLM's buckets
_TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0]
_ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                10.0, 20.0, 40.0, 80.0]
_E2E_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
                120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0]

CONTENT_TYPE = CONTENT_TYPE_LATEST


def _multiprocess_dir() -> str | None:
    return os.environ.get("PROMETHEUS_MULTIPROC_DIR") or os.environ.get("prometheus_multiproc_dir")


class _EngineStats:
    """The engine's gauges and cumulative preemptions, read at scrape time from the snapshot of the
    core's stats that ``AsyncLLM`` refreshes."""

    def __init__(self, async_llm: "AsyncLLM", model_name: str) -> None:
        self.async_llm, self.model_name = async_llm, model_name

    def collect(self):
        stats, lbl = self.async_llm.stats, ["model_name"]
        for name, doc, value in (
            ("vllm:num_requests_running", "Number of requests in model execution batches.", stats.num_running),
            ("vllm:num_requests_waiting", "Number of requests waiting to be processed.", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", stats.kv_cache_usage),
        ):
            g = GaugeMetricFamily(name, doc, labels=lbl)
            g.add_metric([self.model_name], value)
            yield g
        c = CounterMetricFamily("vllm:num_preemptions", "Cumulative number of preemption from the engine.",
                                labels=lbl)
        c.add_metric([self.model_name], stats.num_preemptions)
        yield c


class ServerMetrics:
    """Implements ``AsyncLLM``'s ``StatObserver``; ``render()`` gives the exposition text."""

    def __init__(self, async_llm: "AsyncLLM", model_name: str) -> None:
        self.registry = reg = CollectorRegistry()
        lbl = ["model_name"]
        m = {"model_name": model_name}
        engine = _EngineStats(async_llm, model_name)
        reg.register(engine)
        self._multiprocess = _multiprocess_dir() is not None
        if self._multiprocess:  # the request metrics of every API server process, summed at scrape time
            self._engine_registry = CollectorRegistry()
            self._engine_registry.register(engine)
        self.prompt_tokens = Counter("vllm:prompt_tokens", "Number of prefill tokens processed.",
                                     lbl, registry=reg).labels(**m)
        self.generation_tokens = Counter("vllm:generation_tokens", "Number of generation tokens processed.",
                                         lbl, registry=reg).labels(**m)
        self._success = Counter("vllm:request_success", "Count of successfully processed requests.",
                                lbl + ["finished_reason"], registry=reg)
        self._model = model_name
        for reason in ("stop", "length", "abort"):
            self._success.labels(model_name=model_name, finished_reason=reason)
        self.ttft = Histogram("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                              lbl, buckets=_TTFT_BUCKETS, registry=reg).labels(**m)
        self.tpot = Histogram("vllm:time_per_output_token_seconds",
                              "Histogram of time per output token in seconds (deprecated alias of "
                              "vllm:inter_token_latency_seconds).",
                              lbl, buckets=_ITL_BUCKETS, registry=reg).labels(**m)
        self.itl = Histogram("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                             lbl, buckets=_ITL_BUCKETS, registry=reg).labels(**m)
        runner = async_llm.engine.config.runner_config
        # vLLM's buckets (build_cudagraph_buckets): the CUDA-graph sizes, else a fixed list (8096 as vLLM has it)
        iteration_buckets = (sorted(runner.cudagraph_capture_sizes) if not runner.enforce_eager
                             and runner.cudagraph_capture_sizes else
                             [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8096])
        self.iteration_tokens = Histogram("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                          lbl, buckets=iteration_buckets, registry=reg).labels(**m)
        self.e2e = Histogram("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                             lbl, buckets=_E2E_BUCKETS, registry=reg).labels(**m)

    # ---- StatObserver ----------------------------------------------------------------------
    def on_first_token(self, ttft_s: float, num_prompt_tokens: int) -> None:
        self.ttft.observe(ttft_s)
        self.prompt_tokens.inc(num_prompt_tokens)

    def on_token_interval(self, itl_s: float, num_tokens: int) -> None:
        per = itl_s / max(num_tokens, 1)
        for _ in range(num_tokens):
            self.itl.observe(per)
            self.tpot.observe(per)

    def on_finished(self, finish_reason: str, e2e_s: float, num_generation_tokens: int) -> None:
        self.generation_tokens.inc(num_generation_tokens)
        self._success.labels(model_name=self._model, finished_reason=finish_reason).inc()
        self.e2e.observe(e2e_s)

    def on_iteration(self, num_prompt_tokens: int, num_generation_tokens: int) -> None:
        self.iteration_tokens.observe(num_prompt_tokens + num_generation_tokens)

    def render(self) -> bytes:
        if not self._multiprocess:
            return generate_latest(self.registry)
        shared = CollectorRegistry()
        multiprocess.MultiProcessCollector(shared)
        return generate_latest(self._engine_registry) + generate_latest(shared)
