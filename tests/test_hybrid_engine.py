"""Hybrid models (Gated DeltaNet + gated attention: Qwen3-Next, Qwen3.5, Qwen3.5-MoE) in the engine:
greedy tokens and their logprobs equal transformers' (float64, within float32's spread) through chunked prefill at odd
boundaries, concurrent requests of different lengths and preemption; the recurrent-state pool never
leaks and never lets one request read another's state. (Prefix caching: test_hybrid_prefix_cache.py.)"""

from __future__ import annotations


import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import HYBRID_ARCHS
from hf_reference import hf_greedy_reference, hf_low_precision_reference
from kvserve import LLM, SamplingParams
from kvserve.runner.state_pool import StatePool
from triton_support import skip_without_triton_device

PROMPT_LENS = (5, 17, 9, 30)
MAX_TOKENS = (12, 6, 9, 7)


def _prompts(seed: int = 0) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _kvserve(folder, prompts, **kw) -> tuple[list[list[int]], list[list[float]], LLM]:
    args = dict(dtype="float32", max_num_seqs=4, max_num_batched_tokens=13, kv_cache_memory=1 << 22, seed=0)
    args.update(kw)
    llm = LLM(str(folder), **args)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    tokens = [list(o.outputs[0].token_ids) for o in outs]
    lps = [[d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)] for o in outs]
    return tokens, lps, llm


def check_idle(llm: LLM) -> None:
    """No block, state slot or pending snapshot is held once every request has finished."""
    engine = llm.llm_engine
    engine.kv_manager.check_invariants()  # snapshot slots included
    pool = engine.runner.state_pool
    assert pool is not None
    pool.check_invariants()
    assert pool.num_free == pool.num_slots, "a finished request kept its recurrent-state slot"


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_hybrid_greedy_tokens_and_logprobs_equal_transformers(make_tiny_model, arch, seed, one_thread):
    """Four concurrent prompts of 5-30 tokens, prefill chunks of at most 13 tokens (so chunks end
    at odd offsets inside prompts and share steps with decodes): transformers' float64 greedy
    tokens exactly, logprobs within 5x transformers' own float32 spread (hf_reference.py)."""
    folder = make_tiny_model(arch, seed=seed)
    prompts = _prompts(seed)
    ref = hf_greedy_reference(folder, prompts, MAX_TOKENS)
    tokens, lps, llm = _kvserve(folder, prompts)
    ref.check(tokens, lps)
    assert len({tuple(t) for t in ref.tokens}) == len(ref.tokens)  # distinct: the check can fail
    check_idle(llm)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_bf16_logprobs_within_transformers_bf16_spread(make_tiny_model, arch, one_thread):
    """bf16, the same chunked steps: each logprob along transformers' float64 greedy path within
    4x transformers' own bf16 spread of the float64 truth, leaving the path only at a near-tie
    (hf_reference.LowPrecisionReference)."""
    folder = make_tiny_model(arch, seed=3)
    prompts = _prompts(3)
    ref = hf_low_precision_reference(folder, prompts, MAX_TOKENS)
    tokens, lps, llm = _kvserve(folder, prompts, dtype="bfloat16")
    ref.check(tokens, lps)
    check_idle(llm)


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_survives_preemption_and_requests_are_isolated(make_tiny_model, arch, one_thread):
    """A KV pool too small for all four requests preempts and recomputes (the recurrent state is
    rebuilt from the prompt); each request's tokens equal its solo run, and no slot leaks."""
    folder = make_tiny_model(arch)
    prompts = _prompts(1)
    solo = []
    for i, p in enumerate(prompts):
        llm = LLM(str(folder), dtype="float32", max_num_seqs=1, max_num_batched_tokens=13, kv_cache_memory=1 << 22)
        out = llm.generate([{"prompt_token_ids": p}], SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True),
                           use_tqdm=False)
        solo.append(list(out[0].outputs[0].token_ids))
    tokens, _, llm = _kvserve(folder, prompts, num_gpu_blocks_override=5, max_model_len=48)
    assert llm.llm_engine.scheduler.num_preemptions > 0, "the pool was meant to force preemption"
    assert tokens == solo
    check_idle(llm)


