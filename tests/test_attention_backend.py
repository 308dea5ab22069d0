"""``--attention-backend``: vLLM's names (case-insensitive), ``auto`` as vLLM's selector picks on the
device / dtype / KV dtype / head size, the errors and log lines, and the read each choice gives the
layers (``kvserve.attention_backend``)."""

from __future__ import annotations

import argparse

import pytest
import torch

from kvserve.arg_utils import add_engine_args
from kvserve.attention_backend import AttentionBackend, resolve_attention_backend
from kvserve.config import EngineArgs
from kvserve.quant.kv_cache_dtype import KVCacheDtype

CPU, CUDA = torch.device("cpu"), torch.device("cuda")
BF16, FP32 = torch.bfloat16, torch.float32
KV = {name: KVCacheDtype(name, "test") for name in ("bfloat16", "float32", "fp8_e4m3", "fp8", "fp8_e5m2")}


@pytest.fixture
def capability(monkeypatch):
    """Pretend a CUDA device of the given compute capability (the resolution asks only that)."""
    def set_to(cap: tuple[int, int]) -> None:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: cap)
    return set_to


def _resolve(name, device=CUDA, dtype=BF16, kv="bfloat16", head=128) -> AttentionBackend:
    return resolve_attention_backend(name, device, dtype, KV[kv], head)


def test_auto_off_cuda_is_the_reference(kvlog):
    assert _resolve("auto", CPU, kv="fp8_e4m3") == AttentionBackend("reference", "reference")
    assert kvlog.count("Using the reference attention backend (plain torch) on cpu.") == 1
    assert _resolve("reference", CUDA, kv="fp8_e4m3") == AttentionBackend("reference", "reference")


@pytest.mark.parametrize("dtype,kv,head,want", [
    (BF16, "bfloat16", 128, AttentionBackend("FLASH_ATTN", "triton")),
    (BF16, "fp8_e4m3", 128, AttentionBackend("FLASH_ATTN", "triton", True, 8)),
    (BF16, "fp8", 256, AttentionBackend("FLASH_ATTN", "triton", True, 8)),  # Qwen3.6's head
    (torch.float16, "fp8_e4m3", 64, AttentionBackend("FLASH_ATTN", "triton", True, 8)),
    (BF16, "fp8_e5m2", 128, AttentionBackend("TRITON_ATTN", "triton")),  # FA3: e4m3 only; pages dequantized
    (FP32, "fp8_e4m3", 128, AttentionBackend("TRITON_ATTN", "triton", True, 0)),  # FA: no float32
    (FP32, "float32", 128, AttentionBackend("TRITON_ATTN", "triton")),
    (BF16, "fp8_e4m3", 512, AttentionBackend("TRITON_ATTN", "triton", True, 0)),  # FA3: head <= 256
    (BF16, "fp8_e4m3", 100, AttentionBackend("TRITON_ATTN", "triton", True, 0)),  # FA3: multiple of 8
])
def test_auto_on_hopper_is_vllms_choice(capability, kvlog, dtype, kv, head, want):
    capability((9, 0))
    got = _resolve("auto", dtype=dtype, kv=kv, head=head)
    assert got == want
    assert kvlog.count(f"Using {want.name} attention backend out of potential backends: "
                       "['FLASH_ATTN', 'TRITON_ATTN'].") == 1
    assert (kvlog.count("the query is quantized to fp8_e4m3") == 1) == want.query_fp8


def test_auto_before_hopper_takes_triton_attn_for_fp8(capability):
    """vLLM: FA2 (sm_80 / sm_89) has no fp8, so fp8 pages go to TRITON_ATTN, which quantizes the query on CUDA."""
    capability((8, 9))
    assert _resolve("auto", kv="fp8_e4m3") == AttentionBackend("TRITON_ATTN", "triton", True, 0)
    assert _resolve("auto", kv="bfloat16") == AttentionBackend("FLASH_ATTN", "triton")


