"""``kvserve bench throughput``: offline throughput over a grid, like ``vllm bench throughput``
(no server: the ``Engine`` is stepped in this process).

Grid: every ``--kv-cache-dtype`` x every ``--concurrency`` (``max_num_seqs`` of the engine) x every
workload. One engine is built per (kv dtype, concurrency) and freed (``del``, ``gc``,
``torch.cuda.empty_cache``) before the next; it runs each workload after a short untimed warm-up.
Workloads:

* ``--dataset random`` (default): one workload per ``--input-len`` / ``--output-len`` pair
  (comma lists, paired in order; a single value is repeated), ``--num-prompts`` requests of exactly
  that many random prompt ids and output tokens.
* ``--dataset nano-vllm``: nano-vllm's ``bench.py`` workload, drawn exactly as it does
  (``random.seed(0)``; 256 prompts of ``randint(100, 1024)`` ids, each ``randint(0, 10000)`` --
  Python's ``randint`` includes both ends; then ``max_tokens = randint(100, 1024)`` per request).
  ``--num-prompts N`` takes the first N of those (N > 256 draws N). Ids are capped at
  ``vocab_size - 1`` for tiny test models.

Every request uses ``ignore_eos=True`` and ``max_tokens`` = its output length, so every request
generates exactly that many tokens (checked). Sampling: ``--temperature`` (default 1.0, vLLM's
bench default), ``--top-p``.

Timing (``time.perf_counter``; all requests are added at t0, the offline setting): the scheduler's
output is observed each step (the engine's ``schedule`` is wrapped), so the time a request's
token arrives is the end of the step that sampled it, without building per-step outputs
(``FINAL_ONLY`` outputs, as ``LLM.generate``).

    elapsed   = end of the last step - t0 (add_request of every request included)
    TTFT      = first token - t0 (queueing included, as every request arrives at t0)
    TPOT      = (last token - first token) / (output tokens - 1), per request
    requests/s, output tok/s, total tok/s = requests, output tokens, prompt + output tokens / elapsed

Decode steps: a step whose scheduled requests all computed exactly one token over a non-empty
context. At the largest such batch, the mean (and median) wall time of ``Engine.step`` is compared
with its roofline: ``(weight bytes + KV bytes read) / copy bandwidth``, where weight bytes are the
parameters one decode step reads (all of them, less an untied input embedding table, of which only
one row per sequence is read), KV bytes read = sum over the batch of context length x layers x 2
x kv_heads x head_size x bytes per element of the cache dtype, and the copy bandwidth is measured
once at start (CUDA: a device-to-device copy of a 1 GiB buffer; CPU: a large memcpy), counted as
bytes read + written per second.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, Callable

from kvserve.arg_utils import add_engine_args, engine_kwargs

NANO_VLLM_NUM_SEQS = 256
NANO_VLLM_LENGTHS = (100, 1024, 1024)  # min length, max input length, max output length
NANO_VLLM_MAX_TOKEN_ID = 10000  # randint(0, 10000): inclusive
RANDOM_MAX_TOKEN_ID = 9999  # the random dataset: ids in [0, 10000)
DATASETS = ("random", "nano-vllm")
PERCENTILES = (50, 90, 99)


# ----------------------------------------------------------------------------------------------
# workloads
# ----------------------------------------------------------------------------------------------


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    output_len: int


def nano_vllm_requests(num_prompts: int = NANO_VLLM_NUM_SEQS, seed: int = 0,
                       lengths: tuple[int, int, int] = NANO_VLLM_LENGTHS,
                       max_token_id: int = NANO_VLLM_MAX_TOKEN_ID) -> list[BenchRequest]:
    """nano-vllm's bench.py requests (see the module docstring); the first ``num_prompts``."""
    min_len, max_in, max_out = lengths
    if not 1 <= min_len <= min(max_in, max_out):
        raise ValueError(f"nano-vllm lengths {lengths!r} are invalid: expected 1 <= min <= max input, max output")
    rng = random.Random(seed)  # same stream as nano-vllm's random.seed(seed) + random.randint
    n = max(num_prompts, NANO_VLLM_NUM_SEQS)
    prompts = [[rng.randint(0, max_token_id) for _ in range(rng.randint(min_len, max_in))] for _ in range(n)]
    outs = [rng.randint(min_len, max_out) for _ in range(n)]
    return [BenchRequest(p, o) for p, o in zip(prompts[:num_prompts], outs[:num_prompts])]


def random_requests(num_prompts: int, input_len: int, output_len: int, seed: int = 0,
                    max_token_id: int = RANDOM_MAX_TOKEN_ID) -> list[BenchRequest]:
    """``num_prompts`` prompts of exactly ``input_len`` random ids in [0, max_token_id]."""
    rng = random.Random(seed)
    return [BenchRequest([rng.randint(0, max_token_id) for _ in range(input_len)], output_len)
            for _ in range(num_prompts)]


