"""Per-layer KV-cache scales from the checkpoint: vLLM's name remapping (``get_cache_scale`` /
``maybe_remap_kv_scale_name``), the after-loading rules of ``BaseKVCacheMethod`` and
``CompressedTensorsKVCacheMethod``, their warnings, and the end-to-end load on a tiny model.

Reference: /work/shared/docs/reference/vllm-fp8-kv-cache.md sections 2.1-2.4."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import pytest
import torch

from fp8_checkpoints import make_fp8_checkpoint
from kvserve.quant.kv_cache_dtype import KVCacheDtype, KVQuantConfig
from kvserve.quant.kv_scales import (
    MSG_KV_PER_TENSOR,
    MSG_KV_SCALE_DEPRECATED,
    MSG_NO_Q_SCALE,
    MSG_QP_PER_TENSOR,
    MSG_SCALE_ONE,
    KVScaleLoader,
)

KV_MEM = 1 << 22
BASE = KVQuantConfig("base", "fp8_e4m3", "hf_quant_config.json kv_cache_quant_algo=FP8", "modelopt")
CT = KVQuantConfig("compressed-tensors", "fp8_e4m3", "config.json quantization_config kv_cache_scheme",
                   "compressed-tensors")
PLAIN = KVQuantConfig()
E4M3 = KVCacheDtype("fp8_e4m3", "test")
FP8 = KVCacheDtype("fp8", "test")
E5M2 = KVCacheDtype("fp8_e5m2", "test")
BF16 = KVCacheDtype("bfloat16", "test")
F32 = KVCacheDtype("float32", "test")
FP8_NAMES = {"fp8_e4m3": E4M3, "fp8": FP8, "fp8_e5m2": E5M2}


def not_loaded(kind: str, name: str, remapped: str) -> str:
    return (
        f"Found {kind} in the checkpoint (e.g. {name}), but not found the expected name in the model "
        f"(e.g. {remapped}). {kind} is not loaded."
    )


def uncalibrated(q: float, prob: float) -> str:
    return (
        f"Using uncalibrated q_scale {q} and/or prob_scale {prob} with fp8 attention. This may cause "
        "accuracy issues. Please make sure q/prob scaling factors are available in the fp8 checkpoint."
    )


def f32(x: float) -> float:
    """``x`` as the float32 a checkpoint stores."""
    return float(torch.tensor(x, dtype=torch.float32))


# ---- fake layers -----------------------------------------------------------------------------
class FakeAttn:
    """Stands in for an attention layer: just the four scale attributes (start at a poison value)."""

    def __init__(self) -> None:
        self.k_scale = self.v_scale = self.q_scale = self.prob_scale = -7.0


def path(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def make_loader(quant: KVQuantConfig, num_layers: int = 2) -> tuple[KVScaleLoader, list[FakeAttn]]:
    layers = [FakeAttn() for _ in range(num_layers)]
    return KVScaleLoader({path(i): layer for i, layer in enumerate(layers)}, quant), layers


def run(quant: KVQuantConfig, kv_dtype: KVCacheDtype, tensors: dict[str, object], num_layers: int = 2):
    """Filter ``tensors`` (name -> float or tensor) through a loader, finish, return the fake layers."""
    loader, layers = make_loader(quant, num_layers)
    weights = [(n, v if isinstance(v, torch.Tensor) else torch.tensor(v, dtype=torch.float32))
               for n, v in tensors.items()]
    assert list(loader.filter(weights)) == []  # every KV scale is taken out of the stream
    loader.finish(kv_dtype)
    return layers


def scales(layer: FakeAttn) -> tuple[float, float, float, float]:
    return layer.k_scale, layer.v_scale, layer.q_scale, layer.prob_scale


# ---- remap: table 2.4 ------------------------------------------------------------------------
REMAP_BASE = [
    # ModelOpt (rule 1): the *scale* letter decides
    ("model.layers.0.self_attn.k_proj.k_scale", "model.layers.0.self_attn.attn.k_scale"),
    ("model.layers.1.self_attn.v_proj.v_scale", "model.layers.1.self_attn.attn.v_scale"),
    ("model.layers.0.self_attn.k_proj.v_scale", "model.layers.0.self_attn.attn.v_scale"),
    # fused QKV (rule 2), Qwen3-MoE qkqkv (rule 3)
    ("model.layers.0.self_attn.qkv_proj.k_scale", "model.layers.0.self_attn.attn.k_scale"),
    ("model.layers.1.self_attn.qkv_proj.v_scale", "model.layers.1.self_attn.attn.v_scale"),
    ("model.layers.0.self_attn.qkqkv_proj.k_scale", "model.layers.0.self_attn.attn.k_scale"),
    ("model.layers.1.self_attn.qkqkv_proj.v_scale", "model.layers.1.self_attn.attn.v_scale"),
    # HYV3 (rules 5, 6)
    ("model.layers.0.self_attn.q.scale", "model.layers.0.self_attn.attn.q_scale"),
    ("model.layers.0.self_attn.k_cache.scale", "model.layers.0.self_attn.attn.k_scale"),
    ("model.layers.1.self_attn.v_cache.scale", "model.layers.1.self_attn.attn.v_scale"),
    # compressed-tensors / fp8 checkpoints (rule 7)
    ("model.layers.0.self_attn.k_scale", "model.layers.0.self_attn.attn.k_scale"),
    ("model.layers.0.self_attn.v_scale", "model.layers.0.self_attn.attn.v_scale"),
    ("model.layers.1.self_attn.q_scale", "model.layers.1.self_attn.attn.q_scale"),
    # already canonical
    ("model.layers.0.self_attn.attn.k_scale", "model.layers.0.self_attn.attn.k_scale"),
    ("model.layers.1.self_attn.attn.v_scale", "model.layers.1.self_attn.attn.v_scale"),
    ("model.layers.0.self_attn.attn.q_scale", "model.layers.0.self_attn.attn.q_scale"),
    ("model.layers.0.self_attn.attn.prob_scale", "model.layers.0.self_attn.attn.prob_scale"),
    # get_cache_scale (output_scale style), only with a quant method
    ("model.layers.0.self_attn.k_proj.output_scale", "model.layers.0.self_attn.attn.k_scale"),
    ("model.layers.1.self_attn.v_proj.output_scale", "model.layers.1.self_attn.attn.v_scale"),
    ("model.layers.0.self_attn.q_proj.output_scale", "model.layers.0.self_attn.attn.q_scale"),
    ("model.layers.1.self_attn.prob_output_scale", "model.layers.1.self_attn.attn.prob_scale"),
]


@pytest.mark.parametrize("quant", [BASE, CT], ids=["base", "compressed-tensors"])
@pytest.mark.parametrize("name, expected", REMAP_BASE, ids=[n for n, _ in REMAP_BASE])
def test_remap_rules(kvlog, quant, name, expected):
    loader, _ = make_loader(quant)
    assert loader.remap(name) == expected
    assert kvlog.warnings() == []


def test_remap_nemotron_mixer_rule(kvlog):
    loader = KVScaleLoader({"model.layers.0.mixer.attn": FakeAttn()}, BASE)
    assert loader.remap("model.layers.0.mixer.k_proj.k_scale") == "model.layers.0.mixer.attn.k_scale"
    assert loader.remap("model.layers.0.mixer.v_proj.v_scale") == "model.layers.0.mixer.attn.v_scale"
    assert kvlog.warnings() == []


@pytest.mark.parametrize("kind", ["k", "v", "q"])
def test_remap_zero_points_for_compressed_tensors(kvlog, kind):
    loader, _ = make_loader(CT)
    name = f"model.layers.1.self_attn.{kind}_zero_point"
    assert loader.remap(name) == f"model.layers.1.self_attn.attn.{kind}_zero_point"
    assert kvlog.warnings() == []


def test_zero_points_without_compressed_tensors_are_dropped(kvlog):
    loader, _ = make_loader(BASE)
    name = "model.layers.0.self_attn.k_zero_point"
    assert loader.remap(name) is None
    assert kvlog.warnings() == [not_loaded("k_zero_point", name, "model.layers.0.self_attn.attn.k_zero_point")]


def test_zero_points_are_taken_and_ignored(kvlog):
    layers = run(CT, E4M3, {"model.layers.0.self_attn.k_zero_point": torch.zeros(1),
                            "model.layers.0.self_attn.k_scale": torch.tensor([0.5])})
    assert scales(layers[0]) == (0.5, 1.0, 1.0, 1.0)
    assert kvlog.warnings() == []


def test_deprecated_kv_scale_remaps_to_k_scale_with_one_warning(kvlog):
    loader, _ = make_loader(BASE)
    assert loader.remap("model.layers.0.self_attn.kv_scale") == "model.layers.0.self_attn.attn.k_scale"
    assert loader.remap("model.layers.1.self_attn.kv_scale") == "model.layers.1.self_attn.attn.k_scale"
    assert kvlog.warnings() == [MSG_KV_SCALE_DEPRECATED]


def test_deprecated_kv_scale_for_a_missing_layer(kvlog):
    loader, _ = make_loader(BASE)
    name = "model.layers.99.self_attn.kv_scale"
    assert loader.remap(name) is None
    assert kvlog.warnings() == [
        MSG_KV_SCALE_DEPRECATED,
        not_loaded("kv_scale", name, "model.layers.99.self_attn.attn.k_scale"),
    ]


@pytest.mark.parametrize(
    "name, kind, remapped",
    [
        ("model.layers.99.self_attn.k_proj.k_scale", "k_scale", "model.layers.99.self_attn.attn.k_scale"),
        ("model.layers.99.self_attn.v_proj.v_scale", "v_scale", "model.layers.99.self_attn.attn.v_scale"),
        ("model.layers.2.self_attn.k_scale", "k_scale", "model.layers.2.self_attn.attn.k_scale"),
        ("model.layers.99.self_attn.q.scale", "q_scale", "model.layers.99.self_attn.attn.q_scale"),
        ("model.layers.99.self_attn.k_cache.scale", "k_scale", "model.layers.99.self_attn.attn.k_scale"),
        # rule 2 only knows k/v: a fused q_scale falls through to rule 7 and is not a model name
        ("model.layers.0.self_attn.qkv_proj.q_scale", "q_scale", "model.layers.0.self_attn.qkv_proj.attn.q_scale"),
    ],
)
def test_names_the_model_lacks_are_dropped_with_a_warning(kvlog, name, kind, remapped):
    loader, _ = make_loader(BASE)
    assert loader.remap(name) is None
    assert loader.remap(name) is None  # the same name again: still dropped, warned once
    assert kvlog.warnings() == [not_loaded(kind, name, remapped)]


@pytest.mark.parametrize(
    "name, kind, remapped",
    [
        ("model.layers.0.self_attn.k_proj.k_scale", "k_scale", "model.layers.0.self_attn.attn.k_scale"),
        ("model.layers.0.self_attn.k_scale", "k_scale", "model.layers.0.self_attn.attn.k_scale"),
        ("model.layers.1.self_attn.q_scale", "q_scale", "model.layers.1.self_attn.attn.q_scale"),
        ("model.layers.0.self_attn.attn.k_scale", "k_scale", "model.layers.0.self_attn.attn.attn.k_scale"),
        ("model.layers.0.self_attn.k_zero_point", "k_zero_point", "model.layers.0.self_attn.attn.k_zero_point"),
    ],
)
def test_without_a_quant_method_every_kv_scale_is_dropped(kvlog, name, kind, remapped):
    loader, _ = make_loader(PLAIN)
    assert loader.remap(name) is None
    assert kvlog.warnings() == [not_loaded(kind, name, remapped)]


def test_without_a_quant_method_output_scales_are_not_kv_scales(kvlog):
    """vLLM's get_cache_scale exists only on a quant config: the name stays as it is."""
    loader, _ = make_loader(PLAIN)
    name = "model.layers.0.self_attn.k_proj.output_scale"
    assert loader.remap(name) == name
    assert kvlog.warnings() == []


