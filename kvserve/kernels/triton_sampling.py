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
passes over ``rows x vocab`` fp32 values); a greedy row skips the draws and only compares.

Each row's vocabulary is split over several programs (about two per multiprocessor over the
batch), each over whole ``4 * BLOCK`` column groups so every column keeps its counter: a split
writes its best score and lowest id, and a small kernel picks each row's best (the same token).
"""

from __future__ import annotations

import torch

from kvserve.kernels.triton_store import num_sms

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

    @triton.jit(do_not_specialize=["vocab", "stride_row", "span"])
    def _gumbel_argmax_kernel(
        logits_ptr, stride_row, vocab, span, temps_ptr, keys_ptr, counters_ptr, out_ptr, score_ptr, id_ptr,
        BLOCK: tl.constexpr, ONE: tl.constexpr,
    ):
        """Program (r, s): the best column of row r among columns [s * span, (s + 1) * span), to
        ``out`` when ``ONE`` (a single split), else its score and id to the [R, splits] partials."""
        row = tl.program_id(0)
        split = tl.program_id(1)
        t = tl.load(temps_ptr + row)
        base = logits_ptr + row.to(tl.int64) * stride_row
        lo = split * span
        hi = tl.minimum(lo + span, vocab)
        q = tl.arange(0, BLOCK)
        best = tl.full([BLOCK], float("-inf"), tl.float32)
        best_id = tl.zeros([BLOCK], tl.int32)
        if t > 0.0:
            key = tl.load(keys_ptr + row)
            counter0 = tl.load(counters_ptr + row)
            inv_t = 1.0 / t
            for start in range(lo, hi, 4 * BLOCK):
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
                    s = tl.where(ok, x * inv_t + g, float("-inf"))
                    take = s > best  # strictly greater: the earlier (lower) id keeps ties
                    best = tl.where(take, s, best)
                    best_id = tl.where(take, cols, best_id)
        else:  # greedy: no random draws
            for start in range(lo, hi, BLOCK):
                cols = start + q
                s = tl.load(base + cols, mask=cols < vocab, other=float("-inf")).to(tl.float32)
                take = s > best
                best = tl.where(take, s, best)
                best_id = tl.where(take, cols, best_id)
        top = tl.max(best, axis=0)
        first = tl.min(tl.where(best == top, best_id, 2147483647), axis=0)
        if ONE:
            tl.store(out_ptr + row, first.to(tl.int64))
        else:
            at = row * tl.num_programs(1) + split
            tl.store(score_ptr + at, top)
            tl.store(id_ptr + at, first)

    @triton.jit(do_not_specialize=["splits"])
    def _pick_split_kernel(score_ptr, id_ptr, splits, out_ptr, BLOCK: tl.constexpr):
        """Program r: the best of row r's ``splits`` partials, ties to the lowest id."""
        row = tl.program_id(0)
        q = tl.arange(0, BLOCK)
        ok = q < splits
        score = tl.load(score_ptr + row * splits + q, mask=ok, other=float("-inf"))
        ids = tl.load(id_ptr + row * splits + q, mask=ok, other=2147483647)
        top = tl.max(score, axis=0)
        tl.store(out_ptr + row, tl.min(tl.where(score == top, ids, 2147483647), axis=0).to(tl.int64))


def gumbel_argmax(
    logits: torch.Tensor, temps: torch.Tensor, keys: torch.Tensor, counters: torch.Tensor, splits: int | None = None
) -> torch.Tensor:
    """One token id per row of ``logits`` [R, V] (any float dtype, unit stride along V):
    ``temps`` [R] float32 (0 = greedy), ``keys`` / ``counters`` [R] int32 Philox key and counter
    start per row; ``splits`` forces the programs per row (default: about two per multiprocessor
    over all rows). Returns int64 [R] on the logits' device; no host synchronisation."""
    if triton is None:
        raise RuntimeError("triton is not installed")
    rows, vocab = logits.shape
    assert logits.stride(1) == 1 and temps.shape == keys.shape == counters.shape == (rows,)
    out = torch.empty(rows, dtype=torch.long, device=logits.device)
    if rows == 0:
        return out
    block = 1024 if vocab >= 4096 else max(16, triton.next_power_of_2(triton.cdiv(vocab, 4)))
    groups = triton.cdiv(vocab, 4 * block)
    want = triton.cdiv(2 * num_sms(logits.device), rows) if splits is None else splits
    span = 4 * block * triton.cdiv(groups, max(1, min(want, groups)))  # whole groups: the same counters
    splits = triton.cdiv(vocab, span)
    warps = 8 if block >= 1024 else 4
    args = (logits, logits.stride(0), vocab, span, temps, keys, counters, out)
    if splits == 1:
        _gumbel_argmax_kernel[(rows, 1)](*args, out, out, BLOCK=block, ONE=True, num_warps=warps)
        return out
    score = torch.empty(rows, splits, dtype=torch.float32, device=logits.device)
    ids = torch.empty(rows, splits, dtype=torch.int32, device=logits.device)
    _gumbel_argmax_kernel[(rows, splits)](*args, score, ids, BLOCK=block, ONE=False, num_warps=warps)
    _pick_split_kernel[(rows,)](score, ids, splits, out, BLOCK=max(16, triton.next_power_of_2(groups)), num_warps=1)
    return out
