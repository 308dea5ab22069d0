#!/usr/bin/env python
"""Probe (issue 15): vLLM's Marlin W4A16 NVFP4 kernel, the one vLLM runs for these checkpoints on
Hopper, timed beside kvserve's W4A16 GEMM and bf16 cuBLAS on the 27B's MLP shapes, one process.

The peer is vLLM's ``marlin_moe_wna16`` kernel as vllm.cpp vendors it torch-free (github
mudler/vllm.cpp d85906a, ``src/vt/cuda/marlin``: vLLM's kernel at e24d1b24, shown bit-exact there
against vLLM's own op; copied to ``devcarry/marlin/src``), built on the device with its nvcc
(``benchmarks/marlin_peer/build.sh`` and ``peer_api.cu`` copied beside it, in devcarry/marlin), called
through that C entry point with one expert that every token is
routed to, i.e. a dense NVFP4 GEMM; vLLM's dense layers call the dense twin of the same template
(``gptq_marlin_gemm``). Every MoE block size (8-64 rows) is timed and the best reported, with the one
vLLM's heuristic would pick. Its weights are random bytes of the right sizes (timing only); a
separate check with every code 1.0 and every scale equal verifies that each output is one full
reduction over K (y / rowsum(x) the same for all outputs). Times: quant_bench's CUDA-graph replays
over weight copies past 3x the L2, for all three engines.

    python3 benchmarks/marlin_peer_probe.py --lib devcarry/marlin/libmarlin_peer.so --out p.json
"""

from __future__ import annotations

import argparse
import ctypes
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402
from quant_bench import SHAPES, _copies, _time_ms  # noqa: E402

from kvserve.kernels import gluon_w4a16 as g  # noqa: E402
from kvserve.kernels.triton_w4a16 import pack_w4a16  # noqa: E402
from kvserve.quant.nvfp4 import dequantize_nvfp4, quantize_nvfp4  # noqa: E402

BLOCKS = (8, 16, 32, 48, 64)


