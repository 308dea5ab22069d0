"""Golden-set parity on this machine's device, every read in one run (issue 16's "parity on the GPU").

- ``fp32`` (float32 cache): greedy and teacher-forced against vLLM's fp32 file (the bar: 24/24 exact).
- Each e4m3 read, greedy and teacher-forced against vLLM's fp32 file (docs/KV_CACHE.md's cost table):
  ``dequant_kernel`` (``--attention-backend triton``), ``dequant_reference`` (``reference``),
  ``fp8q_kernel_p0`` / ``_p8`` (the quantized-query kernels with P unshifted, TRITON_ATTN, or shifted by
  2^8 as FLASH_ATTN does; FLASH_ATTN itself refuses an fp32 model, so TRITON_ATTN runs with the shift
  set), ``fp8q_twin_p0`` / ``_p8`` (their torch twin, ``reference.paged_attention_fp8_query``, in the layers).
- The dequantizing reads teacher-forced against the fp8 fake-quant reference made on this host
  (Oracle C, ``kvserve.tools.fp8_reference`` on the CPU), next to that recipe's own spread.
- The quantized-query kernels teacher-forced against their twin's greedy file made here, next to the
  twin's own spread (the twin teacher-forced against that file). That spread is as large as the fp8
  read's whole cost (P is rounded per key tile, and prefill and decode tiles differ), so this bound
  does not tell the kernel from other reads; the GPU tests' per-output checks do (RESULTS.md).

Each run is a subprocess (the twin and the P shift are patched in per process), ``--jobs`` at a time
on the one device, each with a fixed 2 GiB KV pool.

    python3 benchmarks/parity_bench.py [--model DIR | --gguf PART[,PART...]] [--jobs 4] --out parity.json
    python3 benchmarks/parity_bench.py --smoke --out p.json   # CPU: a tiny random Llama, its own references

``--gguf``: build the default model from a local copy of its GGUF file (a device machine has no
package index; the 98 MB file travels in two parts, joined in the order given).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(_HERE))
import common  # noqa: E402  (also puts the repository root on sys.path: kvserve)

EVAL = Path(os.environ.get("KVSERVE_EVAL", _HERE.parent.parent / "shared" / "eval"))
READS = ("fp32", "dequant_kernel", "dequant_reference", "fp8q_kernel_p0", "fp8q_kernel_p8", "fp8q_twin_p0",
         "fp8q_twin_p8")
KERNEL_READS = ("dequant_kernel", "fp8q_kernel_p0", "fp8q_kernel_p8")  # need CUDA (or the interpreter)
KV_POOL_BYTES = 2 << 30


@dataclasses.dataclass(frozen=True)
class Job:
    read: str
    mode: str  # greedy | tf | gen (write this read's greedy output as a golden-format reference file)
    ref: str  # the reference file (gen: the file written)

    @property
    def name(self) -> str:
        return f"{self.read}_{self.mode}_{Path(self.ref).stem}"


# --------------------------------------------------------------------------- one job (a subprocess)
def engine_kwargs(read: str, model: str) -> dict:
    """``LLM`` arguments of one read; patches this process for the twin and the P shift."""
    kw = dict(model=model, dtype="float32", kv_cache_memory=KV_POOL_BYTES, seed=0,
              skip_tokenizer_init=not common.has_tokenizer(Path(model)))
    if read == "fp32":
        return kw
    kw["kv_cache_dtype"] = "fp8_e4m3"
    if read == "dequant_kernel":
        kw["attention_backend"] = "triton"
    elif read == "dequant_reference":
        kw.update(attention_backend="reference", enforce_eager=True)
    elif read.startswith("fp8q_kernel"):
        from kvserve import attention_backend

        attention_backend.P_SHIFT["TRITON_ATTN"] = int(read.rsplit("_p", 1)[1])
        kw["attention_backend"] = "TRITON_ATTN"
    elif read.startswith("fp8q_twin"):
        patch_twin(int(read.rsplit("_p", 1)[1]))
        kw.update(attention_backend="reference", enforce_eager=True)
    else:
        raise ValueError(f"unknown read {read!r}; accepted: {READS}")
    return kw


def patch_twin(shift: int) -> None:
    """Every fp8 attention layer reads through the quantized-query twin, with the kernel's key tiles."""
    import kvserve.layers.attention as attention
    from kvserve.kernels import reference

    forward = attention.Attention.forward

    def twin_forward(self, q, k, v, meta):
        if self.cache_quant is None:
            return forward(self, q, k, v, meta)
        quant = dataclasses.replace(self.cache_quant, query_fp8=True, q_scale=self.q_scale, p_shift=shift)
        reference.store_kv(k, v, self.kv_cache, meta.slot_mapping, self.cache_quant)
        from kvserve.kernels.triton_attention import fp8_query_key_tile

        tile = fp8_query_key_tile(q, self.kv_cache, max(meta.query_lens), True)  # the kernel's, on the GPU
        return reference.paged_attention_fp8_query(q, self.kv_cache, meta.block_tables, meta.query_lens,
                                                   meta.seq_lens, self.scale, quant, tile).flatten(1)

    attention.Attention.forward = twin_forward