@dataclass
class Workload:
    """One workload of the grid; requests are drawn once per id range (cached)."""

    name: str
    dataset: str
    num_prompts: int
    input_len: int | None = None
    output_len: int | None = None
    seed: int = 0
    nano_lengths: tuple[int, int, int] = NANO_VLLM_LENGTHS
    _cache: dict[int, list[BenchRequest]] = field(default_factory=dict, repr=False)

    def requests(self, vocab_size: int) -> list[BenchRequest]:
        if self.dataset == "nano-vllm":
            cap = min(NANO_VLLM_MAX_TOKEN_ID, vocab_size - 1)
            make = lambda: nano_vllm_requests(self.num_prompts, self.seed, self.nano_lengths, cap)  # noqa: E731
        else:
            cap = min(RANDOM_MAX_TOKEN_ID, vocab_size - 1)
            make = lambda: random_requests(self.num_prompts, self.input_len, self.output_len, self.seed, cap)  # noqa: E731
        if cap not in self._cache:
            self._cache[cap] = make()
        return self._cache[cap]

    def describe(self) -> dict[str, Any]:
        d: dict[str, Any] = {"workload": self.name, "dataset": self.dataset, "num_prompts": self.num_prompts,
                             "dataset_seed": self.seed}
        if self.dataset == "nano-vllm":
            d["nano_vllm_lengths"] = list(self.nano_lengths)
        else:
            d["input_len"], d["output_len"] = self.input_len, self.output_len
        return d


def make_workloads(dataset: str, num_prompts: int, input_lens: list[int], output_lens: list[int],
                   seed: int = 0, nano_lengths: tuple[int, int, int] = NANO_VLLM_LENGTHS) -> list[Workload]:
    if dataset not in DATASETS:
        raise ValueError(f"--dataset {dataset!r} is invalid: expected one of {DATASETS}")
    if num_prompts < 1:
        raise ValueError(f"--num-prompts {num_prompts} is invalid: expected an integer >= 1")
    if dataset == "nano-vllm":
        return [Workload("nano-vllm", dataset, num_prompts, seed=seed, nano_lengths=tuple(nano_lengths))]
    if len(input_lens) == 1 and len(output_lens) > 1:
        input_lens = input_lens * len(output_lens)
    if len(output_lens) == 1 and len(input_lens) > 1:
        output_lens = output_lens * len(input_lens)
    if len(input_lens) != len(output_lens):
        raise ValueError(f"--input-len and --output-len need the same number of values (or one), got "
                         f"{len(input_lens)} and {len(output_lens)}")
    return [Workload(f"in{i}/out{o}", dataset, num_prompts, i, o, seed) for i, o in zip(input_lens, output_lens)]


# ----------------------------------------------------------------------------------------------
# bandwidth, bytes
# ----------------------------------------------------------------------------------------------


def measure_copy_bandwidth(device: Any, nbytes: int | None = None, iters: int | None = None) -> dict[str, Any]:
    """Copy bandwidth of ``device``: (bytes read + bytes written) per second of ``dst.copy_(src)``.

    CUDA: two ``nbytes`` (default 1 GiB) uint8 buffers, timed with CUDA events after warm-up copies.
    CPU: a large memcpy (default 256 MiB), ``time.perf_counter``; the best of ``iters``."""
    import torch

    device = torch.device(device)
    cuda = device.type == "cuda"
    nbytes = int(nbytes or ((1 << 30) if cuda else (256 << 20)))
    iters = int(iters or (20 if cuda else 5))
    src = torch.ones(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    if cuda:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            dst.copy_(src)
        end.record()
        end.synchronize()
        seconds = start.elapsed_time(end) / 1e3 / iters
        method = "CUDA device-to-device copy_, CUDA events, mean"
    else:
        times = []
        for _ in range(iters):
            t = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - t)
        seconds = min(times)
        method = f"CPU memcpy (torch copy_, {torch.get_num_threads()} threads), best of {iters}"
    del src, dst
    if cuda:
        torch.cuda.empty_cache()
    bw = 2 * nbytes / seconds
    return {"device": str(device), "bytes": nbytes, "iters": iters, "seconds_per_copy": seconds,
            "bytes_per_s": bw, "GBps": bw / 1e9, "method": method, "counts": "bytes read + bytes written"}


