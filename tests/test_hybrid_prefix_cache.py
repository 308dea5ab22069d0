"""Prefix caching for hybrid models (vLLM's 'align' Mamba cache mode): prefill steps end on
snapshot positions, the recurrent state reached there is snapshotted under the prefix's block hash,
and a later request sharing the prefix resumes from a copy of it. Its tokens and logprobs must equal
transformers' full recompute; without the restored state they do not (the check can fail)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import HYBRID_ARCHS
from hf_reference import hf_greedy_reference
from kvserve import LLM, SamplingParams
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request
from kvserve.engine.state_cache import StateSnapshotCache
from kvserve.runner import memory
from test_hybrid_engine import check_idle
from triton_support import skip_without_triton_device

ROOT = Path(__file__).resolve().parents[1]


def _conversation(seed: int) -> tuple[list[int], list[int]]:
    """Two prompts sharing their first 40 tokens (47 and 49 tokens long)."""
    gen = torch.Generator().manual_seed(seed)
    prefix = torch.randint(3, 500, (40,), generator=gen).tolist()
    return prefix + torch.randint(3, 500, (7,), generator=gen).tolist(), \
        prefix + torch.randint(3, 500, (9,), generator=gen).tolist()


def _run(llm: LLM, prompt: list[int], max_tokens: int, logprobs: bool = True):
    """Greedy tokens, their logprobs (None without: logprobs make async scheduling run steps
    synchronously) and the cached prompt tokens."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=0 if logprobs else None)
    out = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)[0]
    c = out.outputs[0]
    lps = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] if logprobs else None
    return list(c.token_ids), lps, out.num_cached_tokens


def _llm(folder, **kw) -> LLM:
    args = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=64, kv_cache_memory=1 << 22,
                mamba_block_size=16)
    args.update(kw)
    return LLM(str(folder), **args)


@pytest.mark.parametrize("arch,async_scheduling", [(a, False) for a in HYBRID_ARCHS] + [("qwen3_5", True)])
def test_prefix_hits_resume_from_state_snapshots_and_equal_transformers(make_tiny_model, arch, async_scheduling,
                                                                        one_thread):
    """A (47 tokens) runs first: its prefill is cut at 32 (a snapshot), its first decode step ends
    at 48 (another; under async scheduling its input token is named a step later). B shares 40
    tokens with A: it resumes at 32. C continues A's conversation (A's prompt, 5 of its tokens,
    3 new): it resumes at 48, past A's prompt. Every request's greedy tokens equal transformers'
    (float64), logprobs within 5x transformers' own float32 spread (hf_reference.py)."""
    folder = make_tiny_model(arch, seed=5)
    a, b = _conversation(5)
    llm = _llm(folder, async_scheduling=async_scheduling)
    lp = not async_scheduling
    ta, la, ca = _run(llm, a, 10, lp)
    tb, lb, cb = _run(llm, b, 8, lp)
    c = a + ta[:5] + [7, 8, 9]
    tc, lc, cc = _run(llm, c, 6, lp)
    assert (ca, cb, cc) == (0, 32, 48)
    hf_greedy_reference(folder, [a, b, c], (10, 8, 6)).check([ta, tb, tc], [la, lb, lc])
    assert llm.llm_engine.kv_manager.snapshots.num_cached >= 2
    check_idle(llm)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_a_shared_prefix_junction_is_snapshotted_for_the_next_request(make_tiny_model, arch, one_thread):
    """Snapshots every 32 tokens; three prompts share a 48-token prefix (a system prompt). A is
    cut at 32 (align). B's attention prefix hit reaches 48 but its state hit only 32: B's step is
    cut at the junction, 48, and snapshotted there, so C resumes at 48 (vLLM's align mode alone
    would leave C at 32). Every request's tokens and logprobs equal transformers'."""
    folder = make_tiny_model(arch, seed=7)
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(3, 500, (48,), generator=gen).tolist()
    prompts = [system + torch.randint(3, 500, (n,), generator=gen).tolist() for n in (10, 12, 14)]
    llm = _llm(folder, mamba_block_size=32)
    runs = [_run(llm, p, 6) for p in prompts]
    assert [r[2] for r in runs] == [0, 32, 48]
    hf_greedy_reference(folder, prompts, (6, 6, 6)).check([r[0] for r in runs], [r[1] for r in runs])
    check_idle(llm)


