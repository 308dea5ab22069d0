"""FP8 W8A8 GEMM for decode batches (Triton): ``y = (e4m3(x / s_x) @ W^T) * s_x * s_w``, the static
per-tensor scheme of ModelOpt FP8 layers (vLLM's ``input_scale``), with x quantized inside the GEMM.

``FP8Linear`` ran two kernels a layer: the activation quantiser, then cuBLASLt's ``_scaled_mm``. On
the 27B's decode step (32 rows, 128 FP8 layers) that GEMM read its weights at 56-78% of the copy
bandwidth and launched without programmatic dependent launch. Here one kernel quantizes each program's
slice of x as it loads it (the quantiser's formula: ``clamp(x * (1 / s_x), +-448)`` rounded to
nearest even, NaN kept, so the same fp8 operand bits) and multiplies it with fp8 tensor-core dots,
fp32 accumulation.

**Schedule**: programs take ``BLOCK_N`` weight rows x all (up to 64) batch rows, and K is split over
``split`` programs a tile so that one wave fills the GPU; each writes its fp32 partial tile, and the
tile's last program to arrive (an atomic counter) sums the parts in split order (the same sum
whichever arrives last), scales once (``acc * (s_x * s_w)`` in fp32) and stores. Weights are the
dot's first operand (rows as the MMA's M), x its second, so 16-64 batch rows fill the MMA's N.

``fp8_linear_reference`` is the torch twin (float32 accumulation of the same fp8 operands); the CPU
tests run the kernel in the interpreter against it and against float64.
"""

from __future__ import annotations

import functools

import torch

from kvserve.kernels import pdl
from kvserve.kernels.triton_store import num_sms

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover
    triton = tl = None

MAX_M = 64  # batch rows this kernel takes (decode); more: the quantiser and torch._scaled_mm
enabled = True  # the switch (benchmarks A/B it against the quantiser + torch._scaled_mm); read at each call
E4M3_MAX = 448.0
_E4M3_MAX = tl.constexpr(E4M3_MAX) if tl is not None else E4M3_MAX


@functools.lru_cache(maxsize=None)
def available(device: torch.device) -> bool:
    """Whether ``FP8Linear`` runs this kernel on ``device``: sm_90 (its fp8 dots; the measured GPU)."""
    return triton is not None and device.type == "cuda" and torch.cuda.get_device_capability(device) == (9, 0)


def takes(x2: torch.Tensor) -> bool:
    """Whether ``FP8Linear`` gives x2 [M, K] to this kernel: on, on sm_90, 1 <= M <= ``MAX_M``."""
    return enabled and 0 < x2.shape[0] <= MAX_M and available(x2.device)


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, inv_input_scale: torch.Tensor,
                         input_scale: torch.Tensor, weight_scale: torch.Tensor) -> torch.Tensor:
    """The torch twin: x quantized as ``quant.nvfp4.quantize_fp8_static``, products of the fp8 values
    summed in float32, times ``s_x * s_w`` (fp32), cast to x's dtype."""
    v = x.float() * inv_input_scale.float()
    v = torch.where(v.isnan(), v, v.clamp(-E4M3_MAX, E4M3_MAX))
    xq = v.to(torch.float8_e4m3fn).float()
    acc = xq @ weight.float().t()
    return (acc * (input_scale.float() * weight_scale.float())).to(x.dtype)


