"""Async scheduling (vLLM's ``--async-scheduling``): step N+1 is scheduled and launched before
step N's tokens reach the host; a decode row's input token is gathered on the device. The outputs
must be exactly those of the synchronous engine: same tokens, finish and stop reasons, text, through
stops that leave a wasted row in the step already launched, preemption, prefix hits, aborts, n > 1,
and the requests whose sampling needs host state (they run synchronously)."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.engine.sampling import SamplingParams
from kvserve.runner.transfer import rows_to_device


def _engine(model, async_scheduling, **kw):
    args = dict(model=str(model), device="cpu", kv_cache_memory=1 << 22, max_num_seqs=8,
                max_num_batched_tokens=64, max_model_len=256, async_scheduling=async_scheduling)
    args.update(kw)
    return Engine.from_engine_args(EngineArgs(**args))


def _run(engine, requests, abort_at=None):
    """Step to completion; returns {request_id: (token ids, finish, stop reason, text)}."""
    for rid, prompt, params in requests:
        engine.add_request(rid, prompt, params)
    done, steps = {}, 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.token_ids, c.finish_reason, c.stop_reason, c.text) for c in out.outputs]
        steps += 1
        if abort_at is not None and steps == abort_at[0]:
            engine.abort_request(abort_at[1])
        assert steps < 5000
    engine.kv_manager.check_invariants()
    assert engine.kv_manager.num_free_blocks == engine.kv_manager.pool.num_blocks, "KV blocks leaked"
    assert not engine.states and not engine.scheduler.requests
    return done


def _workload(stop_ids, n_requests=14):
    """Greedy and seeded random rows, stop ids that are really generated, min_tokens, a stop
    string, n=2, shared prefixes (prefix-cache hits), different lengths."""
    reqs = []
    shared = list(range(40, 80))
    for i in range(n_requests):
        prompt = (shared if i % 3 == 0 else []) + [(7 * i + j) % 500 + 3 for j in range(5 + 3 * i)]
        kw = dict(max_tokens=12 + 3 * i, ignore_eos=i % 4 == 3)
        if i % 2:
            kw.update(temperature=0.9, seed=100 + i)
        else:
            kw.update(temperature=0.0)
        if i % 3 != 0:
            kw.update(stop_token_ids=stop_ids)
        if i % 5 == 2:
            kw.update(min_tokens=4, stop_token_ids=stop_ids)
        if i == 6:
            kw.update(n=2, temperature=0.8, seed=7)
        reqs.append((f"r{i}", {"prompt_token_ids": prompt}, SamplingParams(**kw)))
    return reqs


@pytest.fixture(scope="module")
def stop_ids(tiny, one_thread):
    """The three tokens the tiny model generates most often in the workload itself (a run without
    stop ids), so stops fire mid-batch in several requests."""
    from collections import Counter

    out = _run(_engine(tiny, False), _workload([]))
    counts = Counter(t for outs in out.values() for (toks, *_) in outs for t in toks)
    return [t for t, _ in counts.most_common(3)]


def test_async_gives_the_sync_outputs(tiny, stop_ids, one_thread):
    sync = _run(_engine(tiny, False), _workload(stop_ids))
    eng = _engine(tiny, True)
    assert eng.async_scheduling
    got = _run(eng, _workload(stop_ids))
    assert got == sync
    reasons = [r for outs in sync.values() for (_, r, _, _) in outs]
    assert reasons.count("stop") >= 2 and reasons.count("length") >= 2  # both kinds of ending happened


def test_async_survives_preemption(tiny, stop_ids, one_thread):
    # 20 blocks of 16 tokens for up to 8 sequences of up to ~140 tokens: preemption is certain
    small = dict(num_gpu_blocks_override=20)
    eng_sync = _engine(tiny, False, **small)
    sync = _run(eng_sync, _workload(stop_ids))
    eng = _engine(tiny, True, **small)
    got = _run(eng, _workload(stop_ids))
    assert eng_sync.scheduler.num_preemptions > 0 and eng.scheduler.num_preemptions > 0
    assert got == sync


def test_async_abort_while_a_step_is_in_flight(tiny, stop_ids, one_thread):
    reqs = _workload(stop_ids, n_requests=6)
    sync = _run(_engine(tiny, False), reqs)
    eng = _engine(tiny, True)
    got = _run(eng, _workload(stop_ids, n_requests=6), abort_at=(6, "r2"))
    assert "r2" not in got
    del sync["r2"]
    assert got == sync


def test_requests_that_need_host_state_run_synchronously(tiny, one_thread):
    def reqs():
        return [
            ("plain", {"prompt_token_ids": [5, 6, 7, 8]}, SamplingParams(temperature=0.0, max_tokens=10)),
            ("lp", {"prompt_token_ids": [9, 10, 11]}, SamplingParams(temperature=0.0, max_tokens=6, logprobs=2)),
            ("pen", {"prompt_token_ids": [12, 13]}, SamplingParams(temperature=0.0, max_tokens=8, repetition_penalty=1.3)),
        ]

    sync_eng = _engine(tiny, False)
    for rid, p, sp in reqs():
        sync_eng.add_request(rid, p, sp)
    eng = _engine(tiny, True)
    for rid, p, sp in reqs():
        eng.add_request(rid, p, sp)
    got, want = {}, {}
    while eng.has_unfinished_requests():
        for o in eng.step():
            got[o.request_id] = o
        if "lp" in eng.states or "pen" in eng.states:
            assert eng.core._pending is None  # nothing left in flight while such a request lives
    while sync_eng.has_unfinished_requests():
        for o in sync_eng.step():
            want[o.request_id] = o
    for rid in want:
        assert got[rid].outputs[0].token_ids == want[rid].outputs[0].token_ids
        assert got[rid].outputs[0].logprobs == want[rid].outputs[0].logprobs


def test_async_keeps_one_step_in_flight(tiny, one_thread):
    eng = _engine(tiny, True)
    eng.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=3))
    assert eng.step() == []  # the prefill was launched; its token is processed by the next call
    assert eng.core._pending is not None and eng.scheduler.requests["a"].num_pending == 1
    outs = []
    while eng.has_unfinished_requests():
        outs += eng.step()
    assert [len(o.outputs[0].token_ids) for o in outs] == [1, 2, 3] and outs[-1].finished
    assert eng.core._pending is None


def test_async_scheduling_resolution(tiny):
    assert EngineArgs(model=str(tiny), device="cpu", kv_cache_memory=1 << 22).create_engine_config().scheduler_config.async_scheduling is False
    assert EngineArgs(model=str(tiny), device="cpu", kv_cache_memory=1 << 22,
                      async_scheduling=True).create_engine_config().scheduler_config.async_scheduling is True


def test_async_scheduling_flag():
    from kvserve.arg_utils import add_engine_args

    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args([]).async_scheduling is None
    assert p.parse_args(["--async-scheduling"]).async_scheduling is True
    assert p.parse_args(["--no-async-scheduling"]).async_scheduling is False


def test_llm_generate_with_async_scheduling(tiny, one_thread):
    from kvserve import LLM

    prompts = [{"prompt_token_ids": [4 + i, 30, 31 + i]} for i in range(5)]
    sp = SamplingParams(temperature=0.0, max_tokens=9)
    a = LLM(str(tiny), device="cpu", kv_cache_memory=1 << 22, async_scheduling=True).generate(prompts, sp)
    b = LLM(str(tiny), device="cpu", kv_cache_memory=1 << 22).generate(prompts, sp)
    assert [o.outputs[0].token_ids for o in a] == [o.outputs[0].token_ids for o in b]


def test_bench_counts_every_token_with_async_scheduling(tiny, one_thread):
    """``run_requests`` attributes each token to the ``Engine.step`` call that delivered it (one
    call after its launch) and checks every request got exactly its output length."""
    from kvserve.bench import throughput as tp

    reqs = tp.nano_vllm_requests(6, lengths=(4, 9, 7), max_token_id=511)
    res = tp.run_requests(_engine(tiny, True), reqs, temperature=0.6)
    assert res["output_tokens"] == sum(r.output_len for r in reqs)
    assert res["decode_steps_total"] > 0 and res["p50_ttft_ms"] > 0


def test_failed_launch_keeps_the_step_before(tiny, one_thread, monkeypatch):
    """A launch that raises aborts that step's requests only; the tokens of the step launched
    before it are still processed and returned by the next ``step`` call; nothing leaks."""
    eng = _engine(tiny, True)
    real = eng.runner.execute_async
    calls = []

    def failing(sched):
        calls.append(sched)
        if len(calls) == 3:
            raise RuntimeError("simulated launch failure")
        return real(sched)

    monkeypatch.setattr(eng.runner, "execute_async", failing)
    eng.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=20))
    assert eng.step() == [] and eng.step()[0].outputs[0].token_ids  # launches 1, 2; returns 1's token
    eng.add_request("b", {"prompt_token_ids": [8, 9]}, SamplingParams(temperature=0.0, max_tokens=20))
    with pytest.raises(RuntimeError, match="simulated"):
        eng.step()
    assert "a" not in eng.states and "b" not in eng.states  # both were in the failed step
    deferred = eng.step()  # the step before the failure: a's second token
    assert [len(o.outputs[0].token_ids) for o in deferred] == [2]
    assert not eng.has_unfinished_requests()
    eng.kv_manager.check_invariants()
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.pool.num_blocks


def test_device_failure_surfacing_late_aborts_both_steps(tiny, one_thread, monkeypatch):
    """A step whose failure shows only when its tokens are awaited (a device fault): that step's
    requests and those of the step launched behind it are aborted; nothing leaks; the engine
    serves the next request."""
    from kvserve.runner import model_runner as mr

    eng = _engine(tiny, True)
    real = mr.PendingSamples.results
    calls = []

    def failing(self):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("simulated device fault")
        return real(self)

    monkeypatch.setattr(mr.PendingSamples, "results", failing)
    eng.add_request("a", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=20))
    eng.add_request("b", {"prompt_token_ids": [9, 10]}, SamplingParams(temperature=0.0, max_tokens=20))
    eng.step()
    eng.step()
    with pytest.raises(RuntimeError, match="simulated device fault"):
        eng.step()
    assert not eng.states and not eng.has_unfinished_requests()
    eng.kv_manager.check_invariants()
    assert eng.kv_manager.num_free_blocks == eng.kv_manager.pool.num_blocks
    monkeypatch.setattr(mr.PendingSamples, "results", real)
    out = _run(eng, [("c", {"prompt_token_ids": [5, 6, 7]}, SamplingParams(temperature=0.0, max_tokens=4))])
    assert len(out["c"][0][0]) == 4


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_rows_to_device_views_are_16_byte_aligned(dtype):
    """One packed copy, one view per list, every view starting on a 16-byte boundary whatever the
    lengths (Triton specializes on pointer alignment), values intact."""
    rows = ([7, 8, 9], [1, 2, 3, 4, 5], [6], [], [10, 11])
    views = rows_to_device(rows, dtype, torch.device("cpu"))
    assert [v.tolist() for v in views] == [list(r) for r in rows]
    assert all(v.dtype == dtype for v in views)
    assert all(v.storage_offset() * v.element_size() % 16 == 0 for v in views)
    assert len({v.untyped_storage().data_ptr() for v in views}) == 1  # one copy