def test_output_scale_of_a_missing_layer_is_dropped_with_a_warning(kvlog):
    loader, _ = make_loader(BASE)
    name = "model.layers.99.self_attn.k_proj.output_scale"
    assert loader.remap(name) is None
    assert kvlog.warnings() == [not_loaded("k_scale", name, "model.layers.99.self_attn.attn.k_scale")]


def test_filter_passes_other_weights_through_untouched(kvlog):
    loader, _ = make_loader(BASE)
    emb = torch.randn(4, 3)
    wscale = torch.tensor(0.02)
    iscale = torch.tensor(0.03)
    k = torch.tensor(0.5)
    stream = [
        ("model.embed_tokens.weight", emb),
        ("model.layers.0.self_attn.k_proj.k_scale", k),
        ("model.layers.0.self_attn.q_proj.weight_scale", wscale),  # weight scales: not KV scales
        ("model.layers.0.mlp.down_proj.input_scale", iscale),
        ("model.layers.99.self_attn.k_proj.k_scale", torch.tensor(0.7)),  # dropped with a warning
        ("lm_head.weight", emb),
    ]
    out = list(loader.filter(stream))
    assert [n for n, _ in out] == [
        "model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight_scale",
        "model.layers.0.mlp.down_proj.input_scale", "lm_head.weight",
    ]
    assert out[0][1] is emb and out[1][1] is wscale and out[2][1] is iscale and out[3][1] is emb
    assert set(loader.loaded[path(0)]) == {"k_scale"} and loader.loaded[path(1)] == {}
    assert kvlog.warnings() == [not_loaded("k_scale", "model.layers.99.self_attn.k_proj.k_scale",
                                           "model.layers.99.self_attn.attn.k_scale")]


