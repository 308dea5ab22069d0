"""Unit tests of the paged-KV bookkeeping: BlockPool (ref counts, LRU free queue, hash cache) and
KVCacheManager (prefix-cache lookup, slot allocation, freeing). No model involved."""

from __future__ import annotations

import random

import pytest

from kvserve.engine.kv_cache import BlockPool, KVCacheManager, hash_block
from kvserve.engine.request import Request
from kvserve.engine.sampling import SamplingParams

BS = 4  # small blocks keep the arithmetic readable


# ---- helpers -------------------------------------------------------------------------------
def make_req(rid: str, tokens) -> Request:
    return Request(rid, list(tokens), SamplingParams(temperature=0, max_tokens=8))


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> tuple[bool, int]:
    """What the scheduler does for a waiting request: prefix lookup, allocate, advance."""
    assert req.num_computed_tokens == 0
    hits, num_hit = kv.get_computed_blocks(req)
    assert num_hit == len(hits) * kv.block_size
    if num_new is None:
        num_new = req.num_tokens - num_hit
    ok = kv.allocate_slots(req, num_new, hits)
    if ok:
        req.num_computed_tokens = num_hit + num_new
    kv.check_invariants()
    return ok, num_hit


def grow(kv: KVCacheManager, req: Request, num_new: int) -> bool:
    """What the scheduler does for a running request (next chunk / decode)."""
    ok = kv.allocate_slots(req, num_new)
    if ok:
        req.num_computed_tokens += num_new
    kv.check_invariants()
    return ok


def release(kv: KVCacheManager, req: Request) -> None:
    kv.free(req)
    kv.check_invariants()


def free_order(kv: KVCacheManager) -> list[int]:
    return list(kv.pool.free_queue)


def snapshot(kv: KVCacheManager, *reqs: Request):
    pool = kv.pool
    return (
        list(pool.free_queue),
        [b.ref_cnt for b in pool.blocks],
        [b.block_hash for b in pool.blocks],
        {h: b.block_id for h, b in pool.cached.items()},
        {rid: [b.block_id for b in blocks] for rid, blocks in kv.req_to_blocks.items()},
        dict(kv._num_cached_blocks),
        [r.num_computed_tokens for r in reqs],
    )


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


# ---- BlockPool -----------------------------------------------------------------------------
def test_new_pool_is_all_free_in_id_order():
    kv = KVCacheManager(6, BS)
    assert kv.num_free_blocks == 6 == kv.pool.num_blocks
    assert free_order(kv) == [0, 1, 2, 3, 4, 5]
    assert kv.usage == 0.0
    kv.check_invariants()


def test_pool_rejects_empty():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockPool(0, True)


def test_pool_get_new_blocks_beyond_free_raises_and_keeps_state():
    pool = BlockPool(3, True)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(2)
    assert list(pool.free_queue) == [2]


def test_double_free_is_caught():
    pool = BlockPool(2, True)
    (b,) = pool.get_new_blocks(1)
    pool.free([b])
    with pytest.raises(AssertionError, match="double free"):
        pool.free([b])


# ---- allocation / free / ref counts --------------------------------------------------------
def test_allocate_and_free_ref_counts():
    kv = KVCacheManager(6, BS)
    a = make_req("a", toks(100, 10))  # 3 blocks (4 + 4 + 2)
    b = make_req("b", toks(200, 5))  # 2 blocks
    assert admit(kv, a) == (True, 0)
    assert kv.get_block_ids("a") == [0, 1, 2]
    assert admit(kv, b) == (True, 0)
    assert kv.get_block_ids("b") == [3, 4]
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [1, 1, 1, 1, 1, 0]
    assert kv.num_free_blocks == 1
    assert kv.usage == pytest.approx(5 / 6)

    release(kv, a)
    assert kv.get_block_ids("a") == []
    # a's blocks join the tail, last block first
    assert free_order(kv) == [5, 2, 1, 0]
    assert [blk.ref_cnt for blk in kv.pool.blocks] == [0, 0, 0, 1, 1, 0]
    release(kv, b)
    assert kv.num_free_blocks == 6
    release(kv, b)  # freeing an unknown / already freed request is a no-op
    assert kv.num_free_blocks == 6


