"""W4A16 GEMM for decode batches (Gluon, CUDA): ``y = x @ W^T`` (``w4a16_linear`` gives it up to
``max_rows`` rows of x: 64, 256 on sm_90), the NVFP4 weight decoded straight into tensor-core
fragments in registers.

The Triton kernel (``triton_w4a16``) stages W through shared memory: the compiler copies each chunk
there (cp.async) and reads it back in the MMA's register layout, and x goes to shared memory and
back twice, with a barrier a chunk. Gluon states the layouts, so here the weights never touch
shared memory: each thread loads, with 16-byte loads, exactly the code words its ``mma.sync``
fragments need, decodes them in registers (the same PTX as the Triton kernel) and multiplies. Its
activations come from global memory the same way, or (``GluonTiles.x_smem``) from a shared copy of
x made by cp.async one or more pairs ahead, one for all warps (a buffer a stage: one CTA barrier a pair).

**Register prefetch**: ``GluonTiles.prefetch`` + 1 register buffers; a buffer is refilled with the
pair ``prefetch`` + 1 ahead right after its pair is multiplied, and the loop body takes one pair a
buffer, so no buffer is ever copied to other registers. (The rotation ``now, next = next, load()``
compiled to register copies at the back edge, and a copy of a load's target waits for the load: on
the H200 every pair waited for its successor's weights, ~1 us a pair, whatever the depth.)

**Why the layout fits** (``triton_w4a16`` module docstring has the word format): the A fragment of
an m16n8k16 MMA gives thread ``q = lane % 4`` the columns ``2q, 2q + 1, 2q + 8, 2q + 9`` of its two
rows, and the B fragment gives it the same four k of its batch row. A pair's word ``8q + 4cc + 2h
+ e`` holds features ``16q + 4j + 2h + e`` of chunk ``cc`` (j = 0..3), so thread q's words of a row
are 16 contiguous bytes (both chunks), its activations of a chunk are the 16 contiguous features
``16q ..``, and all of them share one block scale (group q). The MMA's k order is a permutation of
the features: column ``8h + 2q + e`` of step j is feature ``16q + 4j + 2h + e``, for W and x alike,
so the product is the same sum.

**Schedule**: stream-K as the Triton kernel (its docstring): the (tile, pair) units are split
evenly over one wave of programs, partial tiles summed in program order by the tile's last program
(four, two or one parts loaded at once). Or split-K (``GluonTiles.split``): S programs a tile, none
crossing a tile, the same fix-up over S parts. Tiles are numbered batch tile fastest, so the batch
tiles of one block of weight rows run side by side and share its bytes through the L2.

**Warpgroup MMAs** (``GluonTiles.wgmma``, sm_90; the default from 33 rows there): the decoded
weights are the register A operand of K = 64 wgmmas, x the B operand in shared memory in the MMA's
k order (``mma_order`` on the host, or the kernel's own 4-byte copies: ``x_gather``), ``x_stages``
pairs of it in flight; a pair's second chunk is decoded while the first chunk's wgmma runs. With
``mma_overlap`` (the default from 65 rows) a pair's second wgmma runs on into the next pair.

**Programmatic dependent launch** (``GluonTiles.pdl``, sm_90; the default there): the kernel lets the
next one in the stream launch at once, and a tile's first weights (which no earlier kernel writes)
are loaded before ``griddepcontrol.wait``; x, y, the parts and the counters only after.

**Eviction policy** (``GluonTiles.w_eviction_policy``): the weights are read once and x many times,
so on sm_90 the default tiles of up to 8 and from 33 rows load the weights ``evict_first`` (a hint
to L1 and L2). The gain comes mostly from L2's side: loading them ``.cg`` (past L1 only) gained 0-2%.

CUDA only (``mma.sync`` needs sm_80; the inline PTX is the Triton kernel's). No interpreter: the
Triton kernel is this kernel's CPU counterpart, and tests/test_gluon_w4a16.py holds this one to the
float64 bound on a GPU (and compiles it for sm_90 on the CPU).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton

from kvserve.kernels import triton_w4a16 as tw
from kvserve.kernels.triton_store import num_sms

try:  # (triton >= 3.4)
    from triton.experimental import gluon
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.ampere import async_copy, mma_v2
    from triton.experimental.gluon.language.nvidia.hopper import fence_async_shared, warpgroup_mma, warpgroup_mma_wait
    _cta_barrier = getattr(gl, "thread_barrier", None) or gl.barrier  # (triton 3.6: thread_barrier; 3.9: barrier)
    _cp_async = getattr(async_copy, "async_load", None) or async_copy.async_copy_global_to_shared  # (3.9 / 3.6)
except (ImportError, AttributeError):  # pragma: no cover (a triton without Gluon, or another Gluon API)
    gluon = gl = async_copy = mma_v2 = _cta_barrier = _cp_async = None
    fence_async_shared = warpgroup_mma = warpgroup_mma_wait = None

MAX_M = 64  # batch rows w4a16_linear gives it before sm_90 (H200 at 64: 1.03-1.09x cuBLAS, Triton 0.72-0.83x)
MAX_M_WGMMA = 256  # on sm_90, the wgmma tiles (H200, 128 / 256 rows: 1.8-2.1x / 1.15x the paths before)


@functools.lru_cache(maxsize=None)
def available(device: torch.device) -> bool:
    """Whether this kernel runs on ``device``: CUDA with sm_80+ and a triton with Gluon."""
    return (gluon is not None and device.type == "cuda"
            and torch.cuda.get_device_capability(device) >= (8, 0))


@functools.lru_cache(maxsize=None)
def wgmma_available(device: torch.device) -> bool:
    """Whether ``GluonTiles.wgmma`` runs on ``device``: sm_90 (warpgroup MMAs are sm_90a only)."""
    return available(device) and torch.cuda.get_device_capability(device) == (9, 0)


@dataclass(frozen=True)
class GluonTiles:
    """Output rows x batch rows of a program's accumulator, warps (16 rows each per MMA step),
    programs per SM (None or 0: as many as fit, from the compiled kernel's registers), and how K is
    split over programs: ``split`` None = stream-K over one wave (a program's range may cross tiles);
    S >= 1 = S programs a tile, each a contiguous run of its pairs (split-K: no program crosses a tile,
    1 = no partial sums at all); 0 = the largest S whose programs fit in one wave."""

    block_n: int = 64
    block_m: int = 8
    num_warps: int = 4
    programs_per_sm: int | None = None
    prefetch: int = 1  # pairs of chunks whose weights are loaded ahead of the one multiplied (1-3)
    x_smem: bool = False  # x through shared memory (cp.async x_stages - 1 pairs ahead, one copy for all warps;
    # K % 128 == 0): x_stages = prefetch + 1 buffers, one CTA barrier a pair; or 2 stages of one buffer, two
    split: int | None = None
    wgmma: bool = False  # sm_90 warpgroup MMAs (K = 64, x permuted by ``mma_order`` as B in shared memory)
    x_stages: int = 3  # with wgmma (2-4) or x_smem (2 or prefetch + 1): pairs of x in shared memory
    # with wgmma and x_stages >= 3: a pair's second wgmma runs on while the next pair's first chunk is
    # decoded and multiplied (x copies then x_stages - 2 pairs ahead)
    mma_overlap: bool = False
    x_gather: bool = False  # with wgmma and K % 128 == 0: x put in MMA order by the kernel's 4-byte copies
    pdl: bool = False  # programmatic dependent launch (sm_90): weights loaded before waiting for the last kernel
    maxnreg: int | None = None  # registers a thread at most (ptxas): fewer than it picks, more programs an SM
    # the weights' loads' eviction policy (gl.load's: "", "evict_first", "evict_last"): the codes are read once,
    # x and the partial tiles many times (evict_first: the H200's defaults up to 8 rows and from 33)
    w_eviction_policy: str = ""


def default_tiles(m: int, sm90: bool = False) -> GluonTiles:
    """The launch tiles for ``m`` batch rows (up to ``max_rows``): the accumulator as narrow as the
    batch allows, with the output rows, warps, prefetch depth, x staging and K split of the fastest
    tiles over the 27B's MLP shapes together in the H200 sweeps (benchmarks/RESULTS.md). Up to batch
    8: 64 rows x 4 warps, three pairs in flight, split-K filling one wave; at 16, 64 x 4 warps, two pairs
    in flight, x through shared memory in a buffer a stage (one CTA barrier a pair), stream-K; at 32,
    128 x 4 warps, the same (the 2026-12-04 sweep: 16 rows down 25.6 -> 23.2 us, the c32 step -0.3%);
    at 64, 64 x 4 warps, two in flight, x through shared memory (a3b7df4). On sm_90 (``sm90``) these
    launch with programmatic dependent launch, and from 33 rows the warpgroup-MMA tiles take over:
    64 x 64 x 4 warps up to 64 rows, 128 x 128 x 8 warps (one or two batch tiles) with each pair's
    second wgmma left running into the next pair up to 256 (the 2026-12-03 sweeps of 822c4e9 and
    2e5674d), also with programmatic dependent launch; and there the weights' cache lines are evicted
    first up to 8 rows and from 33 (the GEMM 8-10% faster at batch 8, 2-8% at 64-256; at 9-32 rows it
    was even or slower, and the 27B's decode step at c16 1.8% slower: benchmarks/RESULTS.md)."""
    evict = "evict_first" if sm90 else ""  # (measured on the H200 only)
    if sm90 and m > 32:
        if m <= 64:
            return GluonTiles(64, 64, 4, prefetch=2, wgmma=True, x_stages=3, pdl=True, w_eviction_policy=evict)
        return GluonTiles(128, 128, 8, prefetch=2, wgmma=True, x_stages=3, mma_overlap=True, pdl=True,
                          w_eviction_policy=evict)
    if m <= 8:
        return GluonTiles(64, 8, 4, prefetch=3, split=0, pdl=sm90, w_eviction_policy=evict)
    if m <= 16:
        return GluonTiles(64, 16, 4, prefetch=2, x_smem=True, x_stages=3, pdl=sm90)
    if m <= 32:
        return GluonTiles(128, 32, 4, prefetch=2, x_smem=True, x_stages=3, pdl=sm90)
    return GluonTiles(64, 64, 4, prefetch=2, x_smem=True, x_stages=2)


def max_rows(device: torch.device, dtype: torch.dtype) -> int:
    """The most batch rows of ``dtype`` that ``w4a16_linear`` gives this kernel on ``device`` (0: it
    does not run there): ``MAX_M_WGMMA`` on sm_90, else ``MAX_M``; bf16 and fp16 only."""
    if dtype not in (torch.bfloat16, torch.float16):
        return 0
    return MAX_M_WGMMA if wgmma_available(device) else MAX_M if available(device) else 0


def _bits(n: int) -> list[int]:
    return [1 << i for i in range(n.bit_length() - 1)]


@functools.lru_cache(maxsize=None)
def _layouts(block_n: int, block_m: int, num_warps: int) -> tuple:
    """The register layouts (each as the linear map from register, lane and warp bits to tensor
    coordinates) of: a pair's codes [BN, 4 q, 4 (cc, h)] int32, its scales [BN, 4 q] (2 bytes: cc),
    one chunk's codes [BN, 4 q, 2 h, 2 e] int16, and a chunk's activations [4 q, 16 f, BM]. Each
    matches the MMA fragments (A: rows ``t / 4 + 8 b + 16 w``, columns from q; B: k from q, the batch
    row from ``t / 4``) up to the order of a thread's registers."""
    reps = block_n // (16 * num_warps)
    rows = [[8, 0, 0]] + [[16 * num_warps * b, 0, 0] for b in _bits(reps)]
    warps = [[16 * b, 0, 0] for b in _bits(num_warps)]
    lanes = [[0, 1, 0], [0, 2, 0], [1, 0, 0], [2, 0, 0], [4, 0, 0]]
    pair = gl.DistributedLinearLayout(reg_bases=[[0, 0, 1], [0, 0, 2]] + rows, lane_bases=lanes,
                                      warp_bases=warps, block_bases=[], shape=[block_n, 4, 4])
    scales = gl.DistributedLinearLayout(reg_bases=[r[:2] for r in rows], lane_bases=[v[:2] for v in lanes],
                                        warp_bases=[v[:2] for v in warps], block_bases=[], shape=[block_n, 4])
    four = lambda v: [v[0], v[1], 0, 0]  # noqa: E731
    chunk = gl.DistributedLinearLayout(reg_bases=[[0, 0, 0, 1], [0, 0, 1, 0]] + [four(r) for r in rows],
                                       lane_bases=[four(v) for v in lanes], warp_bases=[four(v) for v in warps],
                                       block_bases=[], shape=[block_n, 4, 2, 2])
    acts = gl.DistributedLinearLayout(
        reg_bases=[[0, 1, 0], [0, 2, 0], [0, 4, 0], [0, 8, 0]] + [[0, 0, 8 * b] for b in _bits(block_m // 8)],
        lane_bases=[[1, 0, 0], [2, 0, 0], [0, 0, 1], [0, 0, 2], [0, 0, 4]],
        warp_bases=[[0, 0, 0]] * len(_bits(num_warps)), block_bases=[], shape=[4, 16, block_m])
    return pair, scales, chunk, acts


def mma_order(x2: torch.Tensor, n_pairs: int) -> torch.Tensor:
    """x [M, K] -> [M, 128 n_pairs] (zeros past K) with each chunk of 64 features in the MMA's k order:
    position 16 j + 8 h + 2 q + e holds feature 16 q + 4 j + 2 h + e (the wgmma path's B operand)."""
    m, k = x2.shape
    if k != 128 * n_pairs:
        x2 = torch.nn.functional.pad(x2, (0, 128 * n_pairs - k))
    return x2.reshape(m, 2 * n_pairs, 4, 4, 2, 2).permute(0, 1, 3, 4, 2, 5).reshape(m, 128 * n_pairs)


@functools.lru_cache(maxsize=None)
def _x_smem_layouts(block_m: int, num_warps: int) -> tuple:
    """With ``x_smem``: the copy layout of a pair of x [BM, 128] (16 bytes a thread) and the register
    layout of a chunk [BM, 64] read back, ACT_L's registers with (m, 16 q + f) coordinates."""
    copy = gl.BlockedLayout([1, 8], [2, 16], [num_warps, 1], [1, 0])
    read = gl.DistributedLinearLayout(
        reg_bases=[[0, 1], [0, 2], [0, 4], [0, 8]] + [[8 * b, 0] for b in _bits(block_m // 8)],
        lane_bases=[[0, 16], [0, 32], [1, 0], [2, 0], [4, 0]],
        warp_bases=[[0, 0]] * len(_bits(num_warps)), block_bases=[], shape=[block_m, 64])
    return copy, read


def _x_chunk_copy_layout(num_warps: int, gather: bool = False):
    """With wgmma: the copy layout of a chunk of x [BM, 64] in MMA order: 16 bytes a thread, 4 x
    num_warps rows a step, from the permuted copy; 4 bytes, num_warps rows a step, gathered from x."""
    if gather:
        return gl.BlockedLayout([1, 2], [1, 32], [num_warps, 1], [1, 0])
    return gl.BlockedLayout([1, 8], [4, 8], [num_warps, 1], [1, 0])


if gluon is not None:
    _DECODE_BF16 = tw._DECODE_BF16
    _DECODE_FP16 = tw._DECODE_FP16
    _PAIR_SCALES_BF16 = gl.constexpr(tw._scales_text(True, 2))  # a thread's group in both chunks of a pair
    _PAIR_SCALES_FP16 = gl.constexpr(tw._scales_text(False, 2))

    @gluon.jit
    def _load_x(x_cols, x_feat, k0, K, EVEN_K: gl.constexpr):
        """A chunk's activations [4 q, 16 f, BM] from feature k0 (zeros past K)."""
        if EVEN_K:
            return gl.load(x_cols + k0)
        return gl.load(x_cols + k0, mask=x_feat + k0 < K, other=0.0)

    @gluon.jit
    def _steps_of_x(x, BLOCK_M: gl.constexpr, B: gl.constexpr):
        """A chunk's activations [4 q, 16 f, BM] (feature 16q + f, f = 4j + 2h + e) -> the B operands
        of its four k16 steps, column 8h + 2q + e."""
        x = gl.permute(gl.reshape(x, [4, 2, 2, 2, 2, BLOCK_M]), [0, 3, 4, 5, 1, 2])  # [q, h, e, m, j1, j0]
        even, odd = gl.split(x)
        x0, x2 = gl.split(even)
        x1, x3 = gl.split(odd)
        x0 = gl.convert_layout(gl.reshape(gl.permute(x0, [1, 0, 2, 3]), [16, BLOCK_M]), B)
        x1 = gl.convert_layout(gl.reshape(gl.permute(x1, [1, 0, 2, 3]), [16, BLOCK_M]), B)
        x2 = gl.convert_layout(gl.reshape(gl.permute(x2, [1, 0, 2, 3]), [16, BLOCK_M]), B)
        x3 = gl.convert_layout(gl.reshape(gl.permute(x3, [1, 0, 2, 3]), [16, BLOCK_M]), B)
        return x0, x1, x2, x3

    @gluon.jit
    def _step_cols(w_j, BLOCK_N: gl.constexpr):
        """Step j's decoded weights [BN, 4 q, 2 h, 2 e] -> [BN, 16], column 8h + 2q + e (the MMA's k)."""
        return gl.reshape(gl.permute(w_j, [0, 2, 1, 3]), [BLOCK_N, 16])

    @gluon.jit
    def _operand(w_j, BLOCK_N: gl.constexpr, A: gl.constexpr):
        """Step j's decoded weights [BN, 4 q, 2 h, 2 e] -> the A operand of one k16 MMA."""
        return gl.convert_layout(_step_cols(w_j, BLOCK_N), A)

    @gluon.jit
    def _chunk_operand(w, s, FP16: gl.constexpr, CHUNK_L: gl.constexpr, BLOCK_N: gl.constexpr, A: gl.constexpr):
        """A chunk's codes and scale pairs -> the A operand [BN, 64] of one K = 64 wgmma, column 16 j + 8 h
        + 2 q + e (x is permuted to the same order, ``mma_order``)."""
        w0, w1, w2, w3 = _decode_chunk(w, s, FP16, CHUNK_L)
        j01 = gl.join(_step_cols(w0, BLOCK_N), _step_cols(w1, BLOCK_N))  # [BN, 16 c, 2 j0]
        j23 = gl.join(_step_cols(w2, BLOCK_N), _step_cols(w3, BLOCK_N))
        a = gl.permute(gl.join(j01, j23), [0, 3, 2, 1])  # [BN, j1, j0, c]
        return gl.convert_layout(gl.reshape(a, [BLOCK_N, 64]), A)

    @gluon.jit
    def _decode_chunk(w, s, FP16: gl.constexpr, CHUNK_L: gl.constexpr):
        """A chunk's codes [BN, 4, 2, 2] int16 and scale pairs [BN, 4] -> its four k16 steps' weights."""
        w = gl.convert_layout(w, CHUNK_L)
        s = gl.convert_layout(s, gl.SliceLayout(2, gl.SliceLayout(3, CHUNK_L)))
        s = gl.expand_dims(gl.expand_dims(s, 2), 3).broadcast_to(w.shape)
        if FP16:
            w0, w1, w2, w3 = gl.inline_asm_elementwise(
                _DECODE_FP16, "=r,=r,=r,=r,r,r,r", [w, s], dtype=(gl.float16, gl.float16, gl.float16, gl.float16),
                is_pure=True, pack=2)
        else:
            w0, w1, w2, w3 = gl.inline_asm_elementwise(
                _DECODE_BF16, "=r,=r,=r,=r,r,r,r", [w, s],
                dtype=(gl.bfloat16, gl.bfloat16, gl.bfloat16, gl.bfloat16), is_pure=True, pack=2)
        return w0, w1, w2, w3

    @gluon.jit
    def _chunk_mma(acc, w, s, x, FP16: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
                   CHUNK_L: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
        """acc += one chunk: codes [BN, 4, 2, 2] int16, their scale pairs [BN, 4], activations [4, 16, BM]."""
        w0, w1, w2, w3 = _decode_chunk(w, s, FP16, CHUNK_L)
        x0, x1, x2, x3 = _steps_of_x(x, BLOCK_M, B)
        acc = mma_v2(_operand(w0, BLOCK_N, A), x0, acc)
        acc = mma_v2(_operand(w1, BLOCK_N, A), x1, acc)
        acc = mma_v2(_operand(w2, BLOCK_N, A), x2, acc)
        acc = mma_v2(_operand(w3, BLOCK_N, A), x3, acc)
        return acc

    @gluon.jit
    def _smem_x(stage, f0, BLOCK_M: gl.constexpr, XS_L: gl.constexpr, ACT_L: gl.constexpr):
        """A chunk's activations [4 q, 16 f, BM] from a shared-memory stage [BM, 128], features f0 .."""
        xs = stage.slice(f0, 64, dim=1).load(XS_L)  # [BM, 64]: ACT_L's registers, in (m, 16 q + f) order
        return gl.convert_layout(gl.reshape(gl.permute(xs, [1, 0]), [4, 16, BLOCK_M]), ACT_L)

    @gluon.jit
    def _copy_x(dst, x_from, k0):
        """cp.async the pair of x [BM, 128] from feature k0 into ``dst`` (K a multiple of 128), one group."""
        _cp_async(dst, x_from + k0)
        async_copy.commit_group()

    @gluon.jit
    def _split_pair(w, s, FP16: gl.constexpr, BLOCK_N: gl.constexpr):
        """A pair's codes [BN, 4 q, 4 words] int32 and scales [BN, 4 q] int16 -> each chunk's codes
        [BN, 4, 2, 2] int16 and scale pairs (the decode's scale operands)."""
        w16 = gl.join((w & 0xFFFF).to(gl.int16), (w >> 16).to(gl.int16))  # [BN, 4, (cc, h), e]
        w0, w1 = gl.split(gl.permute(gl.reshape(w16, [BLOCK_N, 4, 2, 2, 2]), [0, 1, 3, 4, 2]))
        if FP16:
            s0, s1 = gl.inline_asm_elementwise(_PAIR_SCALES_FP16, "=r,=r,r", [s.to(gl.int32) & 0xFFFF],
                                               dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        else:
            s0, s1 = gl.inline_asm_elementwise(_PAIR_SCALES_BF16, "=r,=r,r", [s.to(gl.int32) & 0xFFFF],
                                               dtype=(gl.int32, gl.int32), is_pure=True, pack=1)
        return w0, s0, w1, s1

    @gluon.jit
    def _pair_mma(acc, w, s, xa, xb, FP16: gl.constexpr, A: gl.constexpr, B: gl.constexpr,
                  CHUNK_L: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr):
        """acc += one pair: codes [BN, 4 q, 4 words] int32, scales [BN, 4 q] int16, each chunk's activations."""
        w0, s0, w1, s1 = _split_pair(w, s, FP16, BLOCK_N)
        acc = _chunk_mma(acc, w0, s0, xa, FP16, A, B, CHUNK_L, BLOCK_N, BLOCK_M)
        return _chunk_mma(acc, w1, s1, xb, FP16, A, B, CHUNK_L, BLOCK_N, BLOCK_M)

    @gluon.jit
    def _load_w(w_rows, s_rows, pair, p_last, stride_wp, stride_sp, W_EP: gl.constexpr):
        """A pair's codes and scales (pair clamped to p_last: past the range, a harmless reload), loaded
        with the eviction policy W_EP (``GluonTiles.w_eviction_policy``)."""
        at = gl.minimum(pair, p_last)
        return (gl.load(w_rows + at * stride_wp, eviction_policy=W_EP),
                gl.load(s_rows + at * stride_sp, eviction_policy=W_EP))

    @gluon.jit
    def _first_pairs(w_rows, s_rows, p_begin, p_last, stride_wp, stride_sp, D: gl.constexpr, W_EP: gl.constexpr):
        """The first D (2-4) pairs' codes and scales of a range (the unused last buffers repeat the second)."""
        w0, s0 = _load_w(w_rows, s_rows, p_begin, p_last, stride_wp, stride_sp, W_EP)
        w1, s1 = _load_w(w_rows, s_rows, p_begin + 1, p_last, stride_wp, stride_sp, W_EP)
        w2, s2 = w1, s1
        w3, s3 = w1, s1
        if D >= 3:
            w2, s2 = _load_w(w_rows, s_rows, p_begin + 2, p_last, stride_wp, stride_sp, W_EP)
        if D >= 4:
            w3, s3 = _load_w(w_rows, s_rows, p_begin + 3, p_last, stride_wp, stride_sp, W_EP)
        return w0, s0, w1, s1, w2, s2, w3, s3

    @gluon.jit
    def _grid_dependency(WAIT: gl.constexpr):
        """griddepcontrol (sm_90 programmatic dependent launch): WAIT for the previous kernel in the stream
        to finish and its writes to be visible, else let the next kernel launch (no-ops without PDL)."""
        if WAIT:
            gl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=gl.int32, is_pure=False, pack=1)
        else:
            gl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=gl.int32,
                                      is_pure=False, pack=1)

    @gluon.jit
    def _copy_x_chunks(x_smem, stage, x_from, k0):
        """cp.async the pair of permuted x from feature k0 into ``stage`` (its chunks: buffers 2 stage
        and 2 stage + 1, [BM, 64] each), one group."""
        _cp_async(x_smem.index(2 * stage), x_from + k0)
        _cp_async(x_smem.index(2 * stage + 1), x_from + (k0 + 64))
        async_copy.commit_group()

    @gluon.jit
    def _pair_wgmma(acc, a_prev, w, s, pair, p_begin, p_end, x_from, x_smem, X_STAGES: gl.constexpr,
                    OVERLAP: gl.constexpr, FP16: gl.constexpr, A: gl.constexpr, CHUNK_L: gl.constexpr,
                    BLOCK_N: gl.constexpr):
        """acc += pair ``pair`` by two K = 64 wgmmas: A the weights decoded in registers, B this pair's
        stage of permuted x in shared memory (copied AHEAD pairs ago; the copy AHEAD pairs ahead starts
        here, into the stage the pair AHEAD - X_STAGES ago read). The first chunk is decoded while the
        copy is awaited, the second while the first chunk's wgmma runs. Without OVERLAP (AHEAD =
        X_STAGES - 1) both wgmmas are awaited here; with it (AHEAD = X_STAGES - 2) the second runs on
        into the next pair and is awaited there, after that pair's first wgmma is issued (``a_prev``:
        its A operand, kept alive until then). Returns (acc, a_prev)."""
        AHEAD: gl.constexpr = X_STAGES - 2 if OVERLAP else X_STAGES - 1
        w0, s0, w1, s1 = _split_pair(w, s, FP16, BLOCK_N)
        a0 = _chunk_operand(w0, s0, FP16, CHUNK_L, BLOCK_N, A)
        stage = (pair - p_begin) % X_STAGES
        async_copy.wait_group(AHEAD - 1)  # this pair's copy has landed, for this thread
        fence_async_shared()  # (the copy's generic-proxy writes before the wgmma's async-proxy reads)
        _cta_barrier()  # ... for every thread; and every warpgroup is done with the stage copied next
        _copy_x_chunks(x_smem, (stage + AHEAD) % X_STAGES, x_from, gl.minimum(pair + AHEAD, p_end - 1) * 128)
        acc = warpgroup_mma(a0, x_smem.index(2 * stage).permute((1, 0)), acc, is_async=True)
        if OVERLAP:
            acc, a_prev = warpgroup_mma_wait(1, deps=[acc, a_prev])  # the last pair's second wgmma is done
        a1 = _chunk_operand(w1, s1, FP16, CHUNK_L, BLOCK_N, A)
        acc = warpgroup_mma(a1, x_smem.index(2 * stage + 1).permute((1, 0)), acc, is_async=True)
        if OVERLAP:
            acc, a0 = warpgroup_mma_wait(1, deps=[acc, a0])  # this pair's first; its second runs on
            a_prev = a1
        else:
            acc = warpgroup_mma_wait(0, deps=[acc])
        return acc, a_prev

    @gluon.jit
    def _pair_step(acc, a_prev, w, s, pair, p_begin, p_end, x_cols, x_feat, x_from, x_smem, K, EVEN_K: gl.constexpr,
                   X_SMEM: gl.constexpr, WGMMA: gl.constexpr, X_STAGES: gl.constexpr, OVERLAP: gl.constexpr,
                   PREFETCH: gl.constexpr, SLOT: gl.constexpr, FP16: gl.constexpr,
                   A: gl.constexpr, B: gl.constexpr, CHUNK_L: gl.constexpr, BLOCK_N: gl.constexpr,
                   BLOCK_M: gl.constexpr, XS_L: gl.constexpr, ACT_L: gl.constexpr):
        """acc += pair ``pair`` (codes w, scales s already in registers), its x from global memory or,
        with X_SMEM, from the stage copied X_STAGES - 1 pairs ago (a buffer a stage) or a pair ago (two
        stages of one buffer), the copy that many pairs ahead started here; with WGMMA
        by ``_pair_wgmma`` (``a_prev``: see there; passed through otherwise). SLOT: the pair's place in the
        loop body (pair - p_begin = (PREFETCH + 1) j + SLOT). Returns (acc, a_prev)."""
        if WGMMA:
            acc, a_prev = _pair_wgmma(acc, a_prev, w, s, pair, p_begin, p_end, x_from, x_smem, X_STAGES, OVERLAP,
                                      FP16, A, CHUNK_L, BLOCK_N)
        else:
            if X_SMEM:
                if X_STAGES == PREFETCH + 1:  # a buffer a stage, the loop body's pair k reading buffer k
                    async_copy.wait_group(X_STAGES - 2)  # this pair's copy has landed, for this thread
                    _cta_barrier()  # ... for every thread; and every warp is done with the last pair's buffer
                    _copy_x(x_smem[(SLOT + X_STAGES - 1) % X_STAGES], x_from,
                            gl.minimum(pair + X_STAGES - 1, p_end - 1) * 128)
                    stage_x = x_smem[SLOT]
                else:  # two stages of one buffer
                    stage = (pair - p_begin) % 2
                    _cta_barrier()  # every warp has read the stage the next copy overwrites
                    _copy_x(x_smem.index(1 - stage), x_from, gl.minimum(pair + 1, p_end - 1) * 128)
                    async_copy.wait_group(1)  # this pair's copy (the one before) has landed, for this thread
                    _cta_barrier()  # ... and for every thread
                    stage_x = x_smem.index(stage)
                xa = _smem_x(stage_x, 0, BLOCK_M, XS_L, ACT_L)
                xb = _smem_x(stage_x, 64, BLOCK_M, XS_L, ACT_L)
            else:
                xa = _load_x(x_cols, x_feat, pair * 128, K, EVEN_K)
                xb = _load_x(x_cols, x_feat, pair * 128 + 64, K, EVEN_K)
            acc = _pair_mma(acc, w, s, xa, xb, FP16, A, B, CHUNK_L, BLOCK_N, BLOCK_M)
        return acc, a_prev

    @gluon.constexpr_function
    def _fixup_width(block_n, block_m, num_warps):
        """Parts the fix-up loads at once: 4, 2 or 1, so that they hold at most 32 fp32 registers a thread."""
        per_thread = block_n * block_m // (32 * num_warps)
        return 4 if per_thread <= 8 else 2 if per_thread <= 16 else 1

    @gluon.jit
    def _part_of(q, q_last, tile, units, programs, n_pairs, part_ptr, part_at, TILE: gl.constexpr):
        """Program q's partial of ``tile`` (its slot 0 if the tile is where it starts, else 1), 0 past
        q_last (the load clamped to q_last's, so always in bounds)."""
        q_in = gl.minimum(q, q_last)
        q_lo = (q_in * units // programs).to(gl.int32)
        q_slot = q_in * 2 + 1 - (q_lo // n_pairs == tile).to(gl.int64)
        part = gl.load(part_ptr + q_slot * TILE + part_at, cache_modifier=".cg")
        return gl.where(q <= q_last, part, 0.0)

    @gluon.jit
    def _finish_tile(acc, g_ptr, y_ptr, part_ptr, lock_ptr, M, N, n0, m0, p, first, tile, p_begin, p_end, n_pairs,
                     units, programs, stride_ym, BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr,
                     NUM_WARPS: gl.constexpr, ACC_L: gl.constexpr):
        """Store a tile's accumulator [BN, BM] (layout ACC_L) times the row scales as y^T, or, for a part
        of the tile (pairs [p_begin, p_end) of n_pairs), write it to program p's slot (0 if it is the
        program's first unit, else 1); the tile's last program to arrive sums the parts in program order
        (see triton_w4a16._w4a16_kernel) and stores the tile."""
        on = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, ACC_L))
        om = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, ACC_L))
        rn = n0 + on
        rm = m0 + om
        y_ok = gl.expand_dims(rn < N, 1) & gl.expand_dims(rm < M, 0)
        g = gl.load(g_ptr + gl.minimum(rn, N - 1))
        y_at = y_ptr + gl.expand_dims(rm.to(gl.int64) * stride_ym, 0) + gl.expand_dims(rn, 1)
        if p_begin == 0 and p_end == n_pairs:  # the whole tile
            gl.store(y_at, (acc * gl.expand_dims(g, 1)).to(y_ptr.dtype.element_ty), mask=y_ok)
        else:
            part_at = gl.expand_dims(on, 1) * BLOCK_M + gl.expand_dims(om, 0)
            slot = part_ptr + (p * 2 + 1 - first.to(gl.int32)).to(gl.int64) * (BLOCK_N * BLOCK_M) + part_at
            gl.store(slot, acc)
            _cta_barrier()
            t_lo, t_hi = tile * n_pairs, tile * n_pairs + n_pairs
            q_first = ((t_lo + 1).to(gl.int64) * programs + units - 1) // units - 1
            q_last = (t_hi.to(gl.int64) * programs + units - 1) // units - 1
            arrived = gl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
            if arrived == q_last - q_first:
                total = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, ACC_L)
                FIX: gl.constexpr = _fixup_width(BLOCK_N, BLOCK_M, NUM_WARPS)
                for q in range(q_first, q_last + 1, FIX):  # FIX parts' loads in flight at once, summed in order
                    part_0 = _part_of(q, q_last, tile, units, programs, n_pairs, part_ptr, part_at,
                                      BLOCK_N * BLOCK_M)
                    if FIX >= 2:
                        part_1 = _part_of(q + 1, q_last, tile, units, programs, n_pairs, part_ptr, part_at,
                                          BLOCK_N * BLOCK_M)
                    if FIX >= 4:
                        part_2 = _part_of(q + 2, q_last, tile, units, programs, n_pairs, part_ptr, part_at,
                                          BLOCK_N * BLOCK_M)
                        part_3 = _part_of(q + 3, q_last, tile, units, programs, n_pairs, part_ptr, part_at,
                                          BLOCK_N * BLOCK_M)
                    total += part_0
                    if FIX >= 2:
                        total += part_1
                    if FIX >= 4:
                        total += part_2
                        total += part_3
                gl.atomic_xchg(lock_ptr + tile, 0)
                gl.store(y_at, (total * gl.expand_dims(g, 1)).to(y_ptr.dtype.element_ty), mask=y_ok)

    @gluon.jit(do_not_specialize=["M", "N", "K", "n_pairs", "tiles_m", "units", "programs"])
    def _w4a16_mma_kernel(
        x_ptr, w_ptr, s_ptr, g_ptr, y_ptr, part_ptr, lock_ptr,
        M, N, K, n_pairs, tiles_m, units, programs,
        stride_xm, stride_wn, stride_wp, stride_sn, stride_sp, stride_ym,
        BLOCK_N: gl.constexpr, BLOCK_M: gl.constexpr, NUM_WARPS: gl.constexpr, FP16: gl.constexpr,
        EVEN_K: gl.constexpr, PREFETCH: gl.constexpr, X_SMEM: gl.constexpr, PAIR_L: gl.constexpr, SCALE_L: gl.constexpr,
        CHUNK_L: gl.constexpr,
        ACT_L: gl.constexpr, XCP_L: gl.constexpr, XS_L: gl.constexpr, WGMMA: gl.constexpr, X_STAGES: gl.constexpr,
        X_GATHER: gl.constexpr, PDL: gl.constexpr, OVERLAP: gl.constexpr, W_EP: gl.constexpr,
    ):
        """Program p takes units [p U / P, (p + 1) U / P) of U = tiles x pairs (tile-major). With WGMMA,
        x is the permuted copy (``mma_order``, K a multiple of 128) and X_STAGES of its pairs are staged;
        with X_GATHER too, x as it is (K a multiple of 128), put in MMA order by 4-byte copies. With PDL,
        the next kernel may launch at once, and a tile's first weights are loaded before waiting for the
        previous kernel (x, y, the parts and the counters are touched only after the wait)."""
        if WGMMA:
            MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[NUM_WARPS, 1],
                                                          instr_shape=[16, BLOCK_M, 16])
        else:
            MMA: gl.constexpr = gl.NVMMADistributedLayout(version=[2, 0], warps_per_cta=[NUM_WARPS, 1],
                                                          instr_shape=[16, 8])
        A: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=MMA, k_width=2)
        B: gl.constexpr = gl.DotOperandLayout(operand_index=1, parent=MMA, k_width=2)
        p = gl.program_id(0)
        if PDL:
            _grid_dependency(False)
        u_lo = (p.to(gl.int64) * units // programs).to(gl.int32)
        u_hi = ((p.to(gl.int64) + 1) * units // programs).to(gl.int32)
        # index vectors: codes [BN, 4 q, 4 words], scales [BN, 4 q], activations [4 q, 16 f, BM]
        cn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, gl.SliceLayout(2, PAIR_L)))
        cq = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(2, PAIR_L)))
        cw = gl.arange(0, 4, layout=gl.SliceLayout(0, gl.SliceLayout(1, PAIR_L)))
        c_in_row = gl.expand_dims(gl.expand_dims(cq * 4, 0), 2) + gl.expand_dims(gl.expand_dims(cw, 0), 1)
        sn = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, SCALE_L))
        sq = gl.expand_dims(gl.arange(0, 4, layout=gl.SliceLayout(0, SCALE_L)), 0)
        xq = gl.arange(0, 4, layout=gl.SliceLayout(1, gl.SliceLayout(2, ACT_L)))
        xf = gl.arange(0, 16, layout=gl.SliceLayout(0, gl.SliceLayout(2, ACT_L)))
        xm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, gl.SliceLayout(1, ACT_L)))
        x_feat = gl.expand_dims(gl.expand_dims(xq * 16, 1), 2) + gl.expand_dims(gl.expand_dims(xf, 0), 2)
        if WGMMA:  # [X_STAGES x 2 chunks, BM, 64 features]: the wgmma's B operand layout (128-byte swizzle)
            x_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [2 * X_STAGES, BLOCK_M, 64],
                                               gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16,
                                                                    rank=2))
            cm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XCP_L))
            cc = gl.arange(0, 64, layout=gl.SliceLayout(0, XCP_L))
            if X_GATHER:  # column 16 j + 8 h + 2 q + e of a chunk <- feature 16 q + 4 j + 2 h + e (runs of 2)
                cc = (cc % 2) + 2 * ((cc // 8) % 2) + 4 * (cc // 16) + 16 * ((cc // 2) % 4)
                cc = gl.max_contiguous(gl.multiple_of(cc, 2), 2)
            cf = gl.expand_dims(cc, 0)
        elif X_SMEM:  # stages of [BM, 128 features]: 16-byte pieces, swizzled by row (conflict-free reads)
            XS_SHARED: gl.constexpr = gl.SwizzledSharedLayout(8, 1, 8, order=[1, 0])
            if X_STAGES == PREFETCH + 1:  # a buffer a stage (static indices: one barrier a pair suffices)
                xs0 = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [BLOCK_M, 128], XS_SHARED)
                xs1 = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [BLOCK_M, 128], XS_SHARED)
                xs2 = xs1
                xs3 = xs1
                if X_STAGES >= 3:
                    xs2 = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [BLOCK_M, 128], XS_SHARED)
                if X_STAGES >= 4:
                    xs3 = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [BLOCK_M, 128], XS_SHARED)
                x_smem = (xs0, xs1, xs2, xs3)
            else:  # [2 stages, BM, 128]
                x_smem = gl.allocate_shared_memory(x_ptr.dtype.element_ty, [2, BLOCK_M, 128], XS_SHARED)
            cm = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, XCP_L))
            cf = gl.expand_dims(gl.arange(0, 128, layout=gl.SliceLayout(0, XCP_L)), 0)
        else:
            x_smem = 0
        u = u_lo
        while u < u_hi:
            tile = u // n_pairs
            p_begin = u - tile * n_pairs
            p_end = gl.minimum(n_pairs, p_begin + (u_hi - u))
            n0 = (tile // tiles_m) * BLOCK_N  # (batch tiles of one weight tile next to each other: they
            m0 = (tile % tiles_m) * BLOCK_M  # run at about the same time, the later ones reading it from L2)
            rows = gl.minimum(n0 + cn, N - 1).to(gl.int64)  # (rows past N load row N - 1, never stored)
            w_rows = w_ptr + (gl.expand_dims(gl.expand_dims(rows * stride_wn, 1), 2) + c_in_row)
            s_rows = s_ptr + (gl.expand_dims(gl.minimum(n0 + sn, N - 1).to(gl.int64) * stride_sn, 1) + sq)
            x_rows = gl.minimum(m0 + xm, M - 1).to(gl.int64)
            x_cols = x_ptr + (x_feat + gl.expand_dims(gl.expand_dims(x_rows * stride_xm, 0), 1))
            acc = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, MMA)
            if OVERLAP:  # the A operand of the wgmma left running into the next pair (none yet)
                a_prev = gl.zeros([BLOCK_N, 64], x_ptr.dtype.element_ty, A)
            else:
                a_prev = p_begin  # (a placeholder, passed through)
            # PREFETCH + 1 register buffers, each refilled with the pair PREFETCH + 1 ahead right after
            # its pair is multiplied, so PREFETCH pairs stay in flight. The loop body takes one pair a
            # buffer: a buffer never moves to other registers (a register copy of a load's target waits
            # for the load, which would end the prefetch at the loop's back edge).
            D: gl.constexpr = PREFETCH + 1
            p_last = p_end - 1
            if PDL:  # the weights do not depend on the previous kernel: in flight before the wait
                w0, s0, w1, s1, w2, s2, w3, s3 = _first_pairs(w_rows, s_rows, p_begin, p_last, stride_wp,
                                                              stride_sp, D, W_EP)
                _grid_dependency(True)
            x_from = 0
            if WGMMA:
                x_from = x_ptr + (gl.expand_dims(gl.minimum(m0 + cm, M - 1).to(gl.int64) * stride_xm, 1) + cf)
                _cta_barrier()  # the last tile's wgmmas are done in every warpgroup
                for st in gl.static_range(X_STAGES - 2 if OVERLAP else X_STAGES - 1):  # the first pairs' copies
                    _copy_x_chunks(x_smem, st, x_from, gl.minimum(p_begin + st, p_end - 1) * 128)
            elif X_SMEM:
                x_from = x_ptr + (gl.expand_dims(gl.minimum(m0 + cm, M - 1).to(gl.int64) * stride_xm, 1) + cf)
                _cta_barrier()  # the last tile's reads of every stage are done
                if X_STAGES == PREFETCH + 1:
                    for st in gl.static_range(X_STAGES - 1):  # the first pairs' copies
                        _copy_x(x_smem[st], x_from, gl.minimum(p_begin + st, p_end - 1) * 128)
                else:
                    _copy_x(x_smem.index(0), x_from, p_begin * 128)
            blocks = (p_end - p_begin) // D
            pair = p_begin
            if not PDL:
                w0, s0, w1, s1, w2, s2, w3, s3 = _first_pairs(w_rows, s_rows, p_begin, p_last, stride_wp,
                                                              stride_sp, D, W_EP)
            for _ in range(blocks):
                acc, a_prev = _pair_step(acc, a_prev, w0, s0, pair, p_begin, p_end, x_cols, x_feat,
                                         x_from, x_smem, K, EVEN_K, X_SMEM, WGMMA, X_STAGES, OVERLAP, PREFETCH, 0,
                                         FP16, A, B, CHUNK_L, BLOCK_N, BLOCK_M, XS_L, ACT_L)
                w0, s0 = _load_w(w_rows, s_rows, pair + D, p_last, stride_wp, stride_sp, W_EP)
                acc, a_prev = _pair_step(acc, a_prev, w1, s1, pair + 1, p_begin, p_end, x_cols, x_feat,
                                         x_from, x_smem, K, EVEN_K, X_SMEM, WGMMA, X_STAGES, OVERLAP, PREFETCH, 1,
                                         FP16, A, B, CHUNK_L, BLOCK_N, BLOCK_M, XS_L, ACT_L)
                w1, s1 = _load_w(w_rows, s_rows, pair + 1 + D, p_last, stride_wp, stride_sp, W_EP)
                if D >= 3:
                    acc, a_prev = _pair_step(acc, a_prev, w2, s2, pair + 2, p_begin, p_end, x_cols, x_feat,
                                             x_from, x_smem, K, EVEN_K, X_SMEM, WGMMA, X_STAGES, OVERLAP, PREFETCH, 2,
                                             FP16, A, B, CHUNK_L, BLOCK_N, BLOCK_M, XS_L, ACT_L)
                    w2, s2 = _load_w(w_rows, s_rows, pair + 2 + D, p_last, stride_wp, stride_sp, W_EP)
                if D >= 4:
                    acc, a_prev = _pair_step(acc, a_prev, w3, s3, pair + 3, p_begin, p_end, x_cols, x_feat,
                                             x_from, x_smem, K, EVEN_K, X_SMEM, WGMMA, X_STAGES, OVERLAP, PREFETCH, 3,
                                             FP16, A, B, CHUNK_L, BLOCK_N, BLOCK_M, XS_L, ACT_L)
                    w3, s3 = _load_w(w_rows, s_rows, pair + 3 + D, p_last, stride_wp, stride_sp, W_EP)
                pair += D
            if pair < p_end:  # the last (p_end - p_begin) % D pairs, already loaded
                acc, a_prev = _pair_step(acc, a_prev, w0, s0, pair, p_begin, p_end, x_cols, x_feat,
                                         x_from, x_smem, K, EVEN_K, X_SMEM, WGMMA, X_STAGES, OVERLAP, PREFETCH, 0,
                                         FP16, A, B, CHUNK_L, BLOCK_N, BLOCK_M, XS_L, ACT_L)
            if D >= 3:
                if pair + 1 < p_end:
                    acc, a_prev = _pair_step(acc, a_prev, w1, s1, pair + 1, p_begin, p_end, x_cols, x_feat,
                                             x_from, x_smem, K, EVEN_K, X_SMEM, WGMMA, X_STAGES, OVERLAP, PREFETCH, 1,
                                             FP16, A, B, CHUNK_L, BLOCK_N, BLOCK_M, XS_L, ACT_L)
            if D >= 4:
                if pair + 2 < p_end:
                    acc, a_prev = _pair_step(acc, a_prev, w2, s2, pair + 2, p_begin, p_end, x_cols, x_feat,
                                             x_from, x_smem, K, EVEN_K, X_SMEM, WGMMA, X_STAGES, OVERLAP, PREFETCH, 2,
                                             FP16, A, B, CHUNK_L, BLOCK_N, BLOCK_M, XS_L, ACT_L)
            if OVERLAP:
                acc, a_prev = warpgroup_mma_wait(0, deps=[acc, a_prev])  # the tile's last wgmma
            if X_SMEM or WGMMA:
                async_copy.wait_group(0)  # the loop's last (redundant) copies, before the next tile's
            _finish_tile(acc, g_ptr, y_ptr, part_ptr, lock_ptr, M, N, n0, m0, p, u == u_lo, tile, p_begin, p_end,
                         n_pairs, units, programs, stride_ym, BLOCK_N, BLOCK_M, NUM_WARPS, MMA)
            u += p_end - p_begin