def decode_weight_bytes(model: Any) -> tuple[int, int]:
    """(bytes of all parameters, bytes one decode step reads): an input embedding table that is not
    also the LM head is left out of the second (a decode step reads one row per sequence)."""
    import torch.nn as nn

    total = sum(p.numel() * p.element_size() for p in model.parameters())
    tied = bool(getattr(model, "tie_word_embeddings", False))
    emb = 0
    if not tied:
        seen: set[int] = set()
        for m in model.modules():
            if isinstance(m, nn.Embedding) and id(m.weight) not in seen:
                seen.add(id(m.weight))
                emb += m.weight.numel() * m.weight.element_size()
    return total, total - emb


def routed_expert_bytes(model: Any) -> tuple[int, int, int]:
    """(experts a layer, experts a token, bytes of every layer's routed experts) of a mixture-of-experts
    model (its blocks have ``top_k`` and ``experts``; dense, NVFP4 or FP8 experts alike); zeros when
    it has none."""
    num_experts = top_k = nbytes = 0
    for m in model.modules():
        experts = getattr(m, "experts", None)
        if experts is None or not hasattr(m, "top_k") or not hasattr(experts, "num_experts"):
            continue
        num_experts, top_k = experts.num_experts, m.top_k
        nbytes += sum(t.numel() * t.element_size() for t in (*experts.parameters(), *experts.buffers()))
    return num_experts, top_k, nbytes


def state_bytes_per_sequence(runner: Any) -> int:
    """Recurrent-state bytes of one sequence over all GDN layers (conv state in the model dtype, SSM
    state float32): what a decode step reads and writes per sequence of a hybrid model (0 otherwise)."""
    import torch

    total = 0
    for layer in getattr(runner, "gdn_layers", None) or []:
        (c, w), (hv, k, v) = layer.state_shapes()
        total += c * w * torch.empty((), dtype=runner.config.model_config.dtype).element_size() + hv * k * v * 4
    return total


def kv_bytes_per_token(engine: Any) -> int:
    """K and V bytes of one token over all attention layers, in the engine's cache dtype."""
    spec = getattr(engine.runner, "kv_spec", None)
    if spec is not None:
        return spec.block_bytes // spec.block_size
    mc = engine.config.model_config
    itemsize = 1 if engine.config.cache_config.kv_dtype.is_fp8 else mc.dtype.itemsize
    return mc.num_layers * 2 * mc.num_kv_heads * mc.head_size * itemsize


def _percentiles(values: list[float], scale: float = 1e3) -> dict[str, float]:
    import numpy as np

    if not values:
        return {"mean": float("nan"), **{f"p{p}": float("nan") for p in PERCENTILES}}
    arr = np.asarray(values, dtype=np.float64) * scale
    out = {"mean": float(arr.mean())}
    for p in PERCENTILES:
        out[f"p{p}"] = float(np.percentile(arr, p))
    return out


# ----------------------------------------------------------------------------------------------
# engines and runs
# ----------------------------------------------------------------------------------------------


def build_engine(engine_kwargs: dict[str, Any]) -> Any:
    from kvserve.config import EngineArgs
    from kvserve.engine.engine import Engine

    return Engine.from_engine_args(EngineArgs(**engine_kwargs))


def release_memory() -> None:
    """After the last reference to an engine is dropped: collect it and return CUDA memory."""
    gc.collect()
    try:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
            torch.cuda.empty_cache()
    except Exception:  # noqa: BLE001 - best effort
        pass


def engine_info(engine: Any) -> dict[str, Any]:
    cfg = engine.config
    mc, cc, sc, rc = cfg.model_config, cfg.cache_config, cfg.scheduler_config, cfg.runner_config
    total, read = decode_weight_bytes(engine.runner.model)
    info = {
        "model": mc.model,
        "architecture": mc.architecture,
        "dtype": str(mc.dtype).replace("torch.", ""),
        "load_format": mc.load_format,
        "skip_tokenizer_init": mc.skip_tokenizer_init,
        "max_model_len": mc.max_model_len,
        "vocab_size": mc.vocab_size,
        "kv_cache_dtype": cc.kv_dtype.name if cc.kv_dtype is not None else cc.cache_dtype,
        "block_size": cc.block_size,
        "num_blocks": cc.num_blocks,
        "kv_cache_tokens": cc.num_blocks * cc.block_size,
        "enable_prefix_caching": cc.enable_prefix_caching,
        "max_num_seqs": sc.max_num_seqs,
        "max_num_batched_tokens": sc.max_num_batched_tokens,
        "enable_chunked_prefill": sc.enable_chunked_prefill,
        "device": str(cfg.device),
        "attention_backend": rc.attention.name,
        "fp8_query": rc.attention.query_fp8,
        "enforce_eager": rc.enforce_eager,
        "async_scheduling": sc.async_scheduling,
        "cudagraph_capture_sizes": list(rc.cudagraph_capture_sizes) if not rc.enforce_eager else [],
        "weight_bytes": total,
        "decode_weight_bytes": read,
        "routed_experts": dict(zip(("num_experts", "top_k", "bytes"), routed_expert_bytes(engine.runner.model))),
        "state_bytes_per_sequence": state_bytes_per_sequence(engine.runner),
        "kv_bytes_per_token": kv_bytes_per_token(engine),
    }
    return info