def write_reference(kw: dict, prompts_path: str, out: str, max_tokens: int) -> None:
    """This read's greedy outputs in the golden format (top-5 logprobs per step, highest first)."""
    from kvserve import LLM, SamplingParams
    from kvserve.tools.parity import read_jsonl

    prompts = read_jsonl(prompts_path)
    outs = LLM(**kw).generate([{"prompt_token_ids": p["prompt_token_ids"]} for p in prompts],
                              SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=5), use_tqdm=False)
    with open(out, "w") as f:
        for p, o in zip(prompts, outs):
            c = o.outputs[0]
            top = [sorted(([t, lp.logprob] for t, lp in step.items()), key=lambda x: (-x[1], x[0]))[:5]
                   for step in c.logprobs]
            f.write(json.dumps({"id": p["id"], "output_token_ids": list(c.token_ids), "text": c.text,
                                "finish_reason": c.finish_reason, "top_logprobs": top}) + "\n")


def run_job(job: Job, model: str, prompts: str, max_tokens: int) -> dict:
    from kvserve.tools import parity

    kw = engine_kwargs(job.read, model)
    t0 = time.time()
    if job.mode == "gen":
        write_reference(kw, prompts, job.ref, max_tokens)
        res: dict = {"wrote": job.ref}
    elif job.mode == "greedy":
        rows = parity.run_parity(prompts, job.ref, kw, max_tokens)
        res = {"line": parity.summary_line(rows), "exact": sum(r.status == "match" for r in rows),
               "near_tie": sum(r.status == "near-tie" for r in rows), "prompts": len(rows)}
    else:
        s = parity.summarize_teacher_forced(parity.run_teacher_forced(prompts, job.ref, kw))
        res = {"line": parity.teacher_forced_line(s), **dataclasses.asdict(s)}
    return {**dataclasses.asdict(job), **res, "seconds": round(time.time() - t0, 1)}


# --------------------------------------------------------------------------- the run
class Runner:
    def __init__(self, args: argparse.Namespace, model: str, prompts: str, work: Path, cuda: bool) -> None:
        self.args, self.model, self.prompts, self.work = args, model, prompts, work
        self.t_end = time.time() + args.time_budget_s
        # runs on the device need no CPU threads of their own: leave the host's cores to the recipe,
        # which did not finish in 270 s beside five device runs at torch's default thread count and the
        # GPU tests on an H100 host (2026-12-06; whether the threads were the cause is not measured)
        self.env = {**os.environ, "OMP_NUM_THREADS": "1"} if cuda else None

    def one(self, job: Job) -> dict:
        out, log = self.work / f"{job.name}.json", self.work / f"{job.name}.log"
        timeout = max(10, int(self.t_end - time.time()))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--job", job.read, job.mode, job.ref, str(out),
               "--model", self.model, "--prompts", self.prompts, "--max-tokens", str(self.args.max_tokens)]
        try:
            with open(log, "w") as f:
                rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT, timeout=timeout, env=self.env).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        res = json.loads(out.read_text()) if out.exists() else dataclasses.asdict(job)
        res["rc"] = rc
        if rc != 0:
            res["log_tail"] = log.read_text()[-2000:]
        print(f"[parity] {job.name}: rc {rc} {res.get('line', res.get('wrote', ''))}", flush=True)
        return res

    def batch(self, jobs: list[Job]) -> list[dict]:
        jobs = [j for j in jobs if j.read in self.args.reads]
        with ThreadPoolExecutor(self.args.jobs) as pool:
            return list(pool.map(self.one, jobs))