def test_hybrid_prefix_caching_off_keeps_no_snapshots(make_tiny_model, kvlog, one_thread):
    """``enable_prefix_caching=False``: mode 'none' (an explicit 'align' is overridden with vLLM's
    warning), no snapshot slots, no hits on a repeated prompt, transformers' tokens."""
    folder = make_tiny_model("qwen3_5")
    prompts = _prompts(0)
    prompts[1] = prompts[3]  # a repeated 30-token prompt
    tokens, _, llm = _kvserve(folder, prompts, enable_prefix_caching=False, mamba_cache_mode="align")
    engine = llm.llm_engine
    assert kvlog.count("Mamba cache mode is set to 'none' when prefix caching is disabled") == 1
    assert engine.config.cache_config.mamba_cache_mode == "none"
    assert engine.kv_manager.snapshots is None and engine.runner.num_snapshot_slots == 0
    assert engine.runner.gdn_layers[0].ssm_state.shape[0] == 4  # live slots only
    assert kvlog.count("Recurrent state (CPU): 2 GDN layers") == 1
    assert len(engine.runner.kv_caches) == 2  # pages for the two full-attention layers only
    hf_greedy_reference(folder, prompts, MAX_TOKENS).check_tokens(tokens)
    assert engine.kv_manager.prefix_cache_hits == 0


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(0, 7)), max_size=80))
def test_state_pool_never_leaks_or_shares(ops):
    """Random take / give-back sequences: a slot is never held by two requests, none is lost."""
    pool = StatePool(4)
    held: dict[str, int] = {}
    for take, rid in ops:
        name = f"r{rid}"
        if take and (name in held or len(held) < 4):
            slot = pool.slot(name)
            assert held.setdefault(name, slot) == slot
        elif not take:
            pool.free(name)
            held.pop(name, None)
        pool.check_invariants()
        assert len(set(held.values())) == len(held)
    for name in list(held):
        pool.free(name)
    assert pool.num_free == 4
    with pytest.raises(RuntimeError, match="no free recurrent-state slot"):
        for i in range(5):
            pool.slot(f"x{i}")


def test_gpu_state_slots_fit_half_the_budget_on_the_27b(kvlog):
    """vLLM's H200 default of 1,024 sequences does not fit the 27B's states (146.8 MiB each): the
    live slots (and max_num_seqs) are lowered to what fits in half the budget, with a warning."""
    from pathlib import Path

    from kvserve.runner import memory
    from kvserve.tools.traffic import model_shape

    per_seq = model_shape(str(Path(__file__).resolve().parents[1] / "benchmarks/configs/qwen3.6-27b")).state_bytes
    assert round(per_seq / (1 << 20), 1) == 146.8
    gib = 1 << 30
    assert memory.num_state_slots(1024, per_seq, 70 * gib) == 35 * gib // per_seq == 244
    assert kvlog.count("max_num_seqs lowered from 1024 to 244") == 1
    assert memory.num_state_slots(32, per_seq, 70 * gib) == 32
    with pytest.raises(ValueError, match=r"The recurrent state of one sequence \(146.8 MiB\) does not fit"):
        memory.num_state_slots(32, per_seq, 200 << 20)


@skip_without_triton_device()
@pytest.mark.parametrize("kv", ["auto", "fp8_e4m3"])
def test_hybrid_triton_backend_gives_the_reference_tokens(make_tiny_model, kv, one_thread):
    """Attention layers through the Triton store + unified kernel (GDN layers: the torch reference),
    float and fp8 pages: the reference backend's tokens, chunked prefill and concurrency included."""
    folder = make_tiny_model("qwen3_5")
    prompts = _prompts(2)
    ref, _, _ = _kvserve(folder, prompts, attention_backend="reference", kv_cache_dtype=kv)
    got, _, llm = _kvserve(folder, prompts, attention_backend="triton", kv_cache_dtype=kv)
    assert got == ref
    if kv == "fp8_e4m3":
        assert all(c.dtype == torch.uint8 for c in llm.llm_engine.runner.kv_caches)
    check_idle(llm)


