"""The reference KV-cache kernels (``store_kv``, ``paged_attention``) vs a naive dense float64
implementation on the unpaged K/V, with random non-contiguous block tables, GQA ratios 1/2/4,
head sizes 64/128, block sizes 16/32, mixed batches of decodes and prefill chunks with context."""

from __future__ import annotations

import zlib

import pytest
import torch

from kvserve.kernels import reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])

TOL = {
    torch.float32: dict(atol=2e-5, rtol=1e-5),
    torch.bfloat16: dict(atol=2e-2, rtol=1.6e-2),
}

# (head_size, num_heads, num_kv_heads, block_size)
SHAPES = {
    "d64-mha-bs16": (64, 4, 4, 16),
    "d128-gqa2-bs32": (128, 8, 4, 32),
    "d64-gqa4-bs16": (64, 8, 2, 16),
    "d128-gqa4-bs16": (128, 4, 1, 16),
    "d64-gqa2-bs32": (64, 6, 3, 32),
}

# (query_len, context_len) per sequence
BATCHES = {
    "decode": [(1, 0), (1, 1), (1, 15), (1, 16), (1, 40), (1, 63)],
    "prefill": [(20, 0), (5, 0), (33, 0), (2, 0)],
    "mixed": [(1, 37), (7, 25), (1, 0), (16, 16), (1, 64), (40, 9), (2, 31), (13, 0)],
    "long": [(1, 300), (48, 211), (1, 95), (3, 0)],
}


