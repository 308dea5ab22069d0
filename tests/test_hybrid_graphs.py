"""Decode CUDA graphs of hybrid models, the CPU half: padding rows of a graph point at the scratch
state row and start from zeros, so a padded replay writes no live or snapshot state but its batch's.

Off CUDA a graph cannot be captured, so ``emulated_capture`` stands in for
``DecodeGraphs.capture``: a "replay" reruns the call a capture records (the model on the static
buffers with the graph's metadata) through the Triton kernels in the interpreter. The engine then
takes the graph path for decode-only steps exactly as on the GPU: its greedy tokens and prefix hits
must equal the eager engine's, its logprobs within float32 rounding. ``tests/test_gpu_hybrid.py``
runs the same workload and checks with real graphs on the H200."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any
from unittest import mock

import pytest
import torch

from kvserve.config import EngineArgs
from kvserve.engine.engine import Engine
from kvserve.engine.sampling import SamplingParams
from kvserve.runner.cuda_graphs import DecodeGraphs, fit_capture_sizes, graph_size
from hf_reference import hf_greedy_reference
from triton_support import skip_without_triton_device

# max_num_seqs 8: graphs of 1, 2, 4, 8 rows; 11 KV blocks of 16 tokens preempt one of the first
# five requests; snapshots every 16 tokens
ENGINE_ARGS: dict[str, Any] = dict(
    max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128, num_gpu_blocks_override=11,
    kv_cache_memory=1 << 22, mamba_block_size=16, seed=0,
)
Arrival = tuple[int, str, list[int], int]  # (engine step it arrives before, request id, prompt, max_tokens)
Outputs = dict[str, tuple[list[int], list[float] | None, int | None]]


def hybrid_workload(seed: int = 0) -> list[Arrival]:
    """Five prompts at once, two sharing a 32-token prefix, with different output lengths: decode
    batches of 5 and 3 rows (padded to graphs of 8 and 4) and preemption. Later arrivals hit the
    prefix's snapshot at 32: "f" has one new token, so its first step is a decode row whose state
    is restored just before a graph replay; "g" has eight (a prefill chunk beside decodes)."""
    gen = torch.Generator().manual_seed(seed)

    def ids(n: int) -> list[int]:
        return torch.randint(3, 500, (n,), generator=gen).tolist()

    prefix = ids(32)
    return [
        (0, "a", prefix + ids(7), 14), (0, "b", prefix + ids(11), 9), (0, "c", ids(20), 16),
        (0, "d", ids(9), 11), (0, "e", ids(17), 6), (12, "f", prefix + ids(1), 8), (14, "g", prefix + ids(8), 6),
    ]


def drive(engine: Engine, arrivals: list[Arrival], tag: str, logprobs: bool) -> Outputs:
    """Run the arrivals to completion (ids prefixed with ``tag``): greedy tokens, their logprobs
    (None without: requests with logprobs make async scheduling run steps serially) and the
    cached prompt tokens, per request."""
    waiting = sorted(arrivals, key=lambda a: a[0])
    outs: Outputs = {}
    step = 0
    while waiting or engine.has_unfinished_requests():
        while waiting and waiting[0][0] <= step:
            _, rid, prompt, n = waiting.pop(0)
            params = SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0 if logprobs else None)
            engine.add_request(tag + rid, {"prompt_token_ids": prompt}, params)
        for o in engine.step():
            if o.finished:
                c = o.outputs[0]
                lps = [d[t].logprob for d, t in zip(c.logprobs, c.token_ids)] if logprobs else None
                outs[o.request_id[len(tag):]] = (list(c.token_ids), lps, o.num_cached_tokens)
        step += 1
    return outs


@dataclass
class GraphLog:
    """What the graph replays of an engine did (``watch_graphs``)."""

    replays: list[tuple[int, int]] = field(default_factory=list)  # (batch rows, graph size)
    restored: int = 0  # replays whose step restored a snapshot into a decode row first
    scratch_written: int = 0  # padded replays that wrote fresh state into the scratch row

    @property
    def padded_rows(self) -> set[int]:
        return {n for n, size in self.replays if size > n}


def watch_graphs(engine: Engine) -> GraphLog:
    """Wrap the runner's graph replay: before it the scratch row is poisoned with NaN (padding
    rows never read it); after it every state row that changed must be a slot of the batch or the
    scratch row, and a padded replay must have rewritten the scratch row (finite again)."""
    runner, log = engine.runner, GraphLog()
    graphs = runner.graphs
    assert graphs is not None and graphs.scratch_slot is not None
    scratch = graphs.scratch_slot
    pools = [t for layer in runner.gdn_layers for t in (layer.conv_state, layer.ssm_state)]
    real_prepare, real_run = runner.prepare, graphs.run
    last: dict[str, Any] = {}

    def prepare(sched):
        last["sched"] = sched
        return real_prepare(sched)

    def run(input_ids, positions, meta):
        n = len(meta.query_lens)
        size = graph_size(graphs.sizes, n)
        assert size is not None
        for t in pools:
            t[scratch].fill_(float("nan"))
        before = [t.clone() for t in pools]
        out = real_run(input_ids, positions, meta)
        allowed = set(meta.state_slots) | {scratch}
        assert scratch not in meta.state_slots
        for b, t in zip(before, pools):
            changed = set(torch.nonzero((b != t).flatten(1).any(1)).flatten().tolist())
            assert changed <= allowed, f"a replay of {n} rows wrote state rows {sorted(changed - allowed)}"
        if size > n:
            assert not any(t[scratch].isnan().any() for t in pools), "a padding row did not write the scratch row"
            log.scratch_written += 1
        log.replays.append((n, size))
        log.restored += any(s.restore_state_from is not None for s in last["sched"].scheduled)
        return out

    runner.prepare, graphs.run = prepare, run  # type: ignore[method-assign]
    return log


class _Replay:
    """A captured graph's stand-in: replaying reruns the captured call on the static buffers."""

    def __init__(self, graphs: DecodeGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        g, s = self.graphs, self.size
        g.outputs[s] = g.runner.model(g.input_ids[:s], g.positions[:s], g._meta(s))


def emulated_capture(self: DecodeGraphs) -> None:
    """``DecodeGraphs.capture`` without capturing (see the module docstring)."""
    for size in self.sizes:
        self.graphs[size] = _Replay(self, size)  # type: ignore[assignment]


def build_engine(folder, mode: str, **kw: Any) -> Engine:
    """An engine for the workload (``ENGINE_ARGS``, ``kw`` on top): "eager" (``enforce_eager``),
    "graphs" (captured, on CUDA) or "emulated" (graphs on, replays rerun eagerly on the padded
    static buffers: the kernels and shapes a capture records)."""
    args = EngineArgs(model=str(folder), enforce_eager=mode == "eager", **{**ENGINE_ARGS, **kw})
    config = args.create_engine_config()
    if mode != "emulated":
        return Engine(config)
    config.runner_config.enforce_eager = False  # what the config resolves on CUDA
    with mock.patch.object(DecodeGraphs, "capture", emulated_capture):
        return Engine(config)


def assert_close_logprobs(got: Outputs, want: Outputs, atol: float) -> None:
    """Same tokens and cached prefixes per request, logprobs within ``atol``."""
    assert {r: (o[0], o[2]) for r, o in got.items()} == {r: (o[0], o[2]) for r, o in want.items()}
    diff = max((abs(a - b) for r in want for a, b in zip(got[r][1] or [], want[r][1] or [])), default=0.0)
    assert diff <= atol, f"logprobs differ by {diff:.3g} (bound {atol})"


def test_graph_size_and_capture_sizes_for_fewer_state_slots():
    sizes = [1, 2, 4, 8, 16]
    assert [graph_size(sizes, n) for n in (1, 3, 5, 8, 9, 16, 17)] == [1, 4, 8, 8, 16, 16, None]
    assert fit_capture_sizes(sizes, 12) == [1, 2, 4, 8, 12]  # max_num_seqs lowered to the states that fit
    assert fit_capture_sizes(sizes, 16) == sizes == fit_capture_sizes(sizes, 300)
    assert fit_capture_sizes([], 4) == []


@skip_without_triton_device()
def test_padded_graph_replays_write_only_their_rows_and_the_scratch_row(make_tiny_model, kvlog, one_thread):
    """Emulated graphs (Triton kernels in the interpreter) against the eager reference backend: the
    scratch row is the state row after the live and snapshot rows, and logged; padded replays (5
    and 3 rows) write no state row but their batch's and the scratch row, also right after a
    snapshot was restored into a decode row and through preemption; greedy tokens and prefix hits
    equal eager, the logprobs of both within the float64 reference's bound (float32; the kernels and
    the padded GEMMs are not the same bits: CPU GEMMs of 3 and of 4 rows already differ in the last
    bit)."""
    if torch.cuda.is_available():
        pytest.skip("on CUDA tests/test_gpu_hybrid.py runs this with captured graphs")
    folder = make_tiny_model("qwen3_5", seed=3)
    arrivals = hybrid_workload()
    eager = build_engine(folder, "eager", device="cpu", dtype="float32", attention_backend="reference")
    assert eager.runner.graphs is None and eager.runner.state_scratch_row is None
    assert eager.runner.gdn_layers[0].ssm_state.shape[0] == 16  # 8 live + 8 snapshot rows
    want = drive(eager, arrivals, "", logprobs=True)
    kvlog.clear()
    graphed = build_engine(folder, "emulated", device="cpu", dtype="float32", attention_backend="triton",
                           async_scheduling=False)
    runner = graphed.runner
    assert runner.graphs is not None and runner.graphs.sizes == [1, 2, 4, 8]
    assert runner.state_scratch_row == 16 == runner.gdn_layers[0].conv_state.shape[0] - 1
    assert kvlog.count("8 slots (max_num_seqs) + 1 scratch slot (CUDA-graph padding) = ") == 1
    log = watch_graphs(graphed)
    got = drive(graphed, arrivals, "", logprobs=True)
    # same tokens and prefix hits; the logprobs of both within the bound of transformers' float64
    # run (5x its own float32 spread, tests/hf_reference.py): a fixed bound sat inside the float32
    # noise of these tiny models (1.8e-4 measured between the two here, above the 1e-4 once used)
    assert_close_logprobs(got, want, float("inf"))
    ids = [rid for _, rid, _, _ in arrivals]
    ref = hf_greedy_reference(folder, [p for _, _, p, _ in arrivals], tuple(n for _, _, _, n in arrivals))
    for outs in (want, got):
        ref.check([outs[r][0] for r in ids], [outs[r][1] for r in ids])
    assert {3, 5} <= log.padded_rows, f"padded replays of 3 and 5 rows expected, saw {sorted(log.replays)}"
    assert log.restored > 0 and log.scratch_written > 0
    assert graphed.scheduler.num_preemptions > 0
    assert got["f"][2] == got["g"][2] == 32  # prefix hits on the snapshot at 32
    graphed.kv_manager.check_invariants()
    assert runner.state_pool is not None and runner.state_pool.num_free == 8


def test_moe_layers_keep_decode_eager(make_tiny_model, kvlog):
    """Routed experts in the torch loop read their token counts on the host, which a graph cannot
    capture: with graphs requested a float32 model with MoE layers runs eagerly (logged; enforce_eager
    set, no scratch row); Qwen3-Next with dense MLPs in every layer is captured, and so are MoE
    layers in bf16 on the triton backend, whose experts are fused (aligned on the device)."""
    for arch, kw, dtype, captured in (("qwen3_5_moe", {}, "float32", False), ("qwen3_next", {}, "float32", False),
                                      ("qwen3_next", {"mlp_only_layers": [0, 1, 2, 3]}, "float32", True),
                                      ("qwen3_5_moe", {}, "bfloat16", True)):
        kvlog.clear()
        engine = build_engine(make_tiny_model(arch, **kw), "emulated", device="cpu", dtype=dtype,
                              attention_backend="triton")
        runner = engine.runner
        assert runner.model.supports_cuda_graphs is captured
        assert (runner.graphs is not None) is captured and (runner.state_scratch_row is not None) is captured
        assert engine.config.runner_config.enforce_eager is not captured
        name = runner.config.model_config.architecture
        assert kvlog.count(f"CUDA graphs are off for {name}: its routed experts (MoE)") == (not captured)
