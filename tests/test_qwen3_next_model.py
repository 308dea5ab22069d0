"""Hybrid Gated-DeltaNet models (Qwen3-Next, Qwen3.5 dense / MoE, the image-text wrappers) vs
transformers: float32 logits of tiny random models, for a one-shot prefill, a prompt split into
chunks that continue from the stored KV cache and recurrent state, token-by-token decode, and two
sequences of different lengths batched together. Weights go through ``build_model`` +
``load_weights`` (in-memory state dicts: 3-D fused experts; saved checkpoints: per-expert tensors)."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from kvserve.layers.attention import AttentionMetadata
from kvserve.layers.norm import RMSNorm, ZeroCenteredRMSNorm
from kvserve.loader.weights import WeightLoadError, iterate_weights
from kvserve.models import qwen3_next
from kvserve.models.registry import build_model, resolve_architecture
from kvserve.quant.kv_cache_dtype import KVCacheDtype

# transformers' float32 logits lie at most 7.7e-6 from its float64 logits on these three models
# (prompts of 40-80 tokens, AVX2 and scalar CPU code paths, 2026-12-01): 1e-4 is 13x that
ATOL = 1e-4
VOCAB = 300
BLOCK = 16
NUM_BLOCKS = 32
NUM_SLOTS = 4

pytestmark = pytest.mark.usefixtures("one_thread")

_COMMON = dict(
    vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
    linear_value_head_dim=24, linear_conv_kernel_dim=4, intermediate_size=96, max_position_embeddings=256,
    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    rms_norm_eps=1e-6,
)
_MOE = dict(num_experts=6, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
_ROPE35 = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25,
           "mrope_section": [2, 1, 1], "mrope_interleaved": True}
_VISION = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64, patch_size=4,
               temporal_patch_size=2, spatial_merge_size=2)

FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")
ARCH = {"qwen3_next": "Qwen3NextForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM", "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}


def _text_config(family: str):
    import transformers as tf

    if family == "qwen3_next":  # layer 1 dense via mlp_only_layers, the rest MoE
        return tf.Qwen3NextConfig(**_COMMON, **_MOE, mlp_only_layers=[1], rope_parameters={
            "rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25})
    if family == "qwen3_5":
        return tf.Qwen3_5TextConfig(**_COMMON, rope_parameters=dict(_ROPE35))
    return tf.Qwen3_5MoeTextConfig(**_COMMON, **_MOE, rope_parameters=dict(_ROPE35))


def randomize(model: torch.nn.Module, seed: int) -> None:
    """Seeded random values for every parameter: norm offsets, A_log and dt_bias included. Drawn in
    float64 (torch's float32 ``normal_`` gives other bits with and without AVX2) and rounded to the
    parameter's dtype, so every CPU builds the same models."""
    g = torch.Generator().manual_seed(seed)
    f64 = dict(generator=g, dtype=torch.float64)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                v = torch.empty(p.shape, dtype=torch.float64).uniform_(-3.0, 0.0, generator=g)
            elif name.endswith("dt_bias"):
                v = torch.randn(p.shape, **f64) * 0.5
            elif "linear_attn.norm" in name:  # plain gated RMSNorm weight
                v = torch.empty(p.shape, dtype=torch.float64).uniform_(0.5, 1.5, generator=g)
            elif "norm" in name:  # zero-centred: (1 + w)
                v = torch.empty(p.shape, dtype=torch.float64).uniform_(-0.5, 0.5, generator=g)
            elif "embed_tokens" in name:
                v = torch.randn(p.shape, **f64)
            elif "conv1d" in name:
                v = torch.randn(p.shape, **f64) * 0.4
            else:
                v = torch.randn(p.shape, **f64) * 0.1
            p.copy_(v)


def _hf_model(cls, cfg, seed: int):
    model = cls._from_config(cfg, attn_implementation="eager", dtype=torch.float32)
    randomize(model, seed)
    return model.eval()


@pytest.fixture(scope="module")
def hf_models() -> dict:
    import transformers as tf

    classes = {"qwen3_next": tf.Qwen3NextForCausalLM, "qwen3_5": tf.Qwen3_5ForCausalLM,
               "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM}
    return {f: _hf_model(classes[f], _text_config(f), seed=i + 1) for i, f in enumerate(FAMILIES)}


def kv_model(architecture: str, hf_config, weights) -> torch.nn.Module:
    model = build_model(architecture, hf_config)
    model.load_weights(weights)
    return model.eval()


@pytest.fixture(scope="module")
def kv_models(hf_models) -> dict:
    return {f: kv_model(ARCH[f], m.config, m.state_dict().items()) for f, m in hf_models.items()}


def hf_logits(model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()


def prompt(seed: int, n: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Runner:
    """Binds fresh caches/states to a model and runs steps; each sequence owns blocks and a slot."""

    def __init__(self, model) -> None:
        self.model = model
        kv_dtype = KVCacheDtype("float32", "test")
        for layer in model.attention_layers():
            cache = torch.zeros(NUM_BLOCKS, 2, BLOCK, layer.num_kv_heads, layer.head_size)
            layer.bind_kv_cache(cache, kv_dtype, "reference")
        for gdn in model.gdn_layers():
            conv_shape, ssm_shape = gdn.state_shapes()
            # NaN garbage: a sequence without history must never read its slot
            gdn.bind_state(torch.full((NUM_SLOTS, *conv_shape), float("nan")),
                           torch.full((NUM_SLOTS, *ssm_shape), float("nan"), dtype=torch.float32))
        self.seqs: dict[str, dict] = {}

    def add(self, name: str, tokens: list[int], slot: int, blocks: list[int]) -> None:
        self.seqs[name] = {"tokens": tokens, "slot": slot, "blocks": blocks, "done": 0}

    def step(self, chunks: list[tuple[str, int]]) -> dict[str, torch.Tensor]:
        """Run ``n`` new tokens of each named sequence in one batch; returns their logits."""
        ids, pos, slots, tables = [], [], [], []
        max_blocks = max(len(self.seqs[s]["blocks"]) for s, _ in chunks)
        for name, n in chunks:
            s = self.seqs[name]
            start = s["done"]
            ids += s["tokens"][start : start + n]
            for p in range(start, start + n):
                pos.append(p)
                slots.append(s["blocks"][p // BLOCK] * BLOCK + p % BLOCK)
            tables.append(s["blocks"] + [0] * (max_blocks - len(s["blocks"])))
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long),
            block_tables=torch.tensor(tables, dtype=torch.long),
            query_lens=[n for _, n in chunks],
            seq_lens=[self.seqs[name]["done"] + n for name, n in chunks],
            block_size=BLOCK,
            state_slots=[self.seqs[name]["slot"] for name, _ in chunks],
            has_initial_state=[self.seqs[name]["done"] > 0 for name, _ in chunks],
        )
        with torch.no_grad():
            hidden = self.model(torch.tensor(ids), torch.tensor(pos), meta)
            logits = self.model.compute_logits(hidden)
        out, start = {}, 0
        for name, n in chunks:
            out[name] = logits[start : start + n]
            self.seqs[name]["done"] += n
            start += n
        return out


def assert_close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.shape == want.shape
    err = (got - want).abs().max().item()
    assert err <= ATOL, f"max |logit diff| {err:.3g} > {ATOL}"


# ----------------------------------------------------------------------------------------------


def test_zero_centered_rmsnorm_matches_transformers() -> None:
    from transformers.models.qwen3_next.modeling_qwen3_next import Qwen3NextRMSNorm

    g = torch.Generator().manual_seed(0)
    ref, ours = Qwen3NextRMSNorm(48, eps=1e-6), ZeroCenteredRMSNorm(48, eps=1e-6)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(48, generator=g) * 0.3)
        ours.weight.copy_(ref.weight)
    x, r = torch.randn(5, 48, generator=g) * 3, torch.randn(5, 48, generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        ref_d, ours_d = ref.to(dtype), ours.to(dtype)
        xd, rd = x.to(dtype), r.to(dtype)
        assert torch.equal(ours_d(xd), ref_d(xd))
        normed, summed = ours_d(xd, rd)
        assert torch.equal(summed, xd + rd) and torch.equal(normed, ref_d(xd + rd))
    assert ours.fused is False  # torch's ops unless the runner fuses it (its Triton twin: test_triton_layers.py)
    plain = RMSNorm(48)  # the existing class is unchanged: w * norm(x)
    assert torch.allclose(plain(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))


@pytest.mark.parametrize("family", FAMILIES)
def test_prefill_matches_transformers(family, hf_models, kv_models) -> None:
    model = kv_models[family]
    tokens = prompt(10, 80)  # > 64: two chunks of the chunked delta rule
    runner = Runner(model)
    runner.add("a", tokens, slot=2, blocks=[7, 3, 11, 0, 5, 9])
    got = runner.step([("a", 80)])["a"]
    assert_close(got, hf_logits(hf_models[family], tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_chunked_prefill_and_decode_match(family, hf_models, kv_models) -> None:
    model = kv_models[family]
    tokens = prompt(11, 75)
    runner = Runner(model)
    runner.add("a", tokens, slot=1, blocks=[4, 8, 2, 6, 1])
    parts = [runner.step([("a", 37)])["a"], runner.step([("a", 30)])["a"]]  # 2nd: cached KV + state
    parts += [runner.step([("a", 1)])["a"] for _ in range(8)]  # decode: recurrent rule, conv update
    assert_close(torch.cat(parts), hf_logits(hf_models[family], tokens))


@pytest.mark.parametrize("family", FAMILIES)
def test_two_sequences_batched(family, hf_models, kv_models) -> None:
    model = kv_models[family]
    a, b = prompt(12, 52), prompt(13, 21)
    runner = Runner(model)
    runner.add("a", a, slot=3, blocks=[9, 1, 14, 6])
    runner.add("b", b, slot=0, blocks=[2, 12])
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    for chunks in ([("a", 40), ("b", 9)], [("b", 10), ("a", 1)], [("a", 11), ("b", 1)], [("b", 1), ("a", 0)]):
        chunks = [c for c in chunks if c[1]]
        for name, logits in runner.step(chunks).items():
            got[name].append(logits)
    assert_close(torch.cat(got["a"]), hf_logits(hf_models[family], a))
    assert_close(torch.cat(got["b"]), hf_logits(hf_models[family], b))


@pytest.mark.parametrize("family", FAMILIES)
def test_saved_checkpoint_loads(family, hf_models, tmp_path: Path) -> None:
    """Checkpoint names as saved by transformers (per-expert MoE tensors), plus ignored mtp.*."""
    hf = hf_models[family]
    hf.save_pretrained(tmp_path)
    mtp = [("mtp.fc.weight", torch.zeros(64, 128)), ("mtp.layers.0.input_layernorm.weight", torch.zeros(64))]
    names = [n for n, _ in iterate_weights(tmp_path)]
    if family != "qwen3_5":
        assert any(".mlp.experts.0.gate_proj.weight" in n for n in names)
    model = kv_model(ARCH[family], hf.config, list(iterate_weights(tmp_path)) + mtp)
    tokens = prompt(14, 19)
    runner = Runner(model)
    runner.add("a", tokens, slot=0, blocks=[0, 1])
    assert_close(runner.step([("a", 19)])["a"], hf_logits(hf, tokens))


@pytest.mark.parametrize("tie", [False, True])
def test_conditional_generation_checkpoint(tie: bool, tmp_path: Path) -> None:
    """Qwen3_5ForConditionalGeneration: text_config, model.language_model.* names, vision skipped;
    built from the top-level config or (as EngineArgs does) from its text config alone."""
    import transformers as tf

    cfg = tf.Qwen3_5Config(text_config=_text_config("qwen3_5").to_dict(), vision_config=_VISION,
                           tie_word_embeddings=tie)
    hf = _hf_model(tf.Qwen3_5ForConditionalGeneration, cfg, seed=7)
    hf.save_pretrained(tmp_path)
    names = [n for n, _ in iterate_weights(tmp_path)]
    assert any(n.startswith("model.language_model.layers.") for n in names)
    assert any(n.startswith("model.visual.") for n in names)
    assert ("lm_head.weight" in names) != tie
    assert resolve_architecture(hf.config.architectures) == "Qwen3_5ForConditionalGeneration"
    tokens = prompt(15, 23)
    want = hf_logits(hf, tokens)
    for config in (hf.config, hf.config.get_text_config()):
        model = kv_model("Qwen3_5ForConditionalGeneration", config, iterate_weights(tmp_path))
        assert model.tie_word_embeddings == tie
        runner = Runner(model)
        runner.add("a", tokens, slot=1, blocks=[3, 5])
        assert_close(runner.step([("a", 23)])["a"], want)


def test_moe_conditional_generation_names(hf_models, kv_models) -> None:
    """Qwen3_5MoeForConditionalGeneration prefixes on the text model's (3-D expert) state dict."""
    import transformers as tf

    hf = hf_models["qwen3_5_moe"]
    top = tf.Qwen3_5MoeConfig(text_config=hf.config.to_dict(), vision_config=_VISION)
    renamed = [("lm_head.weight" if n == "lm_head.weight" else "model.language_model." + n[len("model."):], t)
               for n, t in hf.state_dict().items()]
    extra = [("model.visual.blocks.0.attn.qkv.weight", torch.zeros(96, 32)), ("mtp.fc.weight", torch.zeros(64, 128))]
    model = kv_model("Qwen3_5MoeForConditionalGeneration", top, renamed + extra)
    ref = kv_models["qwen3_5_moe"].state_dict()
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, ref[name]), name


def test_name_mapping() -> None:
    m = qwen3_next.hf_to_kvserve_name
    assert m("model.language_model.layers.3.self_attn.q_proj.weight") == "model.layers.3.self_attn.q_proj.weight"
    assert m("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    assert m("lm_head.weight") == "lm_head.weight"
    assert m("model.layers.0.linear_attn.A_log") == "model.layers.0.linear_attn.A_log"
    assert m("model.visual.blocks.0.attn.qkv.weight") is None
    assert m("mtp.layers.0.mlp.gate.weight") is None


def test_structure(kv_models) -> None:
    model = kv_models["qwen3_next"]
    assert model.is_hybrid
    assert [a.layer_idx for a in model.attention_layers()] == [1]
    assert [g.layer_idx for g in model.gdn_layers()] == [0, 2, 3]
    gdn = model.gdn_layers()[0]
    assert gdn.state_shapes() == ((2 * 2 * 16 + 4 * 24, 3), (4, 16, 24))
    assert isinstance(model.model.layers[1].mlp, qwen3_next.SwiGLUMLP)  # mlp_only_layers=[1]
    assert isinstance(model.model.layers[0].mlp, qwen3_next.SparseMoeBlock)
    names = dict(model.named_parameters())
    assert "model.layers.0.linear_attn.in_proj_qkvz.weight" in names
    assert "model.layers.0.linear_attn.conv1d.weight" in names
    # Qwen3.5's four GDN input projections load as vLLM packs them: qkv | z and b | a, two GEMMs
    mods = dict(kv_models["qwen3_5"].named_modules())
    assert mods["model.layers.0.linear_attn.in_proj_qkvz"].shard_sizes == [2 * 2 * 16 + 4 * 24, 4 * 24]
    assert mods["model.layers.0.linear_attn.in_proj_ba"].shard_sizes == [4, 4]
    assert kv_models["qwen3_5"].stacked_params["in_proj_a"] == ("in_proj_ba", 1)
    assert "in_proj_qkv" not in model.stacked_params  # Qwen3-Next's in_proj_qkvz is a checkpoint name
    # KV scales map onto the full-attention layers' Attention modules
    assert "model.layers.1.self_attn.attn" in dict(model.named_modules())


def test_layer_schedule_and_errors() -> None:
    cfg = SimpleNamespace(num_hidden_layers=8, full_attention_interval=4)
    assert [i for i, t in enumerate(qwen3_next.layer_types(cfg)) if t == "full_attention"] == [3, 7]
    with pytest.raises(ValueError, match="sliding_attention"):
        qwen3_next.layer_types(SimpleNamespace(num_hidden_layers=2, layer_types=["sliding_attention"] * 2))
    bad = _text_config("qwen3_5")
    bad.hidden_act = "gelu"
    with pytest.raises(ValueError, match="hidden_act 'gelu'"):
        build_model("Qwen3_5ForCausalLM", bad)
    bad = _text_config("qwen3_5")
    bad.linear_num_value_heads = 3
    with pytest.raises(ValueError, match="linear_num_value_heads=3"):
        build_model("Qwen3_5ForCausalLM", bad)
    with pytest.raises(ValueError, match="are not supported for now"):
        resolve_architecture(["Qwen3VLForConditionalGeneration"])


def test_missing_expert_tensor_is_reported(hf_models, tmp_path: Path) -> None:
    hf = hf_models["qwen3_next"]
    hf.save_pretrained(tmp_path)
    weights = [(n, t) for n, t in iterate_weights(tmp_path) if n != "model.layers.2.mlp.experts.4.up_proj.weight"]
    with pytest.raises(WeightLoadError, match=r"model.layers.2.mlp.experts.4.up_proj.weight"):
        kv_model("Qwen3NextForCausalLM", hf.config, weights)


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_layers_match_transformers(family) -> None:
    """bf16 dtype handling: the GDN mixer (one-shot prefill) and the FFN of layer 0 vs transformers'."""
    import transformers as tf

    classes = {"qwen3_next": tf.Qwen3NextForCausalLM, "qwen3_5": tf.Qwen3_5ForCausalLM,
               "qwen3_5_moe": tf.Qwen3_5MoeForCausalLM}
    hf = _hf_model(classes[family], _text_config(family), seed=5).to(torch.bfloat16)
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        model = build_model(ARCH[family], hf.config)
    finally:
        torch.set_default_dtype(default)
    model.load_weights(hf.state_dict().items())
    gdn = model.gdn_layers()[0]
    conv_shape, ssm_shape = gdn.state_shapes()
    gdn.bind_state(torch.zeros(1, *conv_shape, dtype=torch.bfloat16), torch.zeros(1, *ssm_shape))
    x = torch.randn(70, 64, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    meta = AttentionMetadata(slot_mapping=torch.zeros(0), block_tables=torch.zeros(0), query_lens=[70],
                             seq_lens=[70], state_slots=[0], has_initial_state=[False])
    with torch.no_grad():
        pairs = [(gdn(x, meta), hf.model.layers[0].linear_attn(x[None])[0]),
                 (model.model.layers[0].mlp(x), hf.model.layers[0].mlp(x[None])[0])]
    for got, want in pairs:
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=1.6e-2, atol=1e-2)
    assert gdn.conv_state.dtype == torch.bfloat16 and gdn.ssm_state.dtype == torch.float32
