"""Tuned launch tables of the grouped MoE GEMMs (kernels/moe_configs.py): vLLM's file names and
lookup (nearest token count, $VLLM_TUNED_CONFIG_FOLDER first), clear errors for bad files, and the
routed experts under a table's launch (another row block and tiles) against float64 as the default
launch is (CPU: interpreter)."""

from __future__ import annotations

import json

import pytest
import torch

from kvserve.kernels import moe_configs as mc
from kvserve.kernels.triton_moe import MoETiles
from triton_support import kernel_device, skip_without_triton_device

ENTRY = {"BLOCK_SIZE_M": 16, "BLOCK_SIZE_N": 64, "BLOCK_SIZE_K": 64, "GROUP_SIZE_M": 1, "num_warps": 4,
         "num_stages": 3}


@pytest.fixture(autouse=True)
def _fresh_tables():
    mc.load_table.cache_clear()
    mc._nearest.cache_clear()
    yield
    mc.load_table.cache_clear()
    mc._nearest.cache_clear()


def test_file_names_are_vllms():
    assert mc.config_file_name(256, 512, "NVIDIA H200") == "E=256,N=512,device_name=NVIDIA_H200.json"
    # any H200 reads the H200's file (vLLM's rule); other names keep their words
    assert mc.config_file_name(256, 512, "NVIDIA H200 NVL", mc.FP8_W8A8) == \
        "E=256,N=512,device_name=NVIDIA_H200,dtype=fp8_w8a8.json"
    assert mc.config_file_name(8, 14336, "NVIDIA H100 80GB HBM3") == "E=8,N=14336,device_name=NVIDIA_H100_80GB_HBM3.json"
    assert mc.config_dtype(torch.bfloat16) is None and mc.config_dtype(torch.float16) is None
    assert mc.config_dtype(torch.float32) == "float32" and mc.config_dtype(torch.bfloat16, fp8_w8a8=True) == "fp8_w8a8"


def test_nearest_token_count_and_the_user_folder_first(tmp_path, monkeypatch, kvlog):
    name = mc.config_file_name(4, 32, "Test GPU")
    user, package = tmp_path / "user", tmp_path / "package"
    user.mkdir(), package.mkdir()
    table = {"1": {**ENTRY, "BLOCK_SIZE_N": 32}, "64": {**ENTRY, "BLOCK_SIZE_M": 64, "num_warps": 8},
             "16": ENTRY, "triton_version": "3.6.0"}
    (user / name).write_text(json.dumps(table))
    (package / name).write_text(json.dumps({"1": {**ENTRY, "BLOCK_SIZE_M": 32}}))
    monkeypatch.setattr(mc, "PACKAGE_FOLDER", package)
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(user))
    pick = {m: mc._nearest(4, 32, "Test GPU", None, m) for m in (1, 2, 8, 9, 16, 40, 41, 1000)}
    assert pick[1] == pick[2] == pick[8] == mc.MoELaunch(16, MoETiles(32, 64, 4, 3))  # 8: a tie, the smaller key
    assert pick[9] == pick[16] == pick[40] == mc.MoELaunch(16, MoETiles(64, 64, 4, 3))
    assert pick[41] == pick[1000] == mc.MoELaunch(64, MoETiles(64, 64, 8, 3))
    assert kvlog.count(f"Using configuration from {user / name} for MoE layer.") == 1  # read once
    monkeypatch.delenv("VLLM_TUNED_CONFIG_FOLDER")
    mc.load_table.cache_clear(), mc._nearest.cache_clear()
    assert mc._nearest(4, 32, "Test GPU", None, 5) == mc.MoELaunch(32, MoETiles(64, 64, 4, 3))
    assert mc._nearest(4, 32, "Other GPU", None, 5) is None
    assert kvlog.count("Using default MoE config. Performance might be sub-optimal! Config file not found at "
                       f"{package / mc.config_file_name(4, 32, 'Other GPU')}") == 1


def test_off_cuda_no_table_is_read(monkeypatch):
    monkeypatch.setattr(mc, "load_table", lambda *a: pytest.fail("read a table off CUDA"))
    assert mc.tuned_launch(4, 32, 8, torch.device("cpu")) is None


@pytest.mark.parametrize("doc,message", [
    ([1, 2], "expected a JSON object"),
    ({"x": ENTRY}, "key 'x' is not a positive token count"),
    ({"0": ENTRY}, "key '0' is not a positive token count"),
    ({"8": 4}, "entry 8 is int, expected an object"),
    ({"8": {**ENTRY, "BLOCK_M": 16}}, "unknown fields ['BLOCK_M']"),
    ({"8": {k: v for k, v in ENTRY.items() if k != "num_stages"}}, "missing ['num_stages']"),
    ({"8": {**ENTRY, "BLOCK_SIZE_N": 48}}, "block sizes and warps powers of two"),
    ({"8": {**ENTRY, "BLOCK_SIZE_M": 8}}, "block sizes at least 16"),
    ({"8": {**ENTRY, "num_warps": True}}, "block sizes and warps powers of two"),
    ({"8": {**ENTRY, "num_warps": 6}}, "block sizes and warps powers of two"),
    ({"8": {**ENTRY, "num_stages": 0}}, "stages a positive integer"),
    ({"triton_version": "3.6.0"}, "no token counts"),
])
def test_bad_tables_are_refused_naming_the_file_and_entry(doc, message):
    with pytest.raises(ValueError) as e:
        mc.parse_table(doc, "/x/E=4,N=32.json")
    assert message in str(e.value) and "/x/E=4,N=32.json" in str(e.value)