def test_blocks_grow_one_at_a_time_and_full_blocks_get_hashed():
    kv = KVCacheManager(8, BS)
    r = make_req("r", toks(1, 3))
    admit(kv, r)
    assert len(kv.get_block_ids("r")) == 1
    assert kv.pool.cached == {}  # the only block is partial
    for step in range(10):  # decode: one new token per step
        r.append_output_token(50 + step)
        assert grow(kv, r, 1)
        n = r.num_computed_tokens
        assert len(kv.get_block_ids("r")) == -(-n // BS)
        full = n // BS
        blocks = kv.req_to_blocks["r"]
        assert len(r.block_hashes) == r.num_tokens // BS
        for i, blk in enumerate(blocks):
            if i < full:
                assert blk.block_hash == r.block_hashes[i]
                assert kv.pool.lookup(r.block_hashes[i]) is blk
            else:
                assert blk.block_hash is None


def test_chunked_allocation_only_caches_computed_blocks():
    kv = KVCacheManager(8, BS)
    r = make_req("r", toks(1, 14))
    ok, _ = admit(kv, r, num_new=5)  # first chunk: 5 tokens -> 2 blocks, 1 full
    assert ok and len(kv.get_block_ids("r")) == 2
    assert len(kv.pool.cached) == 1
    assert grow(kv, r, 6)  # 11 tokens -> 3 blocks, 2 full
    assert len(kv.get_block_ids("r")) == 3 and len(kv.pool.cached) == 2
    assert grow(kv, r, 3)  # 14 tokens -> 4 blocks, 3 full
    assert len(kv.get_block_ids("r")) == 4 and len(kv.pool.cached) == 3
    # a second request sees exactly the computed full blocks
    s = make_req("s", toks(1, 14))
    assert admit(kv, s) == (True, 12)


# ---- prefix caching ------------------------------------------------------------------------
def test_prefix_hit_on_shared_prefix_while_owner_runs():
    kv = KVCacheManager(8, BS)
    prefix = toks(10, 8)
    a = make_req("a", prefix + [90, 91, 92])
    b = make_req("b", prefix + [80])
    admit(kv, a)
    ok, hit = admit(kv, b)
    assert ok and hit == 8
    assert b.num_computed_tokens == 9
    a_ids, b_ids = kv.get_block_ids("a"), kv.get_block_ids("b")
    assert b_ids[:2] == a_ids[:2]
    assert b_ids[2] not in a_ids
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids] == [2, 2, 1]

    release(kv, a)  # the shared blocks stay in use by b
    assert [kv.pool.blocks[i].ref_cnt for i in a_ids] == [1, 1, 0]
    assert a_ids[0] not in kv.pool.free_queue and a_ids[1] not in kv.pool.free_queue
    assert a_ids[2] in kv.pool.free_queue
    release(kv, b)
    assert kv.num_free_blocks == 8


def test_prefix_hit_on_freed_cached_blocks_takes_them_off_the_free_queue():
    kv = KVCacheManager(6, BS)
    a = make_req("a", toks(10, 12))
    admit(kv, a)
    a_ids = kv.get_block_ids("a")
    release(kv, a)
    assert kv.num_free_blocks == 6
    b = make_req("b", toks(10, 9))  # shares a's first two blocks
    ok, hit = admit(kv, b)
    assert ok and hit == 8
    assert kv.get_block_ids("b")[:2] == a_ids[:2]
    assert a_ids[0] not in kv.pool.free_queue and a_ids[1] not in kv.pool.free_queue
    assert kv.num_free_blocks == 3
    assert kv.prefix_cache_hits >= 8