# ---- finish(): method 'base' -----------------------------------------------------------------
def _kv(k: float | None, v: float | None, num_layers: int = 2) -> dict[str, float]:
    out = {}
    for i in range(num_layers):
        if k is not None:
            out[f"model.layers.{i}.self_attn.k_proj.k_scale"] = k
        if v is not None:
            out[f"model.layers.{i}.self_attn.v_proj.v_scale"] = v
    return out


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8", "fp8_e5m2"])
def test_base_both_loaded(kvlog, dtype):
    layers = run(BASE, FP8_NAMES[dtype], {"model.layers.0.self_attn.k_proj.k_scale": 0.5,
                                          "model.layers.0.self_attn.v_proj.v_scale": 0.25,
                                          "model.layers.1.self_attn.k_proj.k_scale": 2.0,
                                          "model.layers.1.self_attn.v_proj.v_scale": 0.125})
    assert scales(layers[0]) == (0.5, 0.25, 1.0, 1.0)
    assert scales(layers[1]) == (2.0, 0.125, 1.0, 1.0)
    expected = [MSG_NO_Q_SCALE] + ([uncalibrated(1.0, 1.0)] if dtype == "fp8" else [])
    assert kvlog.warnings() == expected


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8", "fp8_e5m2"])
def test_base_nothing_loaded_is_one(kvlog, dtype):
    layers = run(BASE, FP8_NAMES[dtype], {})
    for layer in layers:
        assert scales(layer) == (1.0, 1.0, 1.0, 1.0)
    expected = {
        "fp8_e4m3": [MSG_NO_Q_SCALE, MSG_SCALE_ONE],
        "fp8": [MSG_NO_Q_SCALE, MSG_SCALE_ONE, uncalibrated(1.0, 1.0)],
        "fp8_e5m2": [MSG_NO_Q_SCALE],  # no "scaling factor 1.0" warning for e5m2
    }[dtype]
    assert kvlog.warnings() == expected


