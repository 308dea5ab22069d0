# prototype: the doc's dequantisation order in-kernel (fp32 product v * fp32(s_b * s2), rounded to bf16), for the cost figure
import triton, triton.language as tl
import sys; sys.path.insert(0, "/work/main")
from kvserve.kernels.triton_w4a16 import _e2m1_value, _block_scale

_F16BITS = tl.constexpr("""{
.reg .b32 t, u;
shl.b32 t, $4, 3;
and.b32 t, t, 0x0E000E00;
and.b32 u, $4, 0x80008000;
or.b32 $0, t, u;
shl.b32 t, $4, 6;
and.b32 t, t, 0x0E000E00;
shl.b32 u, $4, 3;
and.b32 u, u, 0x80008000;
or.b32 $1, t, u;
shl.b32 t, $4, 9;
and.b32 t, t, 0x0E000E00;
shl.b32 u, $4, 2;
and.b32 u, u, 0x80008000;
or.b32 $2, t, u;
and.b32 t, $4, 0x0E000E00;
shl.b32 u, $4, 1;
and.b32 u, u, 0x80008000;
or.b32 $3, t, u;
}""")

@triton.jit
def kern(x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, M, N, K, n_chunks, stride_xm, stride_wn, stride_sn, stride_ym,
         BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr):
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
    ri = tl.arange(0, 16)
    m_ok = rm < M
    w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + ri[None, :]
    s_rows = s_ptr + rn.to(tl.int64) * stride_sn
    x_cols = x_ptr + rm.to(tl.int64)[None, :] * stride_xm + ri[:, None]
    g = tl.load(g_ptr + rn) * (16384.0 / 128.0)   # s2 * 2^14 (fp16 bits carry e2m1 * 2^-14)
    acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    for c in tl.range(0, n_chunks, loop_unroll_factor=CHUNKS):
        w = tl.load(w_rows + c * 16)
        sc = tl.load(s_rows + c)
        x0 = tl.load(x_cols + c * 64, mask=m_ok[None, :], other=0.0)
        x1 = tl.load(x_cols + c * 64 + 16, mask=m_ok[None, :], other=0.0)
        x2 = tl.load(x_cols + c * 64 + 32, mask=m_ok[None, :], other=0.0)
        x3 = tl.load(x_cols + c * 64 + 48, mask=m_ok[None, :], other=0.0)
        b0, b1, b2, b3 = tl.inline_asm_elementwise(_F16BITS, "=r,=r,=r,=r,r", [w], dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
        # doc order: scale = fp32(s_b) * s2 (rounded in fp32), w = bf16(e2m1 * scale) (fp32 product, one rounding)
        sc0 = (_block_scale(sc, 0) * 128.0) * g
        sc1 = (_block_scale(sc, 1) * 128.0) * g
        sc2 = (_block_scale(sc, 2) * 128.0) * g
        sc3 = (_block_scale(sc, 3) * 128.0) * g
        acc = tl.dot((b0.to(tl.float32) * sc0[:, None]).to(tl.bfloat16), x0, acc)
        acc = tl.dot((b1.to(tl.float32) * sc1[:, None]).to(tl.bfloat16), x1, acc)
        acc = tl.dot((b2.to(tl.float32) * sc2[:, None]).to(tl.bfloat16), x2, acc)
        acc = tl.dot((b3.to(tl.float32) * sc3[:, None]).to(tl.bfloat16), x3, acc)
    tl.store(y_ptr + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None], acc.to(tl.bfloat16), mask=m_ok[None, :])