def test_hybrid_kv_scales_load_from_image_text_checkpoint_names(make_tiny_model, tmp_path):
    """k/v scales saved under the image-text prefix (``model.language_model.layers.N.self_attn``)
    reach the attention layer N of the text model with an fp8 cache."""
    import json
    import shutil

    from safetensors.torch import save_file

    folder = tmp_path / "with_scales"
    shutil.copytree(make_tiny_model("qwen3_5"), folder)
    save_file({"model.language_model.layers.1.self_attn.k_scale": torch.tensor(0.5),
               "model.language_model.layers.1.self_attn.v_scale": torch.tensor(0.25)}, folder / "scales.safetensors")
    (folder / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": None, "kv_cache_quant_algo": "FP8"}}))
    llm = LLM(str(folder), dtype="float32", max_num_seqs=2, kv_cache_memory=1 << 22)  # auto -> fp8_e4m3
    assert llm.llm_engine.config.cache_config.cache_dtype == "fp8_e4m3"
    layers = llm.llm_engine.runner.model.attention_layers()
    assert [a.layer_idx for a in layers] == [1, 3]
    assert (layers[0].k_scale, layers[0].v_scale) == (0.5, 0.25)
    assert (layers[1].k_scale, layers[1].v_scale) == (1.0, 1.0)


def test_traffic_counts_the_state_the_engine_allocates(make_tiny_model):
    """``kvserve traffic``'s recurrent-state bytes per sequence, KV bytes per token and state
    snapshot interval are what the engine allocates and uses for the same checkpoint (bf16)."""
    from kvserve.tools.traffic import model_shape, traffic

    folder = make_tiny_model("qwen3_next")
    llm = LLM(str(folder), dtype="bfloat16", max_num_seqs=3, kv_cache_memory=1 << 22)
    runner = llm.llm_engine.runner
    per_seq = sum((layer.conv_state[0].numel() * layer.conv_state.element_size()
                   + layer.ssm_state[0].numel() * layer.ssm_state.element_size()) for layer in runner.gdn_layers)
    shape = model_shape(str(folder))
    assert shape.state_bytes == per_seq
    page = runner.kv_caches[0]
    assert shape.kv_bytes_per_token(page.element_size()) == sum(c[0].numel() * c.element_size() for c in runner.kv_caches) // page.shape[2]
    assert traffic(shape, 64, 8).bf16.snapshot_interval == llm.llm_engine.kv_manager.snapshots.interval


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("arch,path", [("qwen3_5", "chunked"), ("qwen3_next", "preempted")])
def test_hybrid_fp8_cache_matches_fake_quant_oracle(make_tiny_model, arch, path, fmt, one_thread):
    """fp8 attention pages on a hybrid model vs transformers with K/V fake-quantized when written
    (the fp8 issue's Oracle C; GDN layers untouched): the sampled tokens' logprobs within 2e-3,
    while plain fp32 attention differs by more than 5x that (the check discriminates)."""
    from test_fp8_engine import check_against_oracle

    folder = make_tiny_model(arch, seed=4)
    scales = [1.0] * 4  # per model layer; only the full-attention layers (1, 3) write K/V
    kw: dict = dict(max_num_batched_tokens=7, max_num_seqs=2) if path == "chunked" else \
        dict(num_gpu_blocks_override=5, max_model_len=48, max_num_seqs=4, max_num_batched_tokens=13)
    llm = LLM(str(folder), dtype="float32", kv_cache_dtype=fmt, kv_cache_memory=1 << 22, **kw)
    assert all(c.dtype == torch.uint8 for c in llm.llm_engine.runner.kv_caches)
    prompts = _prompts(3)[: 2 if path == "chunked" else 4]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=3, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    if path == "preempted":
        assert llm.llm_engine.scheduler.num_preemptions > 0
    check_against_oracle(outs, folder, fmt, scales, scales)
    check_idle(llm)


@pytest.mark.parametrize("arch", HYBRID_ARCHS)
def test_kvserve_parity_cli_against_transformers_reference(make_tiny_model, arch, tmp_path):
    """``kvserve parity`` (13-token chunks, four concurrent prompts) against a reference file written
    from transformers' greedy generation with its top-5 logprobs: 0 diverged."""
    import json
    import subprocess
    import sys

    from transformers import AutoModelForCausalLM

    folder = make_tiny_model(arch, seed=2)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    prompts, refs = [], []
    for i, ids in enumerate(_prompts(4)):
        with torch.no_grad():
            out = model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, output_scores=True,
                                 return_dict_in_generate=True, pad_token_id=0, eos_token_id=None)
        tops = []
        for s in out.scores:
            lp = torch.log_softmax(s[0].float(), -1)
            v, t = lp.topk(5)
            tops.append([[int(a), float(b)] for a, b in zip(t, v)])
        prompts.append({"id": f"p{i}", "prompt_token_ids": ids})
        refs.append({"id": f"p{i}", "output_token_ids": out.sequences[0, len(ids):].tolist(), "top_logprobs": tops})
    ppath, rpath = tmp_path / "p.jsonl", tmp_path / "r.jsonl"
    ppath.write_text("".join(json.dumps(p) + "\n" for p in prompts))
    rpath.write_text("".join(json.dumps(r) + "\n" for r in refs))
    cmd = [sys.executable, "-m", "kvserve.entrypoints.cli", "parity", "--prompts", str(ppath), "--reference", str(rpath),
           "--model", str(folder), "--dtype", "float32", "--max-tokens", "8", "--max-num-batched-tokens", "13",
           "--max-num-seqs", "4", "--kv-cache-memory", str(1 << 22)]
    res = subprocess.run(cmd, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "parity: 4/4 exact, 0 near-tie, 0 diverged"


@skip_without_triton_device()
def test_hybrid_triton_chunked_prefill_kernel_gives_the_reference_tokens(make_tiny_model, one_thread):
    """Prefill chunks of up to 64 tokens (a 90-token prompt: chunks of 64 and 26 beside decodes)
    take the chunked GDN kernel; tokens equal the reference backend's."""
    folder = make_tiny_model("qwen3_next")
    gen = torch.Generator().manual_seed(7)
    prompts = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (90, 6)]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    outs = {}
    for backend in ("reference", "triton"):
        llm = LLM(str(folder), dtype="float32", attention_backend=backend, max_num_seqs=2, max_num_batched_tokens=64,
                  kv_cache_memory=1 << 22)
        res = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        outs[backend] = [list(o.outputs[0].token_ids) for o in res]
    assert outs["triton"] == outs["reference"]