def test_a_hit_without_its_restored_state_is_wrong(make_tiny_model, one_thread, monkeypatch):
    """The control for the test above: the same hit with the snapshot copy turned into a no-op
    (the slot keeps whatever it held) does not give transformers' tokens and logprobs."""
    folder = make_tiny_model("qwen3_5", seed=5)
    a, b = _conversation(5)
    llm = _llm(folder)
    _run(llm, a, 10)
    monkeypatch.setattr(llm.llm_engine.runner, "_copy_state_rows", lambda src, dst: None)
    tb, lb, cb = _run(llm, b, 8)
    assert cb == 32
    ref = hf_greedy_reference(folder, [b], (8,))
    assert tb != ref.tokens[0] or max(abs(x - y) for x, y in zip(lb, ref.logprobs[0])) > 1e-2


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_concurrent_prefix_sharing_chunked_and_preempted(make_tiny_model, async_scheduling, one_thread):
    """Six prompts sharing 40 tokens in pairs, 13-token steps, a KV pool small enough to preempt:
    every request's tokens equal its run on a fresh engine without prefix caching, some of them
    came from cache hits, and nothing leaks."""
    folder = make_tiny_model("qwen3_next", seed=6)
    prompts = [p for s in range(3) for p in _conversation(10 + s)]
    params = [SamplingParams(temperature=0, max_tokens=6 + i, ignore_eos=True) for i in range(6)]
    kw = dict(max_num_seqs=3, max_num_batched_tokens=13, num_gpu_blocks_override=8, max_model_len=64)
    ref_llm = _llm(folder, enable_prefix_caching=False, mamba_block_size=None, **kw)
    ref = [list(o.outputs[0].token_ids) for o in ref_llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)]
    llm = _llm(folder, async_scheduling=async_scheduling, **kw)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == ref
    assert llm.llm_engine.kv_manager.prefix_cache_hits > 0
    assert llm.llm_engine.scheduler.num_preemptions > 0
    check_idle(llm)


@pytest.mark.parametrize("async_scheduling", [False, True])
def test_abort_drops_the_snapshot_of_its_unconfirmed_step(make_tiny_model, async_scheduling, one_thread):
    """A request aborted right after the step that snapshots its state at 32 (with async scheduling,
    while that step may still be in flight): later requests with the same prefix do not resume from
    that snapshot, nor from each other's within one step, and their tokens are transformers'."""
    folder = make_tiny_model("qwen3_5", seed=5)
    a, b = _conversation(9)
    engine = _llm(folder, async_scheduling=async_scheduling).llm_engine
    engine.add_request("a", {"prompt_token_ids": a}, SamplingParams(temperature=0, max_tokens=10, ignore_eos=True))
    engine.step()
    assert engine.kv_manager.snapshots.num_taken == 1  # the step cut at 32 writes a snapshot
    engine.abort_request("a")
    for rid in ("b1", "b2"):  # admitted in one step: b2 cannot read b1's snapshot, still pending
        engine.add_request(rid, {"prompt_token_ids": b}, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
    outs = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            outs[o.request_id] = o
    assert outs["b1"].num_cached_tokens == outs["b2"].num_cached_tokens == 0
    b1, b2 = (list(outs[r].outputs[0].token_ids) for r in ("b1", "b2"))
    assert b1 == b2
    hf_greedy_reference(folder, [b], (8,)).check_tokens([b1])
    engine.kv_manager.check_invariants()
    assert engine.runner.state_pool.num_free == engine.runner.state_pool.num_slots


@skip_without_triton_device()
def test_triton_backend_prefix_hit_gives_the_reference_tokens(make_tiny_model, one_thread):
    """The Triton GDN kernels start from a restored snapshot: tokens equal the reference backend's."""
    folder = make_tiny_model("qwen3_5", seed=5)
    a, b = _conversation(7)
    out = {}
    for backend in ("reference", "triton"):
        llm = _llm(folder, attention_backend=backend)
        _run(llm, a, 4)
        tokens, _, cached = _run(llm, b, 6)
        out[backend] = (tokens, cached)
    assert out["triton"] == out["reference"]
    assert out["reference"][1] == 32


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
def test_fp8_prefix_hit_matches_fake_quant_oracle(make_tiny_model, fmt, one_thread):
    """fp8 pages and a restored state: B's logprobs equal the fake-quant transformers reference
    (the fp8 issue's Oracle C) as closely as a run without the hit does."""
    from test_fp8_engine import check_against_oracle

    folder = make_tiny_model("qwen3_5", seed=4)
    a, b = _conversation(8)
    llm = _llm(folder, kv_cache_dtype=fmt)
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
    outs = [llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0] for p in (a, b)]
    assert outs[1].num_cached_tokens == 32
    check_against_oracle(outs, folder, fmt, [1.0] * 4, [1.0] * 4)


