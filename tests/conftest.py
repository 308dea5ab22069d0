"""Shared fixtures: tiny random HF checkpoints (Llama / Qwen2 / Qwen3) with a small trained
byte-level BPE tokenizer, and the real default model (fetched once per machine)."""

from __future__ import annotations

import os

import torch

# Triton kernels run in the interpreter without CUDA; triton.jit reads this when a kernel module is
# imported, so it is set before anything imports kvserve.kernels.triton_*.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from triton_support import interpreter_active, patch_interpreter  # noqa: E402

if interpreter_active():
    patch_interpreter()  # the interpreter's fp8/bf16 down-casts made torch's (bit-exact); bf16 tl.dot fixed

import json
import logging
from pathlib import Path
from typing import Callable

import pytest
import torch

_CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks.",
    "Le cœur a ses raisons que la raison ne connaît point. 日本語のテキスト。 Привет, мир! 🙂",
    "def main():\n    return 42\n",
] * 20


def _build_tokenizer(folder: Path) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", bos_token="<|im_start|>", unk_token="<|endoftext|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(folder)


TINY_ARCHS = ("llama", "qwen2", "qwen3")


@pytest.fixture(scope="module")
def one_thread():
    """Tiny tensors: one intra-op thread is much faster than two on a busy 2-core machine."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _tiny_config(arch: str, **overrides):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    common.update(overrides)
    if arch == "llama":
        common.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": 10000.0})
        return LlamaConfig(**common)
    if arch == "qwen2":
        return Qwen2Config(**common)
    if arch == "qwen3":
        common.setdefault("head_dim", 32)
        return Qwen3Config(**common)
    if arch in HYBRID_ARCHS:
        return _tiny_hybrid_config(arch, common, overrides)
    raise ValueError(arch)


HYBRID_ARCHS = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


def _tiny_hybrid_config(arch: str, common: dict, overrides: dict):
    """Gated DeltaNet + gated attention: 4 layers mixing both kinds, grouped value heads (2 key /
    4 value heads), partial rotary, and for the MoE kinds 4 experts top-2 with a shared expert
    (``overrides`` win, e.g. Qwen3-Next's ``mlp_only_layers``)."""
    from transformers import Qwen3NextConfig
    from transformers.models.qwen3_5 import Qwen3_5TextConfig
    from transformers.models.qwen3_5_moe import Qwen3_5MoeTextConfig

    hybrid = dict(
        head_dim=32,
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        num_hidden_layers=4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        linear_conv_kernel_dim=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    )
    moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32, shared_expert_intermediate_size=48)
    cfg = {**common, **hybrid, **overrides}
    if arch == "qwen3_next":
        return Qwen3NextConfig(**{**moe, "decoder_sparse_step": 1, "mlp_only_layers": [], "norm_topk_prob": True, **cfg})
    if arch == "qwen3_5":
        return Qwen3_5TextConfig(**cfg)
    return Qwen3_5MoeTextConfig(**{**moe, **cfg})


@pytest.fixture(scope="session")
def make_tiny_model(tmp_path_factory) -> Callable[..., Path]:
    """``make_tiny_model(arch, seed=0, **config_overrides) -> folder`` with config, fp32 safetensors,
    tokenizer. Weights are random (std 0.2 so logits are not flat), never zeros. Cached per args.
    They are drawn in float64 and rounded to float32: torch's float32 ``normal_`` takes another
    kernel with AVX2 than without it (last-bit different values), so a float32 draw would give
    each CPU its own model; the float64 draw gives the same bits on every machine."""
    from transformers import AutoModelForCausalLM

    cache: dict[str, Path] = {}

    def make(arch: str = "llama", seed: int = 0, **overrides) -> Path:
        key = json.dumps([arch, seed, overrides], sort_keys=True, default=str)
        if key in cache:
            return cache[key]
        folder = tmp_path_factory.mktemp(f"tiny-{arch}")
        torch.manual_seed(seed)
        cfg = _tiny_config(arch, **overrides)
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
        with torch.no_grad():
            for p in model.parameters():
                mean, std = (0.0, 0.2) if p.dim() > 1 else (1.0, 0.1)
                p.copy_(torch.empty(p.shape, dtype=torch.float64).normal_(mean, std))
        model.save_pretrained(folder)
        _build_tokenizer(folder)
        cache[key] = folder
        return folder

    return make


@pytest.fixture(scope="module")
def tiny(make_tiny_model) -> Path:
    """The default tiny Llama (seed 0)."""
    return make_tiny_model("llama")


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    """The real SmolLM2-135M-Instruct folder (converted once into the kvserve cache)."""
    from kvserve.loader.default_model import ensure_default_model

    return ensure_default_model()


@pytest.fixture(scope="session")
def shared_eval() -> Path:
    """The golden prompt sets beside the repository (../shared/eval)."""
    here = Path(__file__).resolve().parents[1]
    path = here.parent / "shared" / "eval"
    if not path.is_dir():
        pytest.skip(f"shared eval folder not found at {path}")
    return path


class LogCapture(logging.Handler):
    """Collects the records of the ``kvserve`` logger."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def messages(self, level: int | None = None) -> list[str]:
        return [r.getMessage() for r in self.records if level is None or r.levelno == level]

    def warnings(self) -> list[str]:
        return self.messages(logging.WARNING)

    def count(self, text: str, level: int | None = None) -> int:
        """How many records contain ``text``."""
        return sum(text in m for m in self.messages(level))

    def clear(self) -> None:
        self.records.clear()


@pytest.fixture
def kvlog():
    """Records of the ``kvserve`` logger (it does not propagate, so caplog alone sees nothing)."""
    root = logging.getLogger("kvserve")
    handler = LogCapture()
    old_level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    try:
        yield handler
    finally:
        root.removeHandler(handler)
        root.setLevel(old_level)
