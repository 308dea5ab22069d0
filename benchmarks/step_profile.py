"""Where a decode step's time goes (H200): one engine on a config-only model (dummy weights),
nano-vllm's workload, then per decode step at full batch: the plain step period (overlapped under
async scheduling), the host time of each part without added synchronisation, then (serial steps)
CPU prepare, graph replay (synchronized), logits + sampler, and the rest of Engine.step; then a
torch.profiler table of the GPU kernels.

    python3 benchmarks/step_profile.py [--model benchmarks/configs/qwen3-0.6b] [--kv-cache-dtype bfloat16]
                                       [--async-scheduling | --no-async-scheduling]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from kvserve.bench import throughput as tp
from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.engine.sampling import RequestOutputKind, SamplingParams


def timed(obj, name, bucket, sync):
    real = getattr(obj, name)

    def wrapper(*a, **k):
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = real(*a, **k)
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        bucket.setdefault(name, []).append(time.perf_counter() - t0)
        return out

    setattr(obj, name, wrapper)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--kv-cache-dtype", default="bfloat16")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--num-prompts", type=int, default=256)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=None)
    a = ap.parse_args()
    eng = Engine.from_engine_args(EngineArgs(
        model=a.model, load_format="dummy", skip_tokenizer_init=True, dtype="bfloat16",
        kv_cache_dtype=a.kv_cache_dtype, max_num_seqs=a.num_prompts, max_model_len=a.max_model_len,
        async_scheduling=a.async_scheduling))
    reqs = tp.nano_vllm_requests() if a.num_prompts == 256 else tp.random_requests(a.num_prompts, 20, 40)
    for i, r in enumerate(reqs):
        eng.add_request(str(i), {"prompt_token_ids": r.prompt_token_ids},
                        SamplingParams(temperature=0.6, max_tokens=r.output_len, ignore_eos=True, detokenize=False,
                                       output_kind=RequestOutputKind.FINAL_ONLY))
    t0 = time.perf_counter()
    while not (len(eng.scheduler.running) == a.num_prompts and not eng.scheduler.waiting
               and all(r.num_output_tokens > 0 for r in eng.scheduler.running)):
        eng.step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    print(f"prefill phase {time.perf_counter() - t0:.2f} s")
    runner = eng.runner
    # 1. plain steps: the step period as the workload sees it (overlapped under async scheduling)
    plain = []
    for _ in range(a.steps):
        t = time.perf_counter()
        eng.step()
        plain.append(time.perf_counter() - t)
    print(f"async_scheduling={eng.async_scheduling}  batch {len(eng.scheduler.running)}  "
          f"plain Engine.step median {statistics.median(plain)*1e3:.2f} ms")
    # 2. host time of each part, no synchronisation added (what the CPU spends per step)
    h: dict[str, list[float]] = {}
    from kvserve.runner import model_runner as mr

    timed(eng.scheduler, "schedule", h, False)
    timed(runner, "prepare", h, False)
    timed(runner, "execute_async" if eng.async_scheduling else "execute", h, False)
    timed(eng, "_process", h, False)
    real_results = mr.PendingSamples.results

    def results(self):
        t = time.perf_counter()
        out = real_results(self)
        h.setdefault("wait for tokens", []).append(time.perf_counter() - t)
        return out

    mr.PendingSamples.results = results
    for _ in range(a.steps):
        eng.step()
    mr.PendingSamples.results = real_results
    for obj, name in ((eng.scheduler, "schedule"), (runner, "prepare"), (runner, "execute_async"), (runner, "execute"), (eng, "_process")):
        obj.__dict__.pop(name, None)
    print("  host time per step (no added sync):")
    for k, v in h.items():
        print(f"  {k:16s} median {statistics.median(v)*1e3:8.3f} ms  (n={len(v)})")
    if eng.async_scheduling:
        eng.async_scheduling = False  # the synchronised split below needs the serial step
        eng.step()
    b: dict[str, list[float]] = {}
    timed(runner, "prepare", b, False)
    if runner.graphs is not None:
        timed(runner.graphs, "run", b, True)
    timed(runner.model, "compute_logits", b, True)
    real_sampler = runner.sampler

    class S:
        def __call__(self, *x, **k):
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t = time.perf_counter()
            out = real_sampler(*x, **k)
            b.setdefault("sampler", []).append(time.perf_counter() - t)
            return out

    runner.sampler = S()
    timed(runner, "execute", b, True)
    timed(eng.scheduler, "schedule", b, False)
    steps = []
    for _ in range(a.steps):
        t = time.perf_counter()
        eng.step()
        steps.append(time.perf_counter() - t)
    print(f"batch {len(eng.scheduler.running)}  Engine.step median {statistics.median(steps)*1e3:.2f} ms")
    for k, v in b.items():
        print(f"  {k:16s} median {statistics.median(v)*1e3:8.3f} ms  (n={len(v)})")
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            eng.step()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60))


if __name__ == "__main__":
    main()
