#!/usr/bin/env python
"""Serving benchmark (the serving family of the suite): ``kvserve serve`` started as a subprocess on
a free port, driven by ``kvserve bench serve`` (random dataset, token-id prompts, ``ignore_eos``,
streaming with usage) over a concurrency sweep, one server per KV cache dtype (bf16 vs fp8 side by
side, same flags otherwise). One JSON with every point.

Model: a checkpoint folder, by default ``benchmarks/configs/qwen3-0.6b`` (config only: the server
gets ``--load-format dummy``, random weights). ``kvserve serve`` needs a tokenizer (it refuses
``--skip-tokenizer-init``: chat templates, text prompts, decoded logprobs), so a folder without one
is served with ``--tokenizer`` pointing at a word-level tokenizer written here: token ``i`` is the
word ``w<i>``, one per id of the config's vocabulary, so every sampled id streams as text. It
detokenizes faster than a real byte-level BPE tokenizer, which understates the server's per-token
cost a little; ``--tokenizer DIR`` serves a real one (its vocabulary must cover the config's).

Per point: ``num_prompts = max(--min-prompts, --prompts-per-concurrency x concurrency)`` requests of
``--input-len`` random token ids (drawn from [1000, 10000)) and ``--output-len`` output tokens, at
most ``concurrency`` in flight, all sent at time 0; ``--num-warmups`` untimed requests first.
Checked: no request failed and every one streamed ``--output-len`` tokens (``all_ok``). After each
point the server's ``/metrics`` gauges are read (running requests and KV usage must be back to 0).
``--offline`` runs the offline engine (``kvserve bench throughput``) on each point's workload after
that dtype's server stopped (issue 17's ratios: serve / offline output tok/s, the server's TPOT p50
/ the offline decode step); ``--client-floor`` drives an engine-free source paced at the point's TPOT
p50 with the same client (what the client itself reports for a perfectly steady stream).

    bash benchmarks/gpu.sh serve                                    # H200: $OUT/serve.json, ~4 min
    python3 benchmarks/serve_bench.py --out serve.json              # H200 by hand (the same run)
    python3 benchmarks/serve_bench.py --model DIR --kv-cache-dtypes auto --concurrency 1,4,16 --out x.json
    python3 benchmarks/serve_bench.py --smoke --out /tmp/serve.json # CPU: tiny model, seconds
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository root on sys.path: kvserve)

DEFAULT_MODEL = common.CONFIGS / "qwen3-0.6b"
CLI = [sys.executable, "-m", "kvserve.entrypoints.cli"]  # the console script may not be installed
GAUGES = ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc")

# --smoke: a tiny Qwen3 (config only, dummy weights), vocabulary above the client's token-id range
SMOKE_CONFIG = {**common.TINY_QWEN3, "torch_dtype": "float32", "vocab_size": 10240}


def write_word_tokenizer(folder: Path, vocab_size: int) -> Path:
    """A fast tokenizer whose id ``i`` is the word ``w<i>`` (no special tokens: every id is text)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(vocab_size)}, unk_token="w0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok).save_pretrained(str(folder))
    return folder


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def http_get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def read_gauges(base_url: str) -> dict[str, float]:
    """The ``GAUGES`` lines of ``/metrics`` (summed over label sets)."""
    out: dict[str, float] = {}
    for line in http_get(base_url + "/metrics").splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in GAUGES:
            out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def read_iteration_tokens(base_url: str) -> tuple[float, float]:
    """``vllm:iteration_tokens_total``'s count and sum (the engine steps that gave tokens, and their tokens)."""
    count = total = 0.0
    for line in http_get(base_url + "/metrics").splitlines():
        if line.startswith("vllm:iteration_tokens_total_count"):
            count += float(line.rsplit(" ", 1)[1])
        elif line.startswith("vllm:iteration_tokens_total_sum"):
            total += float(line.rsplit(" ", 1)[1])
    return count, total


