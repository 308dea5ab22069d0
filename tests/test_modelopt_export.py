"""The ModelOpt-format exporter (kvserve.tools.modelopt_export) on tiny models: which tensors are
quantized with which dtypes and shapes, which are copied bit for bit, the scales fused siblings
share (and FP8 ones do not), hf_quant_config.json and config.json quantization_config exactly, and
the exported tensors decoding to within the codec's error of the source weights."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvserve.quant.nvfp4 import dequantize_fp8_per_tensor, dequantize_nvfp4, quantize_nvfp4
from kvserve.tools.modelopt_export import (
    calibration_ids, export_config_only, export_modelopt, main, summarize_exclude_modules,
)

E4M3 = torch.float8_e4m3fn
TOKENS = 48
PRODUCER = {"name": "modelopt", "version": "0.45.0"}
FP8_KV = {"dynamic": False, "num_bits": 8, "type": "float"}
FP8_GROUP = {"input_activations": dict(FP8_KV), "weights": dict(FP8_KV)}
FP4 = {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16}
NVFP4_GROUP = {"input_activations": dict(FP4), "weights": dict(FP4)}
W4A16_GROUP = {"weights": dict(FP4)}
HYBRID_LINEAR, HYBRID_FULL = (0, 2), (1, 3)

pytestmark = pytest.mark.usefixtures("one_thread")


# ----------------------------------------------------------------------------------------- helpers


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


def _f32(x: float) -> float:
    """fp32 rounding of a float64 quotient (one rounding: the correctly rounded fp32 division)."""
    return float(torch.tensor(x, dtype=torch.float32))


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bits."""
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.reshape(-1).view(torch.uint8), b.reshape(-1).view(torch.uint8))


def _half_step_bound(w: torch.Tensor, step: torch.Tensor) -> torch.Tensor:
    """Half an e2m1 step around |w|/step, or the overshoot past 6 (saturation at 6)."""
    a = w.double().abs() / step.double()
    half = torch.where(a <= 2, 0.25, torch.where(a <= 4, 0.5, 1.0)).double()
    return torch.where(a <= 6, half, a - 6) * step.double() * (1 + 1e-6) + w.double().abs() * 2**-22  # fp32 product


_SUFFIXES = {
    "NVFP4": ("weight", "weight_scale", "weight_scale_2", "input_scale"),
    "W4A16_NVFP4": ("weight", "weight_scale", "weight_scale_2"),
    "FP8": ("weight", "weight_scale", "input_scale"),
}