def w4a16_mma_matmul(x2: torch.Tensor, weight: tw.W4A16Weight, y: torch.Tensor,
                     tiles: GluonTiles | None = None) -> torch.Tensor:
    """y [M, N] = x2 [M, K] (bf16 / fp16, rows contiguous) @ W^T, W from ``pack_w4a16`` (the default
    tiles are chosen for up to ``max_rows`` rows; any M works, one batch tile after another)."""
    m, k = x2.shape
    n = weight.out_features
    t = tiles or default_tiles(m, wgmma_available(x2.device))
    if (t.block_m not in (8, 16, 32, 64) + ((128, 256) if t.wgmma else ()) or t.block_n % (16 * t.num_warps)
            or t.num_warps not in (1, 2, 4, 8) or t.prefetch not in (1, 2, 3)
            or (t.x_smem and 2 * t.num_warps > t.block_m)
            or (t.split is not None and t.split < 0)
            or (t.wgmma and (t.num_warps % 4 or t.block_m < 4 * t.num_warps))
            or (t.wgmma and t.x_stages not in (2, 3, 4))
            or (t.x_smem and not t.wgmma and t.x_stages not in (2, t.prefetch + 1))
            or (t.mma_overlap and not (t.wgmma and t.x_stages >= 3))
            or (t.maxnreg is not None and not 32 <= t.maxnreg <= 255)
            or t.w_eviction_policy not in ("", "evict_first", "evict_last")):
        raise ValueError(f"w4a16_mma_matmul: {t} needs block_m in 8, 16, 32, 64, block_n a multiple of "
                         f"16 x num_warps, num_warps in 1, 2, 4, 8 and prefetch 1, 2 or 3 (x_smem: block_m >= 2 x "
                         f"num_warps; split None or >= 0; wgmma: block_m up to 256 and >= 4 x num_warps, num_warps "
                         f"4 or 8, x_stages 2, 3 or 4; x_smem: x_stages 2 or prefetch + 1; mma_overlap: wgmma with "
                         f"x_stages 3 or 4; maxnreg None or 32-255; w_eviction_policy '', 'evict_first' or "
                         f"'evict_last')")
    n_pairs = weight.codes.shape[1]
    gather = t.wgmma and t.x_gather and k % 128 == 0
    if t.wgmma and not gather:
        x2 = mma_order(x2, n_pairs)
    tiles_n, tiles_m = triton.cdiv(n, t.block_n), triton.cdiv(m, t.block_m)
    n_tiles = tiles_n * tiles_m
    units = n_tiles * n_pairs
    pair_l, scale_l, chunk_l, act_l = _layouts(t.block_n, t.block_m, t.num_warps)
    xcp_l, xs_l = _x_smem_layouts(t.block_m, t.num_warps)
    if t.wgmma:
        xcp_l = _x_chunk_copy_layout(t.num_warps, gather)
    meta = dict(BLOCK_N=t.block_n, BLOCK_M=t.block_m, NUM_WARPS=t.num_warps, FP16=x2.dtype == torch.float16,
                EVEN_K=k % 128 == 0 or t.wgmma, PREFETCH=t.prefetch, X_SMEM=t.x_smem and k % 128 == 0 and not t.wgmma,
                XCP_L=xcp_l, XS_L=xs_l, PAIR_L=pair_l, SCALE_L=scale_l, CHUNK_L=chunk_l, ACT_L=act_l,
                WGMMA=t.wgmma, X_STAGES=t.x_stages, X_GATHER=gather, PDL=t.pdl, OVERLAP=t.mma_overlap,
                W_EP=t.w_eviction_policy, launch_pdl=t.pdl,
                **({"maxnreg": t.maxnreg} if t.maxnreg else {}),
                num_warps=t.num_warps)
    codes, scales = weight.codes.view(torch.int32), weight.scales.view(torch.int16)  # [N, pair, 16 / 4]

    def args(programs: int, part: torch.Tensor, lock: torch.Tensor) -> list:
        return [x2, codes, scales, weight.row_scale, y, part, lock, m, n, k, n_pairs, tiles_m, units, programs,
                x2.stride(0), codes.stride(0), codes.stride(1), scales.stride(0), scales.stride(1), y.stride(0)]

    if n_tiles > tw._LOCKS or t.split == 1:
        programs = n_tiles
    elif t.split:  # S programs a tile: program t S + s takes pairs [s P / S, (s + 1) P / S) of tile t
        programs = n_tiles * min(t.split, n_pairs)
    else:
        per_sm = t.programs_per_sm or tw._ctas_per_sm(
            _w4a16_mma_kernel, lambda: args(1, tw._no_parts(x2.device), tw._tile_locks(x2.device)),
            meta, x2.dtype, x2.device, variant=(t, meta["EVEN_K"]))
        wave = num_sms(x2.device) * per_sm
        programs = min(units, wave) if t.split is None else n_tiles * max(1, min(n_pairs, wave // n_tiles))
    streamed = programs != n_tiles
    part = (torch.empty((programs, 2, t.block_n, t.block_m), dtype=torch.float32, device=x2.device) if streamed
            else tw._no_parts(x2.device))
    _w4a16_mma_kernel[(programs,)](*args(programs, part, tw._tile_locks(x2.device)), **meta)
    return y


def w4a16_linear(x: torch.Tensor, weight: tw.W4A16Weight, out: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ W^T as the model runs it: this kernel for batches of up to ``max_rows`` rows of
    bf16 / fp16 on a GPU that has it, else ``triton_w4a16.w4a16_matmul`` (the Triton kernel, the
    dequantize path for large batches, the interpreter and fp32)."""
    k, n = weight.in_features, weight.out_features
    x2 = x.reshape(-1, k)
    m = x2.shape[0]
    if not (0 < m <= max_rows(x.device, x.dtype) and x.shape[-1] == k):
        return tw.w4a16_matmul(x, weight, out=out)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if tuple(y.shape) != (m, n) or y.stride(-1) != 1 or y.dtype != x.dtype:
        raise ValueError(f"w4a16_linear: out {tuple(y.shape)} {y.dtype}, expected {(m, n)} {x.dtype}, rows contiguous")
    w4a16_mma_matmul(x2, weight, y)
    return y.reshape(*x.shape[:-1], n)