def run_paced_source(port: int, period_s: float) -> None:
    """An engine-free stand-in for ``kvserve serve``'s completions stream: each request gets its
    ``max_tokens`` chunks, one every ``period_s`` (a sleep after each send, so the source itself never
    sends two back to back). Driven at the real server's event rate (``--client-floor``), what the
    client reports for it is the client's own floor: ITL below ``period_s`` means chunks waited in the
    client's socket, not a burst from the server."""
    import asyncio

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse, PlainTextResponse, StreamingResponse
    from starlette.routing import Route

    def chunk(model: str, choices: list, usage: dict | None = None) -> str:
        body = {"id": "cmpl-paced", "object": "text_completion", "created": 0, "model": model, "choices": choices}
        if usage is not None:
            body["usage"] = usage
        return f"data: {json.dumps(body)}\n\n"

    async def completions(request):
        body = await request.json()
        n, model = int(body.get("max_tokens") or 16), str(body.get("model") or "paced")

        async def stream():
            for i in range(n):
                if i:
                    await asyncio.sleep(period_s)
                reason = "length" if i == n - 1 else None
                yield chunk(model, [{"index": 0, "text": f" w{i}", "logprobs": None, "finish_reason": reason}])
            yield chunk(model, [], {"prompt_tokens": 1, "completion_tokens": n, "total_tokens": n + 1})
            yield "data: [DONE]\n\n"

        return StreamingResponse(stream(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": "paced", "object": "model"}]})

    async def empty(request):
        return PlainTextResponse("")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"]), Route("/v1/models", models),
                            Route("/health", empty), Route("/metrics", empty)])
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


