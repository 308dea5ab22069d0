"""ModelOpt quantization config (issue 15, item 1): both file forms, the per-module scheme rules
(vLLM's ``is_layer_excluded`` / ``ModelOptMixedPrecisionConfig``), ``--quantization`` as vLLM's
``ModelConfig._verify_quantization``, and the engine's early error for quantized weights.

Reference: /work/shared/docs/reference/hybrid-gdn-models.md sections 4.1, 4.5, 4.6."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from fp8_checkpoints import CT_QUANT_CONFIG, MODELOPT_QUANT_CONFIG, make_fp8_checkpoint
from kvserve.choices import KVSERVE_QUANTIZATION_METHODS, QUANTIZATION_CHOICES
from kvserve.config import EngineArgs
from kvserve.quant.kv_cache_dtype import read_quant_config
from kvserve.quant.modelopt import LayerQuant, ModelOptConfig, read_modelopt_config

KV_MEM = 1 << 22
ACCEPTED_ALGOS = "['FP8', 'NVFP4', 'W4A16_NVFP4', 'MIXED_PRECISION']"
LEGACY = "hf_quant_config.json"
INLINE = "config.json quantization_config"
PRODUCER = {"name": "modelopt", "version": "0.45.0"}
KV_FP8_SCHEME = {"dynamic": False, "num_bits": 8, "type": "float"}
NVFP4_GROUP = {
    "weights": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
    "input_activations": {"dynamic": False, "num_bits": 4, "type": "float", "group_size": 16},
    "targets": ["Linear"],
}
MIXED_LAYERS = {
    "model.language_model.layers.0.mlp.down_proj": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
    "model.language_model.layers.3.self_attn.q_proj": {"quant_algo": "FP8"},
    "model.language_model.layers.3.self_attn.k_proj": {"quant_algo": "FP8"},
    "model.language_model.layers.3.self_attn.v_proj": {"quant_algo": "FP8"},
    "lm_head": {"quant_algo": "W4A16_NVFP4", "group_size": 16},
}


# ---- helpers ---------------------------------------------------------------------------------
def _read(tmp_path: Path, config: dict | None = None, legacy: dict | None = None) -> ModelOptConfig | None:
    raw = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    if config is not None:
        raw["quantization_config"] = config
    (tmp_path / "config.json").write_text(json.dumps(raw))
    if legacy is not None:
        (tmp_path / LEGACY).write_text(json.dumps(legacy))
    return read_modelopt_config(tmp_path, json.loads((tmp_path / "config.json").read_text()))


def _legacy(**quantization) -> dict:
    return {"producer": PRODUCER, "quantization": quantization}


def _inline(**fields) -> dict:
    return {"quant_method": "modelopt", "producer": PRODUCER, **fields}


def _single(algo: str = "NVFP4", *exclude: str) -> ModelOptConfig:
    return ModelOptConfig(algo, "modelopt_fp4", 16, tuple(exclude), {}, "FP8", LEGACY)


def _mixed(layers: dict[str, dict]) -> ModelOptConfig:
    return ModelOptConfig(
        "MIXED_PRECISION", "modelopt_mixed", 16, (),
        {k: LayerQuant(v["quant_algo"], v.get("group_size", 16)) for k, v in layers.items()}, "FP8", INLINE,
    )


QKV = ("q_proj", "k_proj", "v_proj")
NVFP4_16 = LayerQuant("NVFP4", 16)


# ---- the two file forms ----------------------------------------------------------------------
def test_legacy_hf_quant_config_nvfp4(tmp_path):
    cfg = _read(tmp_path, legacy=_legacy(quant_algo="NVFP4", kv_cache_quant_algo="FP8", group_size=16,
                                         exclude_modules=["lm_head", "model.visual*", "mtp*"]))
    assert cfg == ModelOptConfig("NVFP4", "modelopt_fp4", 16, ("lm_head", "model.visual*", "mtp*"), {}, "FP8", LEGACY)
    assert cfg.quantizes_weights


def test_config_json_compressed_tensors_shaped_nvfp4(tmp_path):
    cfg = _read(tmp_path, config=_inline(quant_algo="NVFP4", config_groups={"group_0": NVFP4_GROUP},
                                         ignore=["lm_head", "model.visual*"], kv_cache_scheme=KV_FP8_SCHEME))
    # no top-level group_size in this form: 16
    assert cfg == ModelOptConfig("NVFP4", "modelopt_fp4", 16, ("lm_head", "model.visual*"), {}, "FP8", INLINE)


def test_config_json_takes_precedence_over_hf_quant_config(tmp_path):
    cfg = _read(tmp_path, config=_inline(quant_algo="FP8"), legacy=_legacy(quant_algo="NVFP4", group_size=16,
                                                                          kv_cache_quant_algo=None, exclude_modules=[]))
    assert (cfg.quant_algo, cfg.source) == ("FP8", INLINE)


def test_read_quant_config_finds_either_file(tmp_path):
    assert read_quant_config(tmp_path, {}) == (None, "")
    assert read_quant_config(tmp_path, {"quantization_config": {"quant_method": "fp8"}}) == ({"quant_method": "fp8"}, INLINE)
    (tmp_path / LEGACY).write_text(json.dumps(MODELOPT_QUANT_CONFIG))
    assert read_quant_config(tmp_path, {}) == (MODELOPT_QUANT_CONFIG, LEGACY)


@pytest.mark.parametrize("algo, method", [
    ("FP8", "modelopt"), ("NVFP4", "modelopt_fp4"), ("W4A16_NVFP4", "modelopt_fp4"), ("MIXED_PRECISION", "modelopt_mixed"),
])
@pytest.mark.parametrize("form", ["legacy", "inline"])
def test_each_algo_and_its_vllm_method_name(tmp_path, algo, method, form):
    fields = dict(quant_algo=algo.lower(), kv_cache_quant_algo=None, group_size=16, exclude_modules=[])
    if algo == "MIXED_PRECISION":
        fields["quantized_layers"] = MIXED_LAYERS
    cfg = _read(tmp_path, legacy=_legacy(**fields)) if form == "legacy" else _read(tmp_path, config=_inline(**fields))
    assert (cfg.quant_algo, cfg.method, cfg.group_size) == (algo, method, 16)  # quant_algo upper-cased


def test_group_size_explicit_and_default(tmp_path):
    assert _read(tmp_path, legacy=_legacy(quant_algo="NVFP4", group_size=32, kv_cache_quant_algo=None,
                                          exclude_modules=[])).group_size == 32
    assert _read(tmp_path, config=_inline(quant_algo="FP8")).group_size == 16
    assert _read(tmp_path, config=_inline(quant_algo="NVFP4", group_size="32")).group_size == 32


def test_mixed_precision_group_size_and_layers(tmp_path):
    layers = {"a.fp8": {"quant_algo": "fp8"}, "a.w4": {"quant_algo": "W4A16_NVFP4", "group_size": 32}}
    cfg = _read(tmp_path, config=_inline(quant_algo="MIXED_PRECISION", quantized_layers=layers))
    assert cfg.group_size == 32  # vLLM: the first NVFP4-family layer's
    assert cfg.quantized_layers == {"a.fp8": LayerQuant("FP8", 16), "a.w4": LayerQuant("W4A16_NVFP4", 32)}
    assert cfg.exclude_modules == () and cfg.kv_cache_quant_algo is None


def test_kv_cache_only_modelopt_checkpoint(tmp_path):
    """quant_algo null (the fp8-KV fixtures): recognised, weights stay unquantized everywhere."""
    cfg = _read(tmp_path, legacy=MODELOPT_QUANT_CONFIG)
    assert cfg == ModelOptConfig(None, "modelopt", 16, ("lm_head",), {}, "FP8", LEGACY)
    assert not cfg.quantizes_weights
    assert cfg.layer_quant("model.layers.0.mlp.down_proj") is None
    inline = _read(tmp_path, config={"quant_method": "modelopt", **MODELOPT_QUANT_CONFIG["quantization"]})
    assert (inline.quant_algo, inline.method, inline.kv_cache_quant_algo, inline.exclude_modules) == (
        None, "modelopt", "FP8", ("lm_head",))


def test_kv_cache_scheme_other_than_fp8_is_no_kv_algo(tmp_path):
    cfg = _read(tmp_path, config=_inline(quant_algo="FP8", kv_cache_scheme={"num_bits": 4, "type": "float"}))
    assert cfg.kv_cache_quant_algo is None


@pytest.mark.parametrize("qc", [None, CT_QUANT_CONFIG, {"quant_method": "fp8"}])
def test_not_a_modelopt_checkpoint_is_none(tmp_path, qc):
    assert _read(tmp_path, config=qc) is None


@pytest.mark.parametrize("algo", ["FP8_PER_CHANNEL_PER_TOKEN", "FP8_PB_WO", "MXFP8"])
def test_vllm_algos_kvserve_does_not_run_yet(tmp_path, algo):
    with pytest.raises(ValueError) as e:
        _read(tmp_path, config=_inline(quant_algo=algo.lower()))
    assert str(e.value) == (f"ModelOpt quant_algo '{algo}' in {INLINE} is not supported by kvserve yet "
                            f"(vLLM runs it). kvserve supports: {ACCEPTED_ALGOS}.")


@pytest.mark.parametrize("where, fields, message", [
    ("legacy", dict(quant_algo="INT4_AWQ", group_size=128),
     f"ModelOpt quant_algo 'INT4_AWQ' in {LEGACY} is not supported. kvserve supports: {ACCEPTED_ALGOS}."),
    ("inline", dict(quant_algo="MIXED_PRECISION"),
     "MIXED_PRECISION quant_algo requires a non-empty 'quantized_layers' mapping in the quantization config."),
    ("inline", dict(quant_algo="MIXED_PRECISION", quantized_layers={"x.y": {"quant_algo": "INT8"}}),
     f"quant_algo 'INT8' of layer 'x.y' in {INLINE} quantized_layers is not supported. "
     "kvserve supports per layer: ['FP8', 'NVFP4', 'W4A16_NVFP4']."),
    ("legacy", dict(quant_algo="NVFP4"),
     "NVFP4 quantization requires the following fields in hf_quant_config.json: "
     "['group_size', 'kv_cache_quant_algo', 'exclude_modules']"),
    ("inline", dict(quant_algo="FP8", ignore="lm_head"), "exclude_modules must be a list, got <class 'str'>"),
], ids=["unknown-algo", "mixed-without-layers", "mixed-unknown-layer-algo", "legacy-nvfp4-fields", "ignore-not-a-list"])
def test_malformed_configs_name_the_value(tmp_path, where, fields, message):
    with pytest.raises(ValueError) as e:
        _read(tmp_path, **({"legacy": _legacy(**fields)} if where == "legacy" else {"config": _inline(**fields)}))
    assert str(e.value) == message


# ---- MIXED_PRECISION lookups -----------------------------------------------------------------
def test_mixed_lookup_plain_and_multimodal_aliases():
    cfg = _mixed({**MIXED_LAYERS, "model.layers.5.mlp.up_proj": {"quant_algo": "NVFP4"}})
    w4 = LayerQuant("W4A16_NVFP4", 16)
    assert cfg.layer_quant("model.language_model.layers.0.mlp.down_proj") == w4  # the HF name itself
    assert cfg.layer_quant("model.layers.0.mlp.down_proj") == w4  # kvserve's name of it
    assert cfg.layer_quant("language_model.model.layers.0.mlp.down_proj") == w4
    assert cfg.layer_quant("model.language_model.layers.5.mlp.up_proj") == NVFP4_16  # the other way round


def test_mixed_lookup_lm_head():
    cfg = _mixed(MIXED_LAYERS)
    assert cfg.layer_quant("lm_head") == LayerQuant("W4A16_NVFP4", 16)
    assert cfg.layer_quant("language_model.lm_head") == LayerQuant("W4A16_NVFP4", 16)


def test_mixed_lookup_absent_is_unquantized():
    cfg = _mixed(MIXED_LAYERS)
    assert cfg.layer_quant("model.layers.0.linear_attn.conv1d") is None
    assert cfg.layer_quant("model.layers.0.mlp.gate_up_proj", ("gate_proj", "up_proj")) is None


def test_mixed_lookup_parent_module_takes_its_childrens_entry():
    cfg = _mixed({"model.language_model.layers.0.mlp.experts.0.gate_proj": {"quant_algo": "NVFP4"}})
    assert cfg.layer_quant("model.layers.0.mlp.experts") == NVFP4_16


def test_mixed_fused_shards_agreeing():
    assert _mixed(MIXED_LAYERS).layer_quant("model.layers.3.self_attn.qkv_proj", QKV) == LayerQuant("FP8", 16)


def test_mixed_fused_shards_disagreeing_is_vllms_error():
    layers = {**MIXED_LAYERS, "model.language_model.layers.3.self_attn.v_proj": {"quant_algo": "W4A16_NVFP4"}}
    with pytest.raises(ValueError) as e:
        _mixed(layers).layer_quant("model.layers.3.self_attn.qkv_proj", QKV)
    assert str(e.value) == ("Mixed quant_algo within fused layer model.layers.3.self_attn.qkv_proj: "
                            "{'q_proj': 'FP8', 'k_proj': 'FP8', 'v_proj': 'W4A16_NVFP4'}. "
                            "All shards must use the same quantization.")


def test_mixed_fused_shard_missing_is_an_error():
    layers = {k: v for k, v in MIXED_LAYERS.items() if not k.endswith("v_proj")}
    with pytest.raises(ValueError, match=r"\{'q_proj': 'FP8', 'k_proj': 'FP8', 'v_proj': 'unquantized'\}"):
        _mixed(layers).layer_quant("model.layers.3.self_attn.qkv_proj", QKV)


def test_mixed_fused_shard_group_sizes_differ():
    layers = {"m.gate_proj": {"quant_algo": "NVFP4", "group_size": 16}, "m.up_proj": {"quant_algo": "NVFP4", "group_size": 32}}
    with pytest.raises(ValueError, match=r"\{'gate_proj': 'NVFP4 \(group_size 16\)', 'up_proj': 'NVFP4 \(group_size 32\)'\}"):
        _mixed(layers).layer_quant("m.gate_up_proj", ("gate_proj", "up_proj"))


def test_mixed_does_not_apply_the_vision_rule():
    cfg = _mixed({"model.visual.blocks.0.attn.qkv": {"quant_algo": "FP8"}})
    assert cfg.layer_quant("model.visual.blocks.0.attn.qkv") == LayerQuant("FP8", 16)


# ---- single algo: exclusion ------------------------------------------------------------------
def test_single_algo_quantizes_everything_not_excluded():
    cfg = _single("NVFP4", "lm_head")
    assert cfg.layer_quant("model.layers.0.mlp.down_proj") == NVFP4_16
    assert cfg.layer_quant("model.layers.0.self_attn.qkv_proj", QKV) == NVFP4_16
    assert cfg.layer_quant("lm_head") is None  # exact
    assert _single("FP8").layer_quant("model.layers.0.mlp.down_proj") == LayerQuant("FP8", 16)


def test_exclusion_of_a_fused_module():
    assert _single("NVFP4", "model.layers.0.self_attn.qkv_proj").layer_quant("model.layers.0.self_attn.qkv_proj", QKV) is None
    shards = [f"model.layers.0.self_attn.{s}" for s in QKV]
    assert _single("NVFP4", *shards).layer_quant("model.layers.0.self_attn.qkv_proj", QKV) is None


def test_exclusion_of_some_shards_is_vllms_error():
    with pytest.raises(ValueError) as e:
        _single("NVFP4", "model.layers.0.self_attn.q_proj").layer_quant("model.layers.0.self_attn.qkv_proj", QKV)
    assert str(e.value) == (
        "Detected some but not all shards of model.layers.0.self_attn.qkv_proj are quantized. All shards of fused "
        "layers to have the same precision. Shards ['q_proj', 'k_proj', 'v_proj']; exclude_modules "
        "['model.layers.0.self_attn.q_proj']."
    )


def test_exclusion_substring_legacy():
    cfg = _single("NVFP4", "linear_attn.in_proj_a", "lm_head")
    assert cfg.layer_quant("model.layers.0.linear_attn.in_proj_a") is None
    assert cfg.layer_quant("language_model.lm_head") is None
    assert cfg.layer_quant("model.layers.0.linear_attn.in_proj_b") == NVFP4_16


def test_exclusion_wildcards():
    cfg = _single("NVFP4", "mtp*", "*linear_attn.conv1d*", "model.language_model.layers.3.mlp*",
                  "model.layers.*.self_attn.o_proj")
    assert cfg.layer_quant("mtp") is None and cfg.layer_quant("mtp.fc") is None  # x* = x and everything under it
    assert cfg.layer_quant("mtpx") == NVFP4_16  # ... not its siblings (vLLM's rewrite into x, x.*)
    assert cfg.layer_quant("model.layers.0.linear_attn.conv1d") is None
    assert cfg.layer_quant("model.layers.3.mlp.down_proj") is None  # HF name, kvserve's prefix
    assert cfg.layer_quant("model.layers.3.mlp.gate_up_proj", ("gate_proj", "up_proj")) is None
    assert cfg.layer_quant("model.layers.30.mlp.down_proj") == NVFP4_16
    assert cfg.layer_quant("model.layers.7.self_attn.o_proj") is None  # fnmatch inside the name


@pytest.mark.parametrize("name", ["model.visual.blocks.0.attn.qkv", "vision_tower.encoder.layers.0.fc1",
                                  "model.vision_model.proj"])
def test_vision_modules_are_unquantized(name):
    assert _single("NVFP4").layer_quant(name) is None


# ---- --quantization --------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ckpts(tiny, tmp_path_factory) -> dict[str, Path]:
    """The tiny Llama: plain, KV-only ModelOpt (legacy file), KV-only compressed-tensors, NVFP4 (legacy
    file) and MIXED_PRECISION (config.json)."""
    root = tmp_path_factory.mktemp("modelopt")
    nvfp4 = _legacy(quant_algo="NVFP4", kv_cache_quant_algo="FP8", group_size=16, exclude_modules=["lm_head"])
    mixed = _inline(quant_algo="MIXED_PRECISION", kv_cache_scheme=KV_FP8_SCHEME, ignore=[], quantized_layers={
        f"model.layers.{i}.mlp.{p}": {"quant_algo": "W4A16_NVFP4", "group_size": 16}
        for i in range(2) for p in ("gate_proj", "up_proj", "down_proj")})
    return {
        "plain": tiny,
        "kv-only": make_fp8_checkpoint(tiny, root / "kv-only", "modelopt"),
        "ct-kv-only": make_fp8_checkpoint(tiny, root / "ct-kv-only", "compressed-tensors"),
        "nvfp4": make_fp8_checkpoint(tiny, root / "nvfp4", "modelopt", quant_config=nvfp4),
        "mixed": make_fp8_checkpoint(tiny, root / "mixed", "modelopt-inline", quant_config=mixed),
    }


def _config(folder: Path, **kw):
    return EngineArgs(model=str(folder), kv_cache_memory=KV_MEM, **kw).create_engine_config()


@pytest.mark.parametrize("ckpt, requested, method, origin", [
    ("nvfp4", None, "modelopt_fp4", f"the checkpoint ({LEGACY} quant_algo=NVFP4)"),
    ("nvfp4", "modelopt_fp4", "modelopt_fp4", f"the checkpoint ({LEGACY} quant_algo=NVFP4)"),
    ("mixed", None, "modelopt_mixed", f"the checkpoint ({INLINE} quant_algo=MIXED_PRECISION)"),
    ("kv-only", None, "modelopt", f"the checkpoint ({LEGACY} quant_algo=None)"),
    ("kv-only", "modelopt", "modelopt", f"the checkpoint ({LEGACY} quant_algo=None)"),
    ("ct-kv-only", None, "compressed-tensors", f"the checkpoint ({INLINE} quant_method=compressed-tensors)"),
])
def test_quantization_resolves_and_logs_once(ckpts, kvlog, ckpt, requested, method, origin):
    mc = _config(ckpts[ckpt], quantization=requested).model_config
    assert mc.quantization == method
    raw = json.loads((ckpts[ckpt] / "config.json").read_text())
    assert mc.quant_config == read_modelopt_config(ckpts[ckpt], raw)
    assert kvlog.messages(logging.INFO).count(f"quantization={method} (from {origin})") == 1
    assert kvlog.count("quantization=") == 1
    assert kvlog.messages(logging.WARNING) == []


def test_unquantized_checkpoint_without_the_flag(ckpts, kvlog):
    mc = _config(ckpts["plain"]).model_config
    assert (mc.quantization, mc.quant_config) == (None, None)
    assert kvlog.messages(logging.INFO).count("quantization=None (unquantized checkpoint)") == 1


@pytest.mark.parametrize("requested", KVSERVE_QUANTIZATION_METHODS)
def test_flag_on_unquantized_checkpoint_is_vllms_error(ckpts, requested):
    with pytest.raises(ValueError) as e:
        _config(ckpts["plain"], quantization=requested)
    assert str(e.value) == f"Cannot find the config file for {requested}"


def test_checkpoint_algo_overrides_another_modelopt_name(ckpts, kvlog):
    """vLLM's ``override_quantization_method``: a ModelOpt checkpoint's quant_algo decides."""
    assert _config(ckpts["nvfp4"], quantization="modelopt").model_config.quantization == "modelopt_fp4"
    assert kvlog.messages(logging.WARNING) == [
        "--quantization modelopt is overridden by the checkpoint: quant_algo NVFP4 runs as modelopt_fp4."
    ]


@pytest.mark.parametrize("ckpt, requested, declared", [
    ("ct-kv-only", "modelopt_fp4", "compressed-tensors"),
    ("kv-only", "modelopt_mixed", "modelopt"),
])
def test_flag_disagreeing_with_the_checkpoint_is_vllms_error(ckpts, ckpt, requested, declared):
    with pytest.raises(ValueError) as e:
        _config(ckpts[ckpt], quantization=requested)
    assert str(e.value) == (
        f"Quantization method specified in the model config ({declared}) does not match the quantization "
        f"method specified in the `quantization` argument ({requested})."
    )


def test_unknown_flag_is_vllms_error(ckpts):
    with pytest.raises(ValueError) as e:
        _config(ckpts["nvfp4"], quantization="nvfp4")
    assert str(e.value) == f"Unknown quantization method: nvfp4. Must be one of {QUANTIZATION_CHOICES}."


@pytest.mark.parametrize("requested", ["awq", "gptq", "fp8", "compressed-tensors", "modelopt_mxfp8"])
def test_vllm_names_kvserve_does_not_run(ckpts, requested):
    with pytest.raises(ValueError) as e:
        _config(ckpts["nvfp4"], quantization=requested)
    assert str(e.value) == (
        f"Quantization method {requested} is not supported by kvserve. kvserve accepts: "
        "['modelopt', 'modelopt_fp4', 'modelopt_mixed'] (ModelOpt checkpoints)."
    )


def test_cli_flag_and_its_short_form():
    from kvserve.entrypoints.cli import build_parser

    p = build_parser()
    assert p.parse_args(["generate", "hi"]).quantization is None
    assert p.parse_args(["generate", "hi", "-q", "modelopt_fp4"]).quantization == "modelopt_fp4"
    assert p.parse_args(["serve", "--quantization", "awq"]).quantization == "awq"  # vLLM's choices; the engine refuses
    with pytest.raises(SystemExit) as e:
        p.parse_args(["generate", "hi", "--quantization", "bogus"])
    assert e.value.code == 2


# ---- the engine ------------------------------------------------------------------------------
def test_kv_only_modelopt_checkpoint_still_loads_and_runs(ckpts):
    from kvserve import LLM, SamplingParams

    llm = LLM(str(ckpts["kv-only"]), quantization="modelopt", kv_cache_memory=KV_MEM)
    config = llm.llm_engine.config
    assert config.cache_config.cache_dtype == "fp8_e4m3"
    assert config.model_config.quantization == "modelopt"
    assert config.model_config.quant_config.kv_cache_quant_algo == "FP8"
    out = llm.generate([[1, 5, 9]], SamplingParams(max_tokens=3, temperature=0.0), use_tqdm=False)
    assert len(out[0].outputs[0].token_ids) == 3