def test_scale_one_warning_text():
    assert MSG_SCALE_ONE.startswith("Using KV cache scaling factor 1.0 for fp8_e4m3.")
    assert MSG_NO_Q_SCALE.startswith("Checkpoint does not provide a q scaling factor.")
    assert MSG_KV_PER_TENSOR == "Only support per-tensor scaling factor for fp8 KV cache"
    assert MSG_QP_PER_TENSOR == "Only support per-tensor scaling factorfor fp8-quantized Q/prob"


def test_base_loaded_scales_equal_to_one_still_warn(kvlog):
    """ModelOpt clamps KV scales to >= 1.0: loaded 1.0 scales trigger the same warning (as in vLLM)."""
    layers = run(BASE, E4M3, _kv(1.0, 1.0))
    assert scales(layers[0]) == (1.0, 1.0, 1.0, 1.0)
    assert kvlog.warnings() == [MSG_NO_Q_SCALE, MSG_SCALE_ONE]


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_base_only_k_is_used_for_both(kvlog, dtype):
    layers = run(BASE, FP8_NAMES[dtype], _kv(0.75, None))
    assert [scales(layer) for layer in layers] == [(0.75, 0.75, 1.0, 1.0)] * 2
    assert kvlog.warnings() == [MSG_NO_Q_SCALE]


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_base_only_v_is_used_for_both(kvlog, dtype):
    layers = run(BASE, FP8_NAMES[dtype], _kv(None, 0.375))
    assert [scales(layer) for layer in layers] == [(0.375, 0.375, 1.0, 1.0)] * 2
    assert kvlog.warnings() == [MSG_NO_Q_SCALE]


