"""Triton paged KV store: vLLM's ``reshape_and_cache_flash`` for kvserve's cache layout.

One launch writes K and V of every token into ``kv_cache [num_blocks, 2, block_size, Hk, D]``
(slot ``s`` -> block ``s // block_size``, offset ``s % block_size``; slot -1 writes nothing).
Each program stores ``BLOCK_T`` consecutive tokens (a compile-time tile; every token masked on its
own slot, so a program of -1 slots writes nothing) for all their heads, or for a group of heads
when ``Hk * D`` is large. ``store_plan`` picks the tile from the shapes and the token count alone
(the grid never depends on slot values): about 4 KB of K + V per program, so several tokens per
program only for small heads, fewer while the grid would leave multiprocessors short of programs.
Float caches take a round-to-nearest-even cast; fp8 caches (uint8 bytes) take
``fp8(clamp(float32(x) / scale, -max, max))`` with a correctly rounded division, bit-exact with
``reference.store_kv``. The scales are read on device, so the store is CUDA-graph capturable.
"""

from __future__ import annotations

import functools

import torch

from kvserve.kernels import pdl
from kvserve.kernels.reference import CacheQuant

try:  # importing this module must work wherever triton imports (no GPU needed)
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency of the GPU backend only
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

_FP8_FORMAT = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2}
# Elements of one token's K (or V) tile: Hk * D (padded to powers of two) up to this is one head group.
_MAX_TILE = 4096
# Elements of one program's K (or V) tile, all its tokens together (bounds registers per thread).
_MAX_PROGRAM_TILE = 16384
_MAX_TOKENS_PER_PROGRAM = 16
# Automatic tiling (H200, benchmarks/HISTORY.md 'Store'): about this many bytes of K + V read per
# program, never fewer than _PROGRAMS_PER_SM programs per multiprocessor while tokens allow, and
# about _ELEMS_PER_THREAD elements of K (and of V) per thread. Hk=8, D=128 bf16 keeps one token per
# program with 2 warps (larger tiles were no faster for bf16 and slower for fp8, whose exact
# division makes it partly ALU-bound); small heads get several tokens per program.
_TARGET_PROGRAM_BYTES = 4 * 1024
_PROGRAMS_PER_SM = 4
_ELEMS_PER_THREAD = 16
_DEFAULT_SMS = 132  # H100/H200; used where no CUDA device is there to ask (the interpreter)

