"""Scheduler tests.

(a) Scheduler-level, with a fake runner (no model): token budget, running-before-waiting, mixed
prefill + decode steps, chunked prefill, max_num_seqs, preemption policy. A fake KV store checks
that every block table maps each position to the K/V of the right token prefix.
(b) A hypothesis property test through the real engine on a tiny model: random request mixes with
tiny KV pools force chunking and preemption; greedy outputs must equal solo runs and nothing
may leak."""

from __future__ import annotations

import random
import zlib

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvserve.config import SchedulerConfig
from kvserve.engine.kv_cache import KVCacheManager
from kvserve.engine.request import Request, RequestStatus
from kvserve.engine.sampling import SamplingParams
from kvserve.engine.scheduler import Scheduler, SchedulerOutput

BS = 4


# ==== (a) scheduler with a fake runner ==========================================================
def make_sched(num_blocks, budget, max_seqs=8, caching=True, chunked=True, max_model_len=None):
    kv = KVCacheManager(num_blocks, BS, caching)
    cfg = SchedulerConfig(
        max_num_seqs=max_seqs,
        max_num_batched_tokens=budget,
        max_model_len=max_model_len or num_blocks * BS,
        enable_chunked_prefill=chunked,
    )
    return Scheduler(cfg, kv)


def make_req(rid, prompt, max_tokens=4):
    return Request(rid, list(prompt), SamplingParams(temperature=0, max_tokens=max_tokens))


def fake_token(tokens) -> int:
    """A 'model': the next token is a function of the whole sequence."""
    return zlib.crc32(repr(list(tokens)).encode()) % 50