# ---- the pieces -------------------------------------------------------------------------------

def _request(n: int, rid: str = "r") -> Request:
    return Request(rid, list(range(3, 3 + n)), SamplingParams(max_tokens=4))


@pytest.mark.parametrize("computed,new,want", [
    (0, 64, 64),  # ends on a position before the last one: kept
    (0, 50, 32),  # cut back to a position
    (0, 20, 20),  # reaches no position: kept (the next step realigns)
    (20, 30, 12),  # realigned to 32
    (64, 36, 32),  # crosses the last position (96): ends there, the tail runs next
    (96, 4, 4),  # the tail
    (0, 100, 96),
])
def test_align_prefill_cuts_steps_like_vllm(computed, new, want):
    kv = KVCacheManager(64, 16, True, StateSnapshotCache(4, 32))
    assert kv.align_prefill(_request(100), computed, new) == want
    assert KVCacheManager(64, 16, True).align_prefill(_request(100), computed, new) == new  # non-hybrid


def test_align_prefill_ends_a_step_at_the_prefix_junction():
    kv = KVCacheManager(64, 16, True, StateSnapshotCache(4, 32))
    r = _request(100)
    assert kv.align_prefill(r, 32, 68, junction=48) == 16  # before the align cut at 96
    assert kv.align_prefill(r, 0, 20, junction=16) == 16
    assert kv.align_prefill(r, 48, 52, junction=48) == 48  # at the start: the align cut (96) stands


def test_hits_stop_at_the_last_snapshot_and_pending_ones_are_invisible():
    kv = KVCacheManager(64, 16, True, StateSnapshotCache(4, 32))
    a = _request(80, "a")
    assert kv.allocate_slots(a, 80)
    assert kv.snapshot_to_save(a, 48) is None  # not a snapshot position
    slot = kv.snapshot_to_save(a, 64)
    assert slot is not None
    b = Request("b", a.all_token_ids[:70] + [1, 2], SamplingParams(max_tokens=4))
    assert kv.get_computed_blocks(b)[1] == 0  # the snapshot is being written: its step has not run
    kv.confirm_cached_blocks()
    assert kv.snapshot_to_save(a, 64) is None  # one snapshot per prefix
    hits, n = kv.get_computed_blocks(b)
    assert n == 64 and len(hits) == 4  # 4 full KV blocks cached, and the state at 64
    assert kv.snapshot_to_restore(b, n) == slot
    c = Request("c", a.all_token_ids[:40] + [1] * 20, SamplingParams(max_tokens=4))
    assert kv.get_computed_blocks(c)[1] == 0  # 2 KV blocks in cache, but no state at 32
    kv.check_invariants()


def test_a_decode_snapshot_is_named_once_its_input_token_is_known():
    """Async scheduling: a decode step ending at 32 is scheduled while its input token (position 31)
    is still on the device; the snapshot is published under the prefix with that token once the
    next step is scheduled (the token is known by then)."""
    kv = KVCacheManager(64, 16, True, StateSnapshotCache(4, 16))
    a = _request(31, "a")
    assert kv.allocate_slots(a, 31)
    a.num_computed_tokens = 31
    kv.confirm_cached_blocks()
    slot = kv.snapshot_to_save(a, 32)  # a.num_tokens == 31: the token at 31 is pending
    assert slot is not None
    a.append_output_token(77)
    kv.confirm_cached_blocks()
    b = Request("b", a.all_token_ids + [5, 6], SamplingParams(max_tokens=4))
    assert kv.allocate_slots(a, 1)  # block 1 (tokens 16..32) is full and known now: cached
    kv.confirm_cached_blocks()
    assert kv.get_computed_blocks(b)[1] == 32 and kv.snapshot_to_restore(b, 32) == slot
    kv.check_invariants()


def test_an_aborted_step_drops_its_pending_snapshots():
    kv = KVCacheManager(64, 16, True, StateSnapshotCache(2, 16))
    a = _request(40, "a")
    assert kv.allocate_slots(a, 32)
    assert kv.snapshot_to_save(a, 32) is not None
    kv.uncache_unconfirmed(a)  # the step that would write it failed
    kv.free(a)
    kv.confirm_cached_blocks()
    assert kv.snapshots.num_cached == 0 and kv.snapshots.num_taken == 0
    kv.check_invariants()
    assert kv.get_computed_blocks(_request(40, "b"))[1] == 0


