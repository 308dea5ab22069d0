"""Programmatic dependent launch for the step's Triton kernels (kernels/pdl.py): when it is on, the
compiled kernels' first instructions, and on an sm_90 GPU a decode layer's chain of kernels (norms,
quantiser, SiLU-and-mul, conv1d, delta rule, gated norm, rotary, KV store, split-KV attention,
output gate) giving the same bits with it as without, eagerly and replayed from a CUDA graph."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from kvserve.kernels import pdl


def test_pdl_is_off_where_it_cannot_run(monkeypatch):
    """The interpreter's (CPU) launches pass PDL False and no ``launch_pdl``; so does any device with
    the switch off."""
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    monkeypatch.setattr(pdl, "enabled", False)
    assert pdl.launch_options(torch.device("cpu")) == {"PDL": False}
    if torch.cuda.is_available():
        assert pdl.launch_options(torch.device("cuda", 0)) == {"PDL": False}


_COMPILE = """
import json, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from kvserve.kernels import triton_gdn, triton_layers, triton_store

name, on = sys.argv[1], sys.argv[2] == "1"
i32 = lambda *names: {n: "i32" for n in names}  # noqa: E731
if name == "fp8_quant":
    fn, consts = triton_layers._fp8_static_quant_kernel, {"BLOCK": 1024}
    sig = {"x_ptr": "*bf16", "inv_ptr": "*fp32", "out_ptr": "*u8", **i32("n")}
elif name == "store_kv":
    fn, consts = triton_store._store_kv_kernel, {"BLOCK_T": 1, "BLOCK_H": 8, "BLOCK_D": 128, "FP8_FORMAT": 0,
                                                 "FP8_MAX": 0.0}
    sig = {"key_ptr": "*bf16", "value_ptr": "*bf16", "cache_ptr": "*bf16", "slot_ptr": "*i64", "k_scale_ptr": "*fp32",
           "v_scale_ptr": "*fp32", **i32("num_tokens", "num_kv_heads", "head_size", "stride_kt", "stride_kh",
                                         "stride_kd", "stride_vt", "stride_vh", "stride_vd", "stride_cb", "stride_ckv",
                                         "stride_cs", "stride_ch", "stride_cd", "block_size")}
else:
    fn, consts = triton_gdn._delta_rule_kernel, {"GROUP": 3, "K": 128, "V": 128, "K_PAD": 128, "BLOCK_V": 32}
    sig = {**{p: "*bf16" for p in ("q_ptr", "k_ptr", "v_ptr", "a_ptr", "b_ptr")}, "A_log_ptr": "*fp32",
           "dt_bias_ptr": "*fp32", "state_ptr": "*fp32", "o_ptr": "*bf16", "qsl_ptr": "*i32", "slots_ptr": "*i32",
           "has_state_ptr": "*i32", "scale": "fp32",
           **i32("stride_qt", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_at", "stride_bt",
                 "stride_ss", "stride_sh", "stride_sk", "stride_ot", "stride_oh")}
k = triton.compile(ASTSource(fn=fn, signature=sig, constexprs={**consts, "PDL": on}), target=GPUTarget("cuda", 90, 32),
                   options={"num_warps": 4, "launch_pdl": on})
ptx = k.asm["ptx"]
body = ptx[ptx.index("{", ptx.index(".entry")):]
first = [line.strip() for line in body.splitlines() if "griddepcontrol" in line or "ld.global" in line
         or "st.global" in line][:2]
print(json.dumps({"gdc": [ptx.count("griddepcontrol.launch_dependents"), ptx.count("griddepcontrol.wait")],
                  "first": first}))