def test_a_launch_reads_back_from_its_json():
    launch = mc.MoELaunch(32, MoETiles(128, 64, 8, 4))
    assert mc.parse_table({"7": launch.to_json()}, "t") == {7: launch}


@skip_without_triton_device()
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("launch", [mc.MoELaunch(32, MoETiles(32, 32, 4, 2)), mc.MoELaunch(64, MoETiles(64, 64, 8, 3))])
def test_routed_experts_under_a_table_launch(dtype, launch):
    """``routed_swiglu`` under a table's launch (row block and both GEMMs' tiles other than the
    defaults): within twice the torch loop's own error against float64, as the default launch; the
    output poisoned first."""
    from kvserve.layers.moe import routed_swiglu
    from kvserve.kernels.triton_moe import grouped_matmul
    from kvserve.models.qwen3_next import Experts

    dev = kernel_device()
    gen = torch.Generator().manual_seed(7)
    e, hidden, inter, tokens, k = 8, 64, 48, 9, 2
    mod = Experts(e, hidden, inter)
    with torch.no_grad():
        mod.gate_up_proj.copy_(torch.randn(e, 2 * inter, hidden, generator=gen) / hidden ** 0.5)
        mod.down_proj.copy_(torch.randn(e, hidden, inter, generator=gen) / inter ** 0.5)
    x64 = torch.randn(tokens, hidden, generator=gen, dtype=torch.float64)
    top = torch.stack([torch.randperm(e - 3, generator=gen)[:k] for _ in range(tokens)]).to(dev)  # 3 experts empty
    w = torch.softmax(torch.randn(tokens, k, generator=gen), dim=-1).to(dev)
    with torch.no_grad():
        want = Experts.forward(mod.double().to(dev), x64.to(dev), top, w.double())
        mod = mod.to(dev, dtype)
        x, wd = x64.to(dev, dtype), w.to(dtype)
        loop = mod(x, top, wd)
        calls = []

        def matmul(a, name, *rows, tiles):
            calls.append(tiles)
            rows[4].fill_(float("nan"))  # out, poisoned
            return grouped_matmul(a, getattr(mod, name), *rows, tiles=tiles)

        got = routed_swiglu(x, top, wd, e, inter, hidden, matmul, launch)
    assert calls == [launch.tiles, launch.tiles]
    err = lambda t: float((t.double() - want).abs().max() / want.abs().max())  # noqa: E731
    assert bool(torch.isfinite(got).all()) and err(got) <= 2 * err(loop) + 1e-7


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="tables are read on CUDA only")
def test_experts_on_cuda_take_the_devices_table(tmp_path, monkeypatch):
    """A table for this GPU in $VLLM_TUNED_CONFIG_FOLDER: the fused ``Experts`` forward launches its
    entry (row block and tiles), and the result stays within twice the torch loop's error as the default."""
    import kvserve.kernels.triton_moe as tm
    from kvserve.models.qwen3_next import Experts

    e, hidden, inter, tokens, k = 16, 128, 64, 24, 4
    launch = mc.MoELaunch(32, MoETiles(32, 64, 4, 2))
    name = mc.config_file_name(e, inter, torch.cuda.get_device_name(), mc.config_dtype(torch.bfloat16))
    (tmp_path / name).write_text(json.dumps({"1": ENTRY, str(tokens): launch.to_json()}))
    monkeypatch.setenv("VLLM_TUNED_CONFIG_FOLDER", str(tmp_path))
    torch.manual_seed(0)
    mod = Experts(e, hidden, inter).to("cuda", torch.float64)
    with torch.no_grad():
        mod.gate_up_proj.normal_(std=hidden ** -0.5)
        mod.down_proj.normal_(std=inter ** -0.5)
    x = torch.randn(tokens, hidden, device="cuda", dtype=torch.float64)
    top = torch.stack([torch.randperm(e, device="cuda")[:k] for _ in range(tokens)])
    w = torch.softmax(torch.randn(tokens, k, device="cuda", dtype=torch.float64), -1)
    with torch.no_grad():
        want = mod(x, top, w)
        mod = mod.to(torch.bfloat16)
        xb, wb = x.bfloat16(), w.bfloat16()
        loop = mod(xb, top, wb)
        seen = []
        real = tm.grouped_matmul
        monkeypatch.setattr(tm, "grouped_matmul", lambda *a, **kw: seen.append((a[4], kw["tiles"])) or real(*a, **kw))
        mod.fused = True
        got = mod(xb, top, wb)
    assert seen == [(launch.block_m, launch.tiles)] * 2
    err = lambda t: float((t.double() - want).abs().max() / want.abs().max())  # noqa: E731
    assert err(got) <= 2 * err(loop) + 1e-7