def recipe_command(model: str, prompts: str, out: Path, max_tokens: int) -> list[str]:
    return [sys.executable, "-m", "kvserve.tools.fp8_reference", "--prompts", prompts, "--model", model,
            "--fp8", "e4m3", "--out", str(out), "--max-tokens", str(max_tokens), "--spread"]


def run(args: argparse.Namespace, model: str, prompts: str, vllm_ref: str, work: Path, cuda: bool) -> dict:
    r = Runner(args, model, prompts, work, cuda)
    local_ref, twin_refs = work / "fp8_e4m3_here.jsonl", {s: str(work / f"twin_p{s}_here.jsonl") for s in (0, 8)}
    recipe_log = work / "recipe.log"
    with open(recipe_log, "w") as f:  # the fake-quant recipe on this host's CPU, beside the device jobs
        recipe = subprocess.Popen(recipe_command(model, prompts, local_ref, args.max_tokens), stdout=f,
                                  stderr=subprocess.STDOUT, env={**os.environ, "CUDA_VISIBLE_DEVICES": ""})
    first = [Job(f"fp8q_twin_p{s}", "gen", twin_refs[s]) for s in (8, 0)]
    first += [Job("fp32", m, vllm_ref) for m in ("greedy", "tf")]
    first += [Job(read, m, vllm_ref) for read in READS[1:] for m in ("tf", "greedy")]
    jobs = r.batch(first)
    jobs += r.batch([Job(f"fp8q_{k}_p{s}", "tf", twin_refs[s]) for s in (8, 0) for k in ("twin", "kernel")
                     if Path(twin_refs[s]).is_file()])
    try:
        recipe.wait(timeout=max(5.0, r.t_end - time.time()))
    except subprocess.TimeoutExpired:
        recipe.kill()
        recipe.wait()
    spread = [ln for ln in recipe_log.read_text().splitlines() if ln.startswith("recipe spread")]
    recipe_row = {"read": "fp8_reference recipe", "mode": "spread", "ref": str(local_ref), "rc": recipe.returncode,
                  "line": spread[-1] if spread else None}
    if recipe.returncode == 0 and local_ref.is_file():
        jobs += r.batch([Job(read, "tf", str(local_ref)) for read in ("dequant_kernel", "dequant_reference", "fp32")])
    else:
        recipe_row["log_tail"] = recipe_log.read_text()[-2000:]
    return {"jobs": jobs, "recipe": recipe_row}


def summary(doc: dict) -> str:
    def find(read: str, mode: str, ref_stem: str) -> dict:
        return next((j for j in doc["jobs"] if j.get("read") == read and j.get("mode") == mode
                     and Path(j.get("ref", "")).stem == ref_stem), {})

    vllm = Path(doc["vllm_reference"]).stem
    greedy = find("fp32", "greedy", vllm)
    parts = [f"fp32 {greedy.get('exact', '-')}/{greedy.get('prompts', '-')} exact"]
    for read in READS[1:]:
        j = find(read, "tf", vllm)
        if j.get("steps"):
            parts.append(f"{read} tf agree {j['agree'] / j['steps']:.1%} p50 {j['p50']:.1e}")
    failed = sum(1 for j in doc["jobs"] if j.get("rc") != 0)
    return "; ".join(parts) + f"; {len(doc['jobs'])} runs, {failed} failed"


