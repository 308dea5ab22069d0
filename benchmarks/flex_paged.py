"""Paged decode attention through PyTorch FlexAttention: the peer in benchmarks/kernel_bench.py.

Usage (normally driven by kernel_bench.py; standalone self-check on tiny shapes, CPU or GPU):

    python3 benchmarks/flex_paged.py            # compares against kvserve.kernels.reference

How it is set up (torch's own paged path, ``torch.nn.attention.experimental._paged_attention``):

* Physical cache: ``k_cache``/``v_cache`` of shape ``[1, Hk, n_pages * page_size, D]`` (the layout
  ``PagedAttention.assign`` and the upstream tests use). A page is ``page_size`` tokens of one head,
  contiguous (32 KiB for 128 x 128 bf16).
* Page table: ``PagedAttention(n_pages, page_size, B)``; its free list is shuffled before
  ``reserve`` so pages are scattered over the whole pool like a long-running server's.
* Mask: a logical ``BlockMask`` (``kv_idx < seq_len[b]``) with KV block size == ``page_size``
  (``convert_logical_block_mask`` requires that), converted to physical pages with
  ``PagedAttention.convert_logical_block_mask(mask, kv_len=seq_lens)``. Flex needs its sparse KV
  block to be a multiple of its BLOCK_N tile, so the page size is 128 by default (16 would force
  16-wide tiles); GQA through ``enable_gqa=True``; no score_mod (``get_score_mod`` is only needed for
  position-dependent score mods and would add a per-element page lookup).
* Kernel: ``torch.compile(flex_attention, dynamic=False)``; decode (1 query token) takes flex's
  split-KV "flex_decoding" template with GQA packing.

Two BlockMask structures, because flex decode sizes its KV splits differently for them
(torch/_inductor/kernel/flex/templates/flex_decode.py.jinja):

* ``"full"``: what ``create_block_mask`` returns (full blocks + partial blocks). Full blocks are
  split by ``cdiv(KV_LEN, SPLIT_KV)`` where KV_LEN is the *physical* pool length, so with a large
  pool one CTA per (sequence, kv head) does all the work: bad at small batch, best (no mask_mod
  calls on full blocks) when SPLIT_KV == 1 (B * Hk >= #SMs / 2).
* ``"partial"``: every block listed as partial (no full blocks; what vLLM's flex backend does).
  Splits follow the sequence's own block count, mask_mod (a physical->logical page lookup) runs on
  every block.

``variant_for_batch`` picks the one expected to be faster (partial when flex would split the KV,
full otherwise); kernel_bench can also time both.

32-bit offsets: flex's template computes ``offs_n * stride_kn`` in int32 (vLLM issue #50427), so a
pool must keep ``n_pages * page_size * D < 2^31`` (16.7M tokens at D = 128) with this layout; head
offsets use INDEX_DTYPE (int64 once a tensor has 2^31 elements) in the templates that have it.
kernel_bench.py sizes the pool accordingly.

fp8 pages: torch's flex templates upcast K/V to the query dtype inside the kernel
(``k = k.to(q.dtype)`` / ``v.to(q.dtype)`` in templates/common.py.jinja, torch >= 2.9 or so), so a bf16
query can read float8_e4m3fn pages directly: k_scale is folded into the softmax scale and v_scale
multiplies the output (same math as vLLM's per-tensor fp8 cache). Torch's CPU flex backend rejects
mixed dtypes and fails to build a mask without full blocks; on CPU those two cases use the eager
(unfused) flex path (smoke checks only).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

import torch
from torch.nn.attention.experimental._paged_attention import PagedAttention
from torch.nn.attention.flex_attention import BlockMask, create_block_mask, flex_attention

VARIANTS = ("full", "partial")


def _flex_fp8(q, k, v, block_mask, scale: float, v_scale: float):
    """bf16 query over fp8 pages: the kernel upcasts K/V tiles; k_scale is inside ``scale``."""
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True) * v_scale


def _flex_bf16(q, k, v, block_mask, scale: float):
    return flex_attention(q, k, v, block_mask=block_mask, scale=scale, enable_gqa=True)


def raise_dynamo_limits(n: int = 128) -> None:
    """One compiled graph per (batch size, mask structure, dtype); the default limit (8) would
    silently fall back to eager flex, which materializes the whole score matrix."""
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(n, getattr(cfg, name)))
    for name in ("accumulated_recompile_limit", "accumulated_cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(4 * n, getattr(cfg, name)))
    if hasattr(cfg, "fail_on_recompile_limit_hit"):
        cfg.fail_on_recompile_limit_hit = True


@dataclass
class FlexBatch:
    """One decode batch laid out for flex: page table, converted BlockMask, lengths."""

    paged: PagedAttention
    block_mask: BlockMask
    seq_lens: torch.Tensor  # [B] int64 on the device
    variant: str
    num_pages_used: int  # sum over sequences of cdiv(len, page_size): kv_indices entries read

    @property
    def batch(self) -> int:
        return int(self.seq_lens.shape[0])


class FlexPagedDecode:
    """A flex-layout paged KV pool (bf16 and/or fp8) and compiled flex decode calls over it."""

    def __init__(
        self,
        n_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        device: torch.device | str,
        dtypes: tuple[str, ...] = ("bf16",),
        compile: bool = True,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
    ) -> None:
        self.n_pages, self.page_size = n_pages, page_size
        self.hk, self.d, self.device = num_kv_heads, head_dim, torch.device(device)
        self.fp8_dtype = fp8_dtype
        n = n_pages * page_size
        self.k: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        for name in dtypes:
            dt = torch.bfloat16 if name == "bf16" else torch.uint8  # fp8 pages kept as bytes
            self.k[name] = torch.empty(1, num_kv_heads, n, head_dim, dtype=dt, device=self.device)
            self.v[name] = torch.empty(1, num_kv_heads, n, head_dim, dtype=dt, device=self.device)
        self.compiled = compile
        if compile:
            raise_dynamo_limits()
            self._bf16 = torch.compile(_flex_bf16, dynamic=False)
            self._fp8 = torch.compile(_flex_fp8, dynamic=False)
        else:
            self._bf16, self._fp8 = _flex_bf16, _flex_fp8
        # CPU inductor's flex template rejects mixed q/kv dtypes, and its C++ template fails to
        # compile a BlockMask without full blocks (torch 2.13): use the unfused path there.
        self.cpu = self.device.type == "cpu"

    def path(self, name: str, variant: str) -> str:
        """"compiled" or "eager" (unfused flex: materializes scores; only for CPU checks)."""
        if not self.compiled or (self.cpu and (name == "fp8" or variant == "partial")):
            return "eager"
        return "compiled"

    # ---------------------------------------------------------------- data
    def fill_random_(self, k_scale: float = 1.0, v_scale: float = 1.0, chunk_tokens: int = 1 << 20) -> None:
        """K, V ~ N(0, 1) in real units; fp8 pages hold fp8(x / scale) bytes (never zeros)."""
        for name in self.k:
            for t, scale in ((self.k[name], k_scale), (self.v[name], v_scale)):
                for h in range(self.hk):
                    for s in range(0, t.shape[2], chunk_tokens):
                        view = t[0, h, s : s + chunk_tokens]
                        if name == "bf16":
                            view.normal_()
                        else:
                            x = torch.randn(view.shape, dtype=torch.bfloat16, device=self.device)
                            view.copy_((x.float() / scale).clamp_(-448.0, 448.0).to(self.fp8_dtype).view(torch.uint8))

    def kv(self, name: str) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = self.k[name], self.v[name]
        if name == "fp8":
            k, v = k.view(self.fp8_dtype), v.view(self.fp8_dtype)
        return k, v

    # ---------------------------------------------------------------- planning
    def plan(self, seq_lens: list[int], variant: str, seed: int = 0) -> FlexBatch:
        """Page table (scattered pages) + converted BlockMask for one decode batch."""
        assert variant in VARIANTS, variant
        b, ps = len(seq_lens), self.page_size
        paged = PagedAttention(self.n_pages, ps, b, device=self.device)
        random.Random(seed).shuffle(paged.empty_pages)  # realistic scatter over the pool
        for i, n in enumerate(seq_lens):
            paged.reserve(torch.tensor(i, device=self.device), torch.tensor(n, device=self.device))
        lens = torch.tensor(seq_lens, dtype=torch.int64, device=self.device)
        max_pages = max(math.ceil(n / ps) for n in seq_lens)
        kv_len = max_pages * ps

        def length_mask(b_, h_, q_idx, kv_idx):
            return kv_idx < lens[b_]

        if variant == "full":
            logical = create_block_mask(length_mask, b, None, 1, kv_len, device=self.device, BLOCK_SIZE=ps)
        else:
            num = torch.tensor([math.ceil(n / ps) for n in seq_lens], dtype=torch.int32, device=self.device)
            idx = torch.arange(max_pages, dtype=torch.int32, device=self.device).expand(b, max_pages)
            logical = BlockMask.from_kv_blocks(
                num.view(b, 1, 1),
                idx.reshape(b, 1, 1, max_pages).contiguous(),
                BLOCK_SIZE=(128, ps),
                mask_mod=length_mask,
                seq_lengths=(1, kv_len),
            )
        try:
            physical = paged.convert_logical_block_mask(logical, kv_len=lens)
        except TypeError:  # a torch without the kv_len bound: the logical mask already bounds by length
            physical = paged.convert_logical_block_mask(logical)
        used = sum(math.ceil(n / ps) for n in seq_lens)
        return FlexBatch(paged, physical, lens, variant, used)

    # ---------------------------------------------------------------- running
    def run(self, q: torch.Tensor, batch: FlexBatch, name: str, scale: float,
            k_scale: float = 1.0, v_scale: float = 1.0) -> torch.Tensor:
        """q: [B, Hq, D] -> [B, Hq, D] (flex output [B, Hq, 1, D] viewed)."""
        q4 = q.unsqueeze(2)
        k, v = self.kv(name)
        eager = self.path(name, batch.variant) == "eager"
        if name == "bf16":
            out = (_flex_bf16 if eager else self._bf16)(q4, k, v, batch.block_mask, scale)
        else:
            out = (_flex_fp8 if eager else self._fp8)(q4, k, v, batch.block_mask, scale * k_scale, v_scale)
        return out.squeeze(2)

    def gather_logical(self, batch: FlexBatch, i: int, name: str, k_scale=1.0, v_scale=1.0):
        """Sequence i's K, V as float32 [Hk, L, D], read back through the page table (for checks)."""
        n, ps = int(batch.seq_lens[i]), self.page_size
        pos = torch.arange(n, device=self.device)
        addr = batch.paged.page_table[i, pos // ps] * ps + pos % ps
        k = self.k[name][0][:, addr]
        v = self.v[name][0][:, addr]
        if name == "fp8":
            return k.view(self.fp8_dtype).float() * k_scale, v.view(self.fp8_dtype).float() * v_scale
        return k.float(), v.float()

    def write_logical(self, batch: FlexBatch, i: int, name: str, k_rows: torch.Tensor, v_rows: torch.Tensor) -> None:
        """Write sequence i's K/V ([L, Hk, D], the cache's storage dtype: bf16 or fp8 bytes) into its
        pages with ``PagedAttention.assign``."""
        n = k_rows.shape[0]
        pos = torch.arange(n, device=self.device, dtype=torch.int32).unsqueeze(0)
        idx = torch.tensor([i], device=self.device, dtype=torch.int32)
        batch.paged.assign(idx, pos, k_rows.transpose(0, 1).unsqueeze(0), v_rows.transpose(0, 1).unsqueeze(0),
                           self.k[name], self.v[name])


def variant_for_batch(batch: int, num_kv_heads: int, num_sms: int) -> str:
    """flex decode's split count is ``max(num_SM // (B * Hkv) * 2, 1)``; with one split the two mask
    structures partition work identically and "full" skips mask_mod, otherwise "partial" splits."""
    return "full" if num_sms // max(batch * num_kv_heads, 1) * 2 <= 1 else "partial"


def _self_check() -> None:
    """Tiny ragged batch vs kvserve.kernels.reference (bf16 and fp8), both mask structures."""
    import os
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
    from kvserve.kernels import reference

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    hq, hk, d, bs, ps = 8, 2, 64, 16, 128
    lens = [300, 1, 129, 64]
    nb = sum(math.ceil(n / bs) for n in lens) + 5
    ks, vs = 0.02, 0.03
    quant = reference.CacheQuant(torch.float8_e4m3fn, 448.0, ks, vs, dev)
    fl = FlexPagedDecode(16, ps, hk, d, dev, dtypes=("bf16", "fp8"))
    fl.fill_random_(ks, vs)
    q = torch.randn(len(lens), hq, d, dtype=torch.bfloat16, device=dev)
    scale = d ** -0.5
    for name in ("bf16", "fp8"):
        cache = torch.empty(nb, 2, bs, hk, d, dtype=torch.bfloat16 if name == "bf16" else torch.uint8, device=dev)
        perm = torch.randperm(nb, device=dev)
        mb = max(math.ceil(n / bs) for n in lens)
        bt = torch.zeros(len(lens), mb, dtype=torch.int32, device=dev)
        used = 0
        for i, n in enumerate(lens):
            m = math.ceil(n / bs)
            bt[i, :m] = perm[used : used + m].int()
            used += m
        for i, n in enumerate(lens):
            pos = torch.arange(n, device=dev)
            slots = bt[i, pos // bs].long() * bs + pos % bs
            reference.store_kv(torch.randn(n, hk, d, device=dev), torch.randn(n, hk, d, device=dev), cache, slots,
                               quant if name == "fp8" else None)
        ref = reference.paged_attention(q, cache, bt, [1] * len(lens), lens, scale, quant=quant if name == "fp8" else None)
        for variant in VARIANTS:
            fb = fl.plan(lens, variant, seed=1)
            rows = cache.view(-1, hk, d)
            for i, n in enumerate(lens):
                pos = torch.arange(n, device=dev)
                r = bt[i, pos // bs].long() * (2 * bs) + pos % bs
                fl.write_logical(fb, i, name, rows[r], rows[r + bs])
            out = fl.run(q, fb, name, scale, ks, vs)
            err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
            print(f"flex {name} {variant}: rel err vs reference {err:.2e}")
            assert err <= 2e-2


if __name__ == "__main__":
    _self_check()