class FakeRunner:
    """Plays the engine's part: writes 'K/V' (the token prefix) into slots, checks that every
    position of a scheduled request reads back its own prefix, samples, finishes at max_tokens."""

    def __init__(self, sched: Scheduler):
        self.sched = sched
        self.content: dict[int, tuple[int, ...]] = {}
        self.finished: dict[str, Request] = {}

    def step(self, fail: bool = False) -> SchedulerOutput:
        sched = self.sched
        out = sched.schedule()
        sched.kv.check_invariants()
        if fail:
            # the step dies part-way (device error, Ctrl-C): some new slots hold garbage, nothing is
            # sampled, and the caller aborts the step's requests (what LLM.generate / chat do)
            for s in out.scheduled:
                for p in range(s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens, 2):
                    self.content[s.block_ids[p // BS] * BS + p % BS] = ("garbage",)
            for s in out.scheduled:
                sched.abort(s.request.request_id)
            sched.kv.check_invariants()
            out.sampled = [False] * len(out.scheduled)  # type: ignore[attr-defined]
            return out
        for s in out.scheduled:
            r, start, end = s.request, s.num_computed_tokens, s.num_computed_tokens + s.num_new_tokens
            assert s.num_new_tokens >= 1
            assert len(s.block_ids) == -(-end // BS), (r, s)
            assert r.num_computed_tokens == end
            for p in range(start, end):
                self.content[s.block_ids[p // BS] * BS + p % BS] = tuple(r.all_token_ids[: p + 1])
            for p in range(end):
                got = self.content.get(s.block_ids[p // BS] * BS + p % BS)
                assert got == tuple(r.all_token_ids[: p + 1]), f"{r}: wrong K/V at position {p}"
        # ``samples`` compares against the request's current length: read it before appending
        out.sampled = [s.samples for s in out.scheduled]  # type: ignore[attr-defined]
        for s, samples in zip(out.scheduled, out.sampled):  # type: ignore[attr-defined]
            if samples:
                r = s.request
                r.append_output_token(fake_token(r.all_token_ids))
                if r.num_output_tokens >= r.sampling_params.max_tokens:
                    sched.finish_request(r, RequestStatus.FINISHED_LENGTH_CAPPED)
                    self.finished[r.request_id] = r
        sched.kv.check_invariants()
        return out

    def run(self, max_steps=10_000) -> list[SchedulerOutput]:
        outs = []
        while self.sched.has_unfinished():
            outs.append(self.step())
            assert len(outs) < max_steps, "scheduler made no progress"
        return outs


def plan(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(s.request.request_id, s.num_computed_tokens, s.num_new_tokens) for s in out.scheduled]


def solo_output(prompt, max_tokens) -> list[int]:
    tokens, out = list(prompt), []
    for _ in range(max_tokens):
        t = fake_token(tokens)
        tokens.append(t)
        out.append(t)
    return out


def test_chunked_prefill_continues_across_steps():
    sched = make_sched(16, budget=8)
    runner = FakeRunner(sched)
    a = make_req("a", range(100, 120), max_tokens=2)
    sched.add_request(a)
    o1 = runner.step()
    assert plan(o1) == [("a", 0, 8)] and o1.sampled == [False]
    assert a.num_output_tokens == 0
    o2 = runner.step()
    assert plan(o2) == [("a", 8, 8)] and o2.sampled == [False]
    o3 = runner.step()
    assert plan(o3) == [("a", 16, 4)] and o3.sampled == [True]
    assert a.num_output_tokens == 1
    o4 = runner.step()
    assert plan(o4) == [("a", 20, 1)]
    assert a.status == RequestStatus.FINISHED_LENGTH_CAPPED
    assert not sched.has_unfinished()
    assert sched.kv.num_free_blocks == 16


def test_running_first_and_mixed_prefill_decode_step():
    sched = make_sched(32, budget=8)
    runner = FakeRunner(sched)
    a = make_req("a", [1, 2, 3], max_tokens=6)
    sched.add_request(a)
    assert plan(runner.step()) == [("a", 0, 3)]
    b = make_req("b", range(200, 220), max_tokens=2)
    sched.add_request(b)
    out = runner.step()
    # the running decode comes first, the new prefill gets the rest of the budget
    assert plan(out) == [("a", 3, 1), ("b", 0, 7)]
    assert out.total_num_tokens == 8
    c = make_req("c", [5, 6], max_tokens=1)
    sched.add_request(c)
    out = runner.step()
    # b (running, mid-prefill) keeps its place before c, which has been waiting; budget is spent
    assert plan(out) == [("a", 4, 1), ("b", 7, 7)]
    assert list(sched.waiting) == [c]
    out = runner.step()
    assert plan(out) == [("a", 5, 1), ("b", 14, 6), ("c", 0, 1)]
    runner.run()
    assert a.output_token_ids == solo_output([1, 2, 3], 6)
    assert b.output_token_ids == solo_output(range(200, 220), 2)
    assert c.output_token_ids == solo_output([5, 6], 1)


def test_running_requests_get_the_budget_before_waiting_ones():
    sched = make_sched(32, budget=4)
    runner = FakeRunner(sched)
    a = make_req("a", range(10, 20), max_tokens=1)
    sched.add_request(a)
    runner.step()  # a: 4 of 10
    b = make_req("b", [7], max_tokens=1)  # tiny, but must wait for a's chunks
    sched.add_request(b)
    assert plan(runner.step()) == [("a", 4, 4)]
    assert plan(runner.step()) == [("a", 8, 2), ("b", 0, 1)]


def test_token_budget_and_max_num_seqs():
    sched = make_sched(64, budget=6, max_seqs=2)
    runner = FakeRunner(sched)
    reqs = [make_req(f"r{i}", range(10 * i, 10 * i + 3 + i), max_tokens=3) for i in range(5)]
    for r in reqs:
        sched.add_request(r)
    first = runner.step()
    assert [s.request.request_id for s in first.scheduled] == ["r0", "r1"]
    assert first.total_num_tokens == 3 + 3  # r1 chunked to the budget left
    assert sched.num_running == 2 and sched.num_waiting == 3
    outs = [first] + runner.run()
    for out in outs:
        assert out.total_num_tokens <= 6
        assert len(out.scheduled) <= 2
    assert set(runner.finished) == {r.request_id for r in reqs}
    for i, r in enumerate(reqs):
        assert r.output_token_ids == solo_output(range(10 * i, 10 * i + 3 + i), 3)


def test_no_chunking_admits_only_whole_prompts():
    sched = make_sched(64, budget=8, chunked=False, max_model_len=8)
    runner = FakeRunner(sched)
    a = make_req("a", range(5), max_tokens=2)
    b = make_req("b", range(50, 56), max_tokens=1)
    sched.add_request(a)
    sched.add_request(b)
    assert plan(runner.step()) == [("a", 0, 5)]  # b (6 tokens) does not fit the 3 left
    assert plan(runner.step()) == [("a", 5, 1), ("b", 0, 6)]


def test_preemption_picks_the_last_running_request():
    sched = make_sched(5, budget=64, caching=False)
    runner = FakeRunner(sched)
    a, b, c = make_req("a", [1, 2, 3, 4], 3), make_req("b", [5, 6, 7, 8], 3), make_req("c", range(20, 28), 3)
    for r in (a, b, c):
        sched.add_request(r)
    assert plan(runner.step()) == [("a", 0, 4), ("b", 0, 4), ("c", 0, 8)]
    assert sched.kv.num_free_blocks == 1
    c_blocks = sched.kv.get_block_ids("c")
    out = runner.step()
    # a takes the free block; b needs one too -> c (last, not b) is preempted
    assert out.preempted == [c]
    assert plan(out) == [("a", 4, 1), ("b", 4, 1)]
    assert c.status == RequestStatus.PREEMPTED
    assert c.num_computed_tokens == 0 and c.num_preemptions == 1 and sched.num_preemptions == 1
    assert "c" not in sched.kv.req_to_blocks
    # c's two blocks were freed: b got one of them, the other is free
    assert sched.kv.get_block_ids("b")[1] in c_blocks
    assert list(sched.kv.pool.free_queue) == [i for i in c_blocks if i != sched.kv.get_block_ids("b")[1]]
    assert list(sched.waiting) == [c] and sched.running == [a, b]
    assert c.output_token_ids == solo_output(range(20, 28), 1)  # the sampled token is kept
    runner.run()
    assert set(runner.finished) == {"a", "b", "c"}
    assert a.output_token_ids == solo_output([1, 2, 3, 4], 3)
    assert b.output_token_ids == solo_output([5, 6, 7, 8], 3)
    assert c.output_token_ids == solo_output(range(20, 28), 3)
    assert sched.kv.num_free_blocks == 5


def test_preemption_repeats_from_the_tail_and_requeues_at_the_front_in_order():
    sched = make_sched(3, budget=8, caching=False, max_model_len=12)
    runner = FakeRunner(sched)
    d1, d2 = make_req("d1", [1, 2], 2), make_req("d2", [3, 4], 2)
    p = make_req("p", range(30, 42), 1)
    w = make_req("w", [9], 1)
    for r in (d1, d2, p):
        sched.add_request(r)
    assert plan(runner.step()) == [("d1", 0, 2), ("d2", 0, 2), ("p", 0, 4)]
    assert sched.kv.num_free_blocks == 0
    sched.add_request(w)
    # white-box: put the mid-prefill request first so that it needs 2 blocks ahead of 2 decodes
    sched.running = [p, d1, d2]
    out = runner.step()
    assert out.preempted == [d2, d1]
    assert plan(out) == [("p", 4, 8)]
    assert list(sched.waiting) == [d1, d2, w]  # preempted ones at the front, original order
    assert all(r.num_computed_tokens == 0 and r.status == RequestStatus.PREEMPTED for r in (d1, d2))
    runner.run()
    assert set(runner.finished) == {"d1", "d2", "p", "w"}
    assert d1.output_token_ids == solo_output([1, 2], 2)
    assert d2.output_token_ids == solo_output([3, 4], 2)


def test_self_preemption_and_no_admission_in_a_step_that_preempted():
    """After p preempts itself there are 2 free blocks and 6 tokens of budget, enough for a
    6-token chunk of p; vLLM still admits nothing from the waiting queue in that step."""
    sched = make_sched(6, budget=8, max_seqs=4, caching=False)
    runner = FakeRunner(sched)
    a, v = make_req("a", [1, 2, 3], 5), make_req("v", [4, 5, 6, 7], 5)
    p = make_req("p", range(40, 60), 1)
    for r in (a, v, p):
        sched.add_request(r)
    assert plan(runner.step()) == [("a", 0, 3), ("v", 0, 4), ("p", 0, 1)]
    assert plan(runner.step()) == [("a", 3, 1), ("v", 4, 1), ("p", 1, 6)]
    out = runner.step()
    assert out.preempted == [p]
    assert plan(out) == [("a", 4, 1), ("v", 5, 1)]
    assert sched.kv.num_free_blocks == 2
    assert list(sched.waiting) == [p] and p.num_computed_tokens == 0
    out = runner.step()
    assert plan(out) == [("a", 5, 1), ("v", 6, 1), ("p", 0, 6)]
    runner.run()
    assert set(runner.finished) == {"a", "v", "p"}
    assert p.output_token_ids == solo_output(range(40, 60), 1)
    assert sched.kv.num_free_blocks == 6


def test_abort_running_waiting_and_preempted_requests_frees_blocks():
    sched = make_sched(5, budget=64, caching=False)
    runner = FakeRunner(sched)
    a, b, c = make_req("a", [1, 2, 3, 4], 3), make_req("b", [5, 6, 7, 8], 3), make_req("c", range(20, 28), 3)
    d = make_req("d", [9, 9], 2)
    for r in (a, b, c):
        sched.add_request(r)
    runner.step()
    sched.add_request(d)
    out = runner.step()
    assert out.preempted == [c]
    assert sched.abort("c") is c and c.status == RequestStatus.FINISHED_ABORTED
    assert sched.abort("d") is d and d.status == RequestStatus.FINISHED_ABORTED
    assert sched.abort("a") is a and a not in sched.running
    assert sched.abort("nope") is None
    assert list(sched.waiting) == [] and sched.running == [b]
    sched.kv.check_invariants()
    runner.run()
    assert sched.kv.num_free_blocks == 5 and sched.requests == {}


def test_failed_step_does_not_poison_the_prefix_cache():
    """Blocks are cached when allocated, before the step writes them. If that step fails and its
    requests are aborted, a later request with the same prefix must not hit those blocks."""
    sched = make_sched(16, budget=64)
    runner = FakeRunner(sched)
    ok = make_req("ok", range(50, 58), max_tokens=1)  # completes normally: its blocks stay cached
    sched.add_request(ok)
    runner.run()
    a = make_req("a", list(range(100, 112)) + [1], max_tokens=3)
    b = make_req("b", list(range(50, 58)) + [2], max_tokens=3)  # hits ok's 2 blocks
    sched.add_request(a)
    sched.add_request(b)
    out = runner.step(fail=True)
    assert plan(out) == [("a", 0, 13), ("b", 8, 1)]
    assert a.status == b.status == RequestStatus.FINISHED_ABORTED
    assert sched.kv.num_free_blocks == 16
    a2 = make_req("a2", list(range(100, 112)) + [7], max_tokens=2)
    b2 = make_req("b2", list(range(50, 58)) + [3], max_tokens=2)
    sched.add_request(a2)
    sched.add_request(b2)
    out = runner.step()
    # a's blocks were never written: no hit; ok's blocks were written by a completed step: hit
    assert plan(out) == [("a2", 0, 13), ("b2", 8, 1)]
    runner.run()
    assert a2.output_token_ids == solo_output(a2.prompt_token_ids, 2)


def test_abort_after_a_completed_step_keeps_earlier_steps_cached():
    sched = make_sched(16, budget=8)
    runner = FakeRunner(sched)
    a = make_req("a", range(100, 120), max_tokens=4)
    sched.add_request(a)
    runner.step()  # 8 tokens: 2 full blocks cached
    runner.step()  # 16 tokens: 2 more; the first two are now confirmed
    sched.abort("a")
    b = make_req("b", range(100, 120), max_tokens=1)
    sched.add_request(b)
    out = runner.step()
    assert plan(out) == [("b", 8, 8)]  # only the blocks of the last step before the abort are dropped
    runner.run()


CONFIGS = [
    dict(caching=True, chunked=True),
    dict(caching=False, chunked=True),
    dict(caching=True, chunked=False),
]


@pytest.mark.parametrize("seed", range(12))
@pytest.mark.parametrize("cfg", CONFIGS, ids=["cache+chunk", "nocache+chunk", "cache+nochunk"])
def test_random_workloads_respect_policy_every_step(seed, cfg):
    rng = random.Random(seed)
    num_blocks = rng.choice([4, 6, 10])
    max_len = num_blocks * BS
    budget = rng.choice([3, 5, 8, 16]) if cfg["chunked"] else max_len
    max_seqs = rng.choice([1, 2, 3, 8])
    budget = max(budget, max_seqs)
    sched = make_sched(num_blocks, budget, max_seqs, cfg["caching"], cfg["chunked"], max_len)
    runner = FakeRunner(sched)
    bases = [[rng.randrange(50) for _ in range(max_len)] for _ in range(2)]
    arrivals: dict[int, list[Request]] = {}
    all_reqs = []
    for i in range(rng.randint(3, 12)):
        max_tokens = rng.randint(1, 6)
        n = rng.randint(1, max_len - max_tokens)
        prompt = rng.choice(bases)[:n]
        if rng.random() < 0.5:
            prompt = prompt[:-1] + [rng.randrange(50)]
        r = make_req(f"r{i}", prompt, max_tokens)
        all_reqs.append(r)
        arrivals.setdefault(rng.randint(0, 15), []).append(r)
    aborts = {r.request_id: rng.randint(0, 30) for r in all_reqs if rng.random() < 0.2}
    aborted = set()
    fail_steps = {rng.randrange(40) for _ in range(rng.choice([0, 0, 1, 3]))}
    t = 0
    while t <= 15 or sched.has_unfinished():
        for r in arrivals.get(t, []):
            sched.add_request(r)
        for rid, when in aborts.items():
            if when == t and rid in sched.requests:
                sched.abort(rid)
                aborted.add(rid)
                sched.kv.check_invariants()
        running_before = list(sched.running)
        waiting_before = list(sched.waiting)
        computed_before = {r.request_id: r.num_computed_tokens for r in running_before}
        if t in fail_steps:
            out = runner.step(fail=True)
            aborted.update(s.request.request_id for s in out.scheduled)
            t += 1
            continue
        out = runner.step()
        t += 1
        assert t < 5000, "no progress"

        assert out.total_num_tokens <= budget
        assert len(sched.running) <= max_seqs
        preempted = out.preempted
        m = len(preempted)
        if m:
            # victims are the tail of the running list, last first
            assert preempted == running_before[::-1][:m]
            for r in preempted:
                assert r.num_computed_tokens == 0
                assert r.request_id not in sched.kv.req_to_blocks
                assert r.status == RequestStatus.PREEMPTED
        sched_ids = [s.request for s in out.scheduled]
        kept = running_before[: len(running_before) - m]
        old = [r for r in sched_ids if r in running_before]
        new = [r for r in sched_ids if r not in running_before]
        # running requests first, in order, as a prefix of the survivors
        assert sched_ids[: len(old)] == old == kept[: len(old)]
        for s in out.scheduled[: len(old)]:
            assert s.num_computed_tokens == computed_before[s.request.request_id]
        if m:
            assert new == []  # nothing admitted in a step that preempted
            assert list(sched.waiting)[:m] == running_before[-m:]
        else:
            # every running request got a turn unless the budget ran out
            if len(old) < len(kept):
                assert out.total_num_tokens == budget
        # admissions come from the head of the waiting queue, in order
        assert new == waiting_before[: len(new)]
        for s, samples in zip(out.scheduled[len(old):], out.sampled[len(old):]):
            assert s.num_computed_tokens % BS == 0
            assert s.num_computed_tokens <= ((s.request.num_tokens - 1) // BS) * BS
            if not cfg["caching"]:
                assert s.num_computed_tokens == 0
            if not cfg["chunked"]:
                assert samples  # whole prompt at once
    for r in all_reqs:
        if r.request_id in aborted:
            continue
        assert r.request_id in runner.finished, r
        assert r.output_token_ids == solo_output(r.prompt_token_ids, r.sampling_params.max_tokens)
    assert sched.running == [] and not sched.waiting and sched.requests == {}
    assert sched.kv.num_free_blocks == num_blocks
    assert sched.kv.req_to_blocks == {}


# ==== (b) the real engine on a tiny model =====================================================
MAX_MODEL_LEN = 96
BUDGET = 24
POOLS = (6, 7)  # 6 blocks x 16 = exactly one max-length request
MAX_OUT = 12
_rng = random.Random(1234)
BASES = [[_rng.randrange(3, 512) for _ in range(MAX_MODEL_LEN)] for _ in range(3)]


@pytest.fixture(scope="module")
def tiny_llama(make_tiny_model):
    return str(make_tiny_model("llama"))


@pytest.fixture(scope="module")
def engines(tiny_llama):
    from kvserve.engine.llm import LLM

    made = {}

    def get(pool: int):
        if pool not in made:
            llm = LLM(
                tiny_llama,
                max_model_len=MAX_MODEL_LEN,
                num_gpu_blocks_override=pool,
                max_num_batched_tokens=BUDGET,
                max_num_seqs=4,
                block_size=16,
                seed=0,
            )
            made[pool] = llm.llm_engine
        return made[pool]

    return get


@pytest.fixture(scope="module")
def solo(tiny_llama):
    """Greedy output of a prompt run alone (no chunking, no prefix cache), cached per prompt."""
    from kvserve.engine.llm import LLM

    llm = LLM(
        tiny_llama,
        max_model_len=MAX_MODEL_LEN,
        num_gpu_blocks_override=8,
        max_num_batched_tokens=MAX_MODEL_LEN,
        max_num_seqs=1,
        enable_prefix_caching=False,
        seed=0,
    )
    cache: dict[tuple[int, ...], tuple[list[int], str]] = {}

    def get(prompt: list[int], max_tokens: int) -> tuple[list[int], str]:
        key = tuple(prompt)
        if key not in cache:
            (out,) = llm.generate(
                {"prompt_token_ids": list(prompt)},
                SamplingParams(temperature=0, max_tokens=MAX_OUT),
                use_tqdm=False,
            )
            cache[key] = (list(out.outputs[0].token_ids), out.outputs[0].finish_reason)
        ids, reason = cache[key]
        if len(ids) > max_tokens:
            return ids[:max_tokens], "length"
        if len(ids) == max_tokens and reason == "length":
            return ids, "length"
        return ids, reason

    return get


def drive(engine, requests, check_each_step=True):
    """requests: list of (rid, prompt, max_tokens, arrival_step, abort_step | None).
    Returns ({rid: (token_ids, finish_reason)} of finished requests, ids aborted while unfinished)."""
    finished: dict[str, tuple[list[int], str]] = {}
    added: set[str] = set()
    aborted: set[str] = set()
    last_arrival = max(r[3] for r in requests)
    kv = engine.kv_manager
    t = 0
    while t <= last_arrival or engine.has_unfinished_requests():
        for rid, prompt, max_tokens, arrival, _ in requests:
            if arrival == t:
                engine.add_request(
                    rid, {"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=max_tokens)
                )
                added.add(rid)
        for rid, _, _, _, abort_at in requests:
            if abort_at == t and rid in added:
                if rid in engine.states:
                    aborted.add(rid)
                engine.abort_request(rid)  # a no-op if it already finished
        for out in engine.step():
            assert out.request_id not in finished
            if out.finished:
                c = out.outputs[0]
                finished[out.request_id] = (list(c.token_ids), c.finish_reason)
        if check_each_step:
            kv.check_invariants()
        t += 1
        assert t < 3000, "engine made no progress"
    assert not (aborted & set(finished))
    return finished, aborted


def assert_idle(engine):
    kv = engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.pool.num_blocks
    assert kv.req_to_blocks == {}
    sched = engine.scheduler
    assert sched.running == [] and len(sched.waiting) == 0 and sched.requests == {}
    assert engine.states == {}
    assert engine.runner.generators == {}


def test_engine_preempts_and_chunks_yet_matches_solo(engines, solo):
    engine = engines(POOLS[0])
    before = engine.scheduler.num_preemptions
    reqs = [
        ("e0", BASES[0][:70], 12, 0, None),
        ("e1", BASES[0][:40] + [7], 10, 0, None),
        ("e2", BASES[1][:33], 12, 1, None),
        ("e3", BASES[2][:5], 12, 2, None),
        ("e4", BASES[1][:50], 3, 2, None),
    ]
    finished, _ = drive(engine, reqs)
    assert engine.scheduler.num_preemptions > before  # the pool really was too small
    for rid, prompt, k, _, _ in reqs:
        assert finished[rid] == solo(prompt, k), rid
    assert_idle(engine)


req_strategy = st.tuples(
    st.integers(0, len(BASES) - 1),  # which base sequence (shared prefixes)
    st.sampled_from([None, 0, 1, 2]),  # another base's first block in front (same blocks at a new prefix)
    st.integers(8, MAX_MODEL_LEN - MAX_OUT),  # prefix length
    st.lists(st.integers(3, 511), max_size=3),  # divergent tail
    st.integers(1, MAX_OUT),  # max_tokens
    st.integers(0, 2),  # arrival step
    st.one_of(st.none(), st.none(), st.integers(0, 15)),  # abort step
)


@settings(
    max_examples=25,
    deadline=None,
    derandomize=True,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
@given(pool=st.sampled_from(POOLS), mix=st.lists(req_strategy, min_size=2, max_size=5))
def test_engine_random_mixes_match_solo_and_leak_nothing(engines, solo, pool, mix):
    engine = engines(pool)
    requests = []
    for i, (base, head, n, tail, k, arrival, abort_at) in enumerate(mix):
        prompt = BASES[base][:n] + tail
        if head is not None:
            prompt[:16] = BASES[head][:16]
        prompt = prompt[: MAX_MODEL_LEN - MAX_OUT]
        requests.append((f"h{i}", prompt, k, arrival, abort_at))
    try:
        finished, aborted = drive(engine, requests)
    except BaseException:
        engine.abort_request(list(engine.states))  # leave the shared engine clean for shrinking
        raise
    for rid, prompt, k, _, abort_at in requests:
        if rid in aborted:
            continue
        assert rid in finished, f"{rid} never finished"
        assert finished[rid] == solo(prompt, k), rid
    assert_idle(engine)
