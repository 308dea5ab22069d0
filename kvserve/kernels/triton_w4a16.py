"""W4A16 GEMM over NVFP4 weights (Triton): ``y = x @ W^T`` with W decoded in registers, so only its
4-bit codes and 8-bit scales live in memory (~3.6x fewer weight bytes than bf16).

**Kernel layout** (``pack_w4a16``, once after loading, as vLLM repacks for Marlin): K is cut into
pairs of chunks of 64; pair P of row n is 32 int16 words, and word ``8q + 4cc + t`` (q, t = 0..3,
cc = 0, 1) holds the four elements of features ``128P + 64cc + 16q + 4j + t`` (j = 0..3): all from
one 16-wide e4m3 scale group (q of chunk 2P + cc), one element for each of the chunk's four k16 MMA
steps. This is the layout whose words and activations a thread of the Gluon kernel
(``gluon_w4a16``) needs as 16 contiguous bytes each; here column ``4q + t`` of step j's [rows, 16]
tile is feature ``64c + 16q + 4j + t``, for W and x alike (the MMA's k order is a permutation of
the features, the same for both operands). The codes are stored pair-major (pair P of all rows
together), so the rows a program takes are one block of memory each step. Inside a
word, element j's 3 magnitude bits (e1 e0 m) sit at ``MAG_AT[j]`` and its sign at ``SIGN_AT[j]``: a
pair of words (one 32-bit register) then becomes a bf16x2 pair of element j by one shift-and-mask
(j = 0, 1) or two (j = 2, 3). That pair reads as ``e2m1 * 2^-126`` (the magnitude lands on the low
exponent bits and the top mantissa bit; e = 0 is the bf16 subnormal), and one ``mul.rn.bf16x2`` by
the block scale ``s_b * 2^119`` gives ``e2m1 * s_b * 2^-7`` exactly (6 significant bits). The block
scales are stored as S0E5M3 bytes (the exponent and mantissa bits of ``fp16(s_b * 2^7)``, always a
normal number, the format vLLM's Marlin path uses), eight per pair (byte ``2q + cc``); a scale
turns into its bf16x2 pair with one byte permute and one multiply-add. fp16 activations take the fp16
twin of both steps. The global scale (one per output row: fused siblings keep their own) times 2^7
multiplies the fp32 accumulator once at the end. So W enters the MMA as ``e2m1 * s_b`` exactly and
the product is ``x @ (e2m1 * s_b * s2)^T`` up to fp32 accumulation: one rounding fewer than
``x @ dequantize_nvfp4(W, dtype)^T``, which rounds every weight to x's dtype first.

**Schedule**: the MMA is ``acc[BLOCK_N, BLOCK_M] += W_j [BLOCK_N, 16] @ x_j^T [16, BLOCK_M]`` (the weight
is the left operand, decoded in its register layout; x comes through shared memory), so a decode
batch of 1-16 rows still fills a 64-row MMA. The (tile, chunk) work is split evenly over a fixed
number of programs (stream-K): a program that covers part of a tile writes its fp32 partial, and
the last of a tile's programs to arrive (an atomic counter) sums the partials in program order
(deterministic) and writes y. The programs are one wave: as many as fit the SMs at once.

**Large batches** (``use_dense_path``: from ``DENSE_FROM_M`` rows, prefill chunks) dequantize the
weight into a reused buffer (``dequantize_w4a16``, the doc's order: exactly the reference backend's
weights) and multiply with torch's GEMM; at those sizes the GEMM takes far longer than writing the
bf16 copy once.

**Routed experts** (``w4a16_grouped_matmul``): the same chunk loop over blocks of rows that share an
expert (``layers/moe.moe_align``), one program per (block, output tile), token rows
gathered; no stream-K.

The inline PTX runs on CUDA only; the Triton interpreter and fp32 activations take ``_decode_twin``,
which builds the same values with Triton arithmetic (tests/test_triton_w4a16.py checks the PTX text
against it bit for bit by emulating each instruction).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from kvserve.kernels.triton_moe import check_routed_rows
from kvserve.kernels.triton_store import num_sms
from kvserve.logger import init_logger
from kvserve.quant.nvfp4 import NVFP4_GROUP_SIZE, unpack_e2m1

logger = init_logger(__name__)
CHUNK = 64  # K elements per chunk: four scale groups, 16 int16 words
PAIR = 2 * CHUNK  # K elements per pair of chunks, the unit of the layout (32 words, 8 scale bytes)
MAG_AT = (6, 3, 0, 9)  # where element j's magnitude bits start in its word (the PTX is made from these; _chunk spells them out)
SIGN_AT = (15, 12, 13, 14)  # and its sign bit
_LOCKS = 1 << 16  # tile counters per device (stream-K); launches with more tiles take whole tiles
DENSE_FROM_M = 256  # batch rows from which the weight is dequantized for cuBLAS (H200: cheaper than the fused kernel at 256)
DENSE_MAX_BYTES = 1 << 30  # the largest bf16 weight copy that path makes (the 27B's gate | up: 356 MB)

def _shifted(dst: str, src: str, by: int) -> list[str]:
    """PTX moving ``src`` left by ``by`` bits (right when negative) into ``dst``."""
    return [f"shl.b32 {dst}, {src}, {by};"] if by > 0 else [f"shr.b32 {dst}, {src}, {-by};"] if by < 0 else []


def _decode_text(mag_to: int, mul: str) -> str:
    """The decode PTX: ``$4`` = two code words (a word's four elements share one block scale),
    ``$5`` = their scale pair -> ``$j`` = element j of both words, its magnitude moved to bits
    ``mag_to`` .. + 2 of each half (bf16: 6, the pair reads e2m1 * 2^-126; fp16: 9, e2m1 * 2^-14) and
    its sign to bit 15, times the scale pair by ``mul``. One shift serves both where the layout puts
    them the same distance. (Operands: ``=r`` x 4, then the words and the two scale registers that
    ``pack=2`` gives; the second is the same pair.)"""
    mag_mask, sign_mask = (7 << mag_to) * 0x10001, 0x80008000
    lines = ["{", ".reg .b32 t, u;"]
    for j in range(4):
        to_mag, to_sign = mag_to - MAG_AT[j], 15 - SIGN_AT[j]
        if to_mag == to_sign:
            shift = _shifted("t", "$4", to_mag)
            lines += shift + [f"and.b32 t, {'t' if shift else '$4'}, {mag_mask | sign_mask:#010x};"]
        else:
            mag, sign = _shifted("t", "$4", to_mag), _shifted("u", "$4", to_sign)
            lines += mag + [f"and.b32 t, {'t' if mag else '$4'}, {mag_mask:#010x};"]
            lines += sign + [f"and.b32 u, {'u' if sign else '$4'}, {sign_mask:#010x};", "or.b32 t, t, u;"]
        lines.append(f"{mul} ${j}, t, $5;")
    return "\n".join(lines + ["}"])


def _scales_text(bf16: bool, count: int) -> str:
    """The scale PTX: bytes 0 .. count - 1 of ``$count`` (S0E5M3) -> ``$b`` = byte b's scale in both
    halves: bf16 ``s_b * 2^119`` (exponent + 224, mantissa << 4: a multiply-add), fp16 ``s_b * 2^7``
    (the byte is bits 14-7 of the fp16)."""
    lines = ["{", ".reg .b32 t;"]
    for b in range(count):
        lines.append(f"prmt.b32 t, ${count}, 0, 0x4{b}4{b};")  # byte b to bytes 0 and 2, zeros between
        lines.append(f"mad.lo.u32 ${b}, t, 16, 0x70007000;" if bf16 else f"shl.b32 ${b}, t, 7;")
    return "\n".join(lines + ["}"])


_DECODE_BF16 = tl.constexpr(_decode_text(6, "mul.rn.bf16x2"))
_DECODE_FP16 = tl.constexpr(_decode_text(9, "mul.rn.f16x2"))
_SCALE_BF16 = tl.constexpr(_scales_text(True, 1))  # one byte an element (the Triton kernels)
_SCALE_FP16 = tl.constexpr(_scales_text(False, 1))


@dataclass(frozen=True)
class W4A16Weight:
    """An NVFP4 weight in the kernel layout (module docstring): ``codes`` int16 [N, P, 32] and
    ``scales`` uint8 [N, P, 8] (S0E5M3), each indexed [row, pair, word] and stored pair-major (one
    pair of all rows together: a program's rows are one contiguous block), ``row_scale`` fp32 [N]
    (global scale x 2^7); P = K / 128 rounded up (padding decodes to 0). Routed experts stack E of
    them: [E, N, P, ...] (pair-major over all experts) and [E, N]."""

    codes: torch.Tensor
    scales: torch.Tensor
    row_scale: torch.Tensor
    in_features: int

    @property
    def out_features(self) -> int:
        return self.codes.shape[-3]


def pack_w4a16(packed: torch.Tensor, block_scale: torch.Tensor, global_scale: torch.Tensor) -> W4A16Weight:
    """A ModelOpt NVFP4 weight (``weight`` uint8 [N, K/2], ``weight_scale`` float8_e4m3fn [N, K/16],
    ``weight_scale_2`` fp32, 1 or N values) -> the kernel layout, on the same device. Exact: a
    negative block scale flips its codes' signs, a zero one zeroes its codes; NaN scales are refused.
    Stacked experts: [E, N, K/2], [E, N, K/16] and [E, N] (one global scale a row)."""
    if packed.dim() == 3:
        e, n, half_k = packed.shape
        if tuple(block_scale.shape[:2]) != (e, n) or tuple(global_scale.shape) != (e, n):
            raise ValueError(f"pack_w4a16: stacked weight {tuple(packed.shape)} needs weight_scale [{e}, {n}, K/16] "
                             f"and weight_scale_2 [{e}, {n}], got {tuple(block_scale.shape)} and "
                             f"{tuple(global_scale.shape)}")
        flat = pack_w4a16(packed.reshape(e * n, half_k), block_scale.reshape(e * n, -1), global_scale.reshape(e * n))
        return W4A16Weight(flat.codes.view(e, n, *flat.codes.shape[1:]), flat.scales.view(e, n, *flat.scales.shape[1:]),
                           flat.row_scale.view(e, n), flat.in_features)
    n, half_k = packed.shape
    k = 2 * half_k
    if packed.dtype != torch.uint8 or k % NVFP4_GROUP_SIZE:
        raise ValueError(f"pack_w4a16: weight {tuple(packed.shape)} {packed.dtype}, expected uint8 [N, K/2] with K a "
                         f"multiple of {NVFP4_GROUP_SIZE}")
    groups = k // NVFP4_GROUP_SIZE
    if block_scale.dtype != torch.float8_e4m3fn or tuple(block_scale.shape) != (n, groups):
        raise ValueError(f"pack_w4a16: weight_scale {tuple(block_scale.shape)} {block_scale.dtype}, expected "
                         f"float8_e4m3fn {(n, groups)}")
    if global_scale.dtype != torch.float32 or global_scale.numel() not in (1, n):
        raise ValueError(f"pack_w4a16: weight_scale_2 of {global_scale.numel()} {global_scale.dtype} values, expected "
                         f"float32, 1 or N = {n}")
    s = block_scale.float()
    if bool(torch.isnan(s).any()):
        raise ValueError(f"pack_w4a16: weight_scale {tuple(block_scale.shape)} holds NaN block scales")
    pairs = -(-k // PAIR)
    codes = torch.zeros((n, pairs * PAIR), dtype=torch.int32, device=packed.device)
    codes[:, :k] = unpack_e2m1(packed)
    codes = codes.view(n, pairs * 8, NVFP4_GROUP_SIZE)
    s_pad = torch.ones((n, pairs * 8), dtype=torch.float32, device=packed.device)
    s_pad[:, :groups] = s
    codes = torch.where((s_pad < 0)[..., None], codes ^ 8, codes)  # (-s) * v = s * (-v)
    codes = torch.where((s_pad == 0)[..., None], torch.zeros_like(codes), codes)
    s_pad = torch.where(s_pad == 0, torch.ones_like(s_pad), s_pad.abs())
    c = codes.view(n, pairs, 2, 4, 4, 4)  # [n, pair, cc, q, j, t]: feature 128 pair + 64 cc + 16 q + 4 j + t
    word = torch.zeros((n, pairs, 2, 4, 4), dtype=torch.int32, device=packed.device)  # [n, pair, cc, q, t]
    for j in range(4):
        word |= ((c[:, :, :, :, j] & 7) << MAG_AT[j]) | ((c[:, :, :, :, j] >> 3) << SIGN_AT[j])
    word = word.permute(0, 1, 3, 2, 4).reshape(n, pairs * 32)  # word 8q + 4cc + t of a pair
    word = word - ((word >> 15) << 16)  # 0..65535 -> the int16 of the same bits
    fp16_bits = (s_pad * 128).to(torch.float16).view(torch.int16).to(torch.int32)  # normal: s_b >= 2^-9
    s0e5m3 = ((fp16_bits >> 7) & 0xFF).to(torch.uint8).view(n, pairs, 2, 4).permute(0, 1, 3, 2)  # byte 2q + cc
    row = global_scale.reshape(-1).to(device=packed.device, dtype=torch.float32).expand(n) * 128.0
    pair_major = lambda t: t.reshape(n, pairs, -1).transpose(0, 1).contiguous().transpose(0, 1)  # noqa: E731
    return W4A16Weight(pair_major(word.to(torch.int16)), pair_major(s0e5m3), row.contiguous(), k)


@dataclass(frozen=True)
class W4A16Tiles:
    """Launch tiles: output rows (W) x batch rows (x) of a program's accumulator, K chunks per loop
    step, warps, pipeline stages, and programs per SM for the stream-K split: None = as many as fit
    an SM at once (the compiled kernel's registers, shared memory and warps), 0 = one program per
    tile (no split). ``maxnreg`` caps a thread's registers (None: the compiler's choice), which sets
    how many programs fit an SM."""

    block_n: int
    block_m: int
    chunks: int = 2
    num_warps: int = 4
    num_stages: int = 3
    programs_per_sm: int | None = None
    programs: int = 0  # an exact program count instead (tests of the stream-K split)
    maxnreg: int | None = None
    one_dot: bool = False  # a chunk's four k16 steps as one K = 64 dot (one wgmma wait, not four)


def default_tiles(m: int, n: int, k: int) -> W4A16Tiles:
    """The launch tiles for an [m, k] x [k, n] product: the fastest of the H200 sweep on the 27B MLP
    shapes (benchmarks/RESULTS.md; batch 32 was not in it and takes batch 64's loop). Stream-K over
    one wave of programs: 136 whole 128-row tiles of a 17408-row weight would leave 4 SMs a second
    tile each."""
    if m <= 16:
        return W4A16Tiles(128, 16, 2, 4, 3)
    if m <= 32:
        return W4A16Tiles(128, 32, 1, 4, 3)
    if m <= 64:
        return W4A16Tiles(128, 64, 1, 4, 3)
    return W4A16Tiles(128, 128, 2, 8, 3)


@triton.jit
def _e2m1_value(w, MAG: tl.constexpr, SIGN: tl.constexpr):
    """fp32 e2m1 value of element j of each code word (its bits at MAG, SIGN)."""
    h = w.to(tl.int32) & 0xFFFF
    mag = (h >> MAG) & 7
    e = mag >> 1
    half_m = (mag & 1).to(tl.float32) * 0.5
    v = tl.where(e == 0, half_m, (1.0 + half_m) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return tl.where(((h >> SIGN) & 1) == 1, -v, v)


@triton.jit
def _block_scale(b):
    """fp32 ``s_b * 2^-7`` of S0E5M3 bytes (s_b * 2^7 = 2^(E5 - 15) (1 + M3 / 8))."""
    b = b.to(tl.int32) & 0xFF
    return (((b >> 3) + 98) << 23 | (b & 7) << 20).to(tl.float32, bitcast=True)


@triton.jit
def _decode_twin(w, scale, MAG: tl.constexpr, SIGN: tl.constexpr, DTYPE: tl.constexpr):
    """Element j of each code word times its block scale (fp32 ``s_b * 2^-7``, one a word),
    ``e2m1 * s_b * 2^-7`` (exact), in Triton arithmetic: what the PTX of ``_DECODE_*`` computes, for
    the interpreter and fp32."""
    return (_e2m1_value(w, MAG, SIGN) * scale).to(DTYPE)


@triton.jit
def _word_scales(s_rows, c, stride_sp, n_ok, BLOCK_N: tl.constexpr, EVEN_N: tl.constexpr):
    """Chunk c's S0E5M3 bytes for each column ``4q + t`` of its [BLOCK_N, 16] words: [BLOCK_N, 16]
    int32 (the 4 bytes of a row, each repeated over its 4 columns). ``s_rows``: [BLOCK_N] byte pointers."""
    rq = tl.arange(0, 4)
    at = s_rows[:, None] + ((c // 2) * stride_sp + c % 2 + 2 * rq)[None, :]
    if EVEN_N:
        b = tl.load(at)
    else:
        b = tl.load(at, mask=n_ok[:, None], other=0)
    b = b.to(tl.int32) & 0xFF
    return tl.reshape(tl.broadcast_to(b[:, :, None], (BLOCK_N, 4, 4)), (BLOCK_N, 16))


@triton.jit
def _word_offsets(c, stride_wp):
    """Where chunk c's 16 words (columns ``4q + t``) sit from their row's start: int16 offsets [16]
    (pairs ``stride_wp`` apart)."""
    ri = tl.arange(0, 16)
    return (c // 2) * stride_wp + (c % 2) * 4 + 8 * (ri // 4) + ri % 4


@triton.jit
def _dequantize_kernel(w_ptr, s_ptr, g_ptr, out_ptr, N, K, stride_wn, stride_wp, stride_sn, stride_sp, stride_on,
                       BLOCK_N: tl.constexpr,
                       PTX: tl.constexpr, EVEN_K: tl.constexpr):
    """One chunk of BLOCK_N rows -> ``dtype(e2m1 * (fp32(s_b) * s2))``, the doc's order (as
    ``quant/nvfp4.dequantize_nvfp4``), stored as one [BLOCK_N, 64] tile in K order. ``PTX``: the
    e2m1 values come from the fp16 decode PTX with a scale of 2^14 (``e2m1 * 2^-14 * 2^14``, exact
    in fp16), a few instructions a pair instead of the Triton arithmetic's ~20 an element; the same
    fp32 product follows."""
    rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    c = tl.program_id(1)
    n_ok = rn < N
    w = tl.load(w_ptr + rn.to(tl.int64)[:, None] * stride_wn + _word_offsets(c, stride_wp)[None, :], mask=n_ok[:, None],
                other=0)
    sb = _word_scales(s_ptr + rn.to(tl.int64) * stride_sn, c, stride_sp, n_ok, BLOCK_N, False)
    s2 = tl.load(g_ptr + rn, mask=n_ok, other=0.0) * (1.0 / 128.0)  # the row's weight_scale_2 (exact)
    if PTX:
        two14 = tl.full([BLOCK_N, 16], 0x74007400, tl.int32)  # fp16 2^14 in both halves
        e0, e1, e2, e3 = tl.inline_asm_elementwise(
            _DECODE_FP16, "=r,=r,=r,=r,r,r,r", [w, two14],
            dtype=(tl.float16, tl.float16, tl.float16, tl.float16), is_pure=True, pack=2)
        e0, e1, e2, e3 = e0.to(tl.float32), e1.to(tl.float32), e2.to(tl.float32), e3.to(tl.float32)
    else:
        e0, e1, e2, e3 = _e2m1_value(w, 6, 15), _e2m1_value(w, 3, 12), _e2m1_value(w, 0, 13), _e2m1_value(w, 9, 14)
    ty = out_ptr.dtype.element_ty
    scale = (_block_scale(sb) * 128.0) * s2[:, None]  # fp32(s_b) * s2, rounded once in fp32
    v0, v1, v2, v3 = (e0 * scale).to(ty), (e1 * scale).to(ty), (e2 * scale).to(ty), (e3 * scale).to(ty)
    v = tl.join(tl.join(v0, v1), tl.join(v2, v3))  # [BLOCK_N, 16 (q, t), 2 (j % 2), 2 (j // 2)]
    v = tl.reshape(tl.permute(tl.reshape(v, (BLOCK_N, 4, 4, 2, 2)), (0, 1, 4, 3, 2)), (BLOCK_N, 64))  # 16q + 4j + t
    rk = c * 64 + tl.arange(0, 64)
    at = out_ptr + rn.to(tl.int64)[:, None] * stride_on + rk[None, :]
    if EVEN_K:
        tl.store(at, v, mask=n_ok[:, None])
    else:
        tl.store(at, v, mask=n_ok[:, None] & (rk[None, :] < K))


@triton.jit
def _decode_ptx(w, sb, BYTE_SCALE: tl.constexpr, DECODE_ASM: tl.constexpr, TY: tl.constexpr):
    """The four k16 steps' weights of a chunk, ``e2m1 * s_b * 2^-7`` in TY, by the inline PTX: each
    word's scale pair from its byte (``BYTE_SCALE``), then the code words two at a time (``DECODE_ASM``)."""
    pairs = tl.inline_asm_elementwise(BYTE_SCALE, "=r,r", [sb], dtype=tl.int32, is_pure=True, pack=1)
    return tl.inline_asm_elementwise(DECODE_ASM, "=r,=r,=r,=r,r,r,r", [w, pairs],
                                     dtype=(TY.value, TY.value, TY.value, TY.value), is_pure=True, pack=2)


@triton.jit
def _mma(acc, a, b, IEEE: tl.constexpr):
    """acc + a @ b, with IEEE fp32 products where ``IEEE`` (the fp32 twin)."""
    if IEEE:
        return tl.dot(a, b, acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def _chunk(acc, w_rows, s_rows, x_cols, c, stride_wp, stride_sp, K, n_ok, m_ok, BLOCK_N: tl.constexpr,
           DECODE: tl.constexpr,
           EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ONE_DOT: tl.constexpr):
    """acc += chunk c of W (rows at ``w_rows`` / ``s_rows``) times x^T (columns at ``x_cols``): the
    four k16 steps' decodes, then their MMAs, as four dots or (``ONE_DOT``) the steps joined in K
    order into one K = 64 dot (the same k16 MMAs in the same order, one wait for them; x loaded as
    one [64, BLOCK_M] tile instead compiles to 157 registers, not 127)."""
    ri = tl.arange(0, 16)
    w_at = w_rows + _word_offsets(c, stride_wp)[None, :]
    if EVEN_N:
        w = tl.load(w_at)  # [BLOCK_N, 16] int16
    else:
        w = tl.load(w_at, mask=n_ok[:, None], other=0)
    sb = _word_scales(s_rows, c, stride_sp, n_ok, BLOCK_N, EVEN_N)
    xm = m_ok[None, :]
    x_at = x_cols + c * 64  # column 4q + t of step j: feature 64c + 16q + 4j + t
    if EVEN_K:
        x0 = tl.load(x_at, mask=xm, other=0.0)  # [16, BLOCK_M]
        x1 = tl.load(x_at + 4, mask=xm, other=0.0)
        x2 = tl.load(x_at + 8, mask=xm, other=0.0)
        x3 = tl.load(x_at + 12, mask=xm, other=0.0)
    else:
        k0 = c * 64 + 16 * (ri // 4)[:, None] + (ri % 4)[:, None]
        x0 = tl.load(x_at, mask=xm & (k0 < K), other=0.0)
        x1 = tl.load(x_at + 4, mask=xm & (k0 + 4 < K), other=0.0)
        x2 = tl.load(x_at + 8, mask=xm & (k0 + 8 < K), other=0.0)
        x3 = tl.load(x_at + 12, mask=xm & (k0 + 12 < K), other=0.0)
    if DECODE == 1:
        w0, w1, w2, w3 = _decode_ptx(w, sb, _SCALE_BF16, _DECODE_BF16, tl.bfloat16)
    elif DECODE == 2:
        w0, w1, w2, w3 = _decode_ptx(w, sb, _SCALE_FP16, _DECODE_FP16, tl.float16)
    else:
        ty = tl.float32 if DECODE == 3 else x_cols.dtype.element_ty
        scale = _block_scale(sb)
        w0 = _decode_twin(w, scale, 6, 15, ty)
        w1 = _decode_twin(w, scale, 3, 12, ty)
        w2 = _decode_twin(w, scale, 0, 13, ty)
        w3 = _decode_twin(w, scale, 9, 14, ty)
    if ONE_DOT:  # [.., 16, 2, 2] with step j = 2p + q, moved to K order: k = 16 j + i
        wk = tl.reshape(tl.permute(tl.join(tl.join(w0, w2), tl.join(w1, w3)), (0, 2, 3, 1)), (BLOCK_N, 64))
        xk = tl.reshape(tl.permute(tl.join(tl.join(x0, x2), tl.join(x1, x3)), (2, 3, 0, 1)), (64, xm.shape[1]))
        acc = _mma(acc, wk, xk, DECODE == 3)
    else:
        acc = _mma(acc, w0, x0, DECODE == 3)
        acc = _mma(acc, w1, x1, DECODE == 3)
        acc = _mma(acc, w2, x2, DECODE == 3)
        acc = _mma(acc, w3, x3, DECODE == 3)
    return acc


@triton.jit(do_not_specialize=["M", "N", "K", "n_chunks", "tiles_n", "units", "programs"])  # (fewer compiles)
def _w4a16_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, part_ptr, lock_ptr,
    M, N, K, n_chunks, tiles_n, units, programs,
    stride_xm, stride_wn, stride_wp, stride_sn, stride_sp, stride_ym,
    BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr, DECODE: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ONE_DOT: tl.constexpr,
):
    """Program p takes work units [p U / P, (p + 1) U / P) of U = tiles x chunks (tile-major). DECODE:
    1 bf16 PTX, 2 fp16 PTX, 0 the Triton twin (interpreter) with x's dtype, 3 the twin in fp32
    with IEEE dots."""
    p = tl.program_id(0)
    u_lo = (p.to(tl.int64) * units // programs).to(tl.int32)
    u_hi = ((p.to(tl.int64) + 1) * units // programs).to(tl.int32)
    ri = tl.arange(0, 16)
    rbn = tl.arange(0, BLOCK_N)
    rbm = tl.arange(0, BLOCK_M)
    u = u_lo
    while u < u_hi:
        tile = u // n_chunks
        c_begin = u - tile * n_chunks
        c_end = tl.minimum(n_chunks, c_begin + (u_hi - u))
        rn = (tile % tiles_n) * BLOCK_N + rbn
        rm = (tile // tiles_n) * BLOCK_M + rbm
        n_ok, m_ok = rn < N, rm < M
        w_rows = w_ptr + rn.to(tl.int64)[:, None] * stride_wn
        s_rows = s_ptr + rn.to(tl.int64) * stride_sn
        x_cols = x_ptr + rm.to(tl.int64)[None, :] * stride_xm + (16 * (ri // 4) + ri % 4)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for c in tl.range(c_begin, c_end, loop_unroll_factor=CHUNKS):
            acc = _chunk(acc, w_rows, s_rows, x_cols, c, stride_wp, stride_sp, K, n_ok, m_ok, BLOCK_N, DECODE, EVEN_N,
                         EVEN_K, ONE_DOT)
        g = tl.load(g_ptr + rn, mask=n_ok, other=0.0)
        y_at = y_ptr + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
        y_ok = n_ok[:, None] & m_ok[None, :]
        if c_begin == 0 and c_end == n_chunks:  # the whole tile
            tl.store(y_at, (acc * g[:, None]).to(y_ptr.dtype.element_ty), mask=y_ok)
        else:  # a part: publish it; the tile's last program to arrive sums the parts in program order
            first = (u == u_lo).to(tl.int32)  # a program's parts: slot 0 its first tile, slot 1 its last
            slot = part_ptr + ((p * 2 + 1 - first).to(tl.int64) * BLOCK_N + rbn[:, None]) * BLOCK_M + rbm[None, :]
            tl.store(slot, acc, mask=m_ok[None, :])  # (batch rows past M are not read back)
            tl.debug_barrier()
            t_lo, t_hi = tile * n_chunks, tile * n_chunks + n_chunks
            q_first = ((t_lo + 1).to(tl.int64) * programs + units - 1) // units - 1  # owner of unit t_lo
            q_last = (t_hi.to(tl.int64) * programs + units - 1) // units - 1  # owner of unit t_hi - 1
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
            if arrived == q_last - q_first:
                total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for q in range(q_first, q_last + 1):
                    q_lo = (q * units // programs).to(tl.int32)
                    q_slot = q * 2 + 1 - (q_lo // n_chunks == tile).to(tl.int64)
                    total += tl.load(part_ptr + (q_slot * BLOCK_N + rbn[:, None]) * BLOCK_M + rbm[None, :],
                                     mask=m_ok[None, :], other=0.0, cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch
                tl.store(y_at, (total * g[:, None]).to(y_ptr.dtype.element_ty), mask=y_ok)
        u += c_end - c_begin


_locks: dict[torch.device, torch.Tensor] = {}
_empty_parts: dict[torch.device, torch.Tensor] = {}


def _tile_locks(device: torch.device) -> torch.Tensor:
    """Zeroed int32 tile counters for stream-K launches on ``device`` (each launch leaves them zero)."""
    lock = _locks.get(device)
    if lock is None:
        lock = _locks[device] = torch.zeros(_LOCKS, dtype=torch.int32, device=device)
    return lock


def _no_parts(device: torch.device) -> torch.Tensor:
    """The fp32 partial-sum argument of a launch with one program a tile (never read or written)."""
    part = _empty_parts.get(device)
    if part is None:
        part = _empty_parts[device] = torch.zeros(1, dtype=torch.float32, device=device)
    return part


def dequantize_w4a16(weight: W4A16Weight, dtype: torch.dtype, out: torch.Tensor | None = None) -> torch.Tensor:
    """The weight as ``dtype`` [N, K], equal bit for bit to ``dequantize_nvfp4`` of the checkpoint
    tensors it was packed from (the large-batch path's operand)."""
    n, k = weight.out_features, weight.in_features
    w = out if out is not None else torch.empty((n, k), dtype=dtype, device=weight.codes.device)
    assert tuple(w.shape) == (n, k) and w.dtype == dtype and w.is_contiguous()
    grid = (triton.cdiv(n, 64), triton.cdiv(k, CHUNK))  # (a padding chunk past K is not read)
    _dequantize_kernel[grid](weight.codes, weight.scales, weight.row_scale, w, n, k, weight.codes.stride(0),
                             weight.codes.stride(1), weight.scales.stride(0), weight.scales.stride(1), w.stride(0), BLOCK_N=64,
                             PTX=w.device.type == "cuda", EVEN_K=k % CHUNK == 0)
    return w


_scratch: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}


def _dense_scratch(device: torch.device, dtype: torch.dtype, n: int, k: int) -> torch.Tensor:
    """A reused [n, k] buffer for the dequantized weight of the large-batch path (one per device and
    dtype, as large as the largest weight seen)."""
    buf = _scratch.get((device, dtype))
    if buf is None or buf.numel() < n * k:
        buf = _scratch[(device, dtype)] = torch.empty(n * k, dtype=dtype, device=device)
    return buf[: n * k].view(n, k)


def reserve_dense_buffer(device: torch.device, dtype: torch.dtype, n: int, k: int) -> int:
    """Make the large-batch buffer for an [n, k] weight now (at start-up, before the memory plan);
    returns its bytes."""
    _dense_scratch(device, dtype, n, k)
    buf = _scratch[(device, dtype)]
    return buf.numel() * buf.element_size()


def use_dense_path(m: int, n: int, k: int) -> bool:
    """Whether a batch of ``m`` rows dequantizes the weight and runs torch's GEMM (cuBLAS) instead
    of the fused kernel: from ``DENSE_FROM_M`` rows (prefill chunks, where the GEMM's time dwarfs
    the dequantisation), for weights whose bf16 copy fits ``DENSE_MAX_BYTES``."""
    return m >= DENSE_FROM_M and 2 * n * k <= DENSE_MAX_BYTES


_occupancy: dict[tuple, int] = {}
_INTERPRETER_CTAS_PER_SM = 4  # (no device to ask: any count is correct, this one splits tiles in tests)
_FALLBACK_CTAS_PER_SM = 2  # where the compiled kernel cannot be asked (logged once)


def ctas_per_sm(n_regs: int, shared_bytes: int, num_warps: int, regs_per_sm: int = 65536,
                shared_per_sm: int = 233472, threads_per_sm: int = 2048) -> int:
    """Programs of a compiled kernel that fit one SM at once: registers (allocated 8 a thread at a
    time, per warp), shared memory (plus the 1 KiB the runtime reserves a block) and threads."""
    by_regs = regs_per_sm // (-(-max(n_regs, 1) // 8) * 8 * 32 * num_warps)
    by_smem = shared_per_sm // (shared_bytes + 1024) if shared_bytes else threads_per_sm
    return max(1, min(by_regs, by_smem, threads_per_sm // (32 * num_warps)))


def _ctas_per_sm(kernel, make_args, meta: dict, dtype: torch.dtype, device: torch.device,
                 variant: tuple | None = None) -> int:
    """``ctas_per_sm`` of this compiled variant (asked once per variant: ``make_args`` builds a
    launch's arguments only then), so the stream-K split fills exactly one wave. ``variant`` names
    the variant where meta's values are not hashable (default: meta's values, in their one order)."""
    if device.type != "cuda":
        return _INTERPRETER_CTAS_PER_SM
    key = (id(kernel), device, dtype, tuple(meta.values()) if variant is None else variant)
    occ = _occupancy.get(key)
    if occ is None:
        try:
            compiled = kernel.warmup(*make_args(), grid=(1,), **meta)
            compiled._init_handles()  # loads it: the register count is known from here
            props = torch.cuda.get_device_properties(device)
            occ = ctas_per_sm(compiled.n_regs, compiled.metadata.shared, meta["num_warps"],
                              getattr(props, "regs_per_multiprocessor", 65536),
                              getattr(props, "shared_memory_per_multiprocessor", 233472),
                              getattr(props, "max_threads_per_multi_processor", 2048))
        except Exception as e:  # noqa: BLE001 (a triton without these internals: a safe split, said once)
            logger.warning("W4A16: cannot read the compiled kernel's occupancy (%s: %s); stream-K assumes %d "
                           "programs a SM", type(e).__name__, e, _FALLBACK_CTAS_PER_SM)
            occ = _FALLBACK_CTAS_PER_SM
        _occupancy[key] = occ
    return occ


def _decode_mode(x: torch.Tensor) -> int:
    if x.dtype == torch.float32:
        return 3
    if x.device.type != "cuda":
        return 0
    return 1 if x.dtype == torch.bfloat16 else 2


def w4a16_matmul(x: torch.Tensor, weight: W4A16Weight, out: torch.Tensor | None = None,
                 tiles: W4A16Tiles | None = None, dense: bool | None = None) -> torch.Tensor:
    """x [..., K] (bf16 / fp16 / fp32) @ W^T -> [..., N] in x's dtype, W from ``pack_w4a16`` on x's
    device. ``tiles`` overrides ``default_tiles`` (tests and tuning); every tiling gives the same
    product up to the fp32 summation order. ``dense`` forces the large-batch path on or off (None:
    ``use_dense_path``), which multiplies by the weights rounded to x's dtype (the reference's)."""
    k, n = weight.in_features, weight.out_features
    if x.shape[-1] != k:
        raise ValueError(f"w4a16_matmul: x [..., {x.shape[-1]}] does not match the weight's in_features {k}")
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"w4a16_matmul: x is {x.dtype}; accepted: bfloat16, float16, float32")
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if tuple(y.shape) != (m, n) or y.stride(-1) != 1 or y.dtype != x.dtype:
        raise ValueError(f"w4a16_matmul: out {tuple(y.shape)} {y.dtype}, expected {(m, n)} {x.dtype}, rows contiguous")
    if m == 0:
        return y.reshape(*x.shape[:-1], n)
    if dense if dense is not None else (tiles is None and use_dense_path(m, n, k)):
        torch.matmul(x2, dequantize_w4a16(weight, x.dtype, _dense_scratch(x.device, x.dtype, n, k)).t(), out=y)
        return y.reshape(*x.shape[:-1], n)
    t = tiles or default_tiles(m, n, k)
    if t.block_n < 16 or t.block_m < 16 or t.chunks < 1 or (t.programs_per_sm or 0) < 0:
        raise ValueError(f"w4a16_matmul: {t} needs block_n, block_m >= 16, chunks >= 1, programs_per_sm >= 0")
    n_chunks = triton.cdiv(k, CHUNK)
    tiles_n, tiles_m = triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m)
    n_tiles = tiles_n * tiles_m
    units = n_tiles * n_chunks
    meta = dict(BLOCK_N=t.block_n, BLOCK_M=t.block_m, CHUNKS=t.chunks, DECODE=_decode_mode(x),
                EVEN_N=n % t.block_n == 0, EVEN_K=k % CHUNK == 0, ONE_DOT=t.one_dot, num_warps=t.num_warps,
                num_stages=t.num_stages)
    if t.maxnreg is not None and x.device.type == "cuda":
        meta["maxnreg"] = t.maxnreg

    def args(programs: int, part: torch.Tensor, lock: torch.Tensor) -> list:
        return [x2, weight.codes, weight.scales, weight.row_scale, y, part, lock,
                m, n, k, n_chunks, tiles_n, units, programs,
                x2.stride(0), weight.codes.stride(0), weight.codes.stride(1), weight.scales.stride(0),
                weight.scales.stride(1), y.stride(0)]

    if t.programs_per_sm == 0 or n_tiles > _LOCKS:
        programs = n_tiles
    else:
        per_sm = t.programs_per_sm or _ctas_per_sm(
            _w4a16_kernel, lambda: args(1, _no_parts(x.device), _tile_locks(x.device)), meta, x.dtype, x.device)
        programs = min(units, t.programs or num_sms(x.device) * per_sm)
    streamed = programs != n_tiles  # (with one program a tile, each takes exactly its tile)
    # (the pointers keep their dtypes when unused, so that one compile serves both kinds of launch)
    part = torch.empty((programs, 2, t.block_n, t.block_m), dtype=torch.float32, device=x.device) if streamed \
        else _no_parts(x.device)
    lock = _tile_locks(x.device)
    _w4a16_kernel[(programs,)](*args(programs, part, lock), **meta)
    return y.reshape(*x.shape[:-1], n)


@triton.jit(do_not_specialize=["N", "K", "n_chunks", "num_experts"])
def _w4a16_grouped_kernel(
    x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, ids_ptr, expert_ptr, rw_ptr,
    N, K, n_chunks, num_experts,
    stride_xm, stride_we, stride_wn, stride_wp, stride_se, stride_sn, stride_sp, stride_ge, stride_ym,
    ROW_DIV: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, CHUNKS: tl.constexpr,
    DECODE: tl.constexpr, EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, ONE_DOT: tl.constexpr,
    ROW_WEIGHT: tl.constexpr,
):
    """Block b of BLOCK_M routed rows, all for expert ``expert[b]`` (>= num_experts: an empty block):
    y[row] = x[row // ROW_DIV] @ W_e^T for the rows ``ids[b * BLOCK_M:]`` (-1: padding)."""
    b = tl.program_id(1)
    e = tl.load(expert_ptr + b)
    if e < num_experts:
        ri = tl.arange(0, 16)
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        ids = tl.load(ids_ptr + b * BLOCK_M + tl.arange(0, BLOCK_M))
        n_ok, m_ok = rn < N, ids >= 0
        x_rows = tl.where(m_ok, ids // ROW_DIV, 0).to(tl.int64)
        w_rows = w_ptr + e.to(tl.int64) * stride_we + rn.to(tl.int64)[:, None] * stride_wn
        s_rows = s_ptr + e.to(tl.int64) * stride_se + rn.to(tl.int64) * stride_sn
        x_cols = x_ptr + x_rows[None, :] * stride_xm + (16 * (ri // 4) + ri % 4)[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for c in tl.range(0, n_chunks, loop_unroll_factor=CHUNKS):
            acc = _chunk(acc, w_rows, s_rows, x_cols, c, stride_wp, stride_sp, K, n_ok, m_ok, BLOCK_N, DECODE, EVEN_N,
                         EVEN_K, ONE_DOT)
        g = tl.load(g_ptr + e.to(tl.int64) * stride_ge + rn, mask=n_ok, other=0.0)
        acc = acc * g[:, None]
        if ROW_WEIGHT:  # the routing weight of each routed row (vLLM's MUL_ROUTED_WEIGHT)
            acc = acc * tl.load(rw_ptr + tl.where(m_ok, ids, 0), mask=m_ok, other=0.0).to(tl.float32)[None, :]
        y_at = y_ptr + tl.where(m_ok, ids, 0).to(tl.int64)[None, :] * stride_ym + rn[:, None]
        tl.store(y_at, acc.to(y_ptr.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


def w4a16_grouped_matmul(x: torch.Tensor, weight: W4A16Weight, ids: torch.Tensor, block_expert: torch.Tensor,
                         block_m: int, rows_per_x: int, out: torch.Tensor,
                         row_weight: torch.Tensor | None = None) -> torch.Tensor:
    """Routed experts: ``out[r] = x[r // rows_per_x] @ W_e^T`` for every row r listed in ``ids``
    (int32, blocks of ``block_m`` rows of one expert each, -1 padding; ``block_expert`` int32 the
    expert of each block, ``E`` for an empty one; ``moe_align`` in ``layers/moe.py`` makes
    both on the device). ``weight`` stacks E experts; ``out`` [rows, N] in x's dtype; rows not
    listed are left as they are; ``row_weight`` (one per routed row) multiplies each row's fp32
    result last. One launch, no host sync: graph-capturable."""
    k, n = weight.in_features, weight.out_features
    num_experts = weight.codes.shape[0]
    if weight.codes.dim() != 4 or x.shape[-1] != k or x.dim() != 2:
        raise ValueError(f"w4a16_grouped_matmul: x {tuple(x.shape)} and stacked experts {tuple(weight.codes.shape)} "
                         f"(in_features {k}) do not match")
    check_routed_rows("w4a16_grouped_matmul", ids, block_expert, block_m, out, n, x.dtype, row_weight)
    if x.stride(-1) != 1:
        x = x.contiguous()
    if block_expert.numel() == 0:
        return out
    block_n = 128 if n >= 128 else 64 if n >= 64 else 16
    grid = (triton.cdiv(n, block_n), block_expert.numel())
    _w4a16_grouped_kernel[grid](
        x, weight.codes, weight.scales, weight.row_scale, out, ids, block_expert,
        out if row_weight is None else row_weight, n, k, triton.cdiv(k, CHUNK), num_experts,
        x.stride(0), weight.codes.stride(0), weight.codes.stride(1), weight.codes.stride(2), weight.scales.stride(0),
        weight.scales.stride(1), weight.scales.stride(2), weight.row_scale.stride(0), out.stride(0),
        ROW_DIV=rows_per_x, BLOCK_N=block_n, BLOCK_M=block_m, CHUNKS=2, DECODE=_decode_mode(x),
        EVEN_N=n % block_n == 0, EVEN_K=k % CHUNK == 0, ONE_DOT=False, ROW_WEIGHT=row_weight is not None,
        num_warps=4 if block_m <= 32 else 8, num_stages=3,
    )
    return out
