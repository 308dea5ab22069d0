"""``--kv-cache-dtype``: accepted values, storage dtypes, ``auto`` resolution from the checkpoint's
quantization config (vLLM ``resolve_kv_cache_dtype_string`` + compressed-tensors ``kv_cache_scheme``),
the engine's log lines / errors, and the memory planner's page arithmetic.

Reference: /work/shared/docs/reference/vllm-fp8-kv-cache.md sections 1.2, 1.3, 1.4, 5.1."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fp8_checkpoints import CT_QUANT_CONFIG, MODELOPT_QUANT_CONFIG, make_fp8_checkpoint
from kvserve.config import EngineArgs
from kvserve.quant.kv_cache_dtype import (
    KV_CACHE_DTYPE_CHOICES,
    KVCacheDtype,
    KVQuantConfig,
    read_kv_quant_config,
    resolve_kv_cache_dtype,
)

KV_MEM = 1 << 22
ACCEPTED = ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"]
E5M2_ERROR = "fp8_e5m2 kv-cache is not supported with fp8 checkpoints."
STORE_INFO = (
    "Using {} data type to store kv cache. It reduces the GPU memory footprint and boosts the "
    "performance. Meanwhile, it may cause accuracy drop without a proper scaling factor"
)


# ---- helpers ---------------------------------------------------------------------------------
def _folder(tmp_path: Path, config: dict | None = None, hf_quant: dict | None = None) -> tuple[Path, dict]:
    """A folder with config.json (and optionally hf_quant_config.json); returns (folder, raw config)."""
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if config is not None:
        raw["quantization_config"] = config
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if hf_quant is not None:
        (tmp_path / "hf_quant_config.json").write_text(json.dumps(hf_quant))
    return tmp_path, json.loads((tmp_path / "config.json").read_text())


def _read(tmp_path: Path, config: dict | None = None, hf_quant: dict | None = None) -> KVQuantConfig:
    folder, raw = _folder(tmp_path, config, hf_quant)
    return read_kv_quant_config(folder, raw)


def _ct(**scheme) -> dict:
    qc = json.loads(json.dumps(CT_QUANT_CONFIG))
    qc["kv_cache_scheme"].update(scheme)
    return qc


@pytest.fixture(scope="module")
def ckpts(tiny, tmp_path_factory) -> dict[str, Path]:
    """The tiny model in the three fp8 forms (k/v scales 0.5/0.25), plus the plain tiny model."""
    root = tmp_path_factory.mktemp("fp8-dtype")
    out = {"plain": tiny}
    for form in ("modelopt", "modelopt-inline", "compressed-tensors"):
        out[form] = make_fp8_checkpoint(tiny, root / form, form, k_scales=[0.5, 0.5], v_scales=[0.25, 0.25])
    return out


def _llm(folder: Path, **kw):
    from kvserve import LLM

    return LLM(str(folder), kv_cache_memory=KV_MEM, **kw)


# ---- accepted values -------------------------------------------------------------------------
def test_choices_are_exactly_the_supported_values():
    assert KV_CACHE_DTYPE_CHOICES == ACCEPTED


@pytest.mark.parametrize(
    "requested, name, storage, view, fp8_max",
    [
        ("bfloat16", "bfloat16", torch.bfloat16, None, None),
        ("float16", "float16", torch.float16, None, None),
        ("fp8", "fp8", torch.uint8, torch.float8_e4m3fn, 448.0),
        ("fp8_e4m3", "fp8_e4m3", torch.uint8, torch.float8_e4m3fn, 448.0),
        ("fp8_e5m2", "fp8_e5m2", torch.uint8, torch.float8_e5m2, 57344.0),
    ],
)
@pytest.mark.parametrize("model_dtype", [torch.float32, torch.bfloat16])
def test_explicit_value_resolves_to_its_storage(requested, name, storage, view, fp8_max, model_dtype):
    d = resolve_kv_cache_dtype(requested, model_dtype, KVQuantConfig())
    assert d.name == name
    assert d.origin == "--kv-cache-dtype"
    assert d.storage_dtype == storage
    assert d.fp8_dtype == view
    assert d.is_fp8 is (fp8_max is not None)
    if fp8_max is not None:
        assert d.fp8_max == fp8_max


@pytest.mark.parametrize(
    "model_dtype, name", [(torch.float32, "float32"), (torch.bfloat16, "bfloat16"), (torch.float16, "float16")]
)
def test_auto_is_the_model_dtype(model_dtype, name):
    d = resolve_kv_cache_dtype("auto", model_dtype, KVQuantConfig())
    assert (d.name, d.origin, d.storage_dtype, d.is_fp8, d.fp8_dtype) == (
        name, "auto: the model dtype", model_dtype, False, None,
    )


@pytest.mark.parametrize("bad", ["fp8_inc", "fp8_ds_mla", "nvfp4", "int8", "FP8", "", "float32", "turboquant_k8v4"])
def test_rejected_values_name_the_value_and_the_choices(bad):
    with pytest.raises(ValueError) as e:
        resolve_kv_cache_dtype(bad, torch.float32, KVQuantConfig())
    msg = str(e.value)
    assert msg == f"kv_cache_dtype {bad!r} is not supported. kvserve accepts: {ACCEPTED}"


def test_rejected_value_through_engine_args(tiny):
    with pytest.raises(ValueError, match=r"kv_cache_dtype 'nvfp4' is not supported\. kvserve accepts: \["):
        EngineArgs(model=str(tiny), kv_cache_dtype="nvfp4", kv_cache_memory=KV_MEM).create_engine_config()


def test_cli_rejects_nvfp4_with_exit_code_2():
    res = subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "generate", "--kv-cache-dtype", "nvfp4", "hi"],
        capture_output=True, text=True, timeout=120,
    )
    assert res.returncode == 2
    assert res.stdout == ""
    last = res.stderr.strip().splitlines()[-1]
    assert "--kv-cache-dtype" in last and "invalid choice: 'nvfp4'" in last
    for choice in ACCEPTED:
        assert f"'{choice}'" in last
    assert "Traceback" not in res.stderr


# ---- read_kv_quant_config --------------------------------------------------------------------
def test_no_quant_config(tmp_path):
    assert _read(tmp_path) == KVQuantConfig(None, None, "", None)


@pytest.mark.parametrize("algo", ["FP8", "fp8", "Fp8"])
def test_legacy_hf_quant_config_fp8_kv(tmp_path, algo):
    legacy = json.loads(json.dumps(MODELOPT_QUANT_CONFIG))
    legacy["quantization"]["kv_cache_quant_algo"] = algo
    q = _read(tmp_path, hf_quant=legacy)
    assert q.method == "base"
    assert q.kv_cache_dtype == "fp8_e4m3"
    assert q.quant_method == "modelopt"
    assert q.source == f"hf_quant_config.json kv_cache_quant_algo={algo}"


def test_legacy_hf_quant_config_without_kv_algo(tmp_path):
    legacy = {"producer": {"name": "modelopt", "version": "0.29.0"}, "quantization": {"quant_algo": "FP8"}}
    assert _read(tmp_path, hf_quant=legacy) == KVQuantConfig("base", None, "hf_quant_config.json", "modelopt")


def test_legacy_hf_quant_config_with_null_kv_algo(tmp_path):
    legacy = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": None}}
    assert _read(tmp_path, hf_quant=legacy) == KVQuantConfig("base", None, "hf_quant_config.json", "modelopt")


def test_inline_modelopt_kv_cache_quant_algo(tmp_path):
    q = _read(tmp_path, config={"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "FP8"})
    assert q == KVQuantConfig(
        "base", "fp8_e4m3", "config.json quantization_config kv_cache_quant_algo=FP8", "modelopt"
    )


@pytest.mark.parametrize("quant_method", ["modelopt", "modelopt_fp4", "ModelOpt"])
def test_inline_modelopt_kv_cache_scheme_dict(tmp_path, quant_method):
    q = _read(tmp_path, config={
        "quant_method": quant_method, "quant_algo": "FP8",
        "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False},
    })
    assert q == KVQuantConfig(
        "base", "fp8_e4m3", "config.json quantization_config kv_cache_scheme", quant_method.lower()
    )


def test_inline_modelopt_nested_quantization_section(tmp_path):
    q = _read(tmp_path, config={"quant_method": "modelopt", "quantization": {"kv_cache_quant_algo": "FP8"}})
    assert (q.method, q.kv_cache_dtype) == ("base", "fp8_e4m3")


def test_inline_modelopt_without_kv(tmp_path):
    q = _read(tmp_path, config={"quant_method": "modelopt", "quant_algo": "FP8"})
    assert q == KVQuantConfig("base", None, "config.json quantization_config", "modelopt")


def test_config_json_takes_precedence_over_hf_quant_config(tmp_path):
    q = _read(tmp_path, config={"quant_method": "modelopt", "quant_algo": "FP8"}, hf_quant=MODELOPT_QUANT_CONFIG)
    assert q == KVQuantConfig("base", None, "config.json quantization_config", "modelopt")
    q = _read(tmp_path, config={"quant_method": "awq", "bits": 4}, hf_quant=MODELOPT_QUANT_CONFIG)
    assert q == KVQuantConfig(None, None, "config.json quantization_config", "awq")


@pytest.mark.parametrize("algo", ["INT8", "NVFP4", "fp8_e5m2"])
def test_unknown_kv_algo_is_an_error_naming_it(tmp_path, algo):
    with pytest.raises(ValueError) as e:
        _read(tmp_path, config={"quant_method": "modelopt", "kv_cache_quant_algo": algo})
    assert str(e.value) == (
        f"Unknown kv_cache_quant_algo {algo!r} in config.json quantization_config. Supported values: ['FP8']."
    )


def test_unknown_kv_algo_in_legacy_file(tmp_path):
    legacy = {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8", "kv_cache_quant_algo": "INT8"}}
    with pytest.raises(ValueError, match=r"Unknown kv_cache_quant_algo 'INT8' in hf_quant_config\.json"):
        _read(tmp_path, hf_quant=legacy)


@pytest.mark.parametrize("spelling", ["compressed-tensors", "compressed_tensors", "Compressed-Tensors"])
def test_compressed_tensors_kv_cache_scheme(tmp_path, spelling):
    qc = _ct()
    qc["quant_method"] = spelling
    q = _read(tmp_path, config=qc)
    assert q == KVQuantConfig(
        "compressed-tensors", "fp8_e4m3", "config.json quantization_config kv_cache_scheme", "compressed-tensors"
    )


def test_compressed_tensors_without_kv_cache_scheme(tmp_path):
    qc = {k: v for k, v in CT_QUANT_CONFIG.items() if k != "kv_cache_scheme"}
    q = _read(tmp_path, config=qc)
    assert q == KVQuantConfig("compressed-tensors", None, "config.json quantization_config", "compressed-tensors")
    qc["kv_cache_scheme"] = None
    assert _read(tmp_path, config=qc).kv_cache_dtype is None


def test_compressed_tensors_attn_head_strategy_is_an_error(tmp_path):
    with pytest.raises(ValueError) as e:
        _read(tmp_path, config=_ct(strategy="attn_head"))
    msg = str(e.value)
    assert msg.startswith("Only support per-tensor scaling factor for compressed-tensors KV cache.")
    assert "strategy='attn_head'" in msg


def test_compressed_tensors_asymmetric_is_an_error(tmp_path):
    with pytest.raises(ValueError, match=r"symmetric=False"):
        _read(tmp_path, config=_ct(symmetric=False))


@pytest.mark.parametrize(
    "scheme", [{"num_bits": 4}, {"type": "int"}, {"dynamic": True}], ids=["num_bits4", "int", "dynamic"]
)
def test_bad_kv_cache_scheme_is_an_error(tmp_path, scheme):
    with pytest.raises(ValueError, match=r"^Unknown kv_cache_scheme \{.*\} in config\.json quantization_config\."):
        _read(tmp_path, config=_ct(**scheme))
    modelopt = {"quant_method": "modelopt", "kv_cache_scheme": {"num_bits": 8, "type": "float", "dynamic": False, **scheme}}
    with pytest.raises(ValueError, match=r"^Unknown kv_cache_scheme"):
        _read(tmp_path, config=modelopt)


def test_fp8_quant_method_never_sets_the_cache_dtype(tmp_path):
    """Even with KV keys present, an Fp8Config checkpoint leaves ``auto`` alone (vLLM's TODO)."""
    q = _read(tmp_path, config={"quant_method": "fp8", "kv_cache_quant_algo": "FP8"})
    assert q == KVQuantConfig("base", None, "config.json quantization_config", "fp8")


def test_kv_cache_scheme_must_say_static(tmp_path):
    """vLLM requires ``dynamic is False``; a scheme without the key is not an fp8 cache."""
    modelopt = {"quant_method": "modelopt", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    with pytest.raises(ValueError, match=r"^Unknown kv_cache_scheme"):
        _read(tmp_path, config=modelopt)


def test_fp8_quant_method_without_kv_is_base(tmp_path):
    """vLLM's Fp8Config returns Fp8KVCacheMethod (BaseKVCacheMethod rules) but never sets the cache dtype."""
    q = _read(tmp_path, config={"quant_method": "fp8", "activation_scheme": "static"})
    assert q == KVQuantConfig("base", None, "config.json quantization_config", "fp8")


@pytest.mark.parametrize("method", ["gguf", "awq", "gptq", "bitsandbytes"])
def test_other_quant_methods_do_not_touch_the_cache(tmp_path, method):
    q = _read(tmp_path, config={"quant_method": method, "kv_cache_quant_algo": "FP8"})
    assert q == KVQuantConfig(None, None, "config.json quantization_config", method)


def test_fp8_checkpoint_fixture_forms(ckpts):
    """What read_kv_quant_config makes of the three forms the fixture builder writes."""
    def read(form):
        folder = ckpts[form]
        return read_kv_quant_config(folder, json.loads((folder / "config.json").read_text()))

    assert read("plain") == KVQuantConfig()
    assert read("modelopt") == KVQuantConfig("base", "fp8_e4m3", "hf_quant_config.json kv_cache_quant_algo=FP8", "modelopt")
    assert read("modelopt-inline") == KVQuantConfig(
        "base", "fp8_e4m3", "config.json quantization_config kv_cache_quant_algo=FP8", "modelopt"
    )
    assert read("compressed-tensors") == KVQuantConfig(
        "compressed-tensors", "fp8_e4m3", "config.json quantization_config kv_cache_scheme", "compressed-tensors"
    )


# ---- resolve against the checkpoint ----------------------------------------------------------
CKPT_FP8 = KVQuantConfig("base", "fp8_e4m3", "hf_quant_config.json kv_cache_quant_algo=FP8", "modelopt")
CKPT_NO_KV = KVQuantConfig("base", None, "hf_quant_config.json", "modelopt")


@pytest.mark.parametrize("requested", ["bfloat16", "float16", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("quant", [CKPT_FP8, CKPT_NO_KV], ids=["fp8-kv", "no-kv"])
def test_explicit_value_wins_over_the_checkpoint(requested, quant):
    assert resolve_kv_cache_dtype(requested, torch.float32, quant) == KVCacheDtype(requested, "--kv-cache-dtype")


def test_auto_takes_the_checkpoint_fp8():
    d = resolve_kv_cache_dtype("auto", torch.bfloat16, CKPT_FP8)
    assert d == KVCacheDtype("fp8_e4m3", "the checkpoint (hf_quant_config.json kv_cache_quant_algo=FP8)")
    assert d.storage_dtype == torch.uint8 and d.fp8_dtype == torch.float8_e4m3fn


def test_auto_with_a_checkpoint_without_kv_is_the_model_dtype():
    assert resolve_kv_cache_dtype("auto", torch.bfloat16, CKPT_NO_KV) == KVCacheDtype("bfloat16", "auto: the model dtype")


# ---- engine config: log lines, override warning, e5m2 error ----------------------------------
@pytest.mark.parametrize(
    "form, source",
    [
        ("modelopt", "hf_quant_config.json kv_cache_quant_algo=FP8"),
        ("modelopt-inline", "config.json quantization_config kv_cache_quant_algo=FP8"),
        ("compressed-tensors", "config.json quantization_config kv_cache_scheme"),
    ],
)
def test_engine_config_auto_on_fp8_checkpoint(ckpts, kvlog, form, source):
    config = EngineArgs(model=str(ckpts[form]), kv_cache_memory=KV_MEM).create_engine_config()
    cc = config.cache_config
    assert cc.cache_dtype == "fp8_e4m3"
    assert cc.kv_dtype == KVCacheDtype("fp8_e4m3", f"the checkpoint ({source})")
    assert config.model_config.dtype == torch.float32  # the model stays fp32; only the cache is fp8
    info = kvlog.messages(logging.INFO)
    assert info.count(f"kv_cache_dtype=fp8_e4m3 (from the checkpoint ({source}))") == 1
    assert info.count(STORE_INFO.format("fp8_e4m3")) == 1
    assert kvlog.count("kv_cache_dtype=") == 1
    assert kvlog.messages(logging.WARNING) == []


def test_engine_config_plain_model(ckpts, kvlog):
    cc = EngineArgs(model=str(ckpts["plain"]), kv_cache_memory=KV_MEM).create_engine_config().cache_config
    assert cc.kv_dtype == KVCacheDtype("float32", "auto: the model dtype")
    assert cc.kv_quant == KVQuantConfig()
    assert kvlog.messages(logging.INFO).count("kv_cache_dtype=float32 (from auto: the model dtype)") == 1
    assert kvlog.count("data type to store kv cache") == 0


def test_engine_config_auto_with_bf16_model(ckpts, kvlog):
    cc = EngineArgs(model=str(ckpts["plain"]), dtype="bfloat16", kv_cache_memory=KV_MEM).create_engine_config().cache_config
    assert (cc.cache_dtype, cc.kv_dtype.storage_dtype) == ("bfloat16", torch.bfloat16)


@pytest.mark.parametrize("name", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_engine_config_explicit_fp8_on_plain_model(ckpts, kvlog, name):
    cc = EngineArgs(model=str(ckpts["plain"]), kv_cache_dtype=name, kv_cache_memory=KV_MEM).create_engine_config().cache_config
    assert cc.kv_dtype == KVCacheDtype(name, "--kv-cache-dtype")
    assert kvlog.messages(logging.INFO).count(f"kv_cache_dtype={name} (from --kv-cache-dtype)") == 1
    assert kvlog.messages(logging.INFO).count(STORE_INFO.format(name)) == 1
    assert kvlog.messages(logging.WARNING) == []


def test_llm_logs_the_resolved_dtype_once_per_engine_start(ckpts, kvlog):
    line = "kv_cache_dtype=fp8_e4m3 (from the checkpoint (hf_quant_config.json kv_cache_quant_algo=FP8))"
    for start in (1, 2):
        llm = _llm(ckpts["modelopt"])
        assert llm.llm_engine.config.cache_config.cache_dtype == "fp8_e4m3"
        assert kvlog.messages(logging.INFO).count(line) == start
        assert kvlog.count("kv_cache_dtype=") == start
        assert kvlog.messages(logging.INFO).count(STORE_INFO.format("fp8_e4m3")) == start


@pytest.mark.parametrize("form", ["modelopt", "compressed-tensors"])
def test_explicit_bfloat16_on_fp8_checkpoint_warns_about_the_override(ckpts, kvlog, form):
    cc = EngineArgs(model=str(ckpts[form]), kv_cache_dtype="bfloat16", kv_cache_memory=KV_MEM).create_engine_config().cache_config
    assert cc.kv_dtype == KVCacheDtype("bfloat16", "--kv-cache-dtype")
    source = read_kv_quant_config(ckpts[form], json.loads((ckpts[form] / "config.json").read_text())).source
    assert kvlog.messages(logging.WARNING) == [
        f"--kv-cache-dtype bfloat16 overrides the checkpoint's KV cache quantization (fp8_e4m3 from {source})."
    ]
    assert kvlog.messages(logging.INFO).count("kv_cache_dtype=bfloat16 (from --kv-cache-dtype)") == 1
    assert kvlog.count("data type to store kv cache") == 0


@pytest.mark.parametrize("flag", ["fp8_e4m3", "fp8"])
def test_explicit_fp8_e4m3_on_fp8_checkpoint_does_not_warn(ckpts, kvlog, flag):
    """``fp8`` is an alias of e4m3: naming it explicitly does not override anything."""
    cc = EngineArgs(model=str(ckpts["modelopt"]), kv_cache_dtype=flag, kv_cache_memory=KV_MEM).create_engine_config().cache_config
    assert cc.kv_dtype == KVCacheDtype(flag, "--kv-cache-dtype")
    assert kvlog.messages(logging.WARNING) == []


@pytest.mark.parametrize("form", ["modelopt", "modelopt-inline", "compressed-tensors"])
def test_fp8_e5m2_on_fp8_checkpoint_is_vllms_error(ckpts, form):
    with pytest.raises(ValueError) as e:
        EngineArgs(model=str(ckpts[form]), kv_cache_dtype="fp8_e5m2", kv_cache_memory=KV_MEM).create_engine_config()
    assert str(e.value) == E5M2_ERROR


def test_fp8_e5m2_on_modelopt_checkpoint_without_kv_is_vllms_error(tmp_path, tiny):
    folder = make_fp8_checkpoint(tiny, tmp_path / "m", "modelopt",
                                 quant_config={"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "FP8"}})
    with pytest.raises(ValueError, match=f"^{E5M2_ERROR}$"):
        EngineArgs(model=str(folder), kv_cache_dtype="fp8_e5m2", kv_cache_memory=KV_MEM).create_engine_config()


def test_fp8_e5m2_through_llm_on_modelopt_checkpoint(ckpts):
    with pytest.raises(ValueError, match=f"^{E5M2_ERROR}$"):
        _llm(ckpts["modelopt"], kv_cache_dtype="fp8_e5m2")


def test_fp8_e5m2_on_plain_checkpoint_works(ckpts, kvlog):
    from kvserve import SamplingParams

    llm = _llm(ckpts["plain"], kv_cache_dtype="fp8_e5m2")
    cc = llm.llm_engine.config.cache_config
    assert cc.kv_dtype == KVCacheDtype("fp8_e5m2", "--kv-cache-dtype")
    layers = llm.llm_engine.runner.model.attention_layers()
    assert all(layer.cache_quant.fp8_dtype == torch.float8_e5m2 and layer.cache_quant.fp8_max == 57344.0
               for layer in layers)
    assert all(layer.kv_cache.dtype == torch.uint8 for layer in layers)
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=4), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 4
    assert kvlog.count("Using KV cache scaling factor 1.0") == 0  # plain checkpoint: no scale method


# ---- memory planner --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def planned(ckpts) -> dict[str, object]:
    """One engine per cache dtype on the same tiny model and the same budget."""
    out = {}
    for name in ("auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2"):
        out[name] = _llm(ckpts["plain"], kv_cache_dtype=name)
    out["ckpt-fp8"] = _llm(ckpts["modelopt"])
    return out


ELEM_BYTES = {"auto": 4, "bfloat16": 2, "float16": 2, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "ckpt-fp8": 1}


def test_float32_is_not_an_explicit_choice(ckpts):
    """vLLM has no 'float32' cache dtype: a float32 cache is reached through auto on an fp32 model."""
    with pytest.raises(ValueError, match="'float32' is not supported"):
        _llm(ckpts["plain"], kv_cache_dtype="float32")


@pytest.mark.parametrize("name", ["auto", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2", "ckpt-fp8"])
def test_page_bytes_and_cache_tensors(planned, name):
    llm = planned[name]
    mc = llm.llm_engine.config.model_config
    cc = llm.llm_engine.config.cache_config
    runner = llm.llm_engine.runner
    spec = runner.kv_spec
    assert (mc.num_layers, mc.num_kv_heads, mc.head_size, cc.block_size) == (2, 2, 16, 16)
    elem = ELEM_BYTES[name]
    page = 2 * cc.block_size * mc.num_kv_heads * mc.head_size * elem
    assert spec.page_bytes == page
    assert spec.block_bytes == page * 2
    assert cc.num_blocks == KV_MEM // (page * 2)
    storage = {"auto": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}.get(name, torch.uint8)
    assert spec.dtype == storage
    assert len(runner.kv_caches) == 2
    for cache, layer in zip(runner.kv_caches, runner.model.attention_layers()):
        assert cache.dtype == storage
        assert tuple(cache.shape) == (cc.num_blocks, 2, cc.block_size, 2, 16)
        assert cache.numel() * cache.element_size() == cc.num_blocks * page
        assert layer.kv_cache is cache
        assert (layer.cache_quant is not None) is (elem == 1)


def test_fp8_holds_exactly_2x_bf16_and_4x_float32_blocks(planned):
    n = {name: llm.llm_engine.config.cache_config.num_blocks for name, llm in planned.items()}
    assert n["auto"] == KV_MEM // (2 * 16 * 2 * 16 * 4 * 2) == 512  # fp32 model: auto = float32
    for fp8 in ("fp8", "fp8_e4m3", "fp8_e5m2", "ckpt-fp8"):
        assert n[fp8] == 2 * n["bfloat16"] == 2 * n["float16"] == 4 * n["auto"] == 2048