def test_base_deprecated_kv_scale_is_duplicated(kvlog):
    layers = run(BASE, E4M3, {"model.layers.0.self_attn.kv_scale": 0.5, "model.layers.1.self_attn.kv_scale": 3.0})
    assert scales(layers[0]) == (0.5, 0.5, 1.0, 1.0)
    assert scales(layers[1]) == (3.0, 3.0, 1.0, 1.0)
    assert kvlog.warnings() == [MSG_KV_SCALE_DEPRECATED, MSG_NO_Q_SCALE]


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8_e5m2"])
def test_base_q_scale_present_is_used_without_warning(kvlog, dtype):
    tensors = {**_kv(0.5, 0.25), "model.layers.0.self_attn.q_scale": 0.0625,
               "model.layers.1.self_attn.attn.q_scale": 0.125}
    layers = run(BASE, FP8_NAMES[dtype], tensors)
    assert scales(layers[0]) == (0.5, 0.25, 0.0625, 1.0)
    assert scales(layers[1]) == (0.5, 0.25, 0.125, 1.0)
    assert kvlog.warnings() == []


def test_base_fp8_q_without_prob_is_uncalibrated(kvlog):
    tensors = {**_kv(0.5, 0.25), "model.layers.0.self_attn.q_scale": 0.0625, "model.layers.1.self_attn.q_scale": 0.0625}
    layers = run(BASE, FP8, tensors)
    assert [scales(layer) for layer in layers] == [(0.5, 0.25, 0.0625, 1.0)] * 2
    assert kvlog.warnings() == [uncalibrated(0.0625, 1.0)]


def test_base_fp8_q_and_prob_calibrated_no_warning(kvlog):
    tensors = {**_kv(0.5, 0.25)}
    for i in range(2):
        tensors[f"model.layers.{i}.self_attn.q_proj.output_scale"] = 0.0625
        tensors[f"model.layers.{i}.self_attn.prob_output_scale"] = 0.5
    layers = run(BASE, FP8, tensors)
    assert [scales(layer) for layer in layers] == [(0.5, 0.25, 0.0625, 0.5)] * 2
    assert kvlog.warnings() == []


def test_base_fp8_q_equal_to_one_is_uncalibrated(kvlog):
    tensors = {**_kv(0.5, 0.25), "model.layers.0.self_attn.q_scale": 1.0, "model.layers.1.self_attn.q_scale": 1.0,
               "model.layers.0.self_attn.attn.prob_scale": 0.5, "model.layers.1.self_attn.attn.prob_scale": 0.5}
    run(BASE, FP8, tensors)
    assert kvlog.warnings() == [uncalibrated(1.0, 0.5)]