"""


@pytest.mark.parametrize("kernel", ["fp8_quant", "store_kv", "delta_rule"])
@pytest.mark.parametrize("on", [True, False], ids=["pdl", "plain"])
def test_pdl_kernels_compile_for_sm90(kernel, on):
    """Compiled for sm_90 with this machine's triton (a fresh process, outside the interpreter mode):
    with PDL one ``launch_dependents`` and one ``wait``, both before the kernel's first global load
    or store; without it, neither."""
    pytest.importorskip("triton")
    env = {key: v for key, v in os.environ.items() if key != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _COMPILE, kernel, "1" if on else "0"], env=env, capture_output=True,
                         text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    got = json.loads(run.stdout.strip().splitlines()[-1])
    if on:
        assert got["gdc"] == [1, 1]
        assert "griddepcontrol.launch_dependents" in got["first"][0] and "griddepcontrol.wait" in got["first"][1]
    else:
        assert got["gdc"] == [0, 0] and "griddepcontrol" not in " ".join(got["first"])


def _layer_inputs(gen: torch.Generator, dev: str = "cuda") -> dict:
    """A decode step of 8 sequences through one small hybrid layer's kernels: inputs, weights, the
    state pools (slots out of order, some sequences fresh) and paged KV with random contexts."""
    bf = torch.bfloat16
    T, D, heads, hd, page, slots_n = 8, 512, 2, 64, 16, 12

    def rnd(*shape, dtype=bf, scale=1.0):
        return (torch.randn(*shape, generator=gen) * scale).to(dev, dtype)

    ctx = torch.randint(1, 40, (T,), generator=gen)
    blocks_per_seq = 3
    block_tables = torch.randperm(T * blocks_per_seq, generator=gen).view(T, blocks_per_seq).to(torch.int32)
    slot_mapping = block_tables[torch.arange(T), ctx // page].long() * page + ctx % page
    pos = ctx.to(torch.int64)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2).float() / hd))
    freqs = torch.outer(torch.arange(64).float(), inv_freq)
    return {
        "x": rnd(T, D), "res": rnd(T, D), "w": rnd(D, scale=0.1) + 1, "inv": torch.tensor([1 / 0.05], device=dev),
        "conv_w": rnd(D // 2, 4, scale=0.5), "conv_state": rnd(slots_n, D // 2, 3, dtype=torch.float32),
        "ssm_state": rnd(slots_n, heads, hd, hd, dtype=torch.float32, scale=0.1),
        "A_log": rnd(heads, dtype=torch.float32, scale=0.5), "dt_bias": rnd(heads, dtype=torch.float32),
        "wg": rnd(hd, scale=0.1) + 1, "qsl": torch.arange(T + 1, dtype=torch.int32, device=dev),
        "slots": torch.randperm(slots_n, generator=gen)[:T].to(dev, torch.int32),
        "has": torch.tensor([i % 3 != 0 for i in range(T)], dtype=torch.int32, device=dev),
        "pos": pos.to(dev), "cos": torch.cat([freqs.cos()] * 2, -1).to(dev),
        "sin": torch.cat([freqs.sin()] * 2, -1).to(dev),
        "kv_cache": rnd(T * blocks_per_seq, 2, page, heads, hd), "block_tables": block_tables.to(dev),
        "slot_mapping": slot_mapping.to(dev), "seq_lens": (ctx + 1).to(dev, torch.int32),
    }


_STATES = ("conv_state", "ssm_state", "kv_cache")


def _layer(t: dict) -> list[torch.Tensor]:
    """The chain, each kernel reading the one before's output; returns every output (the states
    are updated in place)."""
    from kvserve.kernels import triton_attention, triton_gdn, triton_layers, triton_store

    n, r = triton_layers.rms_norm(t["x"], t["w"], 1e-6, residual=t["res"])
    xq = triton_layers.fp8_static_quant(n, t["inv"])
    mixed = triton_layers.silu_and_mul(n)  # [T, 256] = q 64 | k 64 | v 2 x 64
    y = triton_gdn.causal_conv1d_varlen(mixed, t["conv_w"], t["conv_state"], t["qsl"], t["slots"], t["has"])
    T = y.shape[0]
    q, k, v = y[:, :64].view(T, 1, 64), y[:, 64:128].view(T, 1, 64), y[:, 128:].view(T, 2, 64)
    o = triton_gdn.gated_delta_rule_varlen(q, k, v, r[:, :2], r[:, 2:4], t["A_log"], t["dt_bias"], t["ssm_state"],
                                           t["qsl"], t["slots"], t["has"])
    g = triton_layers.gated_rms_norm(o, n[:, :128].view(T, 2, 64), t["wg"], 1e-6)
    rot = triton_layers.rotary(g, t["pos"], t["cos"], t["sin"], 64)
    triton_store.store_kv(rot, g, t["kv_cache"], t["slot_mapping"])
    attn = triton_attention.paged_attention(rot, t["kv_cache"], t["block_tables"], t["qsl"], t["seq_lens"], 0.125, 1,
                                            48, num_splits=2)
    gated = triton_layers.sigmoid_gate(attn.reshape(T, 128), n[:, :256].view(T, 2, 128).chunk(2, dim=-1)[1])
    return [n, r, xq.view(torch.uint8), mixed, y, o, g, rot, attn, gated]


@pytest.mark.skipif(not (torch.cuda.is_available() and pdl.supported(torch.device("cuda", 0))),
                    reason="needs an sm_90+ GPU (programmatic dependent launch)")
def test_a_layer_with_pdl_gives_the_bits_of_one_without(monkeypatch):
    """The chain with PDL (eager, then captured once and replayed on the same starting states) equals
    the chain with the switch off, bit for bit, outputs and updated states (every output poisoned
    with NaN before the replay)."""
    t = _layer_inputs(torch.Generator().manual_seed(15))
    start = {key: t[key].clone() for key in _STATES}

    def run() -> list[torch.Tensor]:
        for key in _STATES:
            t[key].copy_(start[key])
        return [o.clone() for o in _layer(t)] + [t[key].clone() for key in _STATES]

    monkeypatch.setattr(pdl, "enabled", False)
    want = run()
    monkeypatch.setattr(pdl, "enabled", True)
    eager = run()
    for key in _STATES:
        t[key].copy_(start[key])
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _layer(t)
    for o in outs:
        if o.dtype == torch.uint8:
            o.fill_(0xFF)  # (the fp8 codes' NaN)
        else:
            o.fill_(float("nan"))
    for key in _STATES:
        t[key].copy_(start[key])
    graph.replay()
    torch.cuda.synchronize()
    replayed = [o.clone() for o in outs] + [t[key].clone() for key in _STATES]
    for got in (eager, replayed):
        for i, (a, b) in enumerate(zip(got, want)):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), i
