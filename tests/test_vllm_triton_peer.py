"""benchmarks/vllm_triton_peer.py: vLLM's Triton kernel run from a release's source files.

vLLM's own files are not in this repository (nor in CI), so a stand-in source folder with the same
imports (vllm.envs, logger, platforms, triton_utils, the helpers module, kv_cache_interface) and a
dense torch ``unified_attention`` checks what the peer adds: the modules it serves while the source
loads (and removes after), and the backend's call on kvserve's pages: K and V as views of one cache,
fp8 codes with the query quantized to e4m3 and per-tensor descales, the split-KV scratch. The real
kernel ran through it under the interpreter against vLLM 0.33.0's files (kernel_bench --smoke
--vllm-triton-src: bf16 2e-3 from the reference read, fp8 1e-3 from the quantized-query twin).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import vllm_triton_peer  # noqa: E402

from kvserve.kernels import reference  # noqa: E402

pytest.importorskip("triton")

HELPERS = "from vllm.triton_utils import tl, triton\nBLOCK = 16\n"
KERNEL = '''
import torch
import vllm.envs as envs
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.triton_utils import tl, triton
from vllm.v1.attention.ops.triton_attention_helpers import BLOCK
from vllm.v1.kv_cache_interface import KVQuantMode

logger = init_logger(__name__)
assert envs.VLLM_BATCH_INVARIANT is False and current_platform.fp8_dtype() == torch.float8_e4m3fn
CALLS = []


def unified_attention(q, k, v, out, cu_seqlens_q, max_seqlen_q, seqused_k, max_seqlen_k, softmax_scale, causal,
                      window_size, block_table, softcap, q_descale, k_descale, v_descale, seq_threshold_3D=None,
                      num_par_softmax_segments=None, softmax_segm_output=None, softmax_segm_max=None,
                      softmax_segm_expsum=None, kv_quant_mode=KVQuantMode.NONE, **unused):
    logger.debug_once("dense stand-in")
    CALLS.append(dict(q_dtype=q.dtype, kv_quant_mode=kv_quant_mode, threshold=seq_threshold_3D,
                      segments=num_par_softmax_segments, scratch=tuple(softmax_segm_output.shape),
                      k_descale=tuple(k_descale.shape), causal=causal, window=window_size, unused=sorted(unused)))
    bs, hk = k.shape[1], k.shape[2]
    qf = q.float() * (q_descale.float() if q_descale is not None else 1.0)
    for i in range(seqused_k.shape[0]):
        n = int(seqused_k[i])
        pages = block_table[i, : -(-n // bs)].long()
        kk = k[pages].reshape(-1, hk, k.shape[3])[:n].float() * k_descale[i][None, :, None]
        vv = v[pages].reshape(-1, hk, v.shape[3])[:n].float() * v_descale[i][None, :, None]
        g = q.shape[1] // hk
        s = torch.einsum("hd,nhd->hn", qf[i], kk.repeat_interleave(g, dim=1)) * softmax_scale
        out[i] = torch.einsum("hn,nhd->hd", s.softmax(-1), vv.repeat_interleave(g, dim=1)).to(out.dtype)
'''


@pytest.fixture
def source(tmp_path):
    (tmp_path / "triton_unified_attention.py").write_text(KERNEL)
    (tmp_path / "triton_attention_helpers.py").write_text(HELPERS)
    return tmp_path


def _batch(fp8: bool):
    g = torch.Generator().manual_seed(7 + fp8)
    b, ctx, hq, hk, d, bs = 5, 37, 8, 2, 64, 16
    nblk = math.ceil(ctx / bs)
    bt = (torch.randperm(b * nblk + 3, generator=g)[: b * nblk] + 1).to(torch.int32).view(b, nblk)
    pos = torch.arange(ctx)
    slots = torch.cat([bt[i, pos // bs].long() * bs + pos % bs for i in range(b)])
    quant = None
    if fp8:
        quant = reference.CacheQuant(torch.float8_e4m3fn, 448.0, 0.05, 0.03, "cpu", query_fp8=True, q_scale=0.5)
    pool = torch.full((b * nblk + 4, 2, bs, hk, d), 0x7F if fp8 else math.nan,
                      dtype=torch.uint8 if fp8 else torch.bfloat16)  # NaN wherever nothing was stored
    k, v = (torch.randn(b * ctx, hk, d, generator=g) for _ in range(2))
    reference.store_kv(k, v, pool, slots, quant)
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16) * 3
    qsl = torch.arange(b + 1, dtype=torch.int32)
    sl = torch.full((b,), ctx, dtype=torch.int32)
    return q, pool, bt, qsl, sl, ctx, quant


@pytest.mark.parametrize("fp8", [False, True], ids=["bf16", "fp8"])
def test_the_backend_call_on_kvserve_pages(source, fp8):
    q, pool, bt, qsl, sl, ctx, quant = _batch(fp8)
    peer = vllm_triton_peer.VllmTritonAttention(source, 8, 2, 64, 256, torch.device("cpu"))
    out = torch.full_like(q, math.nan)
    peer.run(q, pool, bt, qsl, sl, 1, ctx, 0.125, out, quant)
    call = peer.mod.CALLS[-1]
    if fp8:  # the read vLLM's TRITON_ATTN makes on CUDA: e4m3 query, descaled in the kernel
        query = reference.quantize_query_fp8(q, quant.inv_q_scale_t).float() * quant.q_scale
        assert call["q_dtype"] == torch.float8_e4m3fn
        assert call["kv_quant_mode"] == vllm_triton_peer.KVQuantMode.FP8_PER_TENSOR
        want = reference.paged_attention(query, pool, bt, [1] * 5, [ctx] * 5, 0.125,
                                         quant=reference.CacheQuant(torch.float8_e4m3fn, 448.0, 0.05, 0.03, "cpu"))
    else:
        assert call["q_dtype"] == torch.bfloat16 and call["kv_quant_mode"] == vllm_triton_peer.KVQuantMode.NONE
        want = reference.paged_attention(q, pool, bt, [1] * 5, [ctx] * 5, 0.125)
    err = float((out.double() - want.double()).norm() / want.double().norm())
    assert err < 2 ** -7, err  # bf16 outputs of the same math in float32 (and K / V swapped would be ~1)
    assert call["threshold"] == 128 // 2 and call["segments"] == 16 and call["scratch"] == (64, 8, 16, 64)
    assert call["k_descale"] == (5, 2) and call["causal"] is True and call["window"] == (-1, -1)
    assert peer.uses_3d(5) and not peer.uses_3d(65)


def test_the_stand_ins_leave_no_trace(source):
    before = {m for m in sys.modules if m == "vllm" or m.startswith("vllm.")}
    vllm_triton_peer.load(source)
    assert {m for m in sys.modules if m == "vllm" or m.startswith("vllm.")} == before


def test_availability_names_what_is_missing(tmp_path):
    assert "--vllm-triton-src" in vllm_triton_peer.available(None)
    (tmp_path / "triton_unified_attention.py").write_text("")
    assert vllm_triton_peer.available(str(tmp_path)) == f"{tmp_path} lacks triton_attention_helpers.py"