def test_uncalibrated_warning_only_for_fp8_exactly(kvlog):
    run(BASE, E4M3, _kv(0.5, 0.25))
    run(BASE, E5M2, _kv(0.5, 0.25))
    assert not any("uncalibrated" in m for m in kvlog.warnings())
    kvlog.clear()
    run(BASE, FP8, _kv(0.5, 0.25))
    assert [m for m in kvlog.warnings() if "uncalibrated" in m] == [uncalibrated(1.0, 1.0)]


@pytest.mark.parametrize("dtype", ["fp8_e4m3", "fp8"])
def test_each_warning_once_for_a_multi_layer_model(kvlog, dtype):
    layers = run(BASE, FP8_NAMES[dtype], {}, num_layers=6)
    assert len(layers) == 6 and all(scales(layer) == (1.0, 1.0, 1.0, 1.0) for layer in layers)
    warnings = kvlog.warnings()
    assert warnings.count(MSG_NO_Q_SCALE) == 1
    assert warnings.count(MSG_SCALE_ONE) == 1
    assert warnings.count(uncalibrated(1.0, 1.0)) == (1 if dtype == "fp8" else 0)
    assert len(warnings) == len(set(warnings))


def test_scales_of_one_loader_are_per_layer_info_line(kvlog):
    run(BASE, E4M3, {"model.layers.0.self_attn.k_proj.k_scale": 0.5, "model.layers.0.self_attn.v_proj.v_scale": 0.25},
        num_layers=3)
    info = kvlog.messages(logging.INFO)
    assert info == ["KV cache scales: loaded for 1/3 attention layers; k_scale 0.5..1, v_scale 0.25..1"]


@pytest.mark.parametrize("kind, checkpoint_name", [
    ("k_scale", "model.layers.1.self_attn.k_proj.k_scale"),
    ("v_scale", "model.layers.1.self_attn.v_proj.v_scale"),
])
def test_multi_element_kv_scale_is_an_error(kind, checkpoint_name):
    with pytest.raises(ValueError) as e:
        run(BASE, E4M3, {**_kv(0.5, 0.25), checkpoint_name: torch.tensor([0.5, 0.25])})
    msg = str(e.value)
    assert msg.startswith(MSG_KV_PER_TENSOR)
    assert msg == f"{MSG_KV_PER_TENSOR} (model.layers.1.self_attn.attn.{kind} has shape [2])"


@pytest.mark.parametrize("kind, checkpoint_name", [
    ("q_scale", "model.layers.0.self_attn.q_scale"),
    ("prob_scale", "model.layers.0.self_attn.prob_output_scale"),
])
@pytest.mark.parametrize("kv_dtype", [E4M3, BF16], ids=["fp8_e4m3", "bfloat16"])
def test_multi_element_q_or_prob_scale_is_an_error(kind, checkpoint_name, kv_dtype):
    """vLLM's Q/prob block runs for every cache dtype."""
    with pytest.raises(ValueError) as e:
        run(BASE, kv_dtype, {**_kv(0.5, 0.25), checkpoint_name: torch.ones(2, 1)})
    assert str(e.value) == f"{MSG_QP_PER_TENSOR} (model.layers.0.self_attn.attn.{kind} has shape [2, 1])"


@pytest.mark.parametrize("value", [0.0, -0.5, math.nan, math.inf, -math.inf], ids=["zero", "neg", "nan", "inf", "-inf"])
@pytest.mark.parametrize("kind, checkpoint_name", [
    ("k_scale", "model.layers.1.self_attn.k_proj.k_scale"),
    ("v_scale", "model.layers.1.self_attn.v_proj.v_scale"),
    ("q_scale", "model.layers.1.self_attn.q_scale"),
    ("prob_scale", "model.layers.1.self_attn.attn.prob_scale"),
])
@pytest.mark.parametrize("quant", [BASE, CT], ids=["base", "compressed-tensors"])
def test_invalid_scale_values_name_the_layer(value, kind, checkpoint_name, quant):
    tensors = {**_kv(0.5, 0.25), checkpoint_name: value}
    with pytest.raises(ValueError) as e:
        run(quant, E4M3, tensors)
    assert str(e.value) == (
        f"Invalid {kind} {float(value)} for attention layer model.layers.1.self_attn.attn: KV cache scales "
        "must be finite and positive."
    )