pytestmark = pytest.mark.usefixtures("one_thread")


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int, scale: float) -> torch.Tensor:
    """Naive causal attention in float64. q: [n, Hq, D] at positions ctx..ctx+n-1; k/v: [ctx+n, Hk, D].
    Query head h reads kv head h // (Hq // Hk) (Hugging Face's repeat_kv grouping)."""
    q, k, v = q.double(), k.double(), v.double()
    n, hq, _ = q.shape
    length, hk, _ = k.shape
    assert length == ctx + n
    group = hq // hk
    out = torch.empty(n, hq, q.shape[2], dtype=torch.float64)
    for h in range(hq):
        kh, vh = k[:, h // group], v[:, h // group]  # [L, D]
        scores = (q[:, h] @ kh.T) * scale  # [n, L]
        for t in range(n):
            visible = ctx + t + 1
            s = scores[t, :visible]
            p = torch.exp(s - s.max())
            p = p / p.sum()
            out[t, h] = p @ vh[:visible]
    return out


def build_paged(batch, head_size, num_kv_heads, block_size, dtype, gen, device, extra_blocks=5):
    """Random dense K/V per sequence, scattered into a NaN-poisoned cache through block tables drawn
    from a shuffled pool (tables padded with unrelated block ids). Writes by plain indexing."""
    seq_lens = [q + c for q, c in batch]
    nblocks = [-(-n // block_size) for n in seq_lens]
    num_blocks = sum(nblocks) + extra_blocks
    pool = torch.randperm(num_blocks, generator=gen)
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    max_blocks = max(nblocks) + 2
    tables = torch.randint(0, num_blocks, (len(batch), max_blocks), generator=gen)  # garbage padding
    ks, vs, start = [], [], 0
    for i, (n, nb) in enumerate(zip(seq_lens, nblocks)):
        ids = pool[start : start + nb]
        start += nb
        tables[i, :nb] = ids
        k = (torch.randn(n, num_kv_heads, head_size, generator=gen) * 1.5).to(dtype)
        v = torch.randn(n, num_kv_heads, head_size, generator=gen).to(dtype)
        pos = torch.arange(n)
        cache[ids[pos // block_size], 0, pos % block_size] = k
        cache[ids[pos // block_size], 1, pos % block_size] = v
        ks.append(k)
        vs.append(v)
    return cache.to(device), tables.to(device), ks, vs, seq_lens


@pytest.fixture
def poisoned_outputs(monkeypatch):
    """Make fresh ``torch.empty_like`` tensors NaN so rows the kernel forgets to write show up."""
    original = torch.empty_like

    def empty_like(*args, **kwargs):
        t = original(*args, **kwargs)
        if t.is_floating_point():
            t.fill_(float("nan"))
        return t

    monkeypatch.setattr(torch, "empty_like", empty_like)


def _nan_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return bool(((a == b) | (a.isnan() & b.isnan())).all())


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("batch_name", list(BATCHES))
@pytest.mark.parametrize("shape_name", list(SHAPES))
def test_paged_attention_vs_dense(shape_name, batch_name, dtype, device, poisoned_outputs):
    head_size, num_heads, num_kv_heads, block_size = SHAPES[shape_name]
    batch = BATCHES[batch_name]
    seed = zlib.crc32(f"{shape_name}/{batch_name}/{dtype}".encode())
    gen = torch.Generator().manual_seed(seed)
    cache, tables, ks, vs, seq_lens = build_paged(batch, head_size, num_kv_heads, block_size, dtype, gen, device)
    query_lens = [q for q, _ in batch]
    query = (torch.randn(sum(query_lens), num_heads, head_size, generator=gen) * 2.0).to(dtype).to(device)
    scale = head_size**-0.5
    cache_before, query_before = cache.clone(), query.clone()

    out = reference.paged_attention(query, cache, tables, query_lens, seq_lens, scale)

    assert out.shape == query.shape and out.dtype == dtype and out.device == query.device
    assert torch.isfinite(out).all(), "NaN/inf in output: unwritten rows or poisoned slots were read"
    assert _nan_equal(cache, cache_before) and torch.equal(query, query_before), "inputs were modified"
    start = 0
    for i, (n, ctx) in enumerate(batch):
        expected = dense_attention(query[start : start + n].cpu(), ks[i], vs[i], ctx, scale)
        got = out[start : start + n].cpu().double()
        torch.testing.assert_close(got, expected, **TOL[dtype], msg=lambda m: f"sequence {i} {batch[i]}: {m}")
        start += n


def test_dense_reference_sanity():
    """The test's own reference: one key -> output is that value; uniform keys -> mean of values."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, 8, generator=gen)
    v = torch.randn(1, 1, 8, generator=gen)
    assert torch.allclose(dense_attention(q, torch.randn(1, 1, 8, generator=gen), v, 0, 0.3), v.double().expand(1, 2, 8))
    k = torch.ones(5, 1, 8)
    v5 = torch.randn(5, 1, 8, generator=gen)
    out = dense_attention(torch.randn(1, 2, 8, generator=gen), k, v5, 4, 0.3)
    assert torch.allclose(out[0, 0], v5[:, 0].double().mean(0))


@pytest.mark.parametrize("device", DEVICES)
def test_paged_attention_scale_and_grouping(device):
    """Head grouping is h // group (not h % num_kv_heads) and ``scale`` is applied: distinct kv
    heads with distinct values and a scale far from 1/sqrt(d) must still match the dense result."""
    gen = torch.Generator().manual_seed(5)
    batch = [(1, 20), (6, 10)]
    cache, tables, ks, vs, seq_lens = build_paged(batch, 64, 2, 16, torch.float32, gen, device)
    query = torch.randn(7, 8, 64, generator=gen).to(device)
    for scale in (0.02, 0.5):
        out = reference.paged_attention(query, cache, tables, [1, 6], seq_lens, scale)
        start = 0
        for i, (n, ctx) in enumerate(batch):
            expected = dense_attention(query[start : start + n].cpu(), ks[i], vs[i], ctx, scale)
            torch.testing.assert_close(out[start : start + n].cpu().double(), expected, **TOL[torch.float32])
            start += n


# ---- store_kv -------------------------------------------------------------------------------
def _flat_slots(cache: torch.Tensor) -> torch.Tensor:
    """[num_blocks, 2, bs, H, D] -> [2, num_blocks * bs, H, D] (slot-major view for checking)."""
    nb, _, bs, h, d = cache.shape
    return cache.transpose(0, 1).reshape(2, nb * bs, h, d)


STORE_CASES = {
    "fp32-bs16-d64": (torch.float32, torch.float32, 16, 2, 64),
    "fp32-bs32-d128": (torch.float32, torch.float32, 32, 4, 128),
    "bf16-bs16-d128": (torch.bfloat16, torch.bfloat16, 16, 1, 128),
    "fp32-into-bf16-bs32-d64": (torch.float32, torch.bfloat16, 32, 2, 64),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("case", list(STORE_CASES))
def test_store_kv_writes_only_its_slots(case, device):
    in_dtype, cache_dtype, block_size, num_kv_heads, head_size = STORE_CASES[case]
    gen = torch.Generator().manual_seed(len(case) * 7 + block_size)
    num_blocks, num_tokens = 9, 37
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_size), float("nan"), dtype=cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    pad = torch.zeros(num_tokens, dtype=torch.bool)
    pad[torch.randperm(num_tokens, generator=gen)[:8]] = True
    pad[-1] = True
    slots = torch.where(pad, torch.full_like(slots, -1), slots)
    key = (torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) * 3).to(in_dtype)
    value = (torch.randn(num_tokens, num_kv_heads, head_size, generator=gen) + 0.5).to(in_dtype)
    cache, key_d, value_d = cache.to(device), key.to(device), value.to(device)

    reference.store_kv(key_d, value_d, cache, slots.to(device))

    flat = _flat_slots(cache.cpu())
    valid = ~pad
    torch.testing.assert_close(flat[0, slots[valid]], key[valid].to(cache_dtype), atol=0, rtol=0)
    torch.testing.assert_close(flat[1, slots[valid]], value[valid].to(cache_dtype), atol=0, rtol=0)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots[valid]] = False
    assert untouched.sum() == num_blocks * block_size - int(valid.sum())
    assert flat[:, untouched].isnan().all(), "store_kv wrote a slot it was not given (or a -1 row)"
    # the block/offset layout is [block, K|V, offset]: check one slot by hand
    j = int(valid.nonzero()[0])
    b, o = divmod(int(slots[j]), block_size)
    assert torch.equal(cache.cpu()[b, 0, o], key[j].to(cache_dtype))
    assert torch.equal(cache.cpu()[b, 1, o], value[j].to(cache_dtype))


@pytest.mark.parametrize("device", DEVICES)
def test_store_kv_all_padding_and_overwrite(device):
    gen = torch.Generator().manual_seed(3)
    cache = torch.full((4, 2, 16, 2, 64), float("nan")).to(device)
    key = torch.randn(5, 2, 64, generator=gen).to(device)
    reference.store_kv(key, key + 1, cache, torch.full((5,), -1, dtype=torch.long, device=device))
    assert cache.isnan().all(), "an all-padding slot mapping wrote something"

    slots = torch.tensor([3, 17, 40, 63, 0], device=device)
    reference.store_kv(key, -key, cache, slots)
    key2 = torch.randn(3, 2, 64, generator=gen).to(device)
    reference.store_kv(key2, 2 * key2, cache, torch.tensor([17, -1, 0], device=device))
    flat = _flat_slots(cache.cpu())
    torch.testing.assert_close(flat[0, [3, 40, 63]], key[[0, 2, 3]].cpu(), atol=0, rtol=0)
    torch.testing.assert_close(flat[1, [3, 40, 63]], -key[[0, 2, 3]].cpu(), atol=0, rtol=0)
    torch.testing.assert_close(flat[0, [17, 0]], key2[[0, 2]].cpu(), atol=0, rtol=0)  # overwritten
    torch.testing.assert_close(flat[1, [17, 0]], 2 * key2[[0, 2]].cpu(), atol=0, rtol=0)
    rest = torch.ones(64, dtype=torch.bool)
    rest[[0, 3, 17, 40, 63]] = False
    assert flat[:, rest].isnan().all()


# ---- store + attend over several steps, as the attention layer drives them ------------------
@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape_name", ["d64-gqa4-bs16", "d128-gqa2-bs32"])
def test_store_then_attend_over_steps(shape_name, dtype, device, poisoned_outputs):
    """Sequences advance by chunks of different sizes (prefill chunks, then decodes); each step
    stores this step's K/V through the slot mapping (with -1 padding rows) and attends. Every
    step's output matches dense attention over all K/V so far."""
    head_size, num_heads, num_kv_heads, block_size = SHAPES[shape_name]
    gen = torch.Generator().manual_seed(17 + head_size)
    schedule = [  # new tokens per sequence per step (0 = not scheduled)
        [13, 20, 9],
        [13, 20, 0],
        [19, 30, 0],
        [0, 0, 1],
        [1, 1, 1],
        [1, 1, 0],
    ]
    total = [sum(col) for col in zip(*schedule)]  # final lengths: 47, 72, 11
    num_blocks = sum(-(-(t + 2) // block_size) for t in total) + 4
    pool = torch.randperm(num_blocks, generator=gen).tolist()
    cache = torch.full((num_blocks, 2, block_size, num_kv_heads, head_size), float("nan"), dtype=dtype)
    cache = cache.to(device)
    full_k = [(torch.randn(t + 2, num_kv_heads, head_size, generator=gen) * 1.5).to(dtype) for t in total]
    full_v = [torch.randn(t + 2, num_kv_heads, head_size, generator=gen).to(dtype) for t in total]
    full_q = [(torch.randn(t + 2, num_heads, head_size, generator=gen) * 2).to(dtype) for t in total]
    tables: list[list[int]] = [[] for _ in total]
    done = [0] * len(total)
    scale = head_size**-0.5
    for step in schedule:
        rows = [i for i, n in enumerate(step) if n]
        slots, qs, ks, vs, query_lens, seq_lens = [], [], [], [], [], []
        for i in rows:
            n, start = step[i], done[i]
            while len(tables[i]) * block_size < start + n:
                tables[i].append(pool.pop())
            pos = torch.arange(start, start + n)
            table = torch.tensor(tables[i])
            slots.append(table[pos // block_size] * block_size + pos % block_size)
            qs.append(full_q[i][start : start + n])
            ks.append(full_k[i][start : start + n])
            vs.append(full_v[i][start : start + n])
            query_lens.append(n)
            seq_lens.append(start + n)
        # two padding rows at the end of the batch, as a padded (graph) batch would have
        slot_mapping = torch.cat(slots + [torch.tensor([-1, -1])])
        key = torch.cat(ks + [torch.randn(2, num_kv_heads, head_size, generator=gen).to(dtype)])
        value = torch.cat(vs + [torch.randn(2, num_kv_heads, head_size, generator=gen).to(dtype)])
        width = max(len(tables[i]) for i in rows)
        block_tables = torch.zeros(len(rows), width, dtype=torch.long)
        for r, i in enumerate(rows):
            block_tables[r, : len(tables[i])] = torch.tensor(tables[i])
        query = torch.cat(qs)

        reference.store_kv(key.to(device), value.to(device), cache, slot_mapping.to(device))
        out = reference.paged_attention(
            query.to(device), cache, block_tables.to(device), query_lens, seq_lens, scale
        )
        assert torch.isfinite(out).all()
        start = 0
        for r, i in enumerate(rows):
            n, ctx = query_lens[r], seq_lens[r] - query_lens[r]
            expected = dense_attention(
                query[start : start + n], full_k[i][: seq_lens[r]], full_v[i][: seq_lens[r]], ctx, scale
            )
            torch.testing.assert_close(out[start : start + n].cpu().double(), expected, **TOL[dtype])
            start += n
        for r, i in enumerate(rows):
            done[i] = seq_lens[r]
    assert done == total
    # every slot that no sequence owns is still poisoned (padding rows wrote nothing)
    owned = torch.zeros(num_blocks * block_size, dtype=torch.bool)
    for i, t in enumerate(total):
        pos = torch.arange(t)
        owned[torch.tensor(tables[i])[pos // block_size] * block_size + pos % block_size] = True
    assert _flat_slots(cache.cpu())[:, ~owned].isnan().all()
    assert not _flat_slots(cache.cpu())[:, owned].isnan().any()
    assert int(owned.sum()) == sum(total)


@pytest.mark.parametrize("device", DEVICES)
def test_one_plan_shared_by_layers(device):
    """A step's gather plan, built once and passed to every layer, gives each layer (own cache,
    own queries) the same result as dense attention."""
    if not hasattr(reference, "plan_attention"):
        pytest.skip("no plan_attention in this kernel version")
    gen = torch.Generator().manual_seed(23)
    batch = BATCHES["mixed"]
    query_lens = [q for q, _ in batch]
    cache1, tables, ks1, vs1, seq_lens = build_paged(batch, 64, 2, 16, torch.float32, gen, device)
    # a second layer: same block tables, different contents
    cache2 = torch.full_like(cache1, float("nan"))
    ks2, vs2 = [], []
    for i, n in enumerate(seq_lens):
        k = torch.randn(n, 2, 64, generator=gen)
        v = torch.randn(n, 2, 64, generator=gen)
        pos = torch.arange(n)
        blocks = tables[i].cpu()[pos // 16]
        cache2[blocks, 0, pos % 16] = k.to(device)
        cache2[blocks, 1, pos % 16] = v.to(device)
        ks2.append(k)
        vs2.append(v)
    plan = reference.plan_attention(tables, query_lens, seq_lens, 16)
    for cache, ks, vs in ((cache1, ks1, vs1), (cache2, ks2, vs2)):
        query = torch.randn(sum(query_lens), 8, 64, generator=gen).to(device)
        out = reference.paged_attention(query, cache, tables, query_lens, seq_lens, 0.125, plan=plan)
        start = 0
        for i, (n, ctx) in enumerate(batch):
            expected = dense_attention(query[start : start + n].cpu(), ks[i], vs[i], ctx, 0.125)
            torch.testing.assert_close(out[start : start + n].cpu().double(), expected, **TOL[torch.float32])
            start += n


def test_decode_groups_bound_padding_and_cover_every_row():
    """Decodes are grouped by context length: every decode row lands in exactly one group, and a
    group pads to at most 1.3x its shortest context (a 2k-token row does not pad 20 short ones)."""
    seq_lens = [5, 1900, 6, 7, 300, 1890, 310, 40, 1]
    query_lens = [1] * len(seq_lens)
    tables = torch.arange(len(seq_lens) * 120).view(len(seq_lens), 120)
    plan = reference.plan_attention(tables, query_lens, seq_lens, 16)
    rows = sorted(r for g in plan.decodes for r in g.rows.tolist())
    assert rows == list(range(len(seq_lens)))
    for g in plan.decodes:
        lens = [seq_lens[r] for r in g.rows.tolist()]
        assert g.k_rows.shape[1] == max(lens) <= 1.3 * min(lens)
        assert (g.mask == 0).sum().item() == sum(lens)  # one visible key per real position
    assert len(plan.decodes) >= 4
