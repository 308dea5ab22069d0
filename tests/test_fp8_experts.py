"""FP8 routed experts (layers/quant_experts.FP8Experts, kernels/triton_fp8_moe.py): the grouped FP8
GEMM against float64 on the same fp8 operands, ``FP8Experts`` against the dense ``Experts`` holding
the dequantized weights with both GEMM inputs fake-quantized alike, the load-time scales (vLLM's
ModelOpt FP8 MoE: gate / up requantized to the larger weight scale, one input scale per GEMM, the
largest over the experts) against a hand computation, and a tiny ModelOpt FP8 MoE export loaded
through the quantized loader. Fresh random inputs; outputs poisoned first. CPU: the Triton
interpreter, with ``FP8_GEMM_DEVICES`` widened to the CPU where the module path is forced.

Tolerances. The products of two e4m3 values are exact in fp32 (4 + 4 significant bits), so an fp32
sum of K of them, in any order, is within ``(K - 1) u |x| @ |W|^T`` (u = 2^-24); the two scale
products round once more each: ``(K + 2) u`` covers it with the second-order terms. The store
rounds once to the output dtype (u_out). Hopper's FP8 tensor cores do not accumulate in IEEE fp32
(DeepSeek-V3 report, section 3.3.2: about 14 bits kept), so on CUDA the accumulation unit is 2^-13."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from kvserve.quant.nvfp4 import quantize_fp8_static
from triton_support import kernel_device, skip_without_triton_device

DEV = kernel_device()
UNIT = {torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}
ACC_UNIT = 2.0**-13 if DEV == "cuda" else 2.0**-24  # the fp32 accumulation's unit (module docstring)


def _codes(gen: torch.Generator, *shape: int) -> torch.Tensor:
    """Random e4m3 codes over most of the range (zeros, subnormals and +-448 included)."""
    return (torch.randn(*shape, generator=gen, dtype=torch.float64) * 96).clamp(-448, 448).to(torch.float8_e4m3fn)


def _routing(tokens: int, used: int, k: int, seed: int) -> torch.Tensor:
    """Top-k distinct experts a token among the first ``used`` (later experts get no rows), skewed."""
    gen = torch.Generator().manual_seed(seed)
    logits = torch.randn(tokens, used, generator=gen) + torch.linspace(2, -2, used)
    return logits.topk(k, dim=-1).indices


def _gemm_slack(ref: torch.Tensor, mag: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """The GEMM bound (module docstring): ``u_out |ref| + (1 + u_out) (K + 2) u_acc mag``."""
    return UNIT[dtype] * ref.abs() + (1 + UNIT[dtype]) * (k + 2) * ACC_UNIT * mag


@skip_without_triton_device()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens,block_m,n,kdim,per_x", [
    (1, 16, 48, 160, 2), (5, 16, 20, 40, 2), (5, 16, 48, 160, 1), (40, 64, 48, 160, 2), (40, 16, 20, 40, 1),
])
def test_fp8_grouped_matmul_against_float64(dtype, tokens, block_m, n, kdim, per_x):
    """Each listed row r: ``(xq[r // per_x] @ Wq_e^T) * a_scale * w_scale[e]`` in float64, e its expert,
    into a NaN-poisoned output with one extra row that no id lists (it stays NaN). Experts 5 and 6
    get no rows; N = 48 / 20 and K = 160 / 40 fill no tile (BLOCK_N 64 / 128, BLOCK_K 64 / 128)."""
    from kvserve.kernels.triton_fp8_moe import fp8_grouped_matmul
    from kvserve.layers.moe import moe_align

    e, k = 7, 2
    gen = torch.Generator().manual_seed(1000 * tokens + kdim + per_x)
    top = _routing(tokens, 5, k, tokens)
    rows = tokens * k
    w = _codes(gen, e, n, kdim)
    w_scale = (torch.rand(e, generator=gen) + 0.5) * 1e-2
    a_scale = torch.tensor(0.03)
    x = torch.randn(rows // per_x, kdim, generator=gen) * 4
    xq = quantize_fp8_static(x, 1 / a_scale)
    ids, block_expert = moe_align(top.to(DEV), e, block_m)
    out = torch.full((rows + 1, n), float("nan"), dtype=dtype, device=DEV)
    fp8_grouped_matmul(xq.to(DEV), w.to(DEV), w_scale.to(DEV), a_scale.to(DEV), ids, block_expert, block_m, per_x, out)
    y = out.cpu()
    assert bool(torch.isnan(y[rows]).all()) and not bool(torch.isnan(y[:rows]).any())
    ex = top.reshape(-1)
    xr = xq.double()[torch.arange(rows) // per_x]  # each row's input
    wr = w.double()[ex]  # [rows, n, K]: each row's expert
    scale = a_scale.double() * w_scale.double()[ex][:, None]
    ref = torch.einsum("rk,rnk->rn", xr, wr) * scale
    mag = torch.einsum("rk,rnk->rn", xr.abs(), wr.abs()) * scale
    err = (y[:rows].double() - ref).abs()
    assert bool((err <= _gemm_slack(ref, mag, kdim, dtype)).all()), float((err / mag.clamp_min(1e-30)).max())


def test_fp8_grouped_matmul_refuses_bad_operands():
    pytest.importorskip("triton")
    from kvserve.kernels.triton_fp8_moe import fp8_grouped_matmul

    ids, block_expert = torch.full((16,), -1, dtype=torch.int32), torch.ones(1, dtype=torch.int32)
    w = torch.zeros(1, 8, 32, dtype=torch.float8_e4m3fn)
    xq = torch.zeros(2, 32, dtype=torch.float8_e4m3fn)
    one, out = torch.ones(1), torch.zeros(2, 8)
    with pytest.raises(ValueError, match=r"xq \(2, 32\) torch.bfloat16 .* both float8_e4m3fn"):
        fp8_grouped_matmul(xq.bfloat16(), w, one, one, ids, block_expert, 16, 1, out)
    with pytest.raises(ValueError, match=r"w_scale \(2,\) torch.float32 .* expected float32 \[1\]"):
        fp8_grouped_matmul(xq, w, torch.ones(2), one, ids, block_expert, 16, 1, out)
    with pytest.raises(ValueError, match=r"out dtype torch.float64, expected bfloat16, float16 or float32"):
        fp8_grouped_matmul(xq, w, one, one, ids, block_expert, 16, 1, out.double())


@dataclass
class _Stored:
    """One experts module as a ModelOpt FP8 export stores it, stacked: codes [E, 2I, H] / [E, H, I],
    per expert a weight scale per shard (gate, up, down) and an input scale per GEMM."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_scale: torch.Tensor
    up_scale: torch.Tensor
    down_scale: torch.Tensor
    gate_up_in: torch.Tensor
    down_in: torch.Tensor

    @classmethod
    def random(cls, e: int, hidden: int, inter: int, seed: int) -> _Stored:
        """Random codes; per expert its own scales (gate and up one, as ModelOpt exports; input scales
        differ across experts, as vLLM allows)."""
        gen = torch.Generator().manual_seed(seed)
        codes = _codes(gen, e, 2 * inter, hidden), _codes(gen, e, hidden, inter)
        gate, down = ((torch.rand(e, generator=gen) + 0.5) * 2e-3 for _ in range(2))
        ins = (torch.rand(e, generator=gen) + 0.5) * 0.02, (torch.rand(e, generator=gen) + 0.5) * 0.05
        return cls(*codes, gate, gate.clone(), down, *ins)

    def load_into(self, m) -> None:
        """Fill an ``FP8Experts`` as the loader does: each shard's scales once per row."""
        i = self.gate_up.shape[1] // 2
        with torch.no_grad():
            m.gate_up_proj.copy_(self.gate_up), m.down_proj.copy_(self.down)
            m.gate_up_proj_scale.copy_(torch.cat([self.gate_scale[:, None].expand(-1, i),
                                                  self.up_scale[:, None].expand(-1, i)], 1))
            m.gate_up_proj_input_scale.copy_(self.gate_up_in[:, None].expand(-1, 2 * i))
            m.down_proj_scale.copy_(self.down_scale[:, None].expand_as(m.down_proj_scale))
            m.down_proj_input_scale.copy_(self.down_in[:, None].expand_as(m.down_proj_input_scale))


def _reference(s: _Stored, x: torch.Tensor, top: torch.Tensor, top_w: torch.Tensor, dtype: torch.dtype,
               monkeypatch) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 truth and the bound on ``FP8Experts`` in ``dtype``. The truth: the dense ``Experts`` in
    float64 holding the dequantized weights (exact), each GEMM's input fake-quantized with that GEMM's
    input scale, the largest over the experts (``F.linear`` wrapped). The bound, per (token, slot): the
    gate / up GEMM's (module docstring), carried through ``silu(g) * u`` (|silu'| < 1.1) plus 4 units
    of the dtype (silu and the product rounded in it; torch's fp32 silu within 2 ulps); the quantiser
    is monotone, so the FP8 path's code of each intermediate lies between the codes of the truth's
    value minus and plus that bound, and the down GEMM takes the codes' spread, its own bound and the
    rounding; then the routing weight and the sum over the top-k in the dtype (k + 1 roundings)."""
    from kvserve.models.qwen3_next import Experts

    e, two_i, hidden = s.gate_up.shape
    inter = two_i // 2
    s1, s2 = s.gate_up_in.max(), s.down_in.max()
    inv1, inv2 = torch.ones(()) / s1, torch.ones(()) / s2  # correctly rounded, as FP8Experts'
    u, u_acc = UNIT[dtype], ACC_UNIT
    gu_w = s.gate_up.double() * torch.cat([s.gate_scale[:, None].expand(-1, inter),
                                           s.up_scale[:, None].expand(-1, inter)], 1).double()[..., None]
    dn_w = s.down.double() * s.down_scale.double()[:, None, None]
    dense = Experts(e, hidden, inter).double()
    with torch.no_grad():
        dense.gate_up_proj.copy_(gu_w), dense.down_proj.copy_(dn_w)
    linear = F.linear

    def fake_quant_linear(inp, weight, bias=None):
        sc, inv = (s1, inv1) if weight.shape[1] == hidden else (s2, inv2)
        return linear(quantize_fp8_static(inp, inv).double() * sc.double(), weight, bias)

    with monkeypatch.context() as mp, torch.no_grad():
        mp.setattr(F, "linear", fake_quant_linear)
        truth = dense(x.double(), top, top_w.double())
    bound = torch.zeros_like(truth)
    xq = quantize_fp8_static(x, inv1).double() * s1.double()
    for t in range(x.shape[0]):
        for j, ex in enumerate(top[t].tolist()):
            gu = gu_w[ex] @ xq[t]
            dgu = u * gu.abs() + (1 + u) * (hidden + 2) * u_acc * (gu_w[ex].abs() @ xq[t].abs())
            g, up, dg, du = gu[:inter], gu[inter:], dgu[:inter], dgu[inter:]
            a = F.silu(g) * up
            da = 1.1 * up.abs() * dg + (F.silu(g).abs() + 1.1 * dg) * du
            da = da + 4 * u * (a.abs() + da)
            code = quantize_fp8_static(a, inv2).double()
            spread = torch.maximum(quantize_fp8_static(a + da, inv2).double() - code,
                                   code - quantize_fp8_static(a - da, inv2).double()) * s2.double()
            d = dn_w[ex] @ (code * s2.double())
            dd = dn_w[ex].abs() @ spread
            dd = dd + u * (d.abs() + dd) + (1 + u) * (inter + 2) * u_acc * (dn_w[ex].abs() @ (code.abs() * s2.double()
                                                                                           + spread))
            w = top_w[t, j].double().abs()
            bound[t] += w * dd + (top.shape[1] + 1) * u * w * (d.abs() + dd)
    return truth, bound * 1.01


@skip_without_triton_device()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("tokens", [1, 5, 40])
def test_fp8_experts_equal_dense_experts_on_the_dequantized_weights(dtype, tokens, monkeypatch):
    """``FP8Experts`` (filled as the loader fills it, finalized) against the float64 dense experts with
    the same quantized weights and activations, within the bound of ``_reference``. Six experts, the
    last never routed to; hidden 80 and intermediate 40 fill no tile."""
    from kvserve.layers.quant_experts import FP8Experts

    e, hidden, inter, k = 6, 80, 40, 2
    stored = _Stored.random(e, hidden, inter, seed=tokens)
    m = FP8Experts(e, hidden, inter, device=DEV)
    stored.load_into(m)
    m.finalize()
    gen = torch.Generator().manual_seed(50 + tokens)
    top = _routing(tokens, e - 1, k, tokens)
    top_w = torch.softmax(torch.randn(tokens, k, generator=gen), -1).to(dtype)
    x = (torch.randn(tokens, hidden, generator=gen) * 2).to(dtype)
    with torch.no_grad():
        got = m(x.to(DEV), top.to(DEV), top_w.to(DEV)).double().cpu()
    truth, bound = _reference(stored, x, top, top_w, dtype, monkeypatch)
    err = (got - truth).abs()
    assert bool((err <= bound).all()), (float((err / bound).max()), float(truth.abs().max()))


def test_fp8_experts_finalize_requantizes_gate_up_to_the_larger_scale():
    """vLLM's load-time processing, by hand: expert 0's up scale is half its gate scale, so its up
    codes are requantized to the gate scale (``fp8(fp16(c) * fp16(s_up) * (1 / s_gate))``: halved,
    ties to even, 2^-10 -> 0, 1.5 * 2^-9 -> 2^-8) and its gate codes stay; expert 1's up scale is
    the larger (0.3 vs 0.2: gate codes times 2/3, rounded); expert 2 shares one scale and is left as
    loaded. One weight scale per expert and GEMM, one input scale per GEMM (the largest over the
    experts and shards), and its correctly rounded reciprocal."""
    from kvserve.layers.quant_experts import FP8Experts

    e, hidden, inter = 3, 6, 2
    gate_codes = [1.0, 3.0, 448.0, -0.5, 2.0**-9, 3 * 2.0**-9]  # one row of H = 6
    up_codes = [1.0, 3.0, 448.0, -0.5, 2.0**-9, 3 * 2.0**-9]
    m = FP8Experts(e, hidden, inter)
    gate_s, up_s = torch.tensor([0.5, 0.2, 0.125]), torch.tensor([0.25, 0.3, 0.125])
    with torch.no_grad():
        for ex in range(e):
            m.gate_up_proj[ex, :inter] = torch.tensor(gate_codes).to(torch.float8_e4m3fn)
            m.gate_up_proj[ex, inter:] = torch.tensor(up_codes).to(torch.float8_e4m3fn)
            m.gate_up_proj_scale[ex, :inter], m.gate_up_proj_scale[ex, inter:] = gate_s[ex], up_s[ex]
        m.gate_up_proj_input_scale.copy_(torch.tensor([[0.01], [0.04], [0.02]]).expand(-1, 2 * inter))
        m.gate_up_proj_input_scale[1, inter:] = 0.05  # an up shard's own input scale: the largest wins
        m.down_proj.copy_(torch.randn(e, hidden, inter).to(torch.float8_e4m3fn))
        m.down_proj_scale.copy_(torch.tensor([[1e-3], [2e-3], [3e-3]]).expand(-1, hidden))
        m.down_proj_input_scale.copy_(torch.tensor([[0.3], [0.1], [0.2]]).expand(-1, hidden))
    down_before = m.down_proj.clone()
    m.finalize()
    f8 = lambda v: torch.tensor(v).to(torch.float8_e4m3fn).float()  # noqa: E731
    halved = [0.5, 1.5, 224.0, -0.25, 0.0, 2.0**-8]
    assert torch.equal(m.gate_up_proj[0, :inter].float(), f8([gate_codes] * inter))
    assert torch.equal(m.gate_up_proj[0, inter:].float(), f8([halved] * inter))
    inv = torch.ones(()) / torch.tensor(0.3)  # expert 1: gate requantized by hand, in vLLM's steps
    by_hand = ((torch.tensor(gate_codes).half() * torch.tensor(0.2).half()).float() * inv).to(torch.float8_e4m3fn)
    assert torch.equal(m.gate_up_proj[1, :inter].float(), by_hand.float().expand(inter, -1))
    assert by_hand.float().tolist()[:3] == [0.6875, 2.0, 288.0]  # 2/3, 2, 298.67 rounded to e4m3
    assert torch.equal(m.gate_up_proj[1, inter:].float(), f8([up_codes] * inter))  # its own scale: unchanged
    assert torch.equal(m.gate_up_proj[2].float(), f8([gate_codes] * (2 * inter)))
    assert torch.equal(m.down_proj.float(), down_before.float())
    assert torch.equal(m.gate_up_proj_scale, torch.tensor([0.5, 0.3, 0.125]))
    assert torch.equal(m.down_proj_scale, torch.tensor([1e-3, 2e-3, 3e-3]))
    assert m.gate_up_proj_input_scale.shape == () and float(m.gate_up_proj_input_scale) == float(torch.tensor(0.05))
    assert float(m.down_proj_input_scale) == float(torch.tensor(0.3))
    assert float(m.down_proj_inv_input_scale) == float(torch.ones(()) / torch.tensor(0.3))
    assert not any(n.endswith("_scale_2") for n, _ in m.named_parameters())


@skip_without_triton_device()
def test_fp8_experts_dummy_weights_run():
    """``--load-format dummy``: random codes, scales as FP8Linear's; finalized, the forward is finite."""
    from kvserve.layers.quant_experts import FP8Experts

    m = FP8Experts(4, 64, 32, device=DEV)
    m.init_dummy(torch.Generator(device=DEV).manual_seed(0))
    m.finalize()
    assert bool(m.gate_up_proj.float().abs().max() > 0) and float(m.down_proj_input_scale) == pytest.approx(1 / 448)
    x = torch.randn(3, 64, device=DEV)
    top_w, top = torch.softmax(torch.randn(3, 4, device=DEV), -1).topk(2, dim=-1)
    with torch.no_grad():
        assert bool(torch.isfinite(m(x, top, top_w)).all())


@pytest.fixture(scope="module")
def fp8_moe_export(make_tiny_model, tmp_path_factory) -> Path:
    from kvserve.tools.modelopt_export import export_modelopt

    return export_modelopt(make_tiny_model("qwen3_5_moe", seed=1), tmp_path_factory.mktemp("fp8-moe") / "out", "FP8",
                           kv_cache_quant_algo=None, calibration_tokens=32)


def _load(folder: Path):
    """The model as the runner loads it (float32, triton backend, on DEV): experts swapped before
    loading, the checkpoint through the quantized loader, then finalized."""
    from kvserve.config import EngineArgs
    from kvserve.layers.quantized_model import finalize_quantized_model, prepare_quantized_model
    from kvserve.loader.quantized_weights import dequantized_weights
    from kvserve.loader.weights import iterate_weights
    from kvserve.models.qwen3_next import renamed_weights
    from kvserve.models.registry import build_model

    args = EngineArgs(model=str(folder), device=DEV, dtype="float32", kv_cache_memory=1 << 22)
    mc = args.create_engine_config().model_config
    with torch.device(DEV):
        model = build_model(mc.architecture, mc.hf_config)
    kept = prepare_quantized_model(model, mc.quant_config, model.stacked_params, True, torch.float32)
    model.load_weights(dequantized_weights(renamed_weights(iterate_weights(folder)), mc.quant_config, kept))
    finalize_quantized_model(model, 16, torch.float32)
    return model


@skip_without_triton_device()
def test_fp8_moe_export_loads_fp8_experts_where_the_fp8_gemm_runs(fp8_moe_export, monkeypatch, kvlog):
    """A tiny Qwen3.5-MoE exported FP8: where the FP8 GEMM does not run (the CPU as it is;
    ``FP8_GEMM_DEVICES`` emptied on CUDA), the routed experts stay the dense reference (dequantized,
    bit for bit the weights the FP8 experts hold); with the device among ``FP8_GEMM_DEVICES`` each
    becomes an ``FP8Experts`` holding the checkpoint's codes and weight scales as stored (ModelOpt
    gives gate and up one scale: nothing requantized) and each GEMM's largest input scale, logged
    once; its forward is within ``_reference``'s bound."""
    from safetensors.torch import load_file

    from kvserve.layers import quant_linear
    from kvserve.layers.quant_experts import FP8Experts
    from kvserve.models.qwen3_next import Experts

    ckpt: dict[str, torch.Tensor] = {}
    for f in sorted(fp8_moe_export.glob("*.safetensors")):
        ckpt.update(load_file(str(f)))
    assert json.loads((fp8_moe_export / "hf_quant_config.json").read_text())["quantization"]["quant_algo"] == "FP8"
    monkeypatch.setattr(quant_linear, "FP8_GEMM_DEVICES", ())
    dense = {n: m for n, m in _load(fp8_moe_export).named_modules() if isinstance(m, Experts)}
    monkeypatch.setattr(quant_linear, "FP8_GEMM_DEVICES", ("cuda", "cpu"))
    fp8 = {n: m for n, m in _load(fp8_moe_export).named_modules() if isinstance(m, FP8Experts)}
    assert fp8 and set(fp8) == set(dense)
    assert kvlog.count(f"(and {len(fp8)} routed-expert group(s) the grouped FP8 GEMM)") == 1
    for name, m in fp8.items():
        e = m.num_experts
        t = {p: torch.stack([ckpt[f"{name}.{i}.{p}"] for i in range(e)]).to(DEV) for p in
             ("gate_proj.weight", "up_proj.weight", "down_proj.weight")}
        s = {p: torch.stack([ckpt[f"{name}.{i}.{p}"] for i in range(e)]).to(DEV) for p in
             ("gate_proj.weight_scale", "up_proj.weight_scale", "down_proj.weight_scale", "gate_proj.input_scale",
              "up_proj.input_scale", "down_proj.input_scale")}
        assert torch.equal(s["gate_proj.weight_scale"], s["up_proj.weight_scale"])
        assert torch.equal(m.gate_up_proj.view(torch.uint8),
                           torch.cat([t["gate_proj.weight"], t["up_proj.weight"]], 1).view(torch.uint8))
        assert torch.equal(m.down_proj.view(torch.uint8), t["down_proj.weight"].view(torch.uint8))
        assert torch.equal(m.gate_up_proj_scale, s["gate_proj.weight_scale"])
        assert torch.equal(m.down_proj_scale, s["down_proj.weight_scale"])
        assert float(m.gate_up_proj_input_scale) == float(torch.cat([s["gate_proj.input_scale"],
                                                                     s["up_proj.input_scale"]]).max())
        assert float(m.down_proj_input_scale) == float(s["down_proj.input_scale"].max())
        ref = dense[name]
        assert torch.equal(ref.gate_up_proj, m.gate_up_proj.float() * m.gate_up_proj_scale[:, None, None])
        assert torch.equal(ref.down_proj, m.down_proj.float() * m.down_proj_scale[:, None, None])
        stored = _Stored(*(p.detach().cpu().clone() for p in (
            m.gate_up_proj, m.down_proj, m.gate_up_proj_scale, m.gate_up_proj_scale, m.down_proj_scale,
            m.gate_up_proj_input_scale.reshape(1), m.down_proj_input_scale.reshape(1))))
        gen = torch.Generator().manual_seed(7)
        x = torch.randn(9, m.hidden, generator=gen)
        top_w, top = torch.softmax(torch.randn(9, e, generator=gen), -1).topk(2, dim=-1)
        with torch.no_grad():
            got = m(x.to(DEV), top.to(DEV), top_w.to(DEV)).double().cpu()
        truth, bound = _reference(stored, x, top, top_w, torch.float32, monkeypatch)
        assert bool(((got - truth).abs() <= bound).all())
