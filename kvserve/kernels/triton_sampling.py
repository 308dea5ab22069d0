"""Fused temperature sampling (Triton): one pass over each row's logits.

For rows that only need temperature (no top-k / top-p / min-p, no penalties, no logprobs), the
token is ``argmax_j(x_j / T + g_j)`` with ``g_j = -log(-log u_j)`` Gumbel noise, which draws
``j`` with probability ``softmax(x / T)_j``: the distribution of the torch sampler's exponential
race (``argmax(softmax(x / T) / E)``, ``E ~ Exp(1)``, which is the same rule with ``g = -log E``),
from a different random stream. A row with ``T == 0`` takes ``argmax_j x_j``. Ties go to the
lowest id, as ``torch.argmax``.

The uniforms come from Triton's Philox generator keyed per row: an unseeded row uses the step's
key (drawn from torch's global generator, so the engine seed makes runs repeatable) with a
counter that starts at ``row * vocab``; a seeded request uses a key mixed from its seed and its
output position, so its tokens do not depend on the batch it shares. Reading the logits once
replaces torch's float copy, division, softmax, exponential draw, division and argmax (six
passes over ``rows x vocab`` fp32 values).
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - triton is a dependency of the GPU backend only
    triton = None  # type: ignore[assignment]
    tl = None  # type: ignore[assignment]

_MASK31 = 0x7FFFFFFF


def seeded_key(seed: int, position: int) -> int:
    """Philox key of a seeded request's token at ``position`` (31 bits, well mixed)."""
    h = (seed * 0x9E3779B1 + position * 0x85EBCA77 + 0x165667B1) & 0xFFFFFFFF
    h ^= h >> 15
    h = (h * 0x2C1B3C6D) & 0xFFFFFFFF
    h ^= h >> 12
    return h & _MASK31


if triton is not None:

    @triton.jit(do_not_specialize=["vocab", "stride_row"])
    def _gumbel_argmax_kernel(
        logits_ptr, stride_row, vocab, temps_ptr, keys_ptr, counters_ptr, out_ptr,
        BLOCK: tl.constexpr,
    ):
        """Program r: token of row r (see the module docstring)."""
        row = tl.program_id(0)
        t = tl.load(temps_ptr + row)
        key = tl.load(keys_ptr + row)
        counter0 = tl.load(counters_ptr + row)
        inv_t = 1.0 / tl.where(t > 0.0, t, 1.0)
        noise = t > 0.0
        base = logits_ptr + row.to(tl.int64) * stride_row
        q = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_id = tl.zeros([BLOCK], tl.int32)
        for start in range(0, vocab, 4 * BLOCK):
            # four uniforms per Philox call: one per quarter of the 4 * BLOCK columns
            r0, r1, r2, r3 = tl.randint4x(key, counter0 + start // 4 + q)
            for j in tl.static_range(4):
                if j == 0:
                    r = r0
                elif j == 1:
                    r = r1
                elif j == 2:
                    r = r2
                else:
                    r = r3
                cols = start + j * BLOCK + q
                ok = cols < vocab
                x = tl.load(base + cols, mask=ok, other=float("-inf")).to(tl.float32)
                u = tl.random.uint_to_uniform_float(r)
                g = -tl.log(-tl.log(u))  # u == 0 gives -inf: never picked
                s = tl.where(noise, x * inv_t + g, x)
                s = tl.where(ok, s, float("-inf"))
                take = s > best  # strictly greater: the earlier (lower) id keeps ties
                best = tl.where(take, s, best)
                best_id = tl.where(take, cols, best_id)
        top = tl.max(best, axis=0)
        cand = tl.where(best == top, best_id, 2147483647)
        tl.store(out_ptr + row, tl.min(cand, axis=0).to(tl.int64))


def gumbel_argmax(logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor) -> torch.Tensor:
    """One token id per row of ``logits`` [R, V] (any float dtype, unit stride along V):
    ``temps`` [R] float32 (0 = greedy), ``keys`` / ``counters`` [R] int32 Philox key and counter
    start per row. Returns int64 [R] on the logits' device; no host synchronisation."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and temps.shape == keys.shape == counters.shape == (rows,)
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    block = 1024 if vocab >= 4096 else max(16, triton.next_power_of_2(triton.cdiv(vocab, 4)))
    _gumbel_argmax_kernel[(rows,)](
        logits, logits.stride(0), vocab, temps, keys, counters, out, BLOCK=block, num_warps=8 if block >= 1024 else 4
    )
    return out