class Marlin:
    """The peer's C entry point over torch tensors (one expert, every token routed to it)."""

    def __init__(self, lib: str):
        self.lib = ctypes.CDLL(lib)
        self.lib.kvs_marlin_error.restype = ctypes.c_char_p
        self.sms = torch.cuda.get_device_properties(0).multi_processor_count
        self.workspace = torch.zeros(self.sms * 4, dtype=torch.int32, device="cuda")

    def weight(self, n: int, k: int, code: int | None = None, scale: int | None = None) -> dict:
        """Codes (int32, K*N/8) and e4m3 scales (K/16 x N bytes): random bytes, or every nibble
        ``code`` and every scale byte ``scale``."""
        if code is None:
            codes = torch.randint(-2**31, 2**31 - 1, (k * n // 8,), dtype=torch.int32, device="cuda")
            scales = torch.randint(0x80, 0xC0, (k // 16 * n,), dtype=torch.uint8, device="cuda")
        else:
            codes = torch.full((k * n // 8,), int.from_bytes(bytes([code * 17] * 4), "little", signed=True),
                               dtype=torch.int32, device="cuda")
            scales = torch.full((k // 16 * n,), scale, dtype=torch.uint8, device="cuda")
        # the global scale as vLLM hands it to the kernel for bf16 (nvfp4_marlin_process_global_scale: x 2^119)
        return {"codes": codes, "scales": scales, "g": torch.full((1,), 2.0**119, dtype=torch.float32, device="cuda")}

    def plan(self, m: int, n: int, block: int) -> dict:
        """Routing buffers for ``m`` tokens in blocks of ``block`` (vLLM's moe_align layout)."""
        padded = -(-m // block) * block
        ids = torch.full((padded,), m, dtype=torch.int32)
        ids[:m] = torch.arange(m, dtype=torch.int32)
        return {"block": block, "ids": ids.cuda(), "experts": torch.zeros(padded // block, dtype=torch.int32,
                                                                       device="cuda"),
                "padded": torch.tensor([padded], dtype=torch.int32, device="cuda"),
                "topk_w": torch.ones(m, dtype=torch.float32, device="cuda"),
                # (vLLM's moe_wna16_marlin_gemm: twice as much for blocks of 8)
                "c_tmp": torch.empty(min(n * padded, self.sms * 4 * block * 256) * (2 if block == 8 else 1),
                                     dtype=torch.float32, device="cuda")}

    def __call__(self, x: torch.Tensor, w: dict, plan: dict, out: torch.Tensor) -> torch.Tensor:
        m, k = x.shape
        n = out.shape[1]
        rc = self.lib.kvs_marlin_dense(
            ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(w["codes"].data_ptr()), ctypes.c_void_p(out.data_ptr()),
            ctypes.c_void_p(plan["c_tmp"].data_ptr()), ctypes.c_void_p(w["scales"].data_ptr()),
            ctypes.c_void_p(w["g"].data_ptr()), ctypes.c_void_p(plan["ids"].data_ptr()),
            ctypes.c_void_p(plan["experts"].data_ptr()), ctypes.c_void_p(plan["padded"].data_ptr()),
            ctypes.c_void_p(plan["topk_w"].data_ptr()), plan["block"], m, n, k,
            ctypes.c_void_p(self.workspace.data_ptr()), torch.cuda.current_device(),
            ctypes.c_void_p(torch.cuda.current_stream().cuda_stream), self.sms, -1, -1, -1)
        if rc:
            raise RuntimeError(self.lib.kvs_marlin_error().decode())
        return out


def vllm_block(m: int) -> int:
    """The MoE block vLLM's fused_marlin_moe picks for m tokens on one expert (top-1)."""
    for block in BLOCKS:
        if m / block < 0.9:
            return block
    return BLOCKS[-1]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", required=True)
    ap.add_argument("--batches", default="1,8,16,32,64,128,256")
    ap.add_argument("--shapes", default=",".join(SHAPES))
    ap.add_argument("--check-only", action="store_true", help="only the reduction check")
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    marlin = Marlin(a.lib)
    doc = {"run": common.run_info("marlin_peer_probe", sys.argv[1:], False), "device": torch.cuda.get_device_name(),
           "checks": [], "rows": []}
    gen = torch.Generator().manual_seed(0)
    for name in a.shapes.split(","):
        n, k = SHAPES[name]
        # the check: all codes 1.0, all scales one byte -> y[m, n] = c * sum_k x[m, k] for every n
        # (a scale byte is bits 14-7 of fp16(s * 2^7), vLLM's nvfp4_marlin_process_scales: 0xB0 is s = 1)
        w1 = marlin.weight(n, k, code=2, scale=0xB0)
        for m, block in ((1, 8), (16, 16), (32, 48), (256, 64)):
            x = (torch.rand(m, k, generator=gen) + 0.5).to(torch.bfloat16).cuda()
            y = marlin(x, w1, marlin.plan(m, n, block), torch.full((m, n), float("nan"), dtype=torch.bfloat16,
                                                                    device="cuda"))
            ratio = y.float() / x.float().sum(1, keepdim=True)
            spread = float((ratio.max() - ratio.min()) / ratio.abs().mean()) if torch.isfinite(ratio).all() else None
            doc["checks"].append({"shape": name, "m": m, "block": block, "ratio_mean": float(ratio.mean()),
                                  "relative_spread": spread})
            print(f"check {name} m {m} block {block}: y / rowsum(x) = {float(ratio.mean()):.4g}, spread {spread}",
                  flush=True)
        del w1
        if a.check_only:
            continue
        wt = (torch.randn(n, k, generator=gen) * 0.02).to(torch.bfloat16)
        packed, block_scale, s2 = (t.cuda() for t in quantize_nvfp4(wt))
        wd = dequantize_nvfp4(packed, block_scale, s2, torch.bfloat16)
        wq = pack_w4a16(packed, block_scale, s2)
        q_bytes = sum(t.numel() * t.element_size() for t in (wq.codes, wq.scales, wq.row_scale))
        wds = [wd] + [wd.clone() for _ in range(_copies(wd.numel() * 2) - 1)]
        wqs = [wq] + [pack_w4a16(packed, block_scale, s2) for _ in range(_copies(q_bytes) - 1)]
        wms = [marlin.weight(n, k) for _ in range(_copies(k * n // 2 + k * n // 16))]
        for m in [int(b) for b in a.batches.split(",")]:
            x = torch.randn(m, k, generator=gen).to(torch.bfloat16).cuda()
            y = torch.empty(m, n, dtype=torch.bfloat16, device="cuda")
            dense = _time_ms([lambda c=c: torch.matmul(x, c.t(), out=y) for c in wds])
            ours = _time_ms([lambda c=c: g.w4a16_linear(x, c, out=y) for c in wqs])
            peer = {}
            for block in BLOCKS:
                plan = marlin.plan(m, n, block)
                try:
                    peer[block] = _time_ms([lambda c=c, p=plan: marlin(x, c, p, y) for c in wms])
                except RuntimeError as e:
                    peer[block] = str(e)[:200]
            ok = {b: t for b, t in peer.items() if isinstance(t, float)}
            best = min(ok, key=ok.get)
            row = {"shape": name, "n": n, "k": k, "m": m, "cublas_ms": dense, "kvserve_ms": ours,
                   "marlin_ms": peer, "marlin_best_block": best, "marlin_best_ms": ok[best],
                   "marlin_vllm_block": vllm_block(m), "weight_copies": [len(wds), len(wqs), len(wms)]}
            doc["rows"].append(row)
            print(f"{name:14s} m {m:4d}: cuBLAS {dense * 1e3:7.1f} us, kvserve {ours * 1e3:7.1f} us "
                  f"({dense / ours:.2f}x), Marlin best {ok[best] * 1e3:7.1f} us ({dense / ok[best]:.2f}x, block "
                  f"{best}), vLLM's block {vllm_block(m)}: {peer[vllm_block(m)]}", flush=True)
            common.write_json(a.out, doc)
        del wds, wqs, wms
        torch.cuda.empty_cache()
    common.write_json(a.out, doc)
    return 0


if __name__ == "__main__":
    sys.exit(main())