@pytest.mark.parametrize("spelling,name", [("flash_attn", "FLASH_ATTN"), ("Triton_Attn", "TRITON_ATTN"),
                                           ("TRITON", "triton"), ("Reference", "reference")])
def test_names_are_case_insensitive(capability, spelling, name):
    capability((9, 0))
    assert _resolve(spelling, kv="fp8_e4m3").name == name


def test_explicit_choices_and_their_reads(capability, kvlog):
    capability((9, 0))
    assert _resolve("triton", kv="fp8_e4m3") == AttentionBackend("triton", "triton")  # kvserve's dequantizing read
    assert _resolve("TRITON_ATTN", kv="fp8_e4m3") == AttentionBackend("TRITON_ATTN", "triton", True, 0)
    assert _resolve("TRITON_ATTN", kv="fp8_e5m2") == AttentionBackend("TRITON_ATTN", "triton")
    assert kvlog.count("Using TRITON_ATTN backend.") == 2
    assert kvlog.count("fp8_e5m2 KV cache with TRITON_ATTN: the pages are read dequantized") == 1
    assert _resolve("FLASH_ATTN", kv="float32", dtype=torch.float16) == AttentionBackend("FLASH_ATTN", "triton")


@pytest.mark.parametrize("cap,dtype,kv,head,reasons", [
    ((9, 0), FP32, "fp8_e4m3", 128, "['dtype not supported']"),
    ((9, 0), BF16, "fp8_e5m2", 128, "['kv_cache_dtype not supported']"),
    ((8, 9), BF16, "fp8_e4m3", 128, "['kv_cache_dtype not supported']"),
    ((9, 0), FP32, "bfloat16", 320, "['dtype not supported', 'head_size not supported']"),
])
def test_flash_attn_refuses_what_vllm_refuses(capability, cap, dtype, kv, head, reasons):
    capability(cap)
    with pytest.raises(ValueError) as err:
        _resolve("FLASH_ATTN", dtype=dtype, kv=kv, head=head)
    assert str(err.value) == f"Selected backend FLASH_ATTN is not valid for this configuration. Reason: {reasons}"


def test_unknown_names_and_triton_off_cuda(monkeypatch):
    with pytest.raises(ValueError, match=r"Unknown attention backend: 'flash'. Valid options are: \['auto', "
                                         r"'reference', 'triton', 'FLASH_ATTN', 'TRITON_ATTN'\]"):
        _resolve("flash", CPU)
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    for name in ("triton", "FLASH_ATTN", "TRITON_ATTN"):
        with pytest.raises(ValueError, match=f"--attention-backend {name} needs a CUDA device, got device 'cpu'"):
            _resolve(name, CPU, kv="fp8_e4m3")
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the interpreter stands in for a Hopper GPU
    assert _resolve("FLASH_ATTN", CPU, kv="fp8_e4m3") == AttentionBackend("FLASH_ATTN", "triton", True, 8)


def test_command_line_spellings():
    p = argparse.ArgumentParser()
    add_engine_args(p)
    assert p.parse_args(["--attention-backend", "flash_attn"]).attention_backend == "FLASH_ATTN"
    assert p.parse_args([]).attention_backend == "auto"
    with pytest.raises(SystemExit):
        p.parse_args(["--attention-backend", "FLASHINFER"])


def test_engine_config_carries_the_choice_to_the_layers(tiny, monkeypatch):
    """EngineArgs -> RunnerConfig -> each attention layer's CacheQuant (the interpreter as the device)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    cfg = EngineArgs(model=str(tiny), device="cpu", kv_cache_memory=1 << 22, kv_cache_dtype="fp8_e4m3",
                     attention_backend="TRITON_ATTN").create_engine_config()
    assert cfg.runner_config.attention == AttentionBackend("TRITON_ATTN", "triton", True, 0)
    assert cfg.runner_config.attention_backend == "triton"
    cfg = EngineArgs(model=str(tiny), device="cpu", kv_cache_memory=1 << 22).create_engine_config()
    assert cfg.runner_config.attention == AttentionBackend("reference", "reference")
