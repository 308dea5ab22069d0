"""Probe (2026-12-03, sixth session; kept in git history only): the GDN decode kernels' tiles at the
Qwen3.6-27B shape (16 key / 48 value heads of 128, conv over 10,240 channels, fp32 states), one
token for each of B sequences in out-of-order slots: the delta rule over (block_v, num_warps) and
the conv1d over (block_c, num_warps), CUDA-graph replays, each against the copy bandwidth.

    OUT=dir python3 benchmarks/gdn_decode_tiles_probe.py 32,64
"""
import json
import os
import sys
from pathlib import Path

import torch
import triton.testing

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402

from kvserve.bench.throughput import measure_copy_bandwidth  # noqa: E402
from kvserve.kernels import triton_gdn  # noqa: E402

dev, bf = "cuda", torch.bfloat16
H, HV, K, V, C, W = 16, 48, 128, 128, 10240, 4
bw = measure_copy_bandwidth(dev)["bytes_per_s"]
rows = []
for B in [int(b) for b in sys.argv[1].split(",")]:
    g = torch.Generator(device=dev).manual_seed(B)
    slots = torch.randperm(B + 1, device=dev, generator=g)[:B].to(torch.int32)
    qsl = torch.arange(B + 1, dtype=torch.int32, device=dev)
    has = torch.ones(B, dtype=torch.int32, device=dev)
    q, k = (torch.randn(B, H, K, device=dev, generator=g).to(bf) for _ in range(2))
    v = torch.randn(B, HV, V, device=dev, generator=g).to(bf)
    a, b = (torch.randn(B, HV, device=dev, generator=g).to(bf) for _ in range(2))
    A_log, dt_bias = torch.randn(HV, device=dev, generator=g), torch.randn(HV, device=dev, generator=g)
    ssm = torch.randn(B + 1, HV, K, V, device=dev, generator=g) * 0.01
    x = torch.randn(B, C, device=dev, generator=g).to(bf)
    cw = torch.randn(C, W, device=dev, generator=g).to(bf)
    conv = torch.randn(B + 1, C, W - 1, device=dev, generator=g)
    ref_o = triton_gdn.gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, ssm.clone(), qsl, slots, has,
                                               block_v=32, num_warps=4)
    ref_y = triton_gdn.causal_conv1d_varlen(x, cw, conv.clone(), qsl, slots, has, block_c=128, num_warps=4)
    ssm_t, conv_t = ssm.clone(), conv.clone()  # the timed runs update these in place
    rule_bytes = 2 * B * HV * K * V * 4
    conv_bytes = 2 * B * C * (W - 1) * 4 + 2 * B * C * 2
    for bv in (32, 64, 128):
        for nw in (2, 4, 8):
            f = lambda: triton_gdn.gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, ssm_t, qsl, slots, has,  # noqa
                                                           block_v=bv, num_warps=nw)
            try:
                o = triton_gdn.gated_delta_rule_varlen(q, k, v, a, b, A_log, dt_bias, ssm.clone(), qsl, slots, has,
                                                       block_v=bv, num_warps=nw)
                same = torch.allclose(o.float(), ref_o.float(), rtol=1e-2, atol=1e-3)
                us = triton.testing.do_bench_cudagraph(f, rep=100) * 1e3
            except Exception as e:  # noqa: BLE001 (a tile that does not compile is a finding)
                rows.append({"kernel": "delta_rule", "B": B, "block_v": bv, "num_warps": nw, "error": str(e)[:200]})
                continue
            rows.append({"kernel": "delta_rule", "B": B, "block_v": bv, "num_warps": nw, "us": us, "close": same,
                         "copy_frac": rule_bytes / (us * 1e-6) / bw })
            print(rows[-1], flush=True)
    for bc in (128, 256):
        for nw in (4, 8):
            f = lambda: triton_gdn.causal_conv1d_varlen(x, cw, conv_t, qsl, slots, has, block_c=bc, num_warps=nw)  # noqa
            same = torch.equal(triton_gdn.causal_conv1d_varlen(x, cw, conv.clone(), qsl, slots, has, block_c=bc,
                                                               num_warps=nw), ref_y)
            us = triton.testing.do_bench_cudagraph(f, rep=100) * 1e3
            rows.append({"kernel": "conv1d", "B": B, "block_c": bc, "num_warps": nw, "us": us, "same_bits": same,
                         "copy_frac": conv_bytes / (us * 1e-6) / bw })
            print(rows[-1], flush=True)
json.dump({"run": common.run_info("gdn_decode_tiles_probe"),
           "copy_bandwidth_Bps": bw, "rows": rows}, open(os.environ["OUT"] + "/gdn_decode_tiles.json", "w"), indent=1)