class _StepObserver:
    """Wraps ``engine.scheduler.schedule`` to note, per step, whether the step is decode-only, its
    batch size and the context tokens its attention reads, and ``engine.core._process`` to note which
    requests received a token during the ``Engine.step`` call (with async scheduling, the tokens
    of the step launched one call earlier)."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.scheduler = engine.scheduler
        self.orig = self.scheduler.schedule
        self.orig_process = engine.core._process
        self.samplers: list[str] = []  # requests that received a token in this call
        self.decode = False
        self.batch = 0
        self.context = 0

    def __enter__(self) -> "_StepObserver":
        def schedule() -> Any:
            out = self.orig()
            decode, context = bool(out.scheduled), 0
            for s in out.scheduled:
                c, n = s.num_computed_tokens, s.num_new_tokens
                if n != 1 or c == 0:
                    decode = False
                context += c + n
            self.decode, self.batch, self.context = decode, len(out.scheduled), context
            return out

        def process(scheduled: list, results: dict, prompt_logprobs: dict) -> Any:
            self.samplers.extend(s.request.request_id for s in scheduled if s.request.request_id in results)
            return self.orig_process(scheduled, results, prompt_logprobs)

        self.scheduler.schedule = schedule
        self.engine.core._process = process
        return self

    def __exit__(self, *exc: Any) -> None:
        self.scheduler.__dict__.pop("schedule", None)  # back to the class methods
        self.engine.core.__dict__.pop("_process", None)


_RUN_COUNTER = [0]


def run_requests(engine: Any, requests: list[BenchRequest], *, temperature: float = 1.0, top_p: float = 1.0,
                 detokenize: bool = True, copy_bandwidth: float | None = None,
                 weight_bytes: int | None = None, kv_token_bytes: int | None = None,
                 routed_experts: dict[str, int] | None = None, state_bytes: int = 0) -> dict[str, Any]:
    """Run ``requests`` to completion on ``engine`` (all added at t0); metrics as in the docstring."""
    from kvserve.engine.sampling import RequestOutputKind, SamplingParams

    if engine.has_unfinished_requests():
        raise RuntimeError("the engine has unfinished requests; the benchmark needs an idle engine")
    max_len = engine.config.model_config.max_model_len
    too_long = [i for i, r in enumerate(requests) if len(r.prompt_token_ids) + r.output_len > max_len]
    if too_long:
        r = requests[too_long[0]]
        raise ValueError(f"{len(too_long)} request(s) need more than max_model_len={max_len} tokens (e.g. "
                         f"{len(r.prompt_token_ids)} prompt + {r.output_len} output); raise --max-model-len")
    reset = getattr(engine.kv_manager, "reset_prefix_cache", None)
    if reset is not None:
        reset()  # no KV reuse from the warm-up or an earlier workload
    preempt0 = engine.scheduler.num_preemptions
    _RUN_COUNTER[0] += 1
    prefix = f"bench{_RUN_COUNTER[0]}-"
    n = len(requests)
    index = {f"{prefix}{i}": i for i in range(n)}
    first = [0.0] * n
    last = [0.0] * n
    ntok = [0] * n
    itl: list[float] = []  # gaps between a request's consecutive tokens (as the server's ITL)
    finished = [False] * n
    decode_steps: list[tuple[int, float, int]] = []  # (batch, seconds, context tokens)
    num_steps = 0
    empty_steps = 0

    with _StepObserver(engine) as obs:
        t0 = time.perf_counter()
        for i, r in enumerate(requests):
            params = SamplingParams(temperature=temperature, top_p=top_p, max_tokens=r.output_len, ignore_eos=True,
                                    detokenize=detokenize, output_kind=RequestOutputKind.FINAL_ONLY)
            engine.add_request(f"{prefix}{i}", {"prompt_token_ids": r.prompt_token_ids}, params)
        t_end = t0
        while engine.has_unfinished_requests():
            obs.batch, obs.decode, obs.samplers = 0, False, []
            ts = time.perf_counter()
            outs = engine.step()
            te = time.perf_counter()
            if not obs.batch and not obs.samplers:
                empty_steps += 1
                if empty_steps > 1000:
                    raise RuntimeError("the engine scheduled nothing for 1000 steps with requests waiting")
                continue
            num_steps += 1 if obs.batch else 0
            for rid in obs.samplers:
                i = index.get(rid)
                if i is None:
                    continue
                if not ntok[i]:
                    first[i] = te
                else:
                    itl.append(te - last[i])
                last[i] = te
                ntok[i] += 1
            if obs.decode:
                decode_steps.append((obs.batch, te - ts, obs.context))
            for out in outs:
                if out.finished:
                    i = index[out.request_id]
                    finished[i] = True
                    if len(out.outputs[0].token_ids) != requests[i].output_len:
                        raise RuntimeError(
                            f"request {i} generated {len(out.outputs[0].token_ids)} tokens, expected "
                            f"{requests[i].output_len} (ignore_eos, max_tokens)")
            t_end = te

    if not all(finished):
        raise RuntimeError(f"{finished.count(False)} request(s) did not finish")
    elapsed = t_end - t0
    prompt_tokens = sum(len(r.prompt_token_ids) for r in requests)
    output_tokens = sum(ntok)
    expected = sum(r.output_len for r in requests)
    if output_tokens != expected:
        raise RuntimeError(f"observed {output_tokens} sampled tokens, expected {expected}")
    ttft = [f - t0 for f in first]
    tpot = [(lt - f) / (k - 1) for f, lt, k in zip(first, last, ntok) if k > 1]
    res: dict[str, Any] = {
        "num_requests": n,
        "prompt_tokens": prompt_tokens,
        "output_tokens": output_tokens,
        "elapsed_s": elapsed,
        "requests_per_s": n / elapsed,
        "output_tok_s": output_tokens / elapsed,
        "total_tok_s": (prompt_tokens + output_tokens) / elapsed,
        "num_steps": num_steps,
        "num_preemptions": engine.scheduler.num_preemptions - preempt0,
        "temperature": temperature,
        "top_p": top_p,
    }
    for name, vals in (("ttft", ttft), ("tpot", tpot), ("itl", itl)):
        for k, v in _percentiles(vals).items():
            res[f"{k}_{name}_ms"] = v
    res.update(decode_stats(decode_steps, copy_bandwidth, weight_bytes, kv_token_bytes, routed_experts, state_bytes))
    return res


def decode_stats(decode_steps: list[tuple[int, float, int]], copy_bandwidth: float | None,
                 weight_bytes: int | None, kv_token_bytes: int | None,
                 routed_experts: dict[str, int] | None = None, state_bytes: int = 0) -> dict[str, Any]:
    """Decode-only steps at the largest batch: measured step time vs the roofline (weights + KV +
    each sequence's recurrent state read and written, over the copy bandwidth; of the routed experts,
    those the batch's tokens are expected to go to)."""
    out: dict[str, Any] = {"decode_steps_total": len(decode_steps)}
    if not decode_steps:
        out.update(decode_batch=0, decode_steps=0, decode_step_ms_mean=None, decode_step_ms_median=None,
                   decode_roofline_ms=None, decode_roofline_fraction=None)
        return out
    big = max(b for b, _, _ in decode_steps)
    at = [(t, c) for b, t, c in decode_steps if b == big]
    times = [t for t, _ in at]
    ctx = statistics.fmean(c for _, c in at)
    out.update(
        decode_batch=big,
        decode_steps=len(at),
        decode_step_ms_mean=statistics.fmean(times) * 1e3,
        decode_step_ms_median=statistics.median(times) * 1e3,
        decode_step_ms_min=min(times) * 1e3,
        decode_mean_context_tokens=ctx,
        decode_step_ms_mean_all_batches=statistics.fmean(t for _, t, _ in decode_steps) * 1e3,
    )
    if copy_bandwidth and weight_bytes is not None and kv_token_bytes is not None:
        kv = ctx * kv_token_bytes
        if routed_experts and routed_experts.get("num_experts"):
            from kvserve.tools.traffic import expected_experts_touched

            e, xb = routed_experts["num_experts"], routed_experts["bytes"]
            weight_bytes = weight_bytes - xb + round(xb * expected_experts_touched(e, routed_experts["top_k"], big) / e)
        state = 2 * big * state_bytes  # a hybrid's recurrent state, read and written once a step
        roof = (weight_bytes + kv + state) / copy_bandwidth
        out.update(
            decode_kv_bytes_mean=kv,
            decode_state_bytes=state,
            decode_weight_bytes=weight_bytes,
            decode_roofline_ms=roof * 1e3,
            # roofline / measured: 1.0 would be running at copy bandwidth
            decode_roofline_fraction=roof * 1e3 / out["decode_step_ms_mean"],
        )
    else:
        out.update(decode_roofline_ms=None, decode_roofline_fraction=None)
    return out


def warm_up(engine: Any, requests: list[BenchRequest], num: int, output_len: int = 16, *,
            temperature: float = 1.0, top_p: float = 1.0, detokenize: bool = True) -> float:
    """Untimed: the first ``num`` requests with at most ``output_len`` new tokens; returns seconds."""
    if num <= 0 or not requests:
        return 0.0
    sample = [BenchRequest(r.prompt_token_ids, min(r.output_len, output_len)) for r in requests[:num]]
    t = time.perf_counter()
    run_requests(engine, sample, temperature=temperature, top_p=top_p, detokenize=detokenize)
    return time.perf_counter() - t


def run_grid(engine_kwargs: dict[str, Any], kv_dtypes: list[str], concurrencies: list[int | None],
             workloads: list[Workload], *, temperature: float = 1.0, top_p: float = 1.0, detokenize: bool = True,
             num_warmup: int = 4, warmup_output_len: int = 16, copy_bw: dict[str, Any] | None = None,
             log: Callable[[str], None] = print,
             on_point: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """One engine per (kv dtype, concurrency); every workload on it. Returns one record per point."""
    points: list[dict[str, Any]] = []
    bw = copy_bw["bytes_per_s"] if copy_bw else None
    for kv in kv_dtypes:
        for conc in concurrencies:
            kw = dict(engine_kwargs, kv_cache_dtype=kv)
            if conc is not None:
                kw["max_num_seqs"] = conc
            t = time.perf_counter()
            engine = build_engine(kw)
            try:
                build_s = time.perf_counter() - t
                info = engine_info(engine)
                log(f"[bench] engine kv_cache_dtype={info['kv_cache_dtype']} max_num_seqs={info['max_num_seqs']}: "
                    f"built in {build_s:.1f} s, {info['num_blocks']} blocks ({info['kv_cache_tokens']} tokens), "
                    f"backend {info['attention_backend']}, enforce_eager={info['enforce_eager']}")
                for wl in workloads:
                    reqs = wl.requests(engine.vocab_size)
                    warm_s = warm_up(engine, reqs, num_warmup, warmup_output_len, temperature=temperature,
                                     top_p=top_p, detokenize=detokenize)
                    res = run_requests(engine, reqs, temperature=temperature, top_p=top_p, detokenize=detokenize,
                                       copy_bandwidth=bw, weight_bytes=info["decode_weight_bytes"],
                                       kv_token_bytes=info["kv_bytes_per_token"], routed_experts=info["routed_experts"],
                                       state_bytes=info["state_bytes_per_sequence"])
                    point = {"kv_cache_dtype": kv, "kv_cache_dtype_resolved": info["kv_cache_dtype"],
                             "concurrency": info["max_num_seqs"], **wl.describe(), **res,
                             "engine_build_s": build_s, "warmup_s": warm_s, "warmup_requests": min(num_warmup, len(reqs)),
                             "engine": info}
                    points.append(point)
                    log(f"[bench] {kv} c={info['max_num_seqs']} {wl.name}: {res['output_tok_s']:.1f} out tok/s, "
                        f"{res['requests_per_s']:.2f} req/s, {res['elapsed_s']:.2f} s, decode B={res['decode_batch']} "
                        f"{_fmt(res['decode_step_ms_mean'], '.3g')} ms (roofline {_fmt(res['decode_roofline_ms'], '.3g')} ms)")
                    if on_point is not None:
                        on_point(point)
            finally:
                del engine
                release_memory()
    return points


# ----------------------------------------------------------------------------------------------
# report
# ----------------------------------------------------------------------------------------------


def _fmt(v: Any, spec: str = ".2f") -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    return format(v, spec)


def format_table(points: list[dict[str, Any]]) -> str:
    head = ("| kv dtype | conc | workload | req/s | out tok/s | total tok/s | TTFT p50/p90/p99 ms | "
            "TPOT p50/p90/p99 ms | decode B | step ms | roofline ms | roofline/step |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for p in points:
        lines.append(
            f"| {p['kv_cache_dtype_resolved']} | {p['concurrency']} | {p['workload']} | {p['requests_per_s']:.2f} | "
            f"{p['output_tok_s']:.1f} | {p['total_tok_s']:.1f} | "
            f"{_fmt(p['p50_ttft_ms'], '.1f')} / {_fmt(p['p90_ttft_ms'], '.1f')} / {_fmt(p['p99_ttft_ms'], '.1f')} | "
            f"{_fmt(p['p50_tpot_ms'])} / {_fmt(p['p90_tpot_ms'])} / {_fmt(p['p99_tpot_ms'])} | "
            f"{p['decode_batch']} | {_fmt(p['decode_step_ms_mean'], '.3g')} | {_fmt(p['decode_roofline_ms'], '.3g')} | "
            f"{_fmt(p['decode_roofline_fraction'], '.1%')} |"
        )
    return "\n".join(lines)


def plot_points(points: list[dict[str, Any]], path: str, title: str = "") -> None:
    """Two panels: output tok/s per grid point per kv dtype; decode step time vs its roofline."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kvs = list(dict.fromkeys(p["kv_cache_dtype_resolved"] for p in points))
    labels = list(dict.fromkeys(f"c{p['concurrency']}\n{p['workload']}" for p in points))
    by = {(p["kv_cache_dtype_resolved"], f"c{p['concurrency']}\n{p['workload']}"): p for p in points}
    width = 0.8 / max(len(kvs), 1)
    xs = range(len(labels))
    fig, axes = plt.subplots(1, 2, figsize=(max(10, 2.2 * len(labels) + 4), 4.8))
    ax = axes[0]
    for k, kv in enumerate(kvs):
        off = [x - 0.4 + width * (k + 0.5) for x in xs]
        vals = [by[(kv, lab)]["output_tok_s"] if (kv, lab) in by else 0 for lab in labels]
        ax.bar(off, vals, width, label=f"kv {kv}")
    ax.set_title("Output throughput")
    ax.set_ylabel("output tokens / s")
    ax = axes[1]
    for k, kv in enumerate(kvs):
        off = [x - 0.4 + width * (k + 0.5) for x in xs]
        meas = [by[(kv, lab)]["decode_step_ms_mean"] or 0 if (kv, lab) in by else 0 for lab in labels]
        roof = [by[(kv, lab)]["decode_roofline_ms"] or 0 if (kv, lab) in by else 0 for lab in labels]
        bars = ax.bar(off, meas, width, label=f"kv {kv}: measured")
        ax.scatter(off, roof, marker="_", s=600, linewidths=3, color="black", zorder=3,
                   label="roofline (weights + KV) / copy BW" if k == 0 else None)
        for b, p in zip(bars, [by.get((kv, lab)) for lab in labels]):
            if p and p.get("decode_batch"):
                ax.annotate(f"B={p['decode_batch']}", (b.get_x() + b.get_width() / 2, b.get_height()),
                            ha="center", va="bottom", fontsize=7)
    ax.set_title("Decode step at the largest decode batch")
    ax.set_ylabel("ms per step")
    for ax in axes:
        ax.set_xticks(list(xs))
        ax.set_xticklabels(labels, fontsize=8)
        ax.grid(True, axis="y", alpha=0.3)
        ax.legend(fontsize=8)
        ax.set_ylim(bottom=0)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def machine_info() -> dict[str, Any]:
    import platform
    import subprocess

    import torch

    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "platform": platform.platform(), "cpu_count": os.cpu_count(),
                            "torch_threads": torch.get_num_threads()}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:  # pragma: no cover
        pass
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["cuda"] = torch.version.cuda
    try:
        import triton  # noqa: F401

        info["triton"] = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    try:
        repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        info["git_commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=repo, capture_output=True,
                                            text=True, timeout=10).stdout.strip() or None
        info["git_dirty"] = bool(subprocess.run(["git", "status", "--porcelain", "--", "kvserve"], cwd=repo,
                                                capture_output=True, text=True, timeout=10).stdout.strip())
    except Exception:  # noqa: BLE001
        pass
    return info


def write_json(path: str, doc: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(doc, f, indent=2, default=str)
    os.replace(tmp, path)


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def _int_list(name: str) -> Callable[[str], list[int]]:
    def parse(text: str) -> list[int]:
        out = []
        for part in str(text).split(","):
            try:
                v = int(part.strip())
            except ValueError:
                v = 0
            if v < 1:
                raise argparse.ArgumentTypeError(f"{name} {text!r} is invalid: expected comma-separated integers >= 1")
            out.append(v)
        return out

    return parse


def _kv_list(text: str) -> list[str]:
    from kvserve.choices import KV_CACHE_DTYPE_CHOICES

    vals = [v.strip() for v in str(text).split(",") if v.strip()]
    bad = [v for v in vals if v not in KV_CACHE_DTYPE_CHOICES]
    if not vals or bad:
        raise argparse.ArgumentTypeError(
            f"--kv-cache-dtype {text!r} is invalid: expected comma-separated values of {KV_CACHE_DTYPE_CHOICES}")
    return vals


def add_parser(bench_subparsers: Any) -> argparse.ArgumentParser:
    """``kvserve bench throughput``: the engine flags (``arg_utils.add_engine_args``), with
    ``--kv-cache-dtype`` replaced by a list (conflict_handler='resolve')."""
    p = bench_subparsers.add_parser(
        "throughput", conflict_handler="resolve",
        help="offline throughput grid (like `vllm bench throughput`): kv dtypes x concurrency x ISL/OSL",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_engine_args(p)
    g = p.add_argument_group("throughput grid")
    g.add_argument("--kv-cache-dtype", type=_kv_list, default=["auto"],
                   help="comma list of KV cache dtypes, one engine each (e.g. bfloat16,fp8)")
    g.add_argument("--concurrency", type=_int_list("--concurrency"), default=None,
                   help="comma list of max_num_seqs values, one engine each (default: --max-num-seqs)")
    g.add_argument("--dataset", choices=DATASETS, default="random",
                   help="random: --input-len/--output-len pairs; nano-vllm: nano-vllm's bench.py workload")
    g.add_argument("--input-len", type=_int_list("--input-len"), default=[128], help="comma list (random dataset)")
    g.add_argument("--output-len", type=_int_list("--output-len"), default=[128], help="comma list (random dataset)")
    g.add_argument("--num-prompts", type=int, default=256, help="requests per grid point (default 256)")
    g.add_argument("--nano-vllm-lengths", type=_int_list("--nano-vllm-lengths"), default=list(NANO_VLLM_LENGTHS),
                   help="nano-vllm dataset: MIN,MAX_INPUT,MAX_OUTPUT lengths (default 100,1024,1024)")
    g.add_argument("--dataset-seed", type=int, default=0)
    g.add_argument("--temperature", type=float, default=1.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--disable-detokenize", action="store_true", help="detokenize=False in every request")
    g.add_argument("--num-warmup", type=int, default=4, help="untimed warm-up requests per point (0: none)")
    g.add_argument("--warmup-output-len", type=int, default=16)
    g.add_argument("--copy-bw-bytes", type=int, default=None,
                   help="buffer bytes of the copy-bandwidth measurement (default 1 GiB CUDA, 256 MiB CPU)")
    g.add_argument("--json", default=None, metavar="PATH", help="write all points as JSON")
    g.add_argument("--plot", default=None, metavar="PATH.png", help="throughput and decode-roofline chart")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    import torch

    if args.plot:
        from kvserve.bench.plot import check_plot_path

        check_plot_path(args.plot)
    if len(args.nano_vllm_lengths) != 3:
        raise ValueError("--nano-vllm-lengths expects three values: MIN,MAX_INPUT,MAX_OUTPUT")
    if args.num_warmup < 0:
        raise ValueError(f"--num-warmup {args.num_warmup} is invalid: expected an integer >= 0")
    workloads = make_workloads(args.dataset, args.num_prompts, args.input_len, args.output_len, args.dataset_seed,
                               tuple(args.nano_vllm_lengths))
    kw = engine_kwargs(args)
    kw.pop("kv_cache_dtype")
    concurrencies: list[int | None] = list(args.concurrency) if args.concurrency else [kw.pop("max_num_seqs")]
    kw.pop("max_num_seqs", None)
    device = ("cuda" if torch.cuda.is_available() else "cpu") if kw["device"] == "auto" else kw["device"]
    copy_bw = measure_copy_bandwidth(device, args.copy_bw_bytes)
    print(f"[bench] copy bandwidth on {device}: {copy_bw['GBps']:.1f} GB/s ({copy_bw['method']})", flush=True)
    doc: dict[str, Any] = {
        "benchmark": "kvserve bench throughput",
        "date": datetime.now().isoformat(timespec="seconds"),
        "command": " ".join(["kvserve"] + sys.argv[1:]),
        "machine": machine_info(),
        "copy_bandwidth": copy_bw,
        "settings": {"kv_cache_dtypes": args.kv_cache_dtype, "concurrency": concurrencies,
                     "workloads": [w.describe() for w in workloads], "temperature": args.temperature,
                     "top_p": args.top_p, "ignore_eos": True, "detokenize": not args.disable_detokenize,
                     "num_warmup": args.num_warmup, "warmup_output_len": args.warmup_output_len, "engine_args": kw},
        "points": [],
    }

    def on_point(point: dict[str, Any]) -> None:
        doc["points"].append(point)
        if args.json:
            write_json(args.json, doc)  # after every point: a crash keeps what was measured

    points = run_grid(kw, args.kv_cache_dtype, concurrencies, workloads, temperature=args.temperature,
                      top_p=args.top_p, detokenize=not args.disable_detokenize, num_warmup=args.num_warmup,
                      warmup_output_len=args.warmup_output_len, copy_bw=copy_bw,
                      log=lambda s: print(s, flush=True), on_point=on_point)
    print()
    print(format_table(points), flush=True)
    if args.json:
        write_json(args.json, doc)
        print(f"[bench] wrote {args.json}")
    if args.plot:
        model = points[0]["engine"]["model"] if points else ""
        plot_points(points, args.plot, f"{os.path.basename(str(model).rstrip('/'))} on {device}")
        print(f"[bench] wrote {args.plot}")
    return 0