def test_chained_hash_same_block_at_other_prefix_does_not_hit():
    kv = KVCacheManager(16, BS)
    blk_x, blk_y, blk_z = toks(10, 4), toks(20, 4), toks(30, 4)
    a = make_req("a", blk_x + blk_y + [1])
    admit(kv, a)
    assert hash_block(None, blk_y) != hash_block(hash_block(None, blk_x), blk_y)
    # same second block, different first block: no hit at all
    b = make_req("b", blk_z + blk_y + [1])
    ok, hit = admit(kv, b)
    assert ok and hit == 0
    # block y alone as the first block: no hit either
    c = make_req("c", blk_y + [1])
    assert admit(kv, c) == (True, 0)
    # x, z, y: only x matches
    d = make_req("d", blk_x + blk_z + blk_y + [1])
    assert admit(kv, d) == (True, 4)
    # the hit is by content, independent of the request id
    e = make_req("a-again", blk_x + blk_y + [2])
    assert admit(kv, e) == (True, 8)


@pytest.mark.parametrize("n", list(range(1, 4 * BS + 2)))
def test_last_token_is_always_recomputed(n):
    """vLLM: hit = floor((len - 1) / bs) * bs for a fully cached prompt."""
    kv = KVCacheManager(8, BS)
    prompt = toks(7, n)
    warm = make_req("warm", prompt + [1, 2, 3, 4, 5])  # caches every full block of the prompt
    admit(kv, warm)
    release(kv, warm)
    r = make_req("r", prompt)
    ok, hit = admit(kv, r)
    assert ok
    assert hit == ((n - 1) // BS) * BS
    assert hit < n
    if n % BS == 0:
        assert hit == n - BS  # k full blocks cached -> only k - 1 hit
    assert r.num_computed_tokens == n
    assert len(kv.get_block_ids("r")) == -(-n // BS)


def test_caching_disabled_never_hits_or_hashes():
    kv = KVCacheManager(6, BS, enable_caching=False)
    a = make_req("a", toks(10, 12))
    admit(kv, a)
    release(kv, a)
    b = make_req("b", toks(10, 12))
    assert admit(kv, b) == (True, 0)
    assert kv.pool.cached == {}
    assert all(blk.block_hash is None for blk in kv.pool.blocks)


def test_reset_prefix_cache_only_when_idle():
    kv = KVCacheManager(6, BS)
    a = make_req("a", toks(10, 9))
    admit(kv, a)
    assert kv.reset_prefix_cache() is False
    assert len(kv.pool.cached) == 2
    release(kv, a)
    assert kv.reset_prefix_cache() is True
    assert kv.pool.cached == {} and all(b.block_hash is None for b in kv.pool.blocks)
    b = make_req("b", toks(10, 9))
    assert admit(kv, b) == (True, 0)


# ---- LRU eviction --------------------------------------------------------------------------
def test_lru_eviction_order_tail_first_free_and_hash_drop():
    kv = KVCacheManager(6, BS)
    a = make_req("a", toks(10, 12))  # 3 full blocks, all cached
    admit(kv, a)
    a_ids = kv.get_block_ids("a")
    assert a_ids == [0, 1, 2]
    a_hashes = list(a.block_hashes)
    release(kv, a)
    # freed blocks go to the tail, a request's blocks tail-first
    assert free_order(kv) == [3, 4, 5, 2, 1, 0]

    c = make_req("c", toks(200, 12))  # takes the never-used blocks first
    admit(kv, c)
    assert kv.get_block_ids("c") == [3, 4, 5]
    assert all(kv.pool.lookup(h) is not None for h in a_hashes)

    d = make_req("d", toks(300, 3))  # now evicts a's LAST block (its suffix goes first)
    admit(kv, d)
    assert kv.get_block_ids("d") == [2]
    assert kv.pool.blocks[2].block_hash is None
    assert kv.pool.lookup(a_hashes[2]) is None
    assert kv.pool.lookup(a_hashes[0]) is kv.pool.blocks[0]
    assert kv.pool.lookup(a_hashes[1]) is kv.pool.blocks[1]

    # a's prefix (two blocks) still hits after the suffix was evicted
    a2 = make_req("a2", toks(10, 12) + [99])
    release(kv, c)  # room for a2's remaining blocks: free = [5, 4, 3, 1, 0] (c tail-first)
    assert free_order(kv) == [1, 0, 5, 4, 3]
    ok, hit = admit(kv, a2)
    assert ok and hit == 8
    assert kv.get_block_ids("a2")[:2] == [0, 1]
    # the two remaining blocks came from the head of the LRU queue
    assert kv.get_block_ids("a2")[2:] == [5, 4]
    assert free_order(kv) == [3]


def test_touched_block_moves_to_tail_when_freed_again():
    kv = KVCacheManager(6, BS)
    a = make_req("a", toks(10, 12))
    admit(kv, a)
    release(kv, a)
    assert free_order(kv) == [3, 4, 5, 2, 1, 0]
    b = make_req("b", toks(10, 4) + [77, 78])  # hits block 0 only, one new block (3)
    assert admit(kv, b) == (True, 4)
    assert kv.get_block_ids("b") == [0, 3]
    release(kv, b)
    assert free_order(kv) == [4, 5, 2, 1, 3, 0]  # block 0 was used most recently -> last to go
    # evict 4 blocks: 4, 5, 2, 1 go; 3 (unhashed) and 0 (a's first block) remain
    e = make_req("e", toks(400, 16))
    admit(kv, e)
    assert kv.get_block_ids("e") == [4, 5, 2, 1]
    assert kv.pool.lookup(a.block_hashes[0]) is kv.pool.blocks[0]
    assert kv.pool.lookup(a.block_hashes[1]) is None
    assert kv.pool.lookup(a.block_hashes[2]) is None


# ---- allocation failure --------------------------------------------------------------------
def test_allocate_slots_short_pool_returns_false_and_changes_nothing():
    kv = KVCacheManager(4, BS)
    a = make_req("a", toks(10, 11))  # 3 blocks
    admit(kv, a)
    b = make_req("b", toks(100, 6))  # needs 2, only 1 free
    before = snapshot(kv, a, b)
    ok, _ = admit(kv, b)
    assert not ok
    assert snapshot(kv, a, b) == before
    assert "b" not in kv.req_to_blocks

    # a running request that needs 2 more blocks when 1 is free
    before = snapshot(kv, a, b)
    assert not grow(kv, a, 6)
    assert snapshot(kv, a, b) == before

    # exactly enough is fine
    assert grow(kv, a, 5)  # 16 tokens = 4 blocks
    assert kv.num_free_blocks == 0
    assert not grow(kv, a, 1)


def test_reclaimable_cached_hits_are_not_double_counted():
    """Free cached blocks hit by the request leave the free queue, so they cannot also be handed
    out as new blocks: free=4 with 2 of them being the hits leaves only 2 for new blocks."""
    kv = KVCacheManager(4, BS)
    prefix = toks(10, 8)
    a = make_req("a", prefix + [1, 2, 3, 4])
    admit(kv, a)
    release(kv, a)
    assert kv.num_free_blocks == 4
    b = make_req("b", prefix + toks(500, 9))  # 17 tokens: 2 hits + 3 new = 5 blocks > 4
    before = snapshot(kv, b)
    hits, num_hit = kv.get_computed_blocks(b)
    assert num_hit == 8 and all(h.ref_cnt == 0 for h in hits)
    assert kv.allocate_slots(b, b.num_tokens - num_hit, hits) is False
    kv.check_invariants()
    assert snapshot(kv, b)[:6] == before[:6]
    # 16 tokens: 2 hits + 2 new = 4 blocks: fits exactly
    c = make_req("c", prefix + toks(500, 8))
    assert admit(kv, c) == (True, 8)
    assert kv.num_free_blocks == 0


def test_hits_held_by_running_requests_are_not_subtracted():
    """Hits already in use (ref > 0) are not in the free queue: all free blocks stay usable."""
    kv = KVCacheManager(5, BS)
    prefix = toks(10, 8)
    a = make_req("a", prefix + [1, 2, 3])  # 3 blocks, running
    admit(kv, a)
    assert kv.num_free_blocks == 2
    b = make_req("b", prefix + toks(600, 8))  # 2 shared hits + 2 new = exactly the 2 free
    ok, hit = admit(kv, b)
    assert ok and hit == 8
    assert kv.num_free_blocks == 0
    assert [kv.pool.blocks[i].ref_cnt for i in kv.get_block_ids("b")] == [2, 2, 1, 1]


def test_failed_admission_with_hits_touches_nothing():
    kv = KVCacheManager(3, BS)
    a = make_req("a", toks(10, 8))
    admit(kv, a)
    release(kv, a)
    filler = make_req("filler", toks(900, 4))
    admit(kv, filler)  # evicts the never-used block 2; a's two cached blocks stay free
    assert kv.get_block_ids("filler") == [2]
    b = make_req("b", toks(10, 8) + toks(700, 5))  # 2 hits + 2 new; only the 2 hits are free
    before = snapshot(kv, b, filler)
    ok, _ = admit(kv, b)
    assert not ok
    assert snapshot(kv, b, filler) == before
    assert all(kv.pool.lookup(h) is not None for h in a.block_hashes)


# ---- blocks cached for a step that never ran -----------------------------------------------
def test_uncache_unconfirmed_drops_only_the_last_steps_blocks():
    kv = KVCacheManager(8, BS)
    a = make_req("a", toks(10, 8))
    admit(kv, a)  # caches blocks 0, 1 (their step has not run yet)
    kv.confirm_cached_blocks()  # ... now it has
    a.append_output_token(5)
    for t in range(3):
        a.append_output_token(6 + t)
    assert grow(kv, a, 4)  # tokens 8..11: block 2 becomes full and is cached, unconfirmed
    h = list(a.block_hashes)
    assert all(kv.pool.lookup(x) is not None for x in h[:3])
    kv.uncache_unconfirmed(a)
    kv.check_invariants()
    assert kv.pool.lookup(h[0]) is not None and kv.pool.lookup(h[1]) is not None
    assert kv.pool.lookup(h[2]) is None
    assert kv.req_to_blocks["a"][2].block_hash is None
    kv.uncache_unconfirmed(a)  # idempotent
    release(kv, a)
    b = make_req("b", a.all_token_ids + [1])
    assert admit(kv, b) == (True, 8)


def test_uncache_unconfirmed_keeps_a_block_shared_by_a_same_step_hit():
    kv = KVCacheManager(8, BS)
    a = make_req("a", toks(10, 9))
    b = make_req("b", toks(10, 9))
    admit(kv, a)
    assert admit(kv, b) == (True, 8)  # hits a's blocks in the same step
    shared = kv.req_to_blocks["a"][:2]
    kv.uncache_unconfirmed(a)
    release(kv, a)
    assert all(blk.ref_cnt == 1 and blk.block_hash is None for blk in shared)
    kv.uncache_unconfirmed(b)  # b cached nothing of its own
    release(kv, b)
    assert kv.num_free_blocks == 8 and kv.pool.cached == {}


def test_prompt_logprobs_requests_skip_prefix_cache_reads():
    kv = KVCacheManager(8, BS)
    a = make_req("a", toks(10, 9))
    admit(kv, a)
    r = Request("r", toks(10, 9), SamplingParams(temperature=0, max_tokens=2, prompt_logprobs=1))
    assert admit(kv, r) == (True, 0)


# ---- randomized model check ----------------------------------------------------------------
@pytest.mark.parametrize("seed", range(10))
@pytest.mark.parametrize("enable_caching", [True, False])
def test_random_ops_keep_kv_contents_consistent(seed, enable_caching):
    """Random admissions / chunks / decodes / frees / preemptions over prompts that share
    prefixes. A fake KV store records, per slot, the token prefix whose K/V it holds; every block
    table (including prefix-cache hits) must map each position to the right prefix, and a
    failed allocation must change nothing."""
    rng = random.Random(seed)
    num_blocks = rng.choice([6, 9, 14])
    kv = KVCacheManager(num_blocks, BS, enable_caching)
    content: dict[int, tuple[int, ...]] = {}  # slot -> the token prefix whose K/V is stored
    bases = [[rng.randrange(50) for _ in range(40)] for _ in range(3)]
    live: dict[str, Request] = {}
    counter = 0

    def check_table(r: Request) -> None:
        ids = kv.get_block_ids(r.request_id)
        assert len(ids) == -(-r.num_computed_tokens // BS)
        for p in range(r.num_computed_tokens):
            slot = ids[p // BS] * BS + p % BS
            assert content.get(slot) == tuple(r.all_token_ids[: p + 1]), (r, p)

    def write(r: Request, start: int, end: int) -> None:
        ids = kv.get_block_ids(r.request_id)
        for p in range(start, end):
            content[ids[p // BS] * BS + p % BS] = tuple(r.all_token_ids[: p + 1])

    def admit(r: Request, max_new: int) -> None:
        """Prefix-cache lookup + allocation; hits must already hold exactly this request's prefix."""
        before = snapshot(kv, r)
        hits, num_hit = kv.get_computed_blocks(r)
        assert num_hit <= ((r.num_tokens - 1) // BS) * BS
        num_new = min(r.num_tokens - num_hit, max_new)
        if kv.allocate_slots(r, num_new, hits):
            r.num_computed_tokens = num_hit + num_new
            ids = kv.get_block_ids(r.request_id)
            for p in range(num_hit):
                assert content.get(ids[p // BS] * BS + p % BS) == tuple(r.all_token_ids[: p + 1])
            write(r, num_hit, r.num_computed_tokens)
            live[r.request_id] = r
        else:
            assert snapshot(kv, r)[:6] == before[:6]

    for _ in range(400):
        op = rng.random()
        if op < 0.3 or not live:
            counter += 1
            base = rng.choice(bases)
            n = rng.randint(1, 20)
            tail = [rng.randrange(50) for _ in range(rng.choice([0, 0, 1, 3]))]
            r = make_req(f"r{counter}", base[:n] + tail)
            admit(r, rng.randint(1, 12))
        elif op < 0.75:
            r = rng.choice(list(live.values()))
            if r.num_computed_tokens == r.num_tokens:  # decode: sample a token first
                r.append_output_token(hash(tuple(r.all_token_ids)) % 50)
            num_new = min(r.num_tokens - r.num_computed_tokens, rng.randint(1, 12))
            before = snapshot(kv, r)
            if kv.allocate_slots(r, num_new):
                start = r.num_computed_tokens
                r.num_computed_tokens += num_new
                write(r, start, r.num_computed_tokens)
            else:
                assert snapshot(kv, r) == before
        elif op < 0.9:
            r = live.pop(rng.choice(list(live)))
            kv.free(r)
        else:  # preempt by recompute: free, forget progress, come back later as a new admission
            r = live.pop(rng.choice(list(live)))
            kv.free(r)
            r.num_computed_tokens = 0
            admit(r, r.num_tokens)
        kv.check_invariants()
        for r in live.values():
            check_table(r)
        used = {b for blocks in kv.req_to_blocks.values() for b in blocks}
        assert kv.num_free_blocks + len(used) == num_blocks
        if not enable_caching:
            assert kv.pool.cached == {}
        for h, blk in kv.pool.cached.items():
            assert blk.block_hash == h

    for r in list(live.values()):
        kv.free(r)
    kv.check_invariants()
    assert kv.num_free_blocks == num_blocks
    assert kv.req_to_blocks == {}