if triton is not None:

    @triton.jit(do_not_specialize=["num_tokens"])  # one compile for every batch size
    def _store_kv_kernel(
        key_ptr, value_ptr, cache_ptr, slot_ptr, k_scale_ptr, v_scale_ptr,
        num_tokens, num_kv_heads, head_size,
        stride_kt, stride_kh, stride_kd,
        stride_vt, stride_vh, stride_vd,
        stride_cb, stride_ckv, stride_cs, stride_ch, stride_cd,
        block_size,
        BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
        FP8_FORMAT: tl.constexpr, FP8_MAX: tl.constexpr, PDL: tl.constexpr,
    ):
        """Program (i, j): tokens [i * BLOCK_T, (i + 1) * BLOCK_T), heads [j * BLOCK_H, (j + 1) * BLOCK_H), K and V."""
        pdl.start(PDL)
        t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
        slot = tl.load(slot_ptr + t, mask=t < num_tokens, other=-1).to(tl.int64)
        valid = slot >= 0  # past the end or slot -1: nothing read, nothing written
        slot = tl.where(valid, slot, 0)
        blk = slot // block_size
        off = slot - blk * block_size
        h = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        t3 = t.to(tl.int64)[:, None, None]
        h3 = h.to(tl.int64)[None, :, None]
        d3 = d[None, None, :]
        mask = valid[:, None, None] & (h3 < num_kv_heads) & (d3 < head_size)
        k = tl.load(key_ptr + t3 * stride_kt + h3 * stride_kh + d3 * stride_kd, mask=mask)
        v = tl.load(value_ptr + t3 * stride_vt + h3 * stride_vh + d3 * stride_vd, mask=mask)
        row = (blk * stride_cb + off * stride_cs)[:, None, None]
        row = cache_ptr + row + h3 * stride_ch + d3 * stride_cd
        if FP8_FORMAT == 0:
            out_ty = cache_ptr.dtype.element_ty
            if k.dtype != out_ty:  # via fp32: one RNE rounding, as torch casts
                k = k.to(tl.float32).to(out_ty)
                v = v.to(tl.float32).to(out_ty)
            tl.store(row, k, mask=mask)
            tl.store(row + stride_ckv, v, mask=mask)
        else:
            fp8_ty = tl.float8e4nv if FP8_FORMAT == 1 else tl.float8e5
            kq = tl.math.div_rn(k.to(tl.float32), tl.load(k_scale_ptr))  # true division, not x * (1/s)
            vq = tl.math.div_rn(v.to(tl.float32), tl.load(v_scale_ptr))
            # clamp, keeping NaN (GPU min/max would replace it with the bound)
            kq = tl.where(kq != kq, kq, tl.minimum(tl.maximum(kq, -FP8_MAX), FP8_MAX))
            vq = tl.where(vq != vq, vq, tl.minimum(tl.maximum(vq, -FP8_MAX), FP8_MAX))
            tl.store(row, kq.to(fp8_ty, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=mask)
            tl.store(row + stride_ckv, vq.to(fp8_ty, fp_downcast_rounding="rtne").to(tl.uint8, bitcast=True), mask=mask)


@functools.lru_cache(maxsize=None)
def num_sms(device: torch.device) -> int:
    """Multiprocessors of a CUDA device (the H100/H200's 132 elsewhere, e.g. in the interpreter)."""
    if device.type != "cuda":
        return _DEFAULT_SMS
    return torch.cuda.get_device_properties(device).multi_processor_count


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


def store_plan(
    num_tokens: int,
    num_kv_heads: int,
    head_size: int,
    in_elem_size: int,
    num_sms: int = _DEFAULT_SMS,
    tokens_per_program: int | None = None,
    num_warps: int | None = None,
) -> tuple[int, int, int, int]:
    """``(BLOCK_T, BLOCK_H, BLOCK_D, num_warps)`` of a store; ``None`` arguments chosen here.

    BLOCK_T (tokens per program) aims at ``_TARGET_PROGRAM_BYTES`` of K + V read per program,
    halved while the grid would have fewer than ``_PROGRAMS_PER_SM`` programs per multiprocessor;
    heads are split into groups only when one token's tile (or the whole program's) is too large.
    Everything depends on shapes and the token count alone, never on the slots' values."""
    block_d = triton.next_power_of_2(head_size)
    token_heads = min(triton.next_power_of_2(num_kv_heads), max(1, _MAX_TILE // block_d))
    if tokens_per_program is None:
        per_token = 2 * token_heads * block_d * in_elem_size  # K + V bytes read per token
        block_t = 1
        while block_t < _MAX_TOKENS_PER_PROGRAM and 2 * block_t * per_token <= _TARGET_PROGRAM_BYTES:
            block_t *= 2
        head_groups = triton.cdiv(num_kv_heads, token_heads)
        while block_t > 1 and triton.cdiv(num_tokens, block_t) * head_groups < _PROGRAMS_PER_SM * num_sms:
            block_t //= 2
    else:
        block_t = int(tokens_per_program)
        if not _is_pow2(block_t):
            raise ValueError(f"tokens_per_program must be a power of two, got {tokens_per_program}")
    block_h = max(1, min(token_heads, _MAX_PROGRAM_TILE // (block_t * block_d)))
    if num_warps is None:  # about _ELEMS_PER_THREAD elements of K (and of V) per thread
        num_warps = max(1, min(8, block_t * block_h * block_d // (32 * _ELEMS_PER_THREAD)))
    elif not _is_pow2(num_warps):
        raise ValueError(f"num_warps must be a power of two, got {num_warps}")
    return block_t, block_h, block_d, int(num_warps)


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    quant: CacheQuant | None = None,
    tokens_per_program: int | None = None,
    num_warps: int | None = None,
) -> None:
    """Write ``key``/``value`` ([T, Hk, D], any strides) into their slots; as ``reference.store_kv``.

    The token count is ``slot_mapping.shape[0]`` (may be less than T, as in vLLM); slot -1 writes
    nothing. One Triton launch, no host synchronisation. ``tokens_per_program`` (a power of two)
    and ``num_warps`` override the automatic tiling (``store_plan``); the result is the same."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    num_tokens = slot_mapping.shape[0]
    _, two, block_size, num_kv_heads, head_size = kv_cache.shape
    assert two == 2 and key.dim() == 3 and key.shape == value.shape, (key.shape, value.shape, kv_cache.shape)
    assert key.shape[1:] == (num_kv_heads, head_size) and key.shape[0] >= num_tokens
    if quant is None:
        fp8_format, fp8_max = 0, 0.0
        k_scale = v_scale = slot_mapping  # never read
    else:
        assert kv_cache.dtype == torch.uint8, "an fp8 cache is stored as uint8"
        fp8_format, fp8_max = _FP8_FORMAT[quant.fp8_dtype], float(quant.fp8_max)
        k_scale, v_scale = quant.k_scale_t, quant.v_scale_t
    block_t, block_h, block_d, warps = store_plan(
        num_tokens, num_kv_heads, head_size, key.element_size(), num_sms(kv_cache.device),
        tokens_per_program, num_warps,
    )
    if num_tokens == 0:
        return
    grid = (triton.cdiv(num_tokens, block_t), triton.cdiv(num_kv_heads, block_h))
    _store_kv_kernel[grid](
        key, value, kv_cache, slot_mapping, k_scale, v_scale,
        num_tokens, num_kv_heads, head_size,
        *key.stride(), *value.stride(), *kv_cache.stride(),
        block_size,
        BLOCK_T=block_t, BLOCK_H=block_h, BLOCK_D=block_d, FP8_FORMAT=fp8_format, FP8_MAX=fp8_max,
        num_warps=warps, **pdl.launch_options(kv_cache.device),
    )