@skip_without_triton_device()
@pytest.mark.parametrize("shared_width", [32, 48])
def test_fused_moe_path_in_float32_equals_transformers(make_tiny_model, shared_width, one_thread):
    """The device MoE path (Triton router, ``moe_align``, grouped GEMMs with IEEE fp32 products; a
    shared expert of the experts' width 32 inside the grouped GEMMs as expert E, of width 48 beside
    them with the gated add) switched on in a float32 Qwen3.5-MoE engine (the runner keeps float32 on
    the torch loop; here every ``fused`` flag is set after start-up, so steps run eagerly): through
    chunked prefill, preemption and prefix hits (tests/test_hybrid_graphs.py's workload), transformers'
    float64 greedy tokens and logprobs within 5x its float32 spread, as the torch path gives. CPU:
    interpreter; CUDA: the kernels themselves (``moe_align`` in its one launch)."""
    from test_hybrid_graphs import build_engine, drive, hybrid_workload
    from triton_support import kernel_device

    folder = make_tiny_model("qwen3_5_moe", seed=4, shared_expert_intermediate_size=shared_width)
    arrivals = hybrid_workload()
    engine = build_engine(folder, "eager", device=kernel_device(), dtype="float32", attention_backend="triton",
                          async_scheduling=False)
    blocks = [m for m in engine.runner.model.modules() if hasattr(m, "experts_on_device")]
    assert blocks and not any(b.experts_on_device for b in blocks)
    for b in blocks:
        for m in b.modules():
            if hasattr(m, "fused"):
                m.fused = True
    assert all(b.experts_on_device and b.shared_expert_in_grouped_gemms is (shared_width == 32) for b in blocks)
    out = drive(engine, arrivals, "", logprobs=True)
    assert engine.scheduler.num_preemptions > 0 and out["f"][2] == out["g"][2] == 32  # preempted; prefix hits
    ids = [rid for _, rid, _, _ in arrivals]
    ref = hf_greedy_reference(folder, [p for _, _, p, _ in arrivals], tuple(n for _, _, _, n in arrivals))
    ref.check([out[r][0] for r in ids], [out[r][1] for r in ids])
    engine.kv_manager.check_invariants()
    assert engine.runner.state_pool.num_free == 8
