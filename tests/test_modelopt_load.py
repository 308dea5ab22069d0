"""Loading ModelOpt exports (issue 15, the reference path: quantized weights dequantized once while
loading, ``loader/quantized_weights.py``): a model written by ``tools/modelopt_export.py`` gives
exactly the greedy tokens and logprobs of the same model whose weights were dequantized by the
reference codec (``quant/nvfp4.py``) and saved dense, so every quantized tensor, fused shard and
expert reaches its parameter; malformed exports fail with an error naming the tensors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve import LLM, SamplingParams
from kvserve.loader.weights import WeightLoadError
from kvserve.quant.nvfp4 import dequantize_fp8_per_tensor, dequantize_nvfp4
from kvserve.tools.modelopt_export import export_modelopt
from triton_support import skip_without_triton_device

pytestmark = pytest.mark.usefixtures("one_thread")
PROMPTS = [[5, 17, 101, 33, 8, 250], [9, 3, 77], [400, 12, 12, 56, 91, 7, 64, 2, 18]]
MAX_TOKENS = 6


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _write(folder: Path, tensors: dict[str, torch.Tensor]) -> None:
    for f in folder.glob("*.safetensors*"):
        f.unlink()
    (folder / "model.safetensors.index.json").unlink(missing_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))


def _dense_twin(export: Path, dst: Path) -> Path:
    """The export with every quantized module dequantized to float32 by the codec, no quant config."""
    shutil.copytree(export, dst)
    t = _tensors(export)
    dense = {}
    for name, x in t.items():
        prefix, _, part = name.rpartition(".")
        if part in ("weight_scale", "weight_scale_2", "input_scale"):
            continue
        if part == "weight" and x.dtype == torch.uint8:
            x = dequantize_nvfp4(x, t[f"{prefix}.weight_scale"], t[f"{prefix}.weight_scale_2"], torch.float32)
        elif part == "weight" and x.dtype == torch.float8_e4m3fn:
            x = dequantize_fp8_per_tensor(x, t[f"{prefix}.weight_scale"], torch.float32)
        dense[name] = x
    _write(dst, dense)
    (dst / "hf_quant_config.json").unlink()
    cfg = json.loads((dst / "config.json").read_text())
    del cfg["quantization_config"]
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def _run(folder: Path, dtype: str, kv_cache_dtype: str = "fp8_e4m3", **kw):
    llm = LLM(str(folder), dtype=dtype, kv_cache_dtype=kv_cache_dtype, kv_cache_memory=1 << 22, max_num_seqs=4,
              max_num_batched_tokens=16, **kw)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
    got = [(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
           for o in outs]
    return got, dict(llm.llm_engine.runner.model.named_parameters())


@pytest.fixture(scope="module")
def export(make_tiny_model, tmp_path_factory):
    cache: dict[tuple[str, str, str | None], Path] = {}

    def get(arch: str, algo: str, kv: str | None = "FP8") -> Path:
        if (arch, algo, kv) not in cache:
            src = make_tiny_model(arch, seed=1)
            cache[arch, algo, kv] = export_modelopt(src, tmp_path_factory.mktemp(f"{arch}-{algo}") / "out", algo,
                                                    kv_cache_quant_algo=kv, calibration_tokens=32)
        return cache[arch, algo, kv]

    return get


@pytest.mark.parametrize("arch,algo,dtype", [
    ("llama", "NVFP4", "float32"), ("llama", "W4A16_NVFP4", "bfloat16"), ("qwen3", "MIXED_PRECISION", "float32"),
    ("qwen3", "FP8", "bfloat16"), ("qwen3_5", "MIXED_PRECISION", "float32"), ("qwen3_next", "FP8", "float32"),
    ("qwen3_5_moe", "MIXED_PRECISION", "float32"),
])
def test_export_equals_its_dequantized_twin(export, make_tiny_model, tmp_path, kvlog, arch, algo, dtype):
    folder = export(arch, algo)
    got, params = _run(folder, dtype)
    want, twin_params = _run(_dense_twin(folder, tmp_path / "twin"), dtype)
    assert got == want
    assert all(torch.equal(p, twin_params[n]) for n, p in params.items())  # the same weights, bit for bit
    assert kvlog.count(f"ModelOpt {algo} weights (") == 1  # once, at the export's start-up (the twin has none)
    assert kvlog.count(": 0 layer(s) keep NVFP4 and run the W4A16 GEMM, 0 keep FP8 and run the scaled FP8 GEMM, "
                       "the rest are dequantized") == 1  # the reference backend on the CPU
    _, src_params = _run(make_tiny_model(arch, seed=1), dtype)  # the weights did change: not the source's
    assert any(not torch.equal(p, src_params[n]) for n, p in params.items())


def _broken(export: Path, tmp_path: Path, edit) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(export, folder)
    t = _tensors(folder)
    edit(t)
    _write(folder, t)
    return folder


def _first(t: dict, dtype: torch.dtype) -> str:
    return min(n[: -len(".weight")] for n, x in t.items() if n.endswith(".weight") and x.dtype == dtype)


def test_malformed_exports_name_the_tensor(export, tmp_path):
    folder = export("qwen3", "MIXED_PRECISION")
    t = _tensors(folder)
    fp4, fp8 = _first(t, torch.uint8), _first(t, torch.float8_e4m3fn)
    cases = [
        (lambda t: t.pop(f"{fp4}.weight_scale"), f"{fp4}: missing ['{fp4}.weight_scale']"),
        (lambda t: t.pop(f"{fp8}.weight_scale"), f"{fp8}: missing ['{fp8}.weight_scale']"),
        (lambda t: t.update({f"{fp4}.weight_scale": t[f"{fp4}.weight_scale"][:, :-1].contiguous()}),
         f"ModelOpt NVFP4 tensors of {fp4} do not match: NVFP4 weight_scale must have shape"),
        (lambda t: t.update({f"{fp8}.weight": t[f"{fp8}.weight"].float()}),
         f"{fp8}.weight is torch.float32 on disk, but the checkpoint's quantization config"),
        (lambda t: t.update({f"{fp4}.weight": t[f"{fp8}.weight"].clone()}), f"{fp4}.weight is torch.float8_e4m3fn on disk (FP8)"),
    ]
    for i, (edit, message) in enumerate(cases):
        with pytest.raises(WeightLoadError) as e:
            LLM(str(_broken(folder, tmp_path / str(i), edit)), dtype="float32", kv_cache_memory=1 << 22)
        assert message in str(e.value), (i, str(e.value))


def test_default_model_export_equals_its_dequantized_twin_on_the_golden_set(default_model_path, shared_eval, tmp_path,
                                                                           monkeypatch):
    """The real SmolLM2-135M, MIXED_PRECISION (the Qwen3.5 recipe on a Llama: MLPs W4A16_NVFP4,
    attention FP8; its lm_head is tied, so it stays as it is), float32: 24/24 golden prompts give
    the dequantized twin's greedy tokens (on a GPU through the W4A16 GEMM). The FP8 layers stay on
    their dequantized reference everywhere (``FP8_GEMM_DEVICES`` empty): on CUDA they would quantize
    their activations too (W8A8 with the static input scale, vLLM's path), which no dequantized twin
    reproduces (2 of 24 prompts agreed on the H200, 2026-12-03); tests/test_fp8_linear.py holds that
    GEMM to its torch formula."""
    from kvserve.layers import quant_linear
    from kvserve.tools.parity import read_jsonl

    monkeypatch.setattr(quant_linear, "FP8_GEMM_DEVICES", ())

    folder = export_modelopt(default_model_path, tmp_path / "export", "MIXED_PRECISION", kv_cache_quant_algo=None,
                             calibration_tokens=64)
    prompts = [{"prompt_token_ids": p["prompt_token_ids"]} for p in read_jsonl(shared_eval / "golden_public.jsonl")]
    assert len(prompts) == 24
    outs = {}
    for name, path in (("export", folder), ("twin", _dense_twin(folder, tmp_path / "twin"))):
        llm = LLM(str(path), dtype="float32", kv_cache_memory=1 << 30)
        params = SamplingParams(temperature=0, max_tokens=64)
        outs[name] = [list(o.outputs[0].token_ids) for o in llm.generate(prompts, params, use_tqdm=False)]
        del llm
    assert sum(a == b for a, b in zip(outs["export"], outs["twin"])) == 24


@skip_without_triton_device()
@pytest.mark.parametrize("arch,algo", [("llama", "NVFP4"), ("qwen3_5", "MIXED_PRECISION"), ("qwen3_5_moe", "MIXED_PRECISION")])
def test_nvfp4_layers_run_the_w4a16_gemm_on_the_triton_backend(export, tmp_path, kvlog, monkeypatch, arch, algo):
    """Triton backend: every Linear whose checkpoint shards are all NVFP4 keeps its packed tensors
    (per-row global scales) and runs the W4A16 GEMM, the MoE's routed experts the grouped W4A16
    GEMM; FP8 (dequantized off CUDA) and unquantized modules stay dense (the Qwen3.5 GDN input
    projections as vLLM packs them: qkv | z FP8, b | a unquantized). float32: the GEMM sums in
    another order than torch's, so the run is checked as every float32 run is, against transformers'
    float64 run of the dequantized twin (greedy tokens exactly, logprobs within 5x its own float32
    spread, tests/hf_reference.py). The large-batch path is lowered to steps of 16 rows (full prefill
    chunks here), so both paths run: full chunks dequantize for torch's GEMM, decode rows and
    shorter chunks take the fused kernel; its buffer is made at start-up."""
    from hf_reference import hf_greedy_reference

    from kvserve.kernels import triton_w4a16

    monkeypatch.setattr(triton_w4a16, "DENSE_FROM_M", 16)  # = max_num_batched_tokens of _run
    folder = export(arch, algo, kv=None)  # a float32 KV cache, as the reference
    got, params = _run(folder, "float32", "auto", attention_backend="triton")
    ref = hf_greedy_reference(_dense_twin(folder, tmp_path / "twin"), PROMPTS, (MAX_TOKENS,) * len(PROMPTS))
    ref.check([t for t, _ in got], [lp for _, lp in got])
    nvfp4 = {n.rsplit(".", 1)[0] for n, p in params.items() if n.endswith(".codes")}  # repacked NVFP4Linear codes
    assert nvfp4 and all(params[f"{m}.row_scale"].shape == (params[f"{m}.codes"].shape[0],) for m in nvfp4)
    experts = {n.rsplit(".", 1)[0] for n, p in params.items() if n.endswith(".gate_up_proj_codes")}
    assert bool(experts) == (arch == "qwen3_5_moe")  # routed experts kept NVFP4 (the grouped W4A16 GEMM)
    assert all(params[f"{m}.down_proj_codes"].dtype == torch.int16 for m in experts)
    assert not any(n.endswith(("weight_scale", "weight_scale_2")) for n in params)  # the checkpoint layout freed
    if algo == "MIXED_PRECISION":  # the recipe: MLPs NVFP4, attention and GDN projections FP8 -> dense
        assert all(".mlp." in m or m == "lm_head" for m in nvfp4)
        assert not any("in_proj" in m or "self_attn" in m for m in nvfp4)
    line = [m for m in kvlog.messages() if m.startswith(f"ModelOpt {algo} weights (")]
    assert len(line) == 1 and f": {len(nvfp4)} layer(s) keep NVFP4 and run the W4A16 GEMM" in line[0]
    assert (f"(and {len(experts)} routed-expert group(s) the grouped W4A16 GEMM)" in line[0]) == bool(experts)
    sizes = [m for m in kvlog.messages() if m.startswith("Quantized weights: ")]
    nvfp4_bytes = sum(params[f"{m}.{part}"].numel() * params[f"{m}.{part}"].element_size() for m in nvfp4
                      for part in ("codes", "scales", "row_scale"))
    assert len(sizes) == 1 and f"{len(nvfp4)} NVFP4 layer(s) {nvfp4_bytes / (1 << 30):.2f} GiB" in sizes[0], sizes
    # its buffer (float32 here) is as large as the largest NVFP4 weight (the codes pad K to 128: <= 127 columns more)
    largest = max(p.shape[0] * (p.shape[1] * 128 - 127) * 4 for n, p in params.items() if n.endswith(".codes"))
    assert float(sizes[0].rsplit("large-batch buffer ", 1)[1].split()[0]) * (1 << 20) >= largest * 0.999
    kinds = {"llama": "lm_head none, mlp.down_proj NVFP4, mlp.gate_up_proj NVFP4, self_attn.o_proj NVFP4, self_attn.qkv_proj NVFP4",
             "qwen3_5": "linear_attn.in_proj_ba none, linear_attn.in_proj_qkvz FP8, linear_attn.out_proj FP8, "
                        "lm_head W4A16_NVFP4, "
                        "mlp.down_proj W4A16_NVFP4, mlp.gate_up_proj W4A16_NVFP4, self_attn.o_proj FP8, "
                        "self_attn.qkv_proj FP8"}
    if arch in kinds:  # the start-up line says how each kind of layer is stored, once
        assert line[0].endswith(f"per layer kind: {kinds[arch]}"), line[0]


@skip_without_triton_device()
@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
@pytest.mark.parametrize("fp8_gemm", [False, True], ids=["fp8-dequantized", "fp8-gemm"])
def test_config_only_export_runs_with_dummy_weights_and_resolves_fp8_kv(make_tiny_model, tmp_path, kvlog,
                                                                        monkeypatch, fp8_gemm, arch):
    """The benchmarks' path for a model too large to export here: the configs of a MIXED_PRECISION
    export without weights, `--load-format dummy`: the NVFP4 layers hold random packed codes (run by
    the W4A16 GEMM on the triton backend; the MoE's routed experts by the grouped one),
    `--kv-cache-dtype auto` resolves to fp8_e4m3 from `kv_cache_quant_algo: FP8`, and the model
    generates."""
    from kvserve.tools.modelopt_export import export_config_only

    from kvserve.layers import quant_linear

    if fp8_gemm:  # the FP8 layers as on CUDA (torch._scaled_mm runs on the CPU too): dummy fp8 codes, finalized
        monkeypatch.setattr(quant_linear, "FP8_GEMM_DEVICES", ("cuda", "cpu"))
    folder = export_config_only(make_tiny_model(arch, seed=1), tmp_path / "only", "MIXED_PRECISION")
    assert not list(folder.glob("*.safetensors"))
    llm = LLM(str(folder), load_format="dummy", dtype="float32", kv_cache_dtype="auto", kv_cache_memory=1 << 22,
              max_num_seqs=4, attention_backend="triton")
    assert llm.llm_engine.config.cache_config.cache_dtype == "fp8_e4m3"
    assert any(m.startswith("kv_cache_dtype=fp8_e4m3 (from ") for m in kvlog.messages())
    params = dict(llm.llm_engine.runner.model.named_parameters())
    packed = [n for n, p in params.items() if p.dtype == torch.int16]  # NVFP4 codes, repacked
    assert packed and all(".mlp." in n or n.startswith("lm_head") for n in packed)
    assert all(bool(params[n].any()) for n in packed)  # random codes, not zeros
    assert any(n.endswith("experts.gate_up_proj_codes") for n in packed) == (arch == "qwen3_5_moe")
    fp8 = [m for m in llm.llm_engine.runner.model.modules() if isinstance(m, quant_linear.FP8Linear)]
    assert bool(fp8) == fp8_gemm and all(m.finalized and m.weight_scale.shape == () for m in fp8)
    assert all(bool(m.weight.float().abs().max() > 0) for m in fp8)
    out = llm.generate([{"prompt_token_ids": PROMPTS[0]}], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True),
                       use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4


def _checkpoint(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("arch,algo", [("llama", "FP8"), ("qwen3_5", "MIXED_PRECISION")])
def test_fp8_layers_keep_fp8_and_run_the_scaled_gemm(export, monkeypatch, kvlog, arch, algo):
    """Where the FP8 GEMM runs (``FP8_GEMM_DEVICES``: CUDA; the CPU here, where torch._scaled_mm runs
    too), every Linear whose checkpoint shards are all FP8 keeps its fp8 weight with one weight scale
    and one input scale, the largest of its shards' in the checkpoint (fused q | k | v and gate | up
    requantized to it: tests/test_fp8_linear.py); the Qwen3.5 GDN input projections packed as vLLM
    packs them, so q | k | v | z (FP8) keeps FP8 and b | a (unquantized) stays dense. The run equals the same engine with each FP8Linear replaced by a dense Linear of
    its dequantized weight and a pre-hook that fake-quantizes its input alike (float32: tokens
    exactly; logprobs within 1e-4, the two products round differently in fp32)."""
    from kvserve.layers import quant_linear
    from kvserve.layers.quant_linear import FP8Linear
    from kvserve.quant.nvfp4 import quantize_fp8_static

    monkeypatch.setattr(quant_linear, "FP8_GEMM_DEVICES", ("cuda", "cpu"))
    folder = export(arch, algo, kv=None)
    ckpt = _checkpoint(folder)
    stacked = {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
               "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "in_proj_qkv": "in_proj_qkvz",
               "in_proj_z": "in_proj_qkvz"}
    llm = LLM(str(folder), dtype="float32", kv_cache_dtype="auto", kv_cache_memory=1 << 22, max_num_seqs=4,
              max_num_batched_tokens=16)
    model = llm.llm_engine.runner.model
    fp8 = {n: m for n, m in model.named_modules() if isinstance(m, FP8Linear)}
    assert fp8 and not any("in_proj_ba" in n for n in fp8)
    if algo == "FP8":
        assert {n.rsplit(".", 1)[-1] for n in fp8} == {"qkv_proj", "o_proj", "gate_up_proj", "down_proj"}
    else:
        assert {n.rsplit(".", 1)[-1] for n in fp8} == {"qkv_proj", "o_proj", "out_proj", "in_proj_qkvz"}
        ba = [m for n, m in model.named_modules() if n.endswith("linear_attn.in_proj_ba")]
        assert ba and all(type(m) is torch.nn.Linear for m in ba)
    for name, m in fp8.items():
        parent, leaf = name.rsplit(".", 1)
        shards = [f"{parent}.{c}" for c, f in stacked.items() if f == leaf] or [name]
        assert m.weight.dtype == torch.float8_e4m3fn and m.weight_scale.shape == () and m.input_scale.shape == ()
        assert float(m.weight_scale) == max(float(ckpt[f"{s}.weight_scale"]) for s in shards)
        assert float(m.input_scale) == max(float(ckpt[f"{s}.input_scale"]) for s in shards)
    assert kvlog.count(f"layer(s) keep NVFP4 and run the W4A16 GEMM, {len(fp8)} keep FP8 and run the scaled FP8 GEMM") == 1
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)

    def run():
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        return [(list(o.outputs[0].token_ids), [d[t].logprob for d, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)])
                for o in outs]

    got = run()
    for name, m in fp8.items():  # the same arithmetic spelled out with a dense Linear
        dense = torch.nn.Linear(m.in_features, m.out_features, bias=False)
        with torch.no_grad():
            dense.weight.copy_(m.weight.float() * m.weight_scale)
        s_in, inv = m.input_scale.clone(), m.inv_input_scale.clone()
        dense.register_forward_pre_hook(lambda _m, args, s=s_in, i=inv: (quantize_fp8_static(args[0], i).float() * s,))
        parent, leaf = name.rsplit(".", 1)
        setattr(model.get_submodule(parent), leaf, dense)
    want = run()
    assert [t for t, _ in got] == [t for t, _ in want]
    assert max(abs(a - b) for (_, la), (_, lb) in zip(got, want) for a, b in zip(la, lb)) <= 1e-4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fp8_gemm_on_cuda_matches_the_cpu_run(export, monkeypatch):
    """On CUDA the FP8 layers run the scaled FP8 GEMM by default (cuBLASLt through
    torch._scaled_mm); float32, its greedy run is close to the CPU run of the same layers by vLLM's
    ``check_logprobs_close``: the same tokens up to the first difference, and there each run's token
    among the other's top 5. Not token for token: Hopper's FP8 GEMM is within ~1.6e-5 of the sum of
    |products| (benchmarks/quant_bench.py on the H200), the CPU's within 3e-7, and a difference that
    size moves an activation across an e4m3 rounding boundary in the next layer's quantiser (a whole
    e4m3 step) in most prompts of this model: its first-token logprobs were 1.8e-4 to 0.12 apart on
    the H200, 2026-12-02, with the third greedy token of one prompt flipped (docs/QUANTIZATION.md)."""
    from kvserve.layers import quant_linear
    from kvserve.layers.quant_linear import FP8Linear

    folder = export("llama", "FP8", kv=None)
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    runs = {}
    for device in ("cuda", "cpu"):
        if device == "cpu":
            monkeypatch.setattr(quant_linear, "FP8_GEMM_DEVICES", ("cuda", "cpu"))
        llm = LLM(str(folder), dtype="float32", kv_cache_memory=1 << 22, max_num_seqs=4, device=device)
        assert any(isinstance(m, FP8Linear) for m in llm.llm_engine.runner.model.modules())
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params, use_tqdm=False)
        runs[device] = [(list(o.outputs[0].token_ids), o.outputs[0].logprobs) for o in outs]
        del llm
    for (cuda_tokens, cuda_lps), (cpu_tokens, cpu_lps) in zip(runs["cuda"], runs["cpu"]):
        assert len(cuda_tokens) == len(cpu_tokens) == MAX_TOKENS
        for step, (a, b) in enumerate(zip(cuda_tokens, cpu_tokens)):
            if a != b:  # vLLM's check_logprobs_close: each in the other's top logprobs, then stop
                assert a in cpu_lps[step] and b in cuda_lps[step], (step, cuda_tokens, cpu_tokens)
                break


@pytest.mark.parametrize("dtype,tokens,gluon_rows,want_buffer", [
    (torch.bfloat16, 256, 256, False),  # sm_90: steps of up to 256 rows run the Gluon kernel
    (torch.bfloat16, 257, 256, True),
    (torch.float32, 256, 256, True),  # fp32 never takes the Gluon kernel
    (torch.bfloat16, 256, 64, True),  # before sm_90 the Gluon kernel stops at 64 rows
    (torch.bfloat16, 255, 0, False),  # below DENSE_FROM_M the fused kernel needs no buffer
])
def test_large_batch_buffer_only_where_a_step_dequantizes(monkeypatch, dtype, tokens, gluon_rows, want_buffer):
    """The W4A16 large-batch buffer is made at start-up (so the memory plan counts it) iff a step of
    ``max_batch_tokens`` rows can take the dequantize path: more rows than the Gluon kernel takes on
    the device (``max_rows``, bf16 / fp16 only) and at least ``DENSE_FROM_M``."""
    from kvserve.kernels import gluon_w4a16, triton_w4a16
    from kvserve.layers.quant_linear import NVFP4Linear
    from kvserve.layers.quantized_model import finalize_quantized_model

    monkeypatch.setattr(gluon_w4a16, "available", lambda device: gluon_rows > 0)  # (as on a GPU with Gluon)
    monkeypatch.setattr(gluon_w4a16, "wgmma_available", lambda device: gluon_rows == 256)  # (as on sm_90)
    monkeypatch.setattr(triton_w4a16, "_scratch", {})
    model = torch.nn.Sequential(NVFP4Linear(64, 48, False))
    model[0].init_dummy(torch.Generator().manual_seed(0))
    finalize_quantized_model(model, tokens, dtype)
    assert bool(triton_w4a16._scratch) == want_buffer