def test_snapshots_are_evicted_least_recently_used_first():
    cache = StateSnapshotCache(2, 16)
    s1, s2 = cache.take(), cache.take()
    assert cache.take() is None  # every slot being written
    cache.publish(b"h1", s1)
    cache.publish(b"h2", s2)
    assert cache.lookup(b"h1") == s1  # h1 used: h2 is now the oldest
    s3 = cache.take()
    assert s3 == s2
    cache.publish(b"h1", s3)  # the same prefix written twice: the second slot goes back
    assert cache.num_cached == 1 and cache.lookup(b"h2") is None and cache.lookup(b"h1") == s1
    cache.check_invariants()


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["take", "publish", "release", "lookup"]), st.integers(0, 6)),
                max_size=60))
def test_snapshot_cache_never_leaks_or_shares_a_slot(ops):
    """Random take / publish / release / lookup: a slot is never held twice or lost, a slot being
    written is never found, and a found one is the slot last published for that hash."""
    cache = StateSnapshotCache(3, 16)
    owner: dict[bytes, int] = {}  # published hash -> slot, as the model says it should be
    taken: list[int] = []
    for op, h in ops:
        key = bytes([h])
        if op == "take":
            slot = cache.take()
            if slot is not None:
                for k in [k for k, v in owner.items() if v == slot]:
                    del owner[k]  # evicted
                assert slot not in taken
                taken.append(slot)
        elif op in ("publish", "release") and taken:
            slot = taken.pop(h % len(taken))
            if op == "release":
                cache.release(slot)
            else:
                cache.publish(key, slot)
                owner.setdefault(key, slot)
        elif op == "lookup":
            assert cache.lookup(key) == owner.get(key)
            assert cache.lookup(key) not in taken
        cache.check_invariants()


def test_snapshot_interval_is_vllms_block_size_on_the_27b_config():
    """vLLM's align-mode hit granularity on Qwen3.6-27B: 784 tokens with a bf16 cache, 1,568 with
    fp8 (hybrid-gdn-models.md §2.5); an explicit --mamba-block-size must be a block multiple."""
    from kvserve.tools.traffic import model_shape

    folder = ROOT / "benchmarks" / "configs" / "qwen3.6-27b"
    shape = model_shape(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    n_gdn = sum(t == "linear_attention" for t in cfg["layer_types"])
    per_layer = shape.state_bytes // n_gdn
    assert per_layer == 3_207_168
    for dtype, want in ((torch.bfloat16, 784), (torch.uint8, 1568)):
        spec = memory.KVCacheSpec(64 - n_gdn, 16, cfg["num_key_value_heads"], cfg["head_dim"], dtype)
        assert memory.snapshot_interval(spec, per_layer, None) == want
    assert memory.snapshot_interval(spec, per_layer, 64) == 64
    with pytest.raises(ValueError, match=r"mamba_block_size \(24\) must be a positive multiple of block_size \(16\)"):
        memory.snapshot_interval(spec, per_layer, 24)


def test_mamba_cache_mode_resolves_as_vllm(make_tiny_model, kvlog):
    folder = make_tiny_model("qwen3_5")
    kw = dict(dtype="float32", max_num_seqs=2, kv_cache_memory=1 << 22)
    llm = LLM(str(folder), **kw)
    assert kvlog.count("Mamba cache mode is set to 'align' for Qwen3_5ForCausalLM by default when prefix caching is enabled") == 1
    assert kvlog.count("Prefix caching in Mamba cache 'align' mode is currently enabled. Its support for Mamba layers is experimental") == 1
    assert kvlog.count("2 state snapshot slots") == 1
    assert llm.llm_engine.config.cache_config.mamba_cache_mode == "align"
    kvlog.clear()
    LLM(str(folder), mamba_cache_mode="all", **kw)
    assert kvlog.count("without support for prefix caching with Mamba cache 'all' mode: falling back to 'align' mode.") == 1
    with pytest.raises(ValueError, match="--mamba-block-size can only be set with --enable-prefix-caching"):
        LLM(str(folder), enable_prefix_caching=False, mamba_block_size=32, **kw)
    with pytest.raises(ValueError, match="Chunked prefill is required for mamba cache mode 'align'"):
        LLM(str(folder), enable_chunked_prefill=False, **kw)
    with pytest.raises(ValueError, match=r"Unknown mamba_cache_mode: 'sometimes'. Supported: \['none', 'all', 'align'\]"):
        LLM(str(folder), mamba_cache_mode="sometimes", **kw)
    with pytest.raises(ValueError, match=r"mamba_block_size \(40\) must be a positive multiple of block_size \(16\)"):
        LLM(str(folder), mamba_block_size=40, **kw)