def test_one_element_shapes_are_accepted():
    layers = run(BASE, E4M3, {"model.layers.0.self_attn.k_proj.k_scale": torch.tensor([0.5]),
                              "model.layers.0.self_attn.v_proj.v_scale": torch.tensor([[0.25]])}, num_layers=1)
    assert scales(layers[0]) == (0.5, 0.25, 1.0, 1.0)


# ---- finish(): compressed-tensors, plain checkpoints, float caches ---------------------------
def test_compressed_tensors_uses_loaded_values_without_warnings(kvlog):
    tensors = {"model.layers.0.self_attn.k_scale": torch.tensor([0.5]),
               "model.layers.0.self_attn.v_scale": torch.tensor([0.25]),
               "model.layers.0.self_attn.q_scale": torch.tensor([0.0625]),
               "model.layers.1.self_attn.k_scale": torch.tensor([2.0])}
    layers = run(CT, FP8, tensors)
    assert scales(layers[0]) == (0.5, 0.25, 0.0625, 1.0)
    assert scales(layers[1]) == (2.0, 1.0, 1.0, 1.0)  # missing v -> its initial 1.0, not k
    assert kvlog.warnings() == []


@pytest.mark.parametrize("kv_dtype", [E4M3, FP8], ids=["fp8_e4m3", "fp8"])
def test_compressed_tensors_missing_is_one_without_warnings(kvlog, kv_dtype):
    layers = run(CT, kv_dtype, {})
    assert [scales(layer) for layer in layers] == [(1.0, 1.0, 1.0, 1.0)] * 2
    assert kvlog.warnings() == []


@pytest.mark.parametrize("kv_dtype", [E4M3, FP8, E5M2], ids=["fp8_e4m3", "fp8", "fp8_e5m2"])
def test_plain_checkpoint_is_one_without_warnings(kvlog, kv_dtype):
    layers = run(PLAIN, kv_dtype, {})
    assert [scales(layer) for layer in layers] == [(1.0, 1.0, 1.0, 1.0)] * 2
    assert kvlog.warnings() == []


@pytest.mark.parametrize("kv_dtype", [F32, BF16], ids=["float32", "bfloat16"])
@pytest.mark.parametrize("quant", [BASE, CT], ids=["base", "compressed-tensors"])
def test_float_cache_ignores_kv_scales(kvlog, kv_dtype, quant):
    layers = run(quant, kv_dtype, {"model.layers.0.self_attn.k_scale": 0.5, "model.layers.0.self_attn.v_scale": 0.25,
                                   "model.layers.1.self_attn.k_scale": 0.0})  # not checked: not used
    assert [scales(layer) for layer in layers] == [(1.0, 1.0, 1.0, 1.0)] * 2
    assert kvlog.warnings() == []
    assert kvlog.messages(logging.INFO) == [
        f"KV cache scales in the checkpoint are not used: the cache dtype is {kv_dtype.name}."
    ]


def test_float_cache_still_takes_q_scale():
    """vLLM's Q/prob block runs for every cache dtype (also ``auto``)."""
    layers = run(BASE, BF16, {"model.layers.0.self_attn.q_scale": 0.0625})
    assert scales(layers[0]) == (1.0, 1.0, 0.0625, 1.0)
    assert scales(layers[1]) == (1.0, 1.0, 1.0, 1.0)


# ---- end to end on a tiny model --------------------------------------------------------------
K_SCALES = [0.0861745, 0.1366020]
V_SCALES = [0.0048438, 0.0258340]
FORMS = ("modelopt", "modelopt-inline", "compressed-tensors")


