"""The engine core in its own process (``engine/core_proc.py``) behind ``CoreClient``: the same
tokens as the in-process core, aborts that free blocks across the boundary, a failed step reported
with its requests, a dead core reported within seconds, and no process left behind (shutdown, a
failed start, a front end killed hard)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from kvserve.config import EngineArgs
from kvserve.engine.core import EngineCore
from kvserve.engine.core_client import CoreClient
from kvserve.engine.exceptions import EngineDeadError
from kvserve.engine.core_messages import ENCODER, REQUEST_DECODERS, AddRequest, RequestType, params_of
from kvserve.engine.request import RequestStatus
from kvserve.engine.sampling import RequestOutputKind, SamplingParams


def _config(folder, **kw):
    args = dict(model=str(folder), dtype="float32", max_num_seqs=4, max_model_len=128, skip_tokenizer_init=True,
                kv_cache_memory=1 << 22, device="cpu")
    return EngineArgs(**{**args, **kw}).create_engine_config()


def _params(**kw) -> SamplingParams:
    p = SamplingParams(**{"temperature": 0.0, "max_tokens": 6, **kw})
    p.update_from_generation_config(2, [5])
    return p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie is gone for our purposes (its parent reaps it)
        return f.read().split(")")[-1].split()[0] != "Z"


def _wait_gone(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.1)
    return False


def _drain(client: CoreClient, want: set[str], timeout_s: float = 60.0) -> dict:
    """request id -> (tokens, finish status) until every id in ``want`` finished."""
    got: dict = {}
    deadline = time.monotonic() + timeout_s
    while not all(got.get(r, (None, None))[1] is not None for r in want):
        out = client.get_output(max(0.1, deadline - time.monotonic()))
        assert out is not None, f"no output within {timeout_s} s; got {got}"
        for o in out.outputs:
            ids, _ = got.get(o.request_id, ([], None))
            got[o.request_id] = (ids + o.new_token_ids, o.finish_status)
    return got


@pytest.fixture(scope="module")
def tiny(make_tiny_model):
    return make_tiny_model("llama")


def test_add_request_keeps_the_eos_ids_the_front_end_added():
    p = _params(stop_token_ids=[9], min_tokens=2)
    frame = ENCODER.encode(AddRequest("r", [1, 2], p, sorted(p.all_stop_token_ids)))
    back = params_of(REQUEST_DECODERS[RequestType.ADD].decode(frame))
    assert back.all_stop_token_ids == {2, 5, 9} and back.eos_token_id == 2 and back.stop_token_ids == [5, 9]
    assert back == p


def test_core_process_gives_the_in_process_tokens(tiny, one_thread):
    prompts = {"a": [3, 4, 5, 6], "b": [7, 8], "c": list(range(10, 40))}
    params = {"a": _params(), "b": _params(max_tokens=9), "c": _params(max_tokens=3)}
    core = EngineCore(_config(tiny))
    for rid, ids in prompts.items():
        core.add_request(rid, ids, params[rid].clone())
    want: dict = {}
    while core.has_unfinished_requests():
        for o in core.step():
            ids, _ = want.get(o.request_id, ([], None))
            want[o.request_id] = (ids + o.new_token_ids, o.finish_status)
    client = CoreClient(_config(tiny))
    try:
        for rid, ids in prompts.items():
            client.add_request(rid, ids, params[rid].clone())
        assert _drain(client, set(prompts)) == want
        assert [len(want[r][0]) for r in "abc"] == [6, 9, 3]
    finally:
        client.shutdown()
    assert not client.proc.is_alive()
    assert not any(os.path.exists(a.removeprefix("ipc://")) for a in (client.input_address, client.output_address))


def test_abort_crosses_the_boundary_and_frees_the_blocks(tiny):
    client = CoreClient(_config(tiny))
    try:
        client.add_request("long", [3, 4, 5], _params(max_tokens=100, ignore_eos=True))
        first = client.get_output(60)
        assert first is not None and first.outputs[0].request_id == "long"
        client.finish_requests(["long"])
        call = client.call_utility("scheduler_stats")
        while True:  # outputs already in flight may come first
            out = client.get_output(60)
            assert out is not None
            if out.utility_call_id == call:
                break
        stats = out.utility_result
        assert stats["num_running"] == 0 and stats["num_waiting"] == 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
    finally:
        client.shutdown()


def test_failed_step_is_reported_with_its_requests_and_the_core_goes_on(tiny):
    client = CoreClient(_config(tiny))
    try:
        client.add_request("bad", [3, 10**6], _params())  # an id no embedding row has (the front end would refuse it)
        out = client.get_output(60)
        assert out is not None and out.failed_request_ids == ["bad"] and "Engine step failed" in out.error
        client.add_request("good", [3, 4], _params(max_tokens=4, ignore_eos=True))
        got = _drain(client, {"good"})
        assert len(got["good"][0]) == 4 and got["good"][1] == RequestStatus.FINISHED_LENGTH_CAPPED
    finally:
        client.shutdown()


def test_killed_core_is_reported_within_seconds(tiny):
    client = CoreClient(_config(tiny))
    try:
        client.add_request("a", [3, 4], _params(max_tokens=100, ignore_eos=True))
        os.kill(client.proc.pid, 9)
        t0 = time.monotonic()
        with pytest.raises(EngineDeadError, match="EngineCore encountered an issue"):
            while time.monotonic() - t0 < 5:
                client.get_output(0.2)
        assert time.monotonic() - t0 < 5
        with pytest.raises(EngineDeadError):
            client.add_request("b", [3], _params())
    finally:
        client.shutdown()
    assert not client.proc.is_alive()


def test_failed_start_leaves_no_process(tiny):
    config = _config(tiny)
    config.cache_config.kv_cache_memory = 1  # not one block: the core's memory plan fails
    before = set(os.listdir("/proc"))
    with pytest.raises(RuntimeError, match="Engine core initialization failed"):
        CoreClient(config)
    time.sleep(0.2)
    new = [p for p in set(os.listdir("/proc")) - before if p.isdigit() and _alive(int(p))]
    assert not any("EngineCore" in open(f"/proc/{p}/cmdline", "rb").read().decode(errors="replace") for p in new)


def test_core_exits_when_its_front_end_is_killed(tiny, tmp_path):
    script = tmp_path / "front.py"
    script.write_text(textwrap.dedent(f"""
        import os, sys
        sys.path[:0] = {sys.path!r}
        from kvserve.config import EngineArgs
        from kvserve.engine.core_client import CoreClient
        if __name__ == "__main__":
            cfg = EngineArgs(model={str(tiny)!r}, dtype="float32", max_num_seqs=4, max_model_len=128,
                             skip_tokenizer_init=True, kv_cache_memory=1 << 22, device="cpu").create_engine_config()
            client = CoreClient(cfg)
            print(client.input_address.rsplit("/", 1)[-1], client.output_address.rsplit("/", 1)[-1], flush=True)
            print(client.proc.pid, flush=True)
            os.kill(os.getpid(), 9)
    """))
    proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr[-2000:]
    core_pid = int(proc.stdout.split()[-1])
    assert _wait_gone(core_pid, 10), "the engine core outlived its front end"
    sockets = set(proc.stdout.split()[:2])  # the two ipc file names it printed (whole names, not substrings)
    assert not sockets & set(os.listdir(tempfile.gettempdir())), "ipc socket files left"


# ---- the front end over a core process (Engine / AsyncLLM, multiprocess=True) -----------------
def _final_outputs(engine, prompts: dict, params: SamplingParams) -> dict:
    for rid, prompt in prompts.items():
        engine.add_request(rid, prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = [(c.text, c.token_ids, c.finish_reason, c.stop_reason) for c in out.outputs]
    return done


def test_engine_over_a_core_process_gives_the_in_process_outputs(tiny, one_thread):
    from kvserve.engine.engine import Engine

    # greedy: which requests share a step depends on when the core process receives them, and float32
    # sums over another batch can move a sampled (temperature) token where the race is close
    prompts = {"a": "the quick brown fox", "b": {"prompt_token_ids": [3, 4, 5]}, "c": "hello"}
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[" e", "a"])
    cfg = dict(skip_tokenizer_init=False)
    want = _final_outputs(Engine(_config(tiny, **cfg)), prompts, params)
    remote = Engine(_config(tiny, **cfg), multiprocess=True)
    try:
        assert _final_outputs(remote, prompts, params) == want
        # n = 2 across the boundary: both choices come back, finished, their text the decode of their ids
        n2 = SamplingParams(temperature=0.8, seed=7, n=2, max_tokens=12, output_kind=RequestOutputKind.FINAL_ONLY)
        (pair,) = _final_outputs(remote, {"n2": "hello"}, n2).values()
        assert len(pair) == 2 and all(len(c[1]) == 12 and c[2] == "length" for c in pair)
        assert all(c[0] == remote.tokenizer.decode(c[1], skip_special_tokens=True) for c in pair)
        t0 = time.monotonic()  # the core's stats follow the stop-string finishes it was sent
        while remote.stats()["num_running"] and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        stats = remote.stats()
        assert stats["num_running"] == stats["num_waiting"] == 0
        assert stats["num_free_blocks"] == stats["num_total_blocks"]
        # a stop string ended one
        assert any(c[2] == "stop" and isinstance(c[3], str) for outs in want.values() for c in outs)
        with pytest.raises(AttributeError, match="its own process"):
            remote.scheduler
    finally:
        remote.shutdown()
    assert not remote.core.proc.is_alive()


def test_async_llm_over_a_core_process_streams_then_reports_its_death(tiny):
    import asyncio

    from kvserve.engine.async_llm import AsyncLLM

    llm = AsyncLLM.from_engine_args(EngineArgs(model=str(tiny), dtype="float32", max_num_seqs=4, max_model_len=128,
                                               kv_cache_memory=1 << 22, device="cpu"), multiprocess=True)

    async def run(rid: str, n: int) -> list[int]:
        tokens = []
        async for out in llm.generate("a b c", SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), rid):
            tokens += out.outputs[0].token_ids
        return tokens

    try:
        assert len(asyncio.run(run("first", 5))) == 5 and llm.is_running
        os.kill(llm.engine.core.proc.pid, 9)
        t0 = time.monotonic()
        while llm.is_running and time.monotonic() - t0 < 5:
            time.sleep(0.05)
        assert not llm.is_running, "a dead core was not noticed within 5 s"
        with pytest.raises(EngineDeadError):
            asyncio.run(run("second", 5))
    finally:
        llm.shutdown()


def _async_llm(tiny, multiprocess: bool):
    from kvserve.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(EngineArgs(model=str(tiny), dtype="float32", max_num_seqs=4, max_model_len=128,
                                                kv_cache_memory=1 << 22, device="cpu"), multiprocess=multiprocess)


async def _stream_all(llm, prompts: dict, params: SamplingParams) -> dict:
    """request id -> per choice (text, token ids, finish reason) gathered from the DELTA stream."""
    import asyncio

    async def one(rid: str, prompt) -> tuple:
        got: dict = {}
        async for out in llm.generate(prompt, params, rid):
            for c in out.outputs:
                text, ids, _ = got.get(c.index, ("", [], None))
                got[c.index] = (text + c.text, ids + list(c.token_ids), c.finish_reason)
        return rid, [got[i] for i in sorted(got)]

    return dict(await asyncio.gather(*(one(r, p) for r, p in prompts.items())))


def _wait_idle(llm, seconds: float = 10.0) -> None:
    import asyncio

    async def idle() -> None:  # the output handler runs on a loop: give it one while we wait
        if not llm._thread.is_alive():
            llm._ensure_output_handler()  # (a server's runs from its first request on)
        t0 = time.monotonic()
        while (llm.stats.num_running or llm.stats.num_free_blocks != llm.stats.num_total_blocks) \
                and time.monotonic() - t0 < seconds:
            await asyncio.sleep(0.02)

    asyncio.run(idle())


def test_async_llm_on_the_event_loop_streams_what_the_engine_thread_streams(tiny, one_thread, monkeypatch):
    """The core in its own process: the front end's work on the caller's event loop (output handler
    task, no engine thread) streams exactly what the in-process AsyncLLM streams: greedy text, ids and
    finish reasons of concurrent requests with stop strings, outputs handled two per loop turn."""
    import asyncio

    from kvserve.engine import async_llm

    prompts = {"a": "the quick brown fox", "b": {"prompt_token_ids": [3, 4, 5]}, "c": "hello", "d": "a b c d e"}
    params = SamplingParams(temperature=0.0, max_tokens=12, stop=[" e", "a"])
    local = _async_llm(tiny, multiprocess=False)
    try:
        want = asyncio.run(_stream_all(local, prompts, params))
    finally:
        local.shutdown()
    monkeypatch.setattr(async_llm, "OUTPUT_PROC_CHUNK_SIZE", 2)
    remote = _async_llm(tiny, multiprocess=True)
    try:
        assert not remote._thread.is_alive()  # no engine thread in this mode
        assert asyncio.run(_stream_all(remote, prompts, params)) == want
        assert asyncio.run(_stream_all(remote, prompts, params)) == want  # a second event loop
        _wait_idle(remote)
        assert remote.stats.num_running == 0 and remote.stats.num_free_blocks == remote.stats.num_total_blocks
    finally:
        remote.shutdown()


def test_async_llm_on_the_event_loop_aborts_refuses_and_survives_a_failed_step(tiny, one_thread):
    """Leaving a stream early aborts it across the boundary (its blocks come back); an invalid request
    raises its ValueError at once; a step the core reports failed fails that request's stream with the
    error while another request runs on to its end; abort from another thread reaches the loop."""
    import asyncio
    import threading

    llm = _async_llm(tiny, multiprocess=True)
    long = SamplingParams(temperature=0, max_tokens=100, ignore_eos=True)

    async def scenario() -> None:
        n = 0
        async for _ in llm.generate("a b c", long, "early"):  # leave after 2 outputs
            n += 1
            if n == 2:
                break
        with pytest.raises(ValueError, match="out of vocabulary"):
            await llm.add_request("bad", [3, 10**6], long)
        with pytest.raises(ValueError, match="already exists"):
            it = await llm.add_request("dup", [3, 4], long)
            await llm.add_request("dup", [3, 4], long)
        await it.aclose()
        # past the front end's check (as a stale vocabulary would be): the core's step fails, with
        # the requests of that step only; the next request runs to its end
        llm.engine.vocab_size = 10**7
        with pytest.raises(RuntimeError, match="^Engine step failed: index out of range"):
            async for _ in llm.generate({"prompt_token_ids": [3, 10**6]}, long, "poison"):
                pass
        (ids,) = [c[1] for c in (await _stream_all(llm, {"good": [3, 4]}, long))["good"]]
        assert len(ids) == 100
        # abort from another thread: handed to the loop
        it = await llm.add_request("threaded", [5, 6], long)
        await it.__anext__()
        threading.Thread(target=llm.abort, args=("threaded",)).start()
        rest = [o async for o in it]
        assert not rest or not rest[-1].finished

    try:
        asyncio.run(scenario())
        _wait_idle(llm)
        assert llm.stats.num_running == llm.stats.num_waiting == 0
        assert llm.stats.num_free_blocks == llm.stats.num_total_blocks
        assert llm.is_running
    finally:
        llm.shutdown()
    assert not llm.is_running


def test_one_core_serves_two_front_ends(tiny, one_thread):
    """``--api-server-count``'s core: each attached front end gets the outputs of exactly the requests it
    added, whole; an id one front end already runs is refused to the other without touching the
    first; a front end cannot abort another's request; an attached client's shutdown leaves the core
    running for the others, and a request alone there gives the in-process tokens of the same request
    alone (one batch: the same sums)."""
    from kvserve.engine.core_client import start_core_process, stop_process

    prompts = {"a": [3, 4, 5, 6], "b": [7, 8], "c": list(range(10, 40)), "d": [9, 9, 9]}
    # "a" runs ~100 steps, so it is still running when second's duplicate id arrives (at 6 it could
    # finish in the few ms between the utility answer and that add, and the id was free again)
    lengths = {"a": 100, "b": 4, "c": 7, "d": 5}

    def params(rid: str) -> SamplingParams:
        return _params(max_tokens=lengths[rid], ignore_eos=True)

    def collect(client: CoreClient, into: dict, until: set[str], call: int | None = None) -> list:
        """Outputs into ``into`` until every id in ``until`` finished (and utility ``call`` answered)."""
        failures, answered = [], call is None
        deadline = time.monotonic() + 60
        while not (answered and all(into.get(r, (None, None))[1] is not None for r in until)):
            out = client.get_output(max(0.1, deadline - time.monotonic()))
            assert out is not None, into
            answered |= out.utility_call_id == call
            if out.failed_request_ids:
                failures.append((out.failed_request_ids, out.error))
            for o in out.outputs:
                ids, _ = into.get(o.request_id, ([], None))
                into[o.request_id] = (ids + o.new_token_ids, o.finish_status)
        return failures

    alone = EngineCore(_config(tiny))
    alone.add_request("a", prompts["a"], params("a"))
    want_alone: list[int] = []
    while alone.has_unfinished_requests():
        want_alone += [t for o in alone.step() for t in o.new_token_ids]
    proc = start_core_process(_config(tiny), 2)
    clients = [CoreClient(_config(tiny), address=proc.address(i)) for i in range(2)]
    try:
        assert [c.ready["pid"] for c in clients] == [proc.proc.pid] * 2
        first, second = clients
        got_first: dict = {}
        got_second: dict = {}
        first.add_request("a", prompts["a"], params("a"))
        first.add_request("b", prompts["b"], params("b"))
        # a utility call's answer: the core has taken first's adds (one socket keeps its order)
        collect(first, got_first, set(), first.call_utility("scheduler_stats"))
        second.add_request("c", prompts["c"], params("c"))
        second.add_request("d", prompts["d"], params("d"))
        second.add_request("a", [1, 2], params("a"))  # first's id: refused to second alone
        second.finish_requests(["b"])  # not second's: ignored
        assert collect(first, got_first, {"a", "b"}) == []
        refused = collect(second, got_second, {"c", "d"})
        assert sorted(got_first) == ["a", "b"] and sorted(got_second) == ["c", "d"]
        for rid, (ids, status) in {**got_first, **got_second}.items():
            assert len(ids) == lengths[rid] and status == RequestStatus.FINISHED_LENGTH_CAPPED, rid
        assert refused == [(["a"], "Request id 'a' already exists.")]
        first.shutdown()
        assert proc.proc.is_alive()  # the launcher's core: one front end leaving does not end it
        second.add_request("e", prompts["a"], params("a"))
        got: dict = {}
        collect(second, got, {"e"})
        assert got["e"][0] == want_alone
    finally:
        for c in clients:
            c.shutdown()
        proc.parent_end.close()
        stop_process(proc.proc, 5.0)
    assert not proc.proc.is_alive()
