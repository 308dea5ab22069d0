#!/usr/bin/env python
"""CPU offline throughput (the CPU family of the suite): kvserve vs transformers' own continuous
batching (``generate_batch``), both on the CPU, in one process, on the same checkpoint.

Workload: the 24 prompts of the public golden set (their ``prompt_token_ids``), fp32, greedy,
at most 64 new tokens, stopping on EOS id 2. Both engines serve the same checkpoint (kvserve's
default SmolLM2-135M-Instruct fp32 folder unless ``--model``). Each is built once and warmed up once
(an untimed call over the same prompts, ``--warmup-max-tokens`` new tokens), then ``--repeats``
timed calls per engine run interleaved A B B A ..., so drift in the load of this shared machine hits
both engines alike. Only the generate call is timed. Wall and process CPU seconds are recorded for
every call, and the outputs are compared with each other and (default model and prompts) with
vLLM's fp32 reference.

A ``--model`` folder with only a config.json gets random fp32 weights written by transformers
(seeded) into a temporary copy, so both engines load the same weights; without the golden set
(``--prompts synthetic``, or a machine without ``../shared``) the prompts are 24 random-id prompts
with the golden set's lengths (20 of 35-91 tokens, 4 of 968-1,889).

Fairness settings (see benchmarks/HISTORY.md, CPU section):
* kvserve: ``LLM(dtype="float32", device="cpu")`` with its defaults (block 16,
  max_num_batched_tokens 4096, max_num_seqs 256, chunked prefill on).
* transformers: ``attn_implementation="sdpa"``, ``ContinuousBatchingConfig(page_size=16,
  max_batch_tokens=4096, max_requests_per_batch=256, num_blocks=1024, use_cuda_graph=False,
  use_async_batching=False, auto_switch_to_flash=False)``; ``persistent_manager=True``, so the
  timed calls reuse the warmed-up cache and batch processor, as kvserve reuses its engine.
* Prefix caching / block sharing: off in both by default, so a timed call cannot reuse KV blocks
  left by the warm-up or an earlier repeat (kvserve keeps freed blocks in its prefix cache across
  ``generate`` calls). ``--prefix-caching`` turns it on in both and resets both caches before
  every timed call, so only sharing inside the batch counts.
* Both run with the same ``torch.get_num_threads()`` (``--threads`` sets it; default torch's).
  transformers' generation loop runs in a background thread; its thread count is recorded too.

Usage:
    python3 benchmarks/cpu_bench.py --repeats 3                     # the dev machine (2 cores): ~4 min
    bash benchmarks/gpu.sh cpu                                      # the H200 host's CPU: $OUT/cpu.json
    python3 benchmarks/cpu_bench.py --engines kvserve --repeats 1 --out /tmp/x.json
    python3 benchmarks/cpu_bench.py --smoke --out /tmp/cpu.json     # tiny random model, 3 prompts, seconds
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository root on sys.path: kvserve)

REPO = common.REPO
EVAL = REPO.parent / "shared" / "eval"
GOLDEN = EVAL / "golden_public.jsonl"
VLLM_REF = EVAL / "golden_public_vllm_fp32.jsonl"
MAX_NEW_TOKENS = 64
EOS_ID = 2
ENGINES = ("kvserve", "transformers")

# transformers' CB settings, chosen to match kvserve's defaults (block 16, 4096 batched tokens, 256 seqs)
TF_PAGE_SIZE = 16
TF_MAX_BATCH_TOKENS = 4096
TF_MAX_REQUESTS = 256
TF_NUM_BLOCKS = 1024  # 16,384 tokens of KV: ~2x the peak need of this workload (~8.4k), no preemption

# --smoke: a tiny Llama (SmolLM2's architecture), random weights, three short prompts
SMOKE_CONFIG = common.TINY_LLAMA
SMOKE_PROMPT_LENS = (5, 12, 30)
SMOKE_MAX_NEW_TOKENS = 8
SMOKE_KV_CACHE_MEMORY = 1 << 24  # kvserve's KV pool in the smoke run (the CPU default is 4 GiB)
# --prompts synthetic: the golden set's shape (20 short prompts, 4 long ones)
SYNTHETIC_LENS = ((20, 35, 91), (4, 968, 1889))


def load_jsonl(path: Path) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def synthetic_prompts(vocab_size: int, groups, seed: int = 0) -> list[dict]:
    """Random-id prompts: ``groups`` = (count, min length, max length) triples."""
    rng = random.Random(seed)
    out = []
    for count, lo, hi in groups:
        for _ in range(count):
            ids = [rng.randrange(10, vocab_size) for _ in range(rng.randint(lo, hi))]
            out.append({"id": f"synthetic_{len(out):02d}", "prompt_token_ids": ids})
    return out


# ---------------------------------------------------------------------------------------------
# Engines: build once, warm up once, then timed generate calls (interleaved between engines).
# ---------------------------------------------------------------------------------------------
class KvserveEngine:
    name = "kvserve"

    def __init__(self, model: Path, prefix_caching: bool, kv_cache_memory: int | None = None) -> None:
        from kvserve import LLM, SamplingParams

        self.prefix_caching = prefix_caching
        self.llm = LLM(model=str(model), dtype="float32", device="cpu", enable_prefix_caching=prefix_caching,
                       skip_tokenizer_init=not common.has_tokenizer(model), kv_cache_memory=kv_cache_memory)
        self.sp_cls = SamplingParams

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        sp = self.sp_cls(temperature=0, max_tokens=max_new_tokens)
        outs = self.llm.generate([{"prompt_token_ids": p} for p in prompts], sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def reset(self) -> None:
        """Drop prefix-cache entries left by earlier calls (only matters with prefix caching on)."""
        if self.prefix_caching:
            self.llm.llm_engine.kv_manager.reset_prefix_cache()

    def config(self) -> dict:
        eng = self.llm.llm_engine
        sc, cc, mc = eng.config.scheduler_config, eng.config.cache_config, eng.config.model_config
        return {
            "model": str(mc.model),
            "dtype": str(mc.dtype).replace("torch.", ""),
            "block_size": cc.block_size,
            "num_blocks": cc.num_blocks,
            "max_num_batched_tokens": sc.max_num_batched_tokens,
            "max_num_seqs": sc.max_num_seqs,
            "enable_chunked_prefill": sc.enable_chunked_prefill,
            "enable_prefix_caching": cc.enable_prefix_caching,
        }

    def close(self) -> None:
        del self.llm


class TransformersEngine:
    name = "transformers"

    def __init__(self, model: Path, prefix_caching: bool, kv_cache_memory: int | None = None) -> None:
        import torch
        from transformers import AutoModelForCausalLM, GenerationConfig
        from transformers.generation import ContinuousBatchingConfig

        self.prefix_caching = prefix_caching
        self.path = model  # the very checkpoint kvserve serves
        self.model = AutoModelForCausalLM.from_pretrained(
            str(self.path), dtype=torch.float32, attn_implementation="sdpa"
        ).eval()
        self.gen_cls = GenerationConfig
        self.cb_cfg = ContinuousBatchingConfig(
            page_size=TF_PAGE_SIZE,
            num_blocks=TF_NUM_BLOCKS,
            max_batch_tokens=TF_MAX_BATCH_TOKENS,
            max_requests_per_batch=TF_MAX_REQUESTS,
            use_cuda_graph=False,
            use_async_batching=False,
            allow_block_sharing=prefix_caching,
            auto_switch_to_flash=False,
            scheduler_type="fifo",
        )
        # The generation loop runs in a background thread: record its torch thread count.
        self.loop_threads: int | None = None
        from transformers.generation.continuous_batching.continuous_api import ContinuousBatchProcessor

        orig_step = ContinuousBatchProcessor._generation_step
        engine = self

        def _step(proc, *a, **k):  # noqa: ANN001
            if engine.loop_threads is None:
                engine.loop_threads = torch.get_num_threads()
            return orig_step(proc, *a, **k)

        ContinuousBatchProcessor._generation_step = _step

    def generate(self, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
        gen_cfg = self.gen_cls(
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=EOS_ID, pad_token_id=EOS_ID, bos_token_id=1
        )
        res = self.model.generate_batch(
            inputs=prompts,
            generation_config=gen_cfg,
            continuous_batching_config=self.cb_cfg,
            max_new_tokens=max_new_tokens,
            persistent_manager=True,  # keep cache + batch processor between calls, like a kvserve LLM
            warmup=False,  # only pre-captures CUDA graphs / compiles: a no-op on CPU without them
            progress_bar=False,
        )
        vals = list(res.values())  # generate_batch returns them in input order
        if len(vals) != len(prompts):
            raise RuntimeError(f"transformers returned {len(vals)} results for {len(prompts)} prompts")
        errors = [v.error for v in vals if v.error is not None]
        if errors:
            raise RuntimeError(f"transformers requests failed: {errors[:3]}")
        return [list(v.generated_tokens) for v in vals]

    def _manager(self):  # noqa: ANN202
        return getattr(self.model, "_cached_continuous_batching_manager", None)

    def reset(self) -> None:
        mgr = self._manager()
        if self.prefix_caching and mgr is not None and mgr.batch_processor is not None:
            mgr.batch_processor.cache.reset()

    def config(self) -> dict:
        mgr = self._manager()
        r = mgr.continuous_batching_config
        cache = mgr.batch_processor.cache if mgr.batch_processor is not None else None
        return {
            "model": str(self.path),
            "dtype": str(self.model.dtype).replace("torch.", ""),
            "attn_implementation": self.model.config._attn_implementation,
            "page_size": r.page_size,
            "num_blocks": getattr(cache, "num_blocks", TF_NUM_BLOCKS),
            "max_batch_tokens": getattr(cache, "max_batch_tokens", r.max_batch_tokens),
            "max_requests_per_batch": r.max_requests_per_batch,
            "use_cuda_graph": list(r.use_cuda_graph) if r.use_cuda_graph is not None else None,
            "use_async_batching": r.use_async_batching,
            "allow_block_sharing": r.allow_block_sharing,
            "max_blocks_per_request (decode fast path)": r.max_blocks_per_request,
            "scheduler_type": r.scheduler_type,
            "compiled (varlen, decode)": [r.varlen_compile_config is not None, r.decode_compile_config is not None],
            "torch_threads_in_generation_thread": self.loop_threads,
        }

    def close(self) -> None:
        self.model.destroy_cached_continuous_batching_manager()
        del self.model


ENGINE_CLASSES = {"kvserve": KvserveEngine, "transformers": TransformersEngine}


def _cpu_seconds() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


# ---------------------------------------------------------------------------------------------
# Driver
# ---------------------------------------------------------------------------------------------
def machine_info(run: dict) -> dict:
    """The CPU run's machine record (the fields RESULTS.md's CPU tables were read from)."""
    import torch

    diff = subprocess.run(["git", "diff", "HEAD", "--", "kvserve"], cwd=REPO, capture_output=True).stdout \
        if run["git_dirty"] else b""
    return {
        "cpu_count": run["cpu_count"],
        "cpu_affinity": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_model": run["cpu"],
        "platform": run["platform"],
        "python": run["python"],
        "torch": run["torch"],
        "transformers": run["transformers"],
        "torch_num_threads_default": torch.get_num_threads(),
        "git_commit": run["git_commit"],
        "kvserve_tree_dirty": run["git_dirty"],  # uncommitted changes (or new files) under kvserve/
        "kvserve_diff_sha256_12": hashlib.sha256(diff).hexdigest()[:12] if diff else None,
        "loadavg_at_start": os.getloadavg(),
    }


def compare(a: list[list[int]], b: list[list[int]]) -> tuple[int, list[int]]:
    same = [i for i, (x, y) in enumerate(zip(a, b)) if x == y]
    return len(same), [i for i in range(len(a)) if i not in same]


def summarize(name: str, runs: list[dict], in_tokens: int, golden: list[dict], vllm: list[list[int]] | None) -> dict:
    walls = [r["wall_s"] for r in runs]
    out_tokens = sum(len(o) for o in runs[-1]["outputs"])
    med = statistics.median(walls)
    best = min(walls)
    n_vllm, diff_vllm = compare(runs[-1]["outputs"], vllm) if vllm is not None else (None, None)
    stable = all(r["outputs"] == runs[0]["outputs"] for r in runs)
    return {
        "runs": [{k: v for k, v in r.items() if k != "outputs"} for r in runs],
        "input_tokens": in_tokens,
        "output_tokens": out_tokens,
        "wall_s_median": med,
        "wall_s_best": best,
        "cpu_s_median": statistics.median(r["cpu_s"] for r in runs),
        "output_tok_s_median": out_tokens / med,
        "output_tok_s_best": out_tokens / best,
        "input_tok_s_median": in_tokens / med,
        "input_tok_s_best": in_tokens / best,
        "outputs_identical_across_repeats": stable,
        "identical_vs_vllm_fp32": n_vllm,
        "differs_vs_vllm_fp32": None if diff_vllm is None else [golden[i]["id"] for i in diff_vllm],
        "output_token_ids": runs[-1]["outputs"],
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeats", type=int, default=None,
                   help="timed generate calls per engine, interleaved ABBA between engines (default 2; smoke 1)")
    p.add_argument("--engines", default="kvserve,transformers", help="comma list of: " + ",".join(ENGINES))
    p.add_argument("--out", "--json-out", dest="out", default=None,
                   help="JSON path (default: benchmarks/results/cpu_throughput_<YYYYmmdd-HHMMSS>.json)")
    p.add_argument("--model", default=None,
                   help="checkpoint folder (default: kvserve's default model); config only: random weights")
    p.add_argument("--prompts", default=None,
                   help=f"jsonl with prompt_token_ids (default {GOLDEN} when it exists, else 'synthetic')")
    p.add_argument("--max-new-tokens", type=int, default=None,
                   help=f"default {MAX_NEW_TOKENS} (smoke {SMOKE_MAX_NEW_TOKENS})")
    p.add_argument("--warmup-max-tokens", type=int, default=None,
                   help="max new tokens of the one untimed warm-up call (same prompts; default 8, smoke 2)")
    p.add_argument("--prefix-caching", action="store_true",
                   help="enable prefix caching / block sharing in both engines (caches reset before each timed run)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads for both engines")
    p.add_argument("--smoke", action="store_true", help="a tiny random Llama, 3 short prompts, 1 repeat: seconds")
    args = p.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)

    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    for e in engines:
        if e not in ENGINES:
            p.error(f"unknown engine {e!r}; choose from {ENGINES}")
    repeats = args.repeats or (1 if args.smoke else 2)
    max_new = args.max_new_tokens or (SMOKE_MAX_NEW_TOKENS if args.smoke else MAX_NEW_TOKENS)
    warm_tokens = args.warmup_max_tokens or (2 if args.smoke else 8)
    if repeats < 1:
        p.error("--repeats must be >= 1")
    import torch

    if args.threads or args.smoke:
        torch.set_num_threads(args.threads or min(2, torch.get_num_threads()))
    work = tempfile.TemporaryDirectory(prefix="cpu-bench-")
    # the checkpoint both engines serve
    if args.smoke:
        model = common.with_random_weights(None, SMOKE_CONFIG, Path(work.name))
    elif args.model:
        model = Path(args.model)
        if not list(model.glob("*.safetensors")):
            print(f"[cpu] {model} has no weights: random fp32 weights from its config", flush=True)
            model = common.with_random_weights(model, None, Path(work.name))
    else:
        from kvserve.loader.default_model import ensure_default_model

        model = Path(ensure_default_model())
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    # the prompts, and vLLM's fp32 outputs where they are the reference (default model, golden set)
    prompts_arg = args.prompts or ("smoke" if args.smoke else str(GOLDEN) if GOLDEN.is_file() else "synthetic")
    if prompts_arg in ("smoke", "synthetic"):
        groups = [(1, n, n) for n in SMOKE_PROMPT_LENS] if prompts_arg == "smoke" else SYNTHETIC_LENS
        golden = synthetic_prompts(vocab, groups)
    else:
        golden = load_jsonl(Path(prompts_arg))
    vllm = None
    if not args.model and not args.smoke and Path(prompts_arg) == GOLDEN and VLLM_REF.is_file():
        vllm = [r["output_token_ids"] for r in load_jsonl(VLLM_REF)]
    prompts = [r["prompt_token_ids"] for r in golden]
    in_tokens = sum(len(x) for x in prompts)
    run = common.run_info("cpu_bench", argv, args.smoke)
    info = machine_info(run)
    threads = torch.get_num_threads()
    print(f"machine: {info['cpu_count']} CPUs ({info['cpu_model']}), torch {info['torch']}, "
          f"transformers {info['transformers']}, torch threads {threads}, commit {info['git_commit']}"
          f"{' (kvserve/ has uncommitted changes)' if info['kvserve_tree_dirty'] else ''}, "
          f"load avg {info['loadavg_at_start']}", flush=True)
    print(f"workload: {len(prompts)} prompts ({prompts_arg}), {in_tokens} prompt tokens, fp32 greedy, max {max_new} "
          f"new, eos {EOS_ID}; repeats {repeats}; prefix caching {'on' if args.prefix_caching else 'off'}", flush=True)

    built: dict[str, object] = {}
    meta: dict[str, dict] = {}
    for name in engines:
        t0 = time.perf_counter()
        eng = ENGINE_CLASSES[name](model, args.prefix_caching, SMOKE_KV_CACHE_MEMORY if args.smoke else None)
        init_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        eng.generate(prompts, warm_tokens)
        warm_s = time.perf_counter() - t0
        built[name] = eng
        meta[name] = {"init_s": init_s, "warmup_s": warm_s, "torch_threads": torch.get_num_threads()}
        print(f"[{name}] built in {init_s:.1f} s, warm-up ({warm_tokens} tokens) {warm_s:.1f} s", flush=True)

    runs: dict[str, list[dict]] = {n: [] for n in engines}
    for rep in range(repeats):
        order = engines if rep % 2 == 0 else engines[::-1]  # ABBA: drift in machine load hits both alike
        for name in order:
            eng = built[name]
            eng.reset()
            load = os.getloadavg()[0]
            c0, t0 = _cpu_seconds(), time.perf_counter()
            outs = eng.generate(prompts, max_new)
            wall, cpu = time.perf_counter() - t0, _cpu_seconds() - c0
            n_out = sum(len(o) for o in outs)
            runs[name].append({"repeat": rep, "wall_s": wall, "cpu_s": cpu, "loadavg_1m_before": load,
                               "output_tokens": n_out, "outputs": outs})
            print(f"[{name}] repeat {rep}: {wall:.2f} s wall, {cpu:.1f} s cpu, {n_out} out tok, "
                  f"{n_out / wall:.1f} out tok/s, {in_tokens / wall:.1f} in tok/s (load {load:.2f})", flush=True)

    results = {}
    for name in engines:
        r = summarize(name, runs[name], in_tokens, golden, vllm)
        r.update(meta[name])
        r["engine_config"] = built[name].config()
        results[name] = r
    for eng in built.values():
        eng.close()

    print("\n| engine | wall s (median) | output tokens | output tok/s | input tok/s | = vLLM fp32 |")
    print("|---|---|---|---|---|---|")
    for name, r in results.items():
        same = "-" if r["identical_vs_vllm_fp32"] is None else f"{r['identical_vs_vllm_fp32']}/{len(prompts)}"
        print(f"| {name} | {r['wall_s_median']:.2f} | {r['output_tokens']} | {r['output_tok_s_median']:.2f} | "
              f"{r['input_tok_s_median']:.1f} | {same} |")

    summary: dict = {}
    if "kvserve" in results and "transformers" in results:
        k, t = results["kvserve"], results["transformers"]
        n_same, diff = compare(k["output_token_ids"], t["output_token_ids"])
        paired = [tr["wall_s"] / kr["wall_s"] for kr, tr in zip(k["runs"], t["runs"])]
        summary = {
            "ratio_output_tok_s_median": k["output_tok_s_median"] / t["output_tok_s_median"],
            "ratio_output_tok_s_best": k["output_tok_s_best"] / t["output_tok_s_best"],
            "ratio_per_repeat": paired,
            "ratio_cpu_s_median_t_over_k": t["cpu_s_median"] / k["cpu_s_median"],
            "identical_kvserve_vs_transformers": n_same,
            "differs_kvserve_vs_transformers": [golden[i]["id"] for i in diff],
        }
        print(f"\nratio kvserve/transformers (output tok/s): median {summary['ratio_output_tok_s_median']:.3f}x, "
              f"best-of {summary['ratio_output_tok_s_best']:.3f}x, per repeat "
              f"{', '.join(f'{x:.3f}' for x in paired)}; cpu-time ratio {summary['ratio_cpu_s_median_t_over_k']:.3f}x")
        print(f"identical outputs kvserve vs transformers: {n_same}/{len(prompts)}")

    doc = {
        "run": run,
        "benchmark": "cpu_throughput",
        "date": run["date"],
        "command": run["command"],
        "machine": {**info, "torch_num_threads_used": threads, "loadavg_at_end": os.getloadavg()},
        "workload": {
            "prompts": prompts_arg,
            "model": str(model) if not args.smoke else "tiny random Llama (smoke)",
            "num_prompts": len(prompts),
            "input_tokens": in_tokens,
            "max_new_tokens": max_new,
            "eos_token_id": EOS_ID,
            "greedy": True,
            "dtype": "float32",
            "repeats": repeats,
            "interleaving": "ABBA (even repeats in --engines order, odd repeats reversed)",
            "warmup": f"1 untimed call per engine over the same prompts, max {warm_tokens} new tokens",
            "prefix_caching": args.prefix_caching,
            "timed": "the generate / generate_batch call only (engine build, model load, warm-up excluded)",
        },
        "results": results,
        "summary": summary,
    }
    out = Path(args.out) if args.out else common.default_out("cpu_throughput")
    common.write_json(out, doc)
    work.cleanup()
    print(f"wrote {out}")
    common.print_summary(", ".join(f"{n} {r['output_tok_s_median']:.1f} out tok/s" for n, r in results.items())
                         + (f"; kvserve/transformers {summary['ratio_output_tok_s_median']:.2f}x, identical "
                            f"{summary['identical_kvserve_vs_transformers']}/{len(prompts)}" if summary else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