if triton is not None:

    @triton.jit
    def _fp8_linear_kernel(x_ptr, w_ptr, inv_ptr, sx_ptr, sw_ptr, y_ptr, part_ptr, lock_ptr, M, N, K, k_split,
                           stride_xm, stride_wn, stride_ym, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr, SPLIT: tl.constexpr, EVEN: tl.constexpr, IMPRECISE: tl.constexpr,
                           PDL: tl.constexpr):
        """Program (tile, s): rows [tile BN, +BN) of y^T over K range [s k_split, +k_split)."""
        pdl.start(PDL)
        tile = tl.program_id(0)
        s = tl.program_id(1)
        rbn = tl.arange(0, BLOCK_N)
        rm = tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        rn = tile * BLOCK_N + rbn
        n_ok, m_ok = rn < N, rm < M
        k_lo = s * k_split
        k_hi = tl.minimum(K, k_lo + k_split)
        inv = tl.load(inv_ptr)
        w_at = w_ptr + rn.to(tl.int64)[:, None] * stride_wn + rk[None, :]
        x_at = x_ptr + tl.minimum(rm, M - 1).to(tl.int64)[:, None] * stride_xm + rk[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for k0 in range(k_lo, k_hi, BLOCK_K):
            if EVEN:  # (N a multiple of BLOCK_N, K of the split; batch rows past M repeat row M - 1, never stored)
                w = tl.load(w_at + k0)
                x = tl.load(x_at + k0)
            else:
                k_ok = (k0 + rk) < k_hi
                w = tl.load(w_at + k0, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
                x = tl.load(x_at + k0, mask=k_ok[None, :], other=0.0)
            v = x.to(tl.float32) * inv
            v = tl.where(v != v, v, tl.minimum(tl.maximum(v, -_E4M3_MAX), _E4M3_MAX))
            acc = tl.dot(w, tl.trans(v.to(tl.float8e4nv, fp_downcast_rounding="rtne")), acc,
                         max_num_imprecise_acc=IMPRECISE)
        scale = tl.load(sx_ptr) * tl.load(sw_ptr)
        y_at = y_ptr + rm.to(tl.int64)[None, :] * stride_ym + rn[:, None]
        y_ok = n_ok[:, None] & m_ok[None, :]
        if SPLIT == 1:
            tl.store(y_at, (acc * scale).to(y_ptr.dtype.element_ty), mask=y_ok)
        else:  # publish the part; the tile's last program to arrive sums the parts in split order
            tiles = tl.num_programs(0)
            part_at = part_ptr + (rbn[:, None] * BLOCK_M + rm[None, :])
            tl.store(part_at + (s * tiles + tile).to(tl.int64) * (BLOCK_N * BLOCK_M), acc)
            tl.debug_barrier()
            arrived = tl.atomic_add(lock_ptr + tile, 1, sem="acq_rel")
            if arrived == SPLIT - 1:
                total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
                for q in range(SPLIT):
                    total += tl.load(part_at + (q * tiles + tile).to(tl.int64) * (BLOCK_N * BLOCK_M),
                                     cache_modifier=".cg")
                tl.atomic_xchg(lock_ptr + tile, 0)  # ready for the next launch
                tl.store(y_at, (total * scale).to(y_ptr.dtype.element_ty), mask=y_ok)


IMPRECISE = 32  # one k32 fp8 MMA, then the fp32 accumulator (the finest)
_locks: dict[torch.device, torch.Tensor] = {}
LOCKS = 1 << 12  # tile counters per device (each launch leaves them zero); more tiles: no split


def _tile_locks(device: torch.device) -> torch.Tensor:
    lock = _locks.get(device)
    if lock is None:
        lock = _locks[device] = torch.zeros(LOCKS, dtype=torch.int32, device=device)
    return lock


def launch_split(n_tiles: int, k_blocks: int, sms: int) -> int:
    """Programs a tile: enough for about two programs an SM, at most one a K block (1 past ``LOCKS`` tiles)."""
    if n_tiles > LOCKS:
        return 1
    return max(1, min(k_blocks, (2 * sms + n_tiles - 1) // n_tiles))


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, inv_input_scale: torch.Tensor, input_scale: torch.Tensor,
               weight_scale: torch.Tensor, block_n: int = 128, block_k: int = 128, split: int | None = None,
               num_stages: int | None = None, imprecise: int = IMPRECISE,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """y [M, N] (x's dtype) for x [M, K] (bf16 / fp16 / fp32, rows contiguous, 1 <= M <= ``MAX_M``),
    ``weight`` float8_e4m3fn [N, K] (rows contiguous) and one-element fp32 scales on x's device;
    ``split`` programs a tile (None: ``launch_split``); ``num_stages`` None: 4 up to 32 batch rows, else
    3 (two programs an SM fit in shared memory); ``imprecise``: K the tensor cores sum before the sum
    moves to the fp32 accumulator (sm_90's fp8 MMAs keep fewer bits; triton's default there is all of K);
    ``out``: y's storage ([M, N], x's dtype, rows contiguous)."""
    m, k = x.shape
    n = weight.shape[0]
    if not (1 <= m <= MAX_M and weight.shape[1] == k and x.stride(-1) == 1 and weight.stride(-1) == 1):
        raise ValueError(f"fp8_linear: x {tuple(x.shape)} and weight {tuple(weight.shape)} need 1-{MAX_M} rows, "
                         f"the same K and contiguous rows")
    block_m = max(16, triton.next_power_of_2(m))
    tiles = triton.cdiv(n, block_n)
    k_blocks = triton.cdiv(k, block_k)
    s = 1 if tiles > LOCKS else split or launch_split(tiles, k_blocks, num_sms(x.device))
    k_split = triton.cdiv(k_blocks, s) * block_k
    s = triton.cdiv(k, k_split)  # (no empty split)
    y = out if out is not None else torch.empty((m, n), dtype=x.dtype, device=x.device)
    if tuple(y.shape) != (m, n) or y.dtype != x.dtype or y.stride(-1) != 1:
        raise ValueError(f"fp8_linear: out {tuple(y.shape)} {y.dtype}, expected {(m, n)} {x.dtype}, rows contiguous")
    part = torch.empty((s, tiles, block_n, block_m) if s > 1 else (1,), dtype=torch.float32, device=x.device)
    even = n % block_n == 0 and k % k_split == 0
    _fp8_linear_kernel[(tiles, s)](x, weight, inv_input_scale, input_scale, weight_scale, y, part,
                                   _tile_locks(x.device), m, n, k, k_split, x.stride(0), weight.stride(0),
                                   y.stride(0), BLOCK_N=block_n, BLOCK_M=block_m, BLOCK_K=block_k, SPLIT=s,
                                   EVEN=even, IMPRECISE=imprecise, num_warps=4,
                                   num_stages=num_stages or (4 if block_m <= 32 else 3), **pdl.launch_options(x.device))
    return y