def _check_tensors(src: Path, dst: Path, expected: dict[str, str]) -> tuple[dict, dict]:
    """Every quantized matrix ``m -> format`` has exactly its tensors with the right dtypes and
    shapes and decodes to within the codec's error; every other tensor is the source's, bit for bit."""
    s, o = _tensors(src), _tensors(dst)
    quant_keys: set[str] = set()
    for m, fmt in expected.items():
        w = s[f"{m}.weight"]
        out, inn = w.shape
        mine = {k[len(m) + 1 :] for k in o if k.startswith(m + ".") and k[len(m) + 1 :] in _SUFFIXES["NVFP4"] + ("bias",)}
        assert mine - {"bias"} == set(_SUFFIXES[fmt]), (m, mine)
        quant_keys |= {f"{m}.{x}" for x in _SUFFIXES[fmt]}
        if fmt == "FP8":
            q, scale = o[f"{m}.weight"], o[f"{m}.weight_scale"]
            assert q.dtype == E4M3 and q.shape == (out, inn)
            assert scale.dtype == torch.float32 and scale.shape == ()
            back = dequantize_fp8_per_tensor(q, scale, torch.float32).double()
            bound = torch.maximum(w.double().abs() * 2**-4, torch.full_like(back, 2**-10 * float(scale))) * (1 + 1e-6)
            assert bool(((back - w.double()).abs() <= bound).all()), m
            assert torch.equal(q.view(torch.uint8), (w / scale).to(E4M3).view(torch.uint8))
        else:
            packed, block, s2 = o[f"{m}.weight"], o[f"{m}.weight_scale"], o[f"{m}.weight_scale_2"]
            assert packed.dtype == torch.uint8 and packed.shape == (out, inn // 2)
            assert block.dtype == E4M3 and block.shape == (out, inn // 16)
            assert s2.dtype == torch.float32 and s2.shape == ()
            back = dequantize_nvfp4(packed, block, s2, torch.float32)
            step = (block.float() * s2).repeat_interleave(16, dim=1)
            assert bool(((back.double() - w.double()).abs() <= _half_step_bound(w, step)).all()), m
            again = quantize_nvfp4(w, global_scale=s2)  # the codec with the exported global scale
            assert torch.equal(again[0], packed) and torch.equal(again[1].view(torch.uint8), block.view(torch.uint8))
        if fmt != "W4A16_NVFP4":
            x = o[f"{m}.input_scale"]
            assert x.dtype == torch.float32 and x.shape == () and float(x) > 0
    for k, v in o.items():
        if k not in quant_keys:
            assert k in s and _same(v, s[k]), k
    missing = [k for k in s if k not in o]
    assert not missing, missing
    return s, o


def _config(dst: Path) -> tuple[dict, dict]:
    return json.loads((dst / "hf_quant_config.json").read_text()), json.loads((dst / "config.json").read_text())


def _single_config(algo: str, exclude: list[str], kv: str | None = "FP8") -> tuple[dict, dict]:
    q = {"quant_algo": algo, "kv_cache_quant_algo": kv}
    if algo != "FP8":
        q["group_size"] = 16
    q["exclude_modules"] = exclude
    group = {"NVFP4": NVFP4_GROUP, "W4A16_NVFP4": W4A16_GROUP, "FP8": FP8_GROUP}[algo]
    qc = {"config_groups": {"group_0": {**group, "targets": ["Linear"]}}, "ignore": exclude, "quant_algo": algo}
    if kv:
        qc["kv_cache_scheme"] = dict(FP8_KV)
    qc.update(producer=PRODUCER, quant_method="modelopt")
    return {"producer": PRODUCER, "quantization": q}, qc


def _mixed_config(layers: dict[str, str]) -> tuple[dict, dict]:
    ql = {m: ({"quant_algo": "FP8"} if f == "FP8" else {"quant_algo": f, "group_size": 16}) for m, f in layers.items()}
    first = next(iter(layers.values()))
    order = [first] + [f for f in ("FP8", "W4A16_NVFP4") if f != first]
    groups = {
        f"group_{i}": {**(FP8_GROUP if f == "FP8" else W4A16_GROUP), "targets": sorted(m for m, g in layers.items() if g == f)}
        for i, f in enumerate(order)
    }
    hf = {"producer": PRODUCER, "quantization": {"quant_algo": "MIXED_PRECISION", "kv_cache_quant_algo": "FP8", "quantized_layers": ql}}
    qc = {"config_groups": groups, "quantized_layers": ql, "ignore": [], "quant_algo": "MIXED_PRECISION",
          "kv_cache_scheme": dict(FP8_KV), "producer": PRODUCER, "quant_method": "modelopt"}
    return hf, qc


def _assert_configs(dst: Path, want_hf: dict, want_qc: dict, src: Path) -> None:
    hf, cfg = _config(dst)
    assert hf == want_hf
    assert list(hf["quantization"]) == list(want_hf["quantization"])  # ModelOpt's key order
    assert cfg["quantization_config"] == want_qc
    src_cfg = json.loads((src / "config.json").read_text())
    assert {k: v for k, v in cfg.items() if k != "quantization_config"} == src_cfg
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja"):
        assert (dst / f).read_bytes() == (src / f).read_bytes()
    assert not any("k_scale" in k or "v_scale" in k for k in _tensors(dst))  # fp8_cast: no KV scales


def _amax(t: torch.Tensor) -> float:
    return float(t.abs().max())


def _assert_shared(s, o, members: list[str], fmt: str) -> None:
    """Fused siblings: one weight_scale_2 = max amax / 2688 (and one input_scale)."""
    want = _f32(max(_amax(s[f"{m}.weight"]) for m in members) / 2688.0)
    assert [float(o[f"{m}.weight_scale_2"]) for m in members] == [want] * len(members), members
    if fmt == "NVFP4":
        assert len({float(o[f"{m}.input_scale"]) for m in members}) == 1, members


def _llama_mats(layers: int = 2) -> list[str]:
    return [f"model.layers.{i}.{p}" for i in range(layers) for p in
            ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


def _hybrid_mats(moe: bool, experts: int = 4) -> dict[str, str]:
    """matrix -> kind ("attn" or "mlp") of the tiny hybrid models (layers 0, 2 GDN; 1, 3 attention)."""
    out = {}
    for i in range(4):
        names = (["linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.out_proj"] if i in HYBRID_LINEAR
                 else ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"])
        out.update({f"model.layers.{i}.{n}": "attn" for n in names})
        if moe:
            out.update({f"model.layers.{i}.mlp.shared_expert.{p}": "mlp" for p in ("gate_proj", "up_proj", "down_proj")})
            out.update({f"model.layers.{i}.mlp.experts.{e}.{p}": "mlp" for e in range(experts) for p in ("gate_proj", "up_proj", "down_proj")})
        else:
            out.update({f"model.layers.{i}.mlp.{p}": "mlp" for p in ("gate_proj", "up_proj", "down_proj")})
    return out


def _hybrid_exclude(moe: bool, next_style: bool = False) -> list[str]:
    out = ["lm_head", "model.embed_tokens"]
    for i in range(4):
        if i in HYBRID_LINEAR:
            out += [f"model.layers.{i}.linear_attn.conv1d"]
            out += ([f"model.layers.{i}.linear_attn.in_proj_ba"] if next_style else
                    [f"model.layers.{i}.linear_attn.in_proj_a", f"model.layers.{i}.linear_attn.in_proj_b"])
        if moe:
            out += [f"model.layers.{i}.mlp.gate", f"model.layers.{i}.mlp.shared_expert_gate"]
    return sorted(out)


@pytest.fixture(scope="module")
def exports(make_tiny_model, tmp_path_factory):
    """(arch, algo, kv) -> (src, dst), each made once."""
    cache: dict[tuple, tuple[Path, Path]] = {}

    def get(arch: str, algo: str, kv: str | None = "FP8") -> tuple[Path, Path]:
        key = (arch, algo, kv)
        if key not in cache:
            src = make_tiny_model(arch)
            dst = tmp_path_factory.mktemp(f"mo-{arch}-{algo}") / "out"
            export_modelopt(src, dst, algo, kv_cache_quant_algo=kv, calibration_tokens=TOKENS)
            cache[key] = (src, dst)
        return cache[key]

    return get


# ------------------------------------------------------------------------------------------- dense


def test_llama_nvfp4(exports):
    src, dst = exports("llama", "NVFP4")
    s, o = _check_tensors(src, dst, {m: "NVFP4" for m in _llama_mats()})
    _assert_configs(dst, *_single_config("NVFP4", ["lm_head", "model.embed_tokens"]), src)
    for i in range(2):
        _assert_shared(s, o, [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"], "NVFP4")
        _assert_shared(s, o, [f"model.layers.{i}.mlp.gate_proj", f"model.layers.{i}.mlp.up_proj"], "NVFP4")
        for m in ("self_attn.o_proj", "mlp.down_proj"):  # alone: its own amax
            name = f"model.layers.{i}.{m}"
            assert float(o[f"{name}.weight_scale_2"]) == _f32(_amax(s[f"{name}.weight"]) / 2688.0)


def test_llama_w4a16_without_kv(exports):
    src, dst = exports("llama", "W4A16_NVFP4", None)
    s, o = _check_tensors(src, dst, {m: "W4A16_NVFP4" for m in _llama_mats()})
    _assert_configs(dst, *_single_config("W4A16_NVFP4", ["lm_head", "model.embed_tokens"], kv=None), src)
    assert "kv_cache_quant_algo" in _config(dst)[0]["quantization"]  # written as null
    _assert_shared(s, o, [f"model.layers.1.self_attn.{p}_proj" for p in "qkv"], "W4A16_NVFP4")


def test_llama_fp8_cli_and_input_scales(make_tiny_model, exports, tmp_path):
    """FP8 through the CLI: q/k/v keep their own weight scales (ModelOpt does not fuse FP8); the
    input scales are x_amax / 448 (and, in the NVFP4 export, x_amax / 2688) of an independent
    float32 run over the same calibration ids."""
    from transformers import AutoModelForCausalLM

    src = make_tiny_model("llama")
    dst = tmp_path / "fp8"
    assert main([str(src), str(dst), "--algo", "FP8", "--calibration-tokens", str(TOKENS)]) == 0
    s, o = _check_tensors(src, dst, {m: "FP8" for m in _llama_mats()})
    _assert_configs(dst, *_single_config("FP8", ["lm_head", "model.embed_tokens"]), src)
    for m in _llama_mats():
        assert float(o[f"{m}.weight_scale"]) == _f32(_amax(s[f"{m}.weight"]) / 448.0)
    assert len({float(o[f"model.layers.0.self_attn.{p}_proj.weight_scale"]) for p in "qkv"}) == 3

    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    amax: dict[str, float] = {}
    hooks = [mod.register_forward_pre_hook(lambda _m, a, n=name: amax.__setitem__(n, max(amax.get(n, 0.0), _amax(a[0]))))
             for name, mod in model.named_modules() if isinstance(mod, torch.nn.Linear)]
    with torch.no_grad():
        for ids in calibration_ids(model.config.vocab_size, TOKENS, 0):
            model(input_ids=ids, use_cache=False)
    for h in hooks:
        h.remove()
    _src, nv = exports("llama", "NVFP4")
    onv = _tensors(nv)
    for m in _llama_mats():
        assert float(o[f"{m}.input_scale"]) == _f32(amax[m] / 448.0), m
        assert float(onv[f"{m}.input_scale"]) == _f32(amax[m] / 2688.0), m


def test_qwen3_mixed_precision_dense(exports):
    """The Qwen3.5 recipe on a dense Qwen3: attention FP8, MLP and lm_head W4A16_NVFP4."""
    src, dst = exports("qwen3", "MIXED_PRECISION")
    layers = {}
    for i in range(2):
        layers.update({f"model.layers.{i}.self_attn.{p}_proj": "FP8" for p in "qkvo"})
        layers.update({f"model.layers.{i}.mlp.{p}_proj": "W4A16_NVFP4" for p in ("gate", "up", "down")})
    layers["lm_head"] = "W4A16_NVFP4"
    s, o = _check_tensors(src, dst, layers)
    _assert_configs(dst, *_mixed_config(layers), src)
    _assert_shared(s, o, ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj"], "W4A16_NVFP4")
    assert len({float(o[f"model.layers.0.self_attn.{p}_proj.weight_scale"]) for p in "qkv"}) == 3
    assert len({float(o[f"model.layers.0.self_attn.{p}_proj.input_scale"]) for p in "qkv"}) == 1  # one input


# ------------------------------------------------------------------------------------------ hybrid


def test_qwen3_5_mixed_precision(exports):
    src, dst = exports("qwen3_5", "MIXED_PRECISION")
    layers = {m: ("FP8" if kind == "attn" else "W4A16_NVFP4") for m, kind in _hybrid_mats(moe=False).items()}
    layers["lm_head"] = "W4A16_NVFP4"
    # ModelOpt's module order (named_modules): the GDN layer's out_proj is registered before in_proj_*
    order = []
    for i in range(4):
        order += ([f"model.layers.{i}.linear_attn.{p}" for p in ("out_proj", "in_proj_qkv", "in_proj_z")] if i in HYBRID_LINEAR
                  else [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkvo"])
        order += [f"model.layers.{i}.mlp.{p}_proj" for p in ("gate", "up", "down")]
    layers = {m: layers[m] for m in order + ["lm_head"]}
    s, o = _check_tensors(src, dst, layers)
    _assert_configs(dst, *_mixed_config(layers), src)
    assert list(_config(dst)[0]["quantization"]["quantized_layers"]) == list(layers)
    # GDN in_proj_qkv / in_proj_z read one input but are FP8: not fused, own weight scales
    for i in HYBRID_LINEAR:
        p = f"model.layers.{i}.linear_attn"
        for m in ("in_proj_qkv", "in_proj_z", "out_proj"):
            assert float(o[f"{p}.{m}.weight_scale"]) == _f32(_amax(s[f"{p}.{m}.weight"]) / 448.0)
        assert o[f"{p}.in_proj_qkv.input_scale"] == o[f"{p}.in_proj_z.input_scale"]
        for k in ("conv1d.weight", "in_proj_a.weight", "in_proj_b.weight", "A_log", "dt_bias", "norm.weight"):
            assert _same(o[f"{p}.{k}"], s[f"{p}.{k}"])


def test_qwen3_5_nvfp4_fuses_gdn_projections(exports):
    src, dst = exports("qwen3_5", "NVFP4")
    s, o = _check_tensors(src, dst, {m: "NVFP4" for m in _hybrid_mats(moe=False)})
    _assert_configs(dst, *_single_config("NVFP4", _hybrid_exclude(moe=False)), src)
    for i in range(4):
        if i in HYBRID_LINEAR:
            _assert_shared(s, o, [f"model.layers.{i}.linear_attn.in_proj_qkv", f"model.layers.{i}.linear_attn.in_proj_z"], "NVFP4")
        else:
            _assert_shared(s, o, [f"model.layers.{i}.self_attn.{p}_proj" for p in "qkv"], "NVFP4")
        _assert_shared(s, o, [f"model.layers.{i}.mlp.gate_proj", f"model.layers.{i}.mlp.up_proj"], "NVFP4")


def _assert_experts(s, o, fmt: str, layers=range(4), experts: int = 4) -> None:
    """Each expert's gate/up share one weight scale (ModelOpt's one quantizer per expert over the
    fused gate_up), downs keep their own; every expert reads one input_scale per projection."""
    for i in layers:
        p = f"model.layers.{i}.mlp.experts"
        for e in range(experts):
            gu = max(_amax(s[f"{p}.{e}.gate_proj.weight"]), _amax(s[f"{p}.{e}.up_proj.weight"]))
            down = _amax(s[f"{p}.{e}.down_proj.weight"])
            if fmt == "FP8":
                assert float(o[f"{p}.{e}.gate_proj.weight_scale"]) == float(o[f"{p}.{e}.up_proj.weight_scale"]) == _f32(gu / 448.0)
                assert float(o[f"{p}.{e}.down_proj.weight_scale"]) == _f32(down / 448.0)
            else:
                assert float(o[f"{p}.{e}.gate_proj.weight_scale_2"]) == float(o[f"{p}.{e}.up_proj.weight_scale_2"]) == _f32(gu / 2688.0)
                assert float(o[f"{p}.{e}.down_proj.weight_scale_2"]) == _f32(down / 2688.0)
        if fmt != "W4A16_NVFP4":
            assert len({float(o[f"{p}.{e}.{q}.input_scale"]) for e in range(experts) for q in ("gate_proj", "up_proj")}) == 1
            assert len({float(o[f"{p}.{e}.down_proj.input_scale"]) for e in range(experts)}) == 1


def test_qwen3_5_moe_nvfp4(exports):
    src, dst = exports("qwen3_5_moe", "NVFP4")
    s, o = _check_tensors(src, dst, {m: "NVFP4" for m in _hybrid_mats(moe=True)})
    _assert_configs(dst, *_single_config("NVFP4", _hybrid_exclude(moe=True)), src)
    _assert_experts(s, o, "NVFP4")
    for i in range(4):
        _assert_shared(s, o, [f"model.layers.{i}.mlp.shared_expert.gate_proj", f"model.layers.{i}.mlp.shared_expert.up_proj"], "NVFP4")
        for k in ("mlp.gate.weight", "mlp.shared_expert_gate.weight"):  # router and shared-expert gate
            assert _same(o[f"model.layers.{i}.{k}"], s[f"model.layers.{i}.{k}"])


def test_qwen3_5_moe_mixed_precision(exports):
    src, dst = exports("qwen3_5_moe", "MIXED_PRECISION")
    mats = {m: ("FP8" if kind == "attn" else "W4A16_NVFP4") for m, kind in _hybrid_mats(moe=True).items()}
    mats["lm_head"] = "W4A16_NVFP4"
    s, o = _check_tensors(src, dst, mats)
    _assert_experts(s, o, "W4A16_NVFP4")
    hf, cfg = _config(dst)
    ql = hf["quantization"]["quantized_layers"]
    # the fused experts module is one entry (ModelOpt names the transformers 5 *Experts module)
    layers = {}
    for m, f in mats.items():
        layers[re.sub(r"\.experts\.\d+\.\w+$", ".experts", m)] = f
    assert set(ql) == set(layers) and all(ql[m]["quant_algo"] == f for m, f in layers.items())
    assert "model.layers.0.mlp.experts" in ql and "model.layers.0.mlp.experts.0.gate_proj" not in ql
    assert hf["quantization"]["quant_algo"] == "MIXED_PRECISION" and cfg["quantization_config"]["quantized_layers"] == ql


def test_qwen3_next_fp8(exports):
    src, dst = exports("qwen3_next", "FP8")
    mats = {}
    for i in range(4):
        names = (["linear_attn.in_proj_qkvz", "linear_attn.out_proj"] if i in HYBRID_LINEAR
                 else [f"self_attn.{p}_proj" for p in "qkvo"])
        mats.update({f"model.layers.{i}.{n}": "FP8" for n in names})
        mats.update({f"model.layers.{i}.mlp.shared_expert.{p}": "FP8" for p in ("gate_proj", "up_proj", "down_proj")})
        mats.update({f"model.layers.{i}.mlp.experts.{e}.{p}": "FP8" for e in range(4) for p in ("gate_proj", "up_proj", "down_proj")})
    s, o = _check_tensors(src, dst, mats)
    _assert_configs(dst, *_single_config("FP8", _hybrid_exclude(moe=True, next_style=True)), src)
    _assert_experts(s, o, "FP8")


def test_fused_3d_expert_tensors_in_the_source(make_tiny_model, exports, tmp_path):
    """A source with transformers' fused ``experts.gate_up_proj`` / ``down_proj`` tensors gives
    the same per-expert export as the per-expert source."""
    src, ref = exports("qwen3_5_moe", "NVFP4")
    fused = tmp_path / "fused-src"
    shutil.copytree(src, fused)
    sd = load_file(str(fused / "model.safetensors"))
    out = {k: v for k, v in sd.items() if ".mlp.experts." not in k}
    for i in range(4):
        p = f"model.layers.{i}.mlp.experts"
        out[f"{p}.gate_up_proj"] = torch.stack([torch.cat([sd[f"{p}.{e}.gate_proj.weight"], sd[f"{p}.{e}.up_proj.weight"]]) for e in range(4)])
        out[f"{p}.down_proj"] = torch.stack([sd[f"{p}.{e}.down_proj.weight"] for e in range(4)])
    save_file(out, str(fused / "model.safetensors"), metadata={"format": "pt"})
    dst = export_modelopt(fused, tmp_path / "out", "NVFP4", calibration_tokens=TOKENS)
    a, b = _tensors(ref), _tensors(dst)
    assert set(a) == set(b) and all(_same(a[k], b[k]) for k in a)
    assert _config(dst)[0] == _config(ref)[0]


def test_mtp_tensors_copied_and_excluded(make_tiny_model, tmp_path):
    """Tensors named mtp.* (transformers does not load them) are copied as they are and their
    prefixes excluded, as hf_ptq's load_mtp_weights + _add_mtp_exclusions do; written in shards."""
    src = tmp_path / "with-mtp"
    shutil.copytree(make_tiny_model("qwen3_5"), src)
    sd = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    sd["mtp.fc.weight"] = torch.randn(64, 128, generator=g)
    sd["mtp.layers.0.mlp.gate_proj.weight"] = torch.randn(128, 64, generator=g)
    save_file(sd, str(src / "model.safetensors"), metadata={"format": "pt"})
    dst = export_modelopt(src, tmp_path / "out", "MIXED_PRECISION", calibration_tokens=16, shard_bytes=64 << 10)
    o = _tensors(dst)
    index = json.loads((dst / "model.safetensors.index.json").read_text())  # small shards: an index
    shards = sorted(p.name for p in dst.glob("*.safetensors"))
    assert len(shards) > 1 and sorted(set(index["weight_map"].values())) == shards
    assert sorted(index["weight_map"]) == sorted(o)
    for k in ("mtp.fc.weight", "mtp.layers.0.mlp.gate_proj.weight"):
        assert _same(o[k], sd[k])
    hf, cfg = _config(dst)
    assert hf["quantization"]["exclude_modules"] == ["mtp*", "mtp.layers.0*"]
    assert cfg["quantization_config"]["ignore"] == ["mtp*", "mtp.layers.0*"]
    assert not any(m.startswith("mtp") for m in hf["quantization"]["quantized_layers"])


# ---------------------------------------------------------------------------------- errors, helpers


def test_refusals(make_tiny_model, exports, tmp_path):
    src = make_tiny_model("llama", intermediate_size=40)  # down_proj in_features 40
    with pytest.raises(ValueError, match=r"model\.layers\.0\.mlp\.down_proj\.weight: in_features 40 of shape \(64, 40\)"):
        export_modelopt(src, tmp_path / "a", "W4A16_NVFP4", calibration_tokens=8)
    with pytest.raises(ValueError, match="algo must be one of"):
        export_modelopt(src, tmp_path / "b", "nvfp4")
    with pytest.raises(ValueError, match="kv_cache_quant_algo"):
        export_modelopt(src, tmp_path / "b", "FP8", kv_cache_quant_algo="INT8")
    _src, done = exports("llama", "NVFP4")
    with pytest.raises(FileExistsError):
        export_modelopt(src, done, "FP8")
    with pytest.raises(ValueError, match="already quantized"):
        export_modelopt(done, tmp_path / "c", "FP8")


def test_summarize_exclude_modules():
    """ModelOpt's prefix wildcards: the shortest dot-boundary ``x*`` matching no quantized module,
    else ``x.*`` (when ``x*`` would also catch ``x0...``), else the exact name."""
    q = ["model.layers.0.mlp.gate_proj", "model.layers.10.mlp.up_proj", "model.layers.11.self_attn.q_proj"]
    u = ["lm_head", "model.embed_tokens", "model.visual.blocks.0.attn.qkv", "model.visual.merger.fc",
         "model.layers.1.mlp.gate", "model.layers.1.self_attn.o_proj", "model.layers.0.mlp.gate",
         "model.layers.2.mlp.down_proj", "model.layers.2.mlp.up_proj", "mtp.fc"]
    assert summarize_exclude_modules(u, q) == [
        "lm_head", "model.embed_tokens", "model.layers.0.mlp.gate", "model.layers.1.*", "model.layers.2*",
        "model.visual*", "mtp*",
    ]


@pytest.mark.parametrize("arch,algo", [("llama", "NVFP4"), ("qwen3_5", "MIXED_PRECISION"), ("qwen3_5_moe", "MIXED_PRECISION")])
def test_config_only_export_writes_the_full_exports_configs(exports, arch, algo, tmp_path):
    """--config-only: the same hf_quant_config.json and config.json as the real export (module
    kinds from the model on the meta device instead of the calibration run), and no weights."""
    src, dst = exports(arch, algo)
    assert main([str(src), str(tmp_path / "only"), "--algo", algo, "--config-only"]) == 0
    only = tmp_path / "only"
    for name in ("hf_quant_config.json", "config.json"):
        assert json.loads((only / name).read_text()) == json.loads((dst / name).read_text()), name
    assert not list(only.glob("*.safetensors"))
    with pytest.raises(FileExistsError, match="not empty"):
        export_config_only(src, only, algo)
    with pytest.raises(ValueError, match="algo must be one of"):
        export_config_only(src, tmp_path / "x", "INT4")