class Server:
    """``kvserve serve`` (or, ``paced_period_s``, the paced source) in its own process group,
    stdout/stderr to ``log``."""

    def __init__(self, serve_args: list[str], log: Path, env: dict[str, str], paced_period_s: float | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        if paced_period_s is None:
            self.cmd = [*CLI, "serve", *serve_args, "--host", "127.0.0.1", "--port", str(self.port)]
        else:
            self.cmd = [sys.executable, __file__, "--paced-source", str(self.port), str(paced_period_s)]
        self.t0 = time.perf_counter()
        with open(log, "w") as f:
            self.proc = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def wait_healthy(self, timeout_s: float) -> float:
        """Seconds until ``/health`` answers; raises with the log's tail if the server dies first."""
        deadline = time.perf_counter() + timeout_s
        while time.perf_counter() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvserve serve exited with {self.proc.returncode}:\n{self.tail()}")
            try:
                http_get(self.url + "/health", timeout=2.0)
                return time.perf_counter() - self.t0
            except OSError:
                time.sleep(0.5)
        raise RuntimeError(f"kvserve serve not healthy after {timeout_s:.0f} s:\n{self.tail()}")

    def tail(self, n: int = 30) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])

    def stop(self) -> None:
        """SIGINT (uvicorn's graceful shutdown), then SIGKILL to the group after 30 s."""
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGINT)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` (all its threads) from /proc (0.0 once it is gone)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")  # utime, stime (fields 14, 15)


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (the server's engine-core process)."""
    kids = []
    for task in Path(f"/proc/{pid}/task").glob("*/children"):
        try:
            kids += [int(x) for x in task.read_text().split()]
        except OSError:
            pass
    return kids


def process_name(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def process_cpu(server: Server) -> dict[str, float]:
    """CPU seconds so far of the API server process(es: the ``ApiServer_<i>`` children of the launcher
    with ``--api-server-count`` > 1, plus the launcher) and of the ``EngineCore`` child."""
    cpu = {"api_server": cpu_seconds(server.proc.pid), "engine_core": 0.0}
    for kid in child_pids(server.proc.pid):
        name = process_name(kid)
        if name == "EngineCore":
            cpu["engine_core"] += cpu_seconds(kid)
        elif name.startswith("ApiServer_"):
            cpu["api_server"] += cpu_seconds(kid)
            cpu[name] = cpu_seconds(kid)
    return cpu


def num_prompts(a: argparse.Namespace, concurrency: int) -> int:
    """Requests of a point: ``max(--min-prompts, --prompts-per-concurrency x concurrency)``."""
    return max(a.min_prompts, a.prompts_per_concurrency * concurrency)


def bench_point(server: Server, a: argparse.Namespace, concurrency: int, work: Path, env: dict[str, str]) -> dict:
    """One ``kvserve bench serve`` run at ``concurrency``; its result file as a dict, with the CPU time
    the API server process, the engine core and the client spent on it (Linux /proc)."""
    n = num_prompts(a, concurrency)
    result = work / f"point_{concurrency}.json"
    cmd = [*CLI, "bench", "serve", "--base-url", server.url, "--endpoint", a.endpoint, "--dataset", "random",
           "--input-len", str(a.input_len), "--output-len", str(a.output_len), "--num-prompts", str(n),
           "--max-concurrency", str(concurrency), "--num-warmups", str(a.num_warmups), "--seed", "0",
           "--result-file", str(result), "--disable-tqdm"]
    steps0 = read_iteration_tokens(server.url)
    cpu0, client0, t0 = process_cpu(server), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.point_timeout_s)
    cpu1, client1, wall = process_cpu(server), resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter() - t0
    if r.returncode != 0:
        raise RuntimeError(f"kvserve bench serve exited with {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    print(r.stdout.strip(), flush=True)
    point = json.loads(result.read_text())
    # CPU time over the whole client run (its start and warm-ups included) against that run's wall time:
    # a process near 1.0 (one core busy) bounds the stream; the API server's CPU per output token is its
    # per-token cost
    cpu = {k: cpu1[k] - cpu0[k] for k in cpu0}
    cpu["client"] = (client1.ru_utime + client1.ru_stime) - (client0.ru_utime + client0.ru_stime)
    tokens = max(1, point["total_output_tokens"])
    point["cpu_s"] = cpu
    point["cpu_wall_s"] = wall
    point["cpu_share_of_wall"] = {k: v / wall for k, v in cpu.items()}
    point["api_server_us_per_output_token"] = 1e6 * cpu["api_server"] / tokens
    point["num_prompts"] = n
    point["all_ok"] = point["failed"] == 0 and point["total_output_tokens"] == n * a.output_len
    point["gauges_after"] = read_gauges(server.url)
    steps1 = read_iteration_tokens(server.url)  # the engine's steps over the run (warm-ups included)
    point["engine_steps"] = steps1[0] - steps0[0]
    point["tokens_per_engine_step"] = (steps1[1] - steps0[1]) / max(1.0, point["engine_steps"])
    return point


def client_floor(point: dict, a: argparse.Namespace, concurrency: int, work: Path, env: dict[str, str]) -> dict:
    """The same requests against the paced source at ``point``'s TPOT p50 (the server's event rate)."""
    period = point["median_tpot_ms"] / 1e3
    source = Server([], work / f"paced_{concurrency}.log", env, paced_period_s=period)
    try:
        source.wait_healthy(60)
        r = bench_point(source, a, concurrency, work, env)
    finally:
        source.stop()
    floor = {"period_ms": period * 1e3, **{k: r.get(k) for k in (
        "output_throughput", "median_tpot_ms", "median_itl_ms", "p99_itl_ms", "failed", "cpu_share_of_wall")}}
    print(f"[serve]   client floor at a steady {period * 1e3:.2f} ms a chunk: {floor['output_throughput']:.0f} tok/s, "
          f"ITL p50 {floor['median_itl_ms']:.2f} / p99 {floor['p99_itl_ms']:.2f} ms, client CPU "
          f"{floor['cpu_share_of_wall'].get('client', 0):.2f}", flush=True)
    return floor


def offline_point(a: argparse.Namespace, engine_args: list[str], kv: str, concurrency: int, work: Path,
                  env: dict[str, str]) -> dict:
    """The offline engine (``kvserve bench throughput``) on a point's workload: the same number of
    requests, prompt and output lengths (random prompt ids), greedy, ignore_eos, ``max_num_seqs`` = the
    concurrency; run after that dtype's server stopped, so the two never share the GPU."""
    n = num_prompts(a, concurrency)
    result = work / f"offline_{kv}_{concurrency}.json"
    cmd = [*CLI, "bench", "throughput", *engine_args, "--kv-cache-dtype", kv, "--concurrency", str(concurrency),
           "--dataset", "random", "--input-len", str(a.input_len), "--output-len", str(a.output_len),
           "--num-prompts", str(n), "--temperature", "0", "--skip-tokenizer-init", "--json", str(result)]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=a.point_timeout_s)
    if r.returncode != 0:
        raise RuntimeError(f"kvserve bench throughput exited with {r.returncode}:\n{(r.stdout + r.stderr)[-3000:]}")
    p = json.loads(result.read_text())["points"][0]
    return {"command": " ".join(["python3", *cmd[1:]]), "num_prompts": n, **{k: p.get(k) for k in (
        "num_requests", "output_tokens", "output_tok_s", "num_steps", "p50_tpot_ms", "p50_ttft_ms", "p50_itl_ms", "p99_itl_ms",
        "decode_step_ms_median", "decode_roofline_ms", "elapsed_s")}}


def compare_offline(point: dict, offline: dict) -> None:
    """The server's point against the offline engine's: output tok/s and TPOT p50 ratios, and both
    ITL p99 / p50 (the offline one is the engine's own: its steps as each request saw them)."""
    point["offline"] = offline
    point["serve_over_offline_tok_s"] = point["output_throughput"] / offline["output_tok_s"]
    point["tpot_p50_over_offline_step"] = point["median_tpot_ms"] / offline["decode_step_ms_median"]
    if offline.get("num_steps") and point.get("engine_steps"):
        point["engine_steps_over_offline"] = point["engine_steps"] / offline["num_steps"]
    print(f"[serve] kv {point['kv_cache_dtype']} c={point['concurrency']} offline engine on the same workload: "
          f"{offline['output_tok_s']:.0f} out tok/s, TPOT p50 "
          f"{offline['p50_tpot_ms']:.2f} ms, decode step p50 {offline['decode_step_ms_median']:.2f} ms, "
          f"{offline.get('num_steps')} steps (server {point.get('engine_steps', 0):.0f}, warm-ups included) -> serve / "
          f"offline {point['serve_over_offline_tok_s']:.3f}, server TPOT p50 / offline step "
          f"{point['tpot_p50_over_offline_step']:.2f}; ITL p99 / p50 server {point['p99_itl_ms']:.2f} / "
          f"{point['median_itl_ms']:.2f} ms, offline {offline['p99_itl_ms']:.2f} / {offline['p50_itl_ms']:.2f} ms",
          flush=True)


def parse_args(argv: list[str]) -> argparse.Namespace:
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default=None,
                   help=f"checkpoint folder (default {DEFAULT_MODEL.relative_to(common.REPO)})")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer folder (default: the model's, else a word-level tokenizer over its vocabulary)")
    p.add_argument("--load-format", default=None, help="default: dummy for a folder without weights, else auto")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-dtypes", default=None, help="one server each, side by side (default bfloat16,fp8)")
    p.add_argument("--concurrency", type=ints, default=None, help="sweep (default 1,16,64,256)")
    p.add_argument("--input-len", type=int, default=None, help="prompt tokens (default 512)")
    p.add_argument("--output-len", type=int, default=None, help="output tokens per request (default 256)")
    p.add_argument("--prompts-per-concurrency", type=int, default=4)
    p.add_argument("--min-prompts", type=int, default=8)
    p.add_argument("--num-warmups", type=int, default=2, help="untimed requests before each point")
    p.add_argument("--endpoint", default="/v1/completions")
    p.add_argument("--serve-args", default="", help="more `kvserve serve` flags, one string (e.g. '--enforce-eager')")
    p.add_argument("--startup-timeout-s", type=float, default=600.0)
    p.add_argument("--point-timeout-s", type=float, default=600.0)
    p.add_argument("--client-floor", action="store_true",
                   help="after each point, the same requests against an engine-free source that streams one chunk "
                        "per request every (that point's TPOT p50): the client's own ITL floor at that event rate")
    p.add_argument("--offline", action="store_true",
                   help="after each server, the offline engine (kvserve bench throughput) on each point's requests; "
                        "JSON: offline, serve_over_offline_tok_s, tpot_p50_over_offline_step")
    p.add_argument("--offline-args", default="", help="more `kvserve bench throughput` flags for --offline, one string")
    p.add_argument("--paced-source", nargs=2, metavar=("PORT", "PERIOD_S"), default=None, help=argparse.SUPPRESS)
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny config, 16 in / 8 out, concurrency 1,4")
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/serve_<time>.json)")
    a = p.parse_args(argv)
    smoke = dict(kv_cache_dtypes="auto,fp8", concurrency=[1, 4], input_len=16, output_len=8)
    full = dict(kv_cache_dtypes="bfloat16,fp8", concurrency=[1, 16, 64, 256], input_len=512, output_len=256)
    for k, v in (smoke if a.smoke else full).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.smoke:
        a.min_prompts, a.num_warmups = min(a.min_prompts, 4), min(a.num_warmups, 1)
    return a


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.paced_source:
        run_paced_source(int(a.paced_source[0]), float(a.paced_source[1]))
        return 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # `timeout` ends us: stop the server first
    tmp = tempfile.TemporaryDirectory(prefix="serve-bench-")
    work = Path(tmp.name)
    if a.smoke:
        model = work / "tiny-qwen3"
        model.mkdir()
        (model / "config.json").write_text(json.dumps(SMOKE_CONFIG))
    else:
        model = Path(a.model) if a.model else DEFAULT_MODEL
    config = json.loads((model / "config.json").read_text())
    load_format = a.load_format or ("auto" if list(model.glob("*.safetensors")) else "dummy")
    tokenizer = a.tokenizer or (str(model) if common.has_tokenizer(model) else
                                str(write_word_tokenizer(work / "word-tokenizer", config["vocab_size"])))
    serve_args = ["--model", str(model), "--tokenizer", tokenizer, "--load-format", load_format, "--dtype", a.dtype,
                  *shlex.split(a.serve_args)]
    engine_args = ["--model", str(model), "--load-format", load_format, "--dtype", a.dtype, *shlex.split(a.offline_args)]
    if a.smoke:
        smoke_engine = ["--device", "cpu", "--kv-cache-memory", str(1 << 24), "--max-model-len", "256"]
        serve_args += smoke_engine
        engine_args += smoke_engine
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(common.REPO), os.environ.get("PYTHONPATH")])),
           "PYTHONUNBUFFERED": "1", "HF_HUB_OFFLINE": "1"}
    out = Path(a.out) if a.out else common.default_out("serve")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc: dict[str, Any] = {
        "run": common.run_info("serve_bench", argv, a.smoke),
        "settings": {"model": "tiny Qwen3 (smoke)" if a.smoke else str(model), "load_format": load_format,
                     "tokenizer": "word-level w<i> (written here)" if tokenizer.startswith(str(work)) else tokenizer,
                     "serve_args": serve_args, "endpoint": a.endpoint, "dataset": "random, token-id prompts",
                     "input_len": a.input_len, "output_len": a.output_len, "ignore_eos": True,
                     "concurrency": a.concurrency, "prompts_per_concurrency": a.prompts_per_concurrency,
                     "min_prompts": a.min_prompts, "num_warmups": a.num_warmups,
                     "offline_engine_args": engine_args if a.offline else None},
        "servers": {},
        "points": [],
    }
    failed = False
    for kv in [k for k in a.kv_cache_dtypes.split(",") if k]:
        log = out.with_name(f"{out.stem}_server_{kv}.log")
        server = Server([*serve_args, "--kv-cache-dtype", kv], log, env)
        info: dict[str, Any] = {"log": str(log), "command": " ".join(["python3", *server.cmd[1:]])}
        doc["servers"][kv] = info
        try:
            info["ready_s"] = server.wait_healthy(a.startup_timeout_s)
            print(f"[serve] kv {kv}: server ready in {info['ready_s']:.1f} s at {server.url}", flush=True)
            for c in a.concurrency:
                point = {"kv_cache_dtype": kv, "concurrency": c, **bench_point(server, a, c, work, env)}
                doc["points"].append(point)
                failed |= not point["all_ok"]
                share = point["cpu_share_of_wall"]
                print(f"[serve] kv {kv} c={c}: {point['output_throughput']:.1f} out tok/s, TTFT p50 "
                      f"{point['median_ttft_ms']:.1f} ms, TPOT p50 {point['median_tpot_ms']:.2f} ms, "
                      f"failed {point['failed']}; CPU share of wall: API server {share.get('api_server', 0):.2f}, "
                      f"engine core {share.get('engine_core', 0):.2f}, client {share.get('client', 0):.2f}; API "
                      f"server {point['api_server_us_per_output_token']:.1f} us CPU per output token", flush=True)
                if a.client_floor:
                    point["client_floor"] = client_floor(point, a, c, work, env)
                common.write_json(out, doc)
        except Exception as e:  # noqa: BLE001 - keep the other dtype's points; the run fails
            failed = True
            info["error"] = f"{type(e).__name__}: {e}"[-4000:]
            print(f"[serve] kv {kv}: {info['error']}", flush=True)
        finally:
            server.stop()
            info["server_returncode"] = server.proc.returncode
        if a.offline:
            for point in [p for p in doc["points"] if p["kv_cache_dtype"] == kv]:
                try:
                    compare_offline(point, offline_point(a, engine_args, kv, point["concurrency"], work, env))
                except Exception as e:  # noqa: BLE001 - the server's figures stand; the run fails
                    failed = True
                    point["offline_error"] = f"{type(e).__name__}: {e}"[-4000:]
                    print(f"[serve]   offline kv {kv} c={point['concurrency']}: {point['offline_error']}", flush=True)
        common.write_json(out, doc)
    doc["failed"] = failed
    common.write_json(out, doc)
    tmp.cleanup()
    print(f"wrote {out}")
    by_kv: dict[str, list[str]] = {}
    for p in doc["points"]:
        ratio = f" ({p['serve_over_offline_tok_s']:.2f}x offline)" if "serve_over_offline_tok_s" in p else ""
        by_kv.setdefault(p["kv_cache_dtype"], []).append(f"c{p['concurrency']} {p['output_throughput']:.0f}{ratio}")
    common.print_summary("; ".join(f"{kv} out tok/s {', '.join(v)}" for kv, v in by_kv.items())
                         + f"; {'FAILED' if failed else 'all requests ok'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
