#!/usr/bin/env python
"""Hybrid-model prefill throughput (the hybrid family of the suite): a Qwen3.6-27B-shaped model
(real config, ``benchmarks/configs/qwen3.6-27b``, random non-zero bf16 weights), prompts of ISL
tokens at each concurrency, one output token, bf16 KV vs fp8 KV in the same run, ``kvserve
traffic``'s predicted fp8 change beside the measured one, and transformers' ``generate`` on the
same model as the peer (its continuous batching rejects hybrid layers).

Prefill tok/s = concurrency x ISL / (time from submitting the batch to its last first token).

    bash benchmarks/gpu.sh hybrid                                      # H200: $OUT/hybrid.json, ~6 min
    python3 benchmarks/hybrid_bench.py --out hybrid.json               # H200 by hand
    python3 benchmarks/hybrid_bench.py --config DIR --out moe.json     # another hybrid config
    python3 benchmarks/hybrid_bench.py --smoke --out /tmp/hybrid.json  # CPU: tiny config, every path
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402  (also puts the repository root on sys.path: kvserve)

from kvserve import LLM, SamplingParams  # noqa: E402
from kvserve.tools.traffic import model_shape, traffic  # noqa: E402

CONFIG = common.CONFIGS / "qwen3.6-27b"


def _tiny_config(folder: Path) -> Path:
    """A 4-layer Qwen3.5 config (2 GDN + 2 attention) for the CPU smoke run."""
    cfg = json.loads((CONFIG / "config.json").read_text())
    cfg.update(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
               head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
               linear_value_head_dim=16, vocab_size=512, max_position_embeddings=4096,
               layer_types=["linear_attention", "full_attention"] * 2, dtype="float32")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def _prompts(n: int, isl: int, vocab: int, seed: int) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab - 10, (isl,), generator=gen).tolist() for _ in range(n)]


def run_kvserve(folder: Path, kv: str, isl: int, concurrency: list[int], vocab: int, dtype: str, budget: int,
                kv_cache_memory: int | None = None) -> dict:
    t0 = time.perf_counter()
    llm = LLM(str(folder), load_format="dummy", skip_tokenizer_init=True, dtype=dtype, kv_cache_dtype=kv,
              max_num_seqs=max(concurrency), max_num_batched_tokens=budget, max_model_len=isl + 16,
              # plain prefill: 'align' prefix caching would cut bf16 prompts at 784 tokens (a state
              # snapshot) but not fp8 ones (1,568), which would skew the bf16-vs-fp8 comparison
              enable_prefix_caching=False, kv_cache_memory=kv_cache_memory)
    start_s = time.perf_counter() - t0
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    llm.generate([{"prompt_token_ids": p} for p in _prompts(1, isl, vocab, 99)], params, use_tqdm=False)  # warm-up
    rows = []
    for c in concurrency:
        prompts = [{"prompt_token_ids": p} for p in _prompts(c, isl, vocab, c)]
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        t = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        dt = time.perf_counter() - t
        assert all(len(o.outputs[0].token_ids) == 1 for o in outs)
        rows.append({"concurrency": c, "seconds": dt, "prefill_tok_s": c * isl / dt})
        print(f"[kvserve {kv}] concurrency {c:3d}: {c * isl / dt:10.0f} prefill tok/s ({dt * 1e3:.1f} ms)", flush=True)
    runner = llm.llm_engine.runner
    info = {"kv_cache_dtype": kv, "start_s": start_s, "num_blocks": llm.llm_engine.config.cache_config.num_blocks,
            "state_slots": runner.state_pool.num_slots if runner.state_pool else 0, "rows": rows}
    del llm, runner
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return info


def run_transformers(folder: Path, isl: int, concurrency: list[int], vocab: int, dtype: torch.dtype, device: str) -> dict:
    """transformers' generate (1 new token) on the same config, random weights, batch = concurrency."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = AutoConfig.from_pretrained(folder)
    t0 = time.perf_counter()
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    start_s = time.perf_counter() - t0
    rows = []
    for c in concurrency:
        ids = torch.tensor(_prompts(c, isl, vocab, c), device=device)
        with torch.no_grad():
            # warm-up at the timed shape: fla (when installed) autotunes its kernels per shape
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=1, do_sample=False, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
        dt = time.perf_counter() - t
        rows.append({"concurrency": c, "seconds": dt, "prefill_tok_s": c * isl / dt})
        print(f"[transformers] concurrency {c:3d}: {c * isl / dt:10.0f} prefill tok/s ({dt * 1e3:.1f} ms)", flush=True)
    del model
    gc.collect()
    if device == "cuda":
        torch.cuda.empty_cache()
    return {"start_s": start_s, "rows": rows}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(CONFIG))
    ap.add_argument("--isl", type=int, default=1024)
    ap.add_argument("--concurrency", default="1,4,16,32")
    ap.add_argument("--kv", default="bfloat16,fp8")
    ap.add_argument("--peer-concurrency", default="1,4,16,32", help="transformers batch sizes ('' = no peer)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=8192)
    ap.add_argument("--smoke", action="store_true", help="CPU: a tiny config, ISL 64, concurrency 1,2")
    ap.add_argument("--out", default=None, help="JSON path (written after every engine)")
    a = ap.parse_args(argv)
    argv = list(sys.argv[1:] if argv is None else argv)
    conc = [int(c) for c in a.concurrency.split(",") if c]
    peer = [int(c) for c in a.peer_concurrency.split(",") if c]
    folder, isl, dtype, kv_memory = Path(a.config), a.isl, "bfloat16", None
    if a.smoke:
        folder = _tiny_config(Path(tempfile.mkdtemp()) / "tiny-qwen3.5")
        isl, conc, peer, dtype, kv_memory = 64, [1, 2], [1], "float32", 1 << 24
    device = "cuda" if torch.cuda.is_available() else "cpu"
    vocab = json.loads((folder / "config.json").read_text())["vocab_size"]
    res: dict = {"run": common.run_info("hybrid_bench", argv, a.smoke), "benchmark": "hybrid prefill",
                 "config": str(folder), "isl": isl, "device": device,
                 "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
                 "command": " ".join(sys.argv), "kvserve": {}, "traffic": {}}

    def save() -> None:
        if a.out:
            common.write_json(a.out, res)

    for kv in [k for k in a.kv.split(",") if k]:
        res["kvserve"][kv] = run_kvserve(folder, kv, isl, conc, vocab, dtype, max(a.max_num_batched_tokens, isl),
                                         kv_memory)
        save()
    shape = model_shape(str(folder))
    for c in conc:
        r = traffic(shape, isl, 1, c, prefill_chunk=min(isl, a.max_num_batched_tokens))
        res["traffic"][c] = {"prefill_memory_change_pct": r.change_pct("prefill"),
                             "prefill_roofline_change_pct": r.change_pct("prefill", roofline=True)}
    if "bfloat16" in res["kvserve"] and "fp8" in res["kvserve"]:
        for b, f in zip(res["kvserve"]["bfloat16"]["rows"], res["kvserve"]["fp8"]["rows"]):
            t = res["traffic"][b["concurrency"]]
            print(f"concurrency {b['concurrency']:3d}: fp8 / bf16 prefill tok/s {f['prefill_tok_s'] / b['prefill_tok_s']:.3f} "
                  f"(traffic predicts {t['prefill_memory_change_pct']:+.1f}% bytes time, "
                  f"{t['prefill_roofline_change_pct']:+.1f}% roofline)", flush=True)
    save()
    if peer:
        res["transformers"] = run_transformers(folder, isl, peer, vocab, getattr(torch, dtype), device)
        save()
    if a.out:
        print(f"wrote {a.out}")
    runs = {f"kvserve {kv}": v["rows"] for kv, v in res["kvserve"].items()}
    if "transformers" in res:
        runs["transformers"] = res["transformers"]["rows"]
    common.print_summary("; ".join(f"{name} prefill tok/s " + ", ".join(
        f"c{r['concurrency']} {r['prefill_tok_s']:.0f}" for r in rows) for name, rows in runs.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