@pytest.fixture(scope="module")
def ckpts(tiny, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8-scales")
    return {form: make_fp8_checkpoint(tiny, root / form, form, k_scales=K_SCALES, v_scales=V_SCALES)
            for form in FORMS}


def _llm(folder: Path, **kw):
    from kvserve import LLM

    return LLM(str(folder), kv_cache_memory=KV_MEM, **kw)


def _greedy(llm, n: int = 6) -> list[int]:
    from kvserve import SamplingParams

    out = llm.generate(["The quick brown fox"], SamplingParams(temperature=0, max_tokens=n), use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


@pytest.mark.parametrize("form", FORMS)
def test_every_layer_loads_its_scales(ckpts, kvlog, form):
    llm = _llm(ckpts[form])
    assert llm.llm_engine.config.cache_config.cache_dtype == "fp8_e4m3"
    layers = llm.llm_engine.runner.model.attention_layers()
    assert len(layers) == 2
    for i, layer in enumerate(layers):
        assert type(layer.k_scale) is float and type(layer.v_scale) is float
        assert (layer.k_scale, layer.v_scale) == (f32(K_SCALES[i]), f32(V_SCALES[i]))
        assert (layer.q_scale, layer.prob_scale) == (1.0, 1.0)
        cq = layer.cache_quant
        assert cq is not None
        assert (cq.fp8_dtype, cq.fp8_max, cq.k_scale, cq.v_scale) == (
            torch.float8_e4m3fn, 448.0, f32(K_SCALES[i]), f32(V_SCALES[i]))
        assert layer.kv_cache.dtype == torch.uint8
    expected_warnings = [] if form == "compressed-tensors" else [MSG_NO_Q_SCALE]
    assert kvlog.warnings() == expected_warnings
    assert kvlog.messages(logging.INFO).count(
        "KV cache scales: loaded for 2/2 attention layers; k_scale %.4g..%.4g, v_scale %.4g..%.4g"
        % (f32(K_SCALES[0]), f32(K_SCALES[1]), f32(V_SCALES[0]), f32(V_SCALES[1]))) == 1
    assert len(_greedy(llm)) == 6


@pytest.mark.parametrize("form", FORMS)
def test_bfloat16_cache_ignores_the_checkpoint_scales(ckpts, kvlog, form):
    llm = _llm(ckpts[form], kv_cache_dtype="bfloat16")
    layers = llm.llm_engine.runner.model.attention_layers()
    for layer in layers:
        assert (layer.k_scale, layer.v_scale, layer.q_scale, layer.prob_scale) == (1.0, 1.0, 1.0, 1.0)
        assert layer.cache_quant is None
        assert layer.kv_cache.dtype == torch.bfloat16
    assert kvlog.messages(logging.INFO).count(
        "KV cache scales in the checkpoint are not used: the cache dtype is bfloat16.") == 1
    assert not any("scaling factor" in m for m in kvlog.warnings())
    assert len(_greedy(llm)) == 6


def test_unknown_scale_tensor_warns_and_still_loads(tiny, tmp_path, kvlog):
    name = "model.layers.7.self_attn.k_proj.k_scale"
    folder = make_fp8_checkpoint(tiny, tmp_path / "extra", "modelopt", k_scales=K_SCALES, v_scales=V_SCALES,
                                 extra_tensors={name: torch.tensor(0.5)})
    llm = _llm(folder)
    layers = llm.llm_engine.runner.model.attention_layers()
    assert [(layer.k_scale, layer.v_scale) for layer in layers] == [
        (f32(k), f32(v)) for k, v in zip(K_SCALES, V_SCALES)]
    assert kvlog.warnings().count(not_loaded("k_scale", name, "model.layers.7.self_attn.attn.k_scale")) == 1
    assert kvlog.warnings() == [not_loaded("k_scale", name, "model.layers.7.self_attn.attn.k_scale"), MSG_NO_Q_SCALE]
    assert len(_greedy(llm)) == 6


def test_modelopt_checkpoint_without_scales_uses_one(tiny, tmp_path, kvlog):
    folder = make_fp8_checkpoint(tiny, tmp_path / "noscales", "modelopt")
    llm = _llm(folder)
    assert [(layer.k_scale, layer.v_scale) for layer in llm.llm_engine.runner.model.attention_layers()] == [(1.0, 1.0)] * 2
    assert kvlog.warnings() == [MSG_NO_Q_SCALE, MSG_SCALE_ONE]