def smoke_setup(work: Path) -> tuple[str, str, str]:
    """A tiny random Llama, two random-id prompts and a stand-in 'vLLM' file: its own fp32 greedy run."""
    import random

    model = common.with_random_weights(None, common.TINY_LLAMA, work)
    rng = random.Random(0)
    prompts = work / "prompts.jsonl"
    rows = [{"id": f"smoke_{i}", "prompt_token_ids": [rng.randrange(10, 512) for _ in range(n)]}
            for i, n in enumerate((7, 23))]
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    ref = work / "fp32_stand_in.jsonl"
    write_reference(engine_kwargs("fp32", str(model)), str(prompts), str(ref), 8)
    return str(model), str(prompts), str(ref)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=None, help="JSON path (default benchmarks/results/parity_<time>.json)")
    p.add_argument("--smoke", action="store_true", help="CPU: a tiny random Llama, 2 prompts, 8 tokens")
    p.add_argument("--model", default=None, help="HF folder (default: the default model)")
    p.add_argument("--gguf", default=None,
                   help="build the default model from this GGUF file (or its parts, comma-separated, in order)")
    p.add_argument("--prompts", default=str(EVAL / "golden_public.jsonl"))
    p.add_argument("--vllm-reference", default=str(EVAL / "golden_public_vllm_fp32.jsonl"))
    p.add_argument("--reads", default=None, help=f"comma-separated subset of {','.join(READS)} (default: all on "
                                                 "CUDA; without CUDA the non-kernel reads)")
    p.add_argument("--jobs", type=int, default=4, help="runs at a time (each a process on the one device)")
    p.add_argument("--max-tokens", type=int, default=None, help="greedy tokens (default 64; smoke 8)")
    p.add_argument("--time-budget-s", type=float, default=480.0)
    p.add_argument("--job", nargs=4, metavar=("READ", "MODE", "REF", "OUT"), help=argparse.SUPPRESS)
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.max_tokens = args.max_tokens or (8 if args.smoke else 64)
    if args.job:
        read, mode, ref, out = args.job
        res = run_job(Job(read, mode, ref), args.model, args.prompts, args.max_tokens)
        Path(out).write_text(json.dumps(res))
        return 0
    import torch

    cuda = torch.cuda.is_available() and not args.smoke
    chosen = args.reads.split(",") if args.reads else [r for r in READS if cuda or r not in KERNEL_READS]
    unknown = sorted(set(chosen) - set(READS))
    if unknown:
        raise SystemExit(f"parity_bench: unknown read(s) {unknown}; accepted: {list(READS)}")
    args.reads = chosen
    run_doc = common.run_info("parity_bench", argv, args.smoke)
    with tempfile.TemporaryDirectory(prefix="parity-bench-") as tmp:
        work = Path(tmp)
        if args.smoke:
            model, prompts, vllm_ref = smoke_setup(work)
        else:
            prompts, vllm_ref = args.prompts, args.vllm_reference
            if args.model:
                model = args.model
            else:
                from kvserve.loader.default_model import ensure_default_model

                parts = [Path(x) for x in args.gguf.split(",")] if args.gguf else None
                model = str(ensure_default_model(gguf_parts=parts))
        t0 = time.time()
        doc = {"run": run_doc, "model": "tiny random Llama (smoke)" if args.smoke else model, "prompts": prompts,
               "vllm_reference": vllm_ref, "reads": args.reads, "jobs_at_a_time": args.jobs,
               "kv_pool_bytes": KV_POOL_BYTES, **run(args, model, prompts, vllm_ref, work, cuda)}
        doc["seconds"] = round(time.time() - t0, 1)
    out = Path(args.out) if args.out else common.default_out("parity")
    common.write_json(out, doc)
    common.print_summary(summary(doc))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
