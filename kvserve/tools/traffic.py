"""``kvserve traffic``: how many bytes the KV cache moves, bf16 next to fp8, and what that is worth.

Arithmetic only (no torch, no weights). Notation: A = layers with paged KV (full attention;
Gated DeltaNet / linear-attention layers keep a recurrent state instead), Hkv = KV heads,
D = head_dim, e = bytes per KV element (bf16 2, fp8 1), I = ISL, O = OSL, N = concurrency,
C = prefill chunk (default I), T = query tile (default 128), W = weight bytes one forward step reads.

    kv_tok          = 2 * Hkv * D * e * A                 K and V of one token, all KV layers
    store / request = (I + O) * kv_tok                    prompt + one token per decode step
    prefill read    = kv_tok * sum over query tiles of the tile's last position + 1
                      (chunk j covers [jC, min((j+1)C, I)); its tiles of T rows start at jC and
                      each tile reads the K/V of every position up to its last row from the cache:
                      causal, no reuse between tiles -- an upper bound; T = C gives the
                      once-per-chunk lower bound, chunk j reading min((j+1)C, I) tokens)
    decode step s   = N * (I + s) * kv_tok read, N * kv_tok written, s = 1..O
                      (mean over the steps: context I + (O + 1) / 2; last step: I + O)
    weights         = W per forward step (each prefill chunk, each decode step), shared by the batch;
                      with routed experts (E a layer, k a token) a step of T tokens reads the
                      experts they go to, E (1 - (1 - k/E)^T) a layer expected for uniform routing
    state           = recurrent state of the linear-attention layers, read + written once per
                      sequence per decode step ((2 * chunks - 1) times per prefill)
    KV share        = (KV written + KV read) / (weights + KV + state)
    memory time     = bytes / bandwidth (default 4.1e12 B/s, DESIGN.md section 6)
    compute time    = 2 * params a token uses * tokens / flops (matmuls only; default 750e12, bf16;
                      with routed experts: k of E)
    roofline time   = max(memory time, compute time); fp8 vs bf16 change = (fp8 - bf16) / bf16

Not counted: activations (counting them would only lower the KV share, so the share is an upper
bound), fp8 scales, attention-score and recurrence FLOPs; the lm_head is counted on every prefill
token although it runs on one (about 5% too much prefill compute for the 27B). The prefill is one
request alone in its steps. The engine's first output token comes from the prefill and its last
is never fed back (O - 1 decode steps); the table counts O steps, a 1/O overestimate of the
decode KV. W and the parameter count skip the input embedding table when it is untied (a gather
reads only the prompt's rows), the vision tower and the MTP head.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import struct
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvserve.choices import KV_CACHE_DTYPE_CHOICES as KV_CACHE_DTYPES
from kvserve.engine.state_cache import snapshot_interval_tokens

KV_ELEM_BYTES = {"bf16": 2, "fp8": 1}
DEFAULT_BANDWIDTH = 4.1e12  # B/s, H200 device-to-device copy (DESIGN.md section 6)
DEFAULT_FLOPS = 750e12  # FLOP/s, H200 bf16 matmul 8192^3 (DESIGN.md section 6)
_WEIGHT_DTYPE_BYTES = {"float32": 2, "bfloat16": 2, "float16": 2, "half": 2}  # fp32 is served as bf16


@dataclass(frozen=True)
class ModelShape:
    """What the byte model needs to know about a model."""

    name: str
    num_layers: int
    num_attention_layers: int  # layers with paged KV (full attention)
    num_kv_heads: int
    head_dim: int
    num_params: int  # parameters one forward step reads (no untied input embedding, vision, MTP)
    weight_bytes: int  # bytes of those parameters as served
    weight_dtype: str = "bf16"
    state_bytes: int = 0  # recurrent state per sequence, all linear-attention layers
    # mixture of experts: routed experts a layer, how many a token goes to, and the parameters and bytes
    # of all routed experts (all MoE layers; the router and the shared expert not included)
    num_experts: int = 0
    experts_per_token: int = 0
    expert_params: int = 0
    expert_bytes: int = 0

    def kv_bytes_per_token(self, elem_bytes: int) -> int:
        return 2 * self.num_kv_heads * self.head_dim * elem_bytes * self.num_attention_layers

    def step_weight_bytes(self, tokens: int) -> int:
        """Weight bytes a forward step over ``tokens`` tokens reads: all of them but the routed
        experts none of its tokens goes to (``expected_experts_touched``)."""
        if not self.num_experts:
            return self.weight_bytes
        touched = expected_experts_touched(self.num_experts, self.experts_per_token, tokens)
        return self.weight_bytes - self.expert_bytes + round(self.expert_bytes * touched / self.num_experts)

    @property
    def active_params(self) -> float:
        """Parameters one token is multiplied by: all but the routed experts it does not go to."""
        if not self.num_experts:
            return self.num_params
        return self.num_params - self.expert_params * (1 - self.experts_per_token / self.num_experts)


def expected_experts_touched(num_experts: int, top_k: int, tokens: int) -> float:
    """Distinct experts of one layer that ``tokens`` tokens go to, expected when each token picks its
    ``top_k`` uniformly (random-weight benchmarks; a router trained for balance comes close, a skewed
    one touches fewer): E (1 - (1 - k / E)^T)."""
    if tokens <= 0:
        return 0.0
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** tokens)


# Qwen3.5/3.6-27B text model (hybrid-gdn-models.md 1.9): 48 GDN + 16 gated full-attention layers,
# hidden 5120, MLP 17408, vocab 248320 untied. Parameters read per step 25,624,600,064 (+1.27e9
# input embedding = 26.90e9 text parameters); state per sequence and GDN layer: conv 10240 x 3
# bf16 + SSM 48 x 128 x 128 fp32 = 3,207,168 bytes. The NVFP4 export (reported recipe): MLPs and
# lm_head NVFP4 weight-only (0.5 byte + one fp8 scale per 16), attention and GDN projections FP8,
# the rest bf16.
_QWEN36_27B = ModelShape("qwen3.6-27b", 64, 16, 4, 256, 25_624_600_064, 51_249_200_128, "bf16", 153_944_064)
PRESETS: dict[str, ModelShape] = {
    "qwen3.6-27b": _QWEN36_27B,
    "qwen3.6-27b-nvfp4": replace(_QWEN36_27B, name="qwen3.6-27b-nvfp4", weight_bytes=17_607_781_512,
                                 weight_dtype="nvfp4+fp8"),
    "smollm2-135m": ModelShape("smollm2-135m", 30, 30, 3, 64, 134_515_008, 269_030_016, "bf16"),
    "llama-3.1-8b": ModelShape("llama-3.1-8b", 32, 32, 8, 128, 7_504_924_672, 15_009_849_344, "bf16"),
}
_ALIASES = {"qwen3.5-27b": "qwen3.6-27b", "qwen3.5-27b-nvfp4": "qwen3.6-27b-nvfp4",
            "smollm2-135m-instruct": "smollm2-135m", "llama-3.1-8b-instruct": "llama-3.1-8b",
            "meta-llama-3.1-8b": "llama-3.1-8b", "meta-llama-3.1-8b-instruct": "llama-3.1-8b"}


def _need(cfg: dict[str, Any], key: str) -> Any:
    if key not in cfg:
        raise ValueError(f"config.json has no {key!r}; the traffic model needs it")
    return cfg[key]


def shape_from_config(cfg: dict[str, Any], name: str = "config", weight_bytes: int | None = None,
                      expert_bytes: int | None = None) -> ModelShape:
    """A ModelShape from an HF config dict (nested ``text_config`` read first); parameters and
    weight bytes estimated from the shapes unless ``weight_bytes`` (and the routed experts' share,
    ``expert_bytes``) is given."""
    t = cfg.get("text_config") or cfg
    if "kv_lora_rank" in t:
        raise ValueError(f"{name}: multi-head latent attention (kv_lora_rank) is not modelled")
    L, h, V = _need(t, "num_hidden_layers"), _need(t, "hidden_size"), _need(t, "vocab_size")
    H = _need(t, "num_attention_heads")
    Hkv = t.get("num_key_value_heads") or H
    D = t.get("head_dim") or h // H
    mt = str(t.get("model_type", cfg.get("model_type", "")))
    types = t.get("layer_types")
    if types is None:
        k = t.get("full_attention_interval")
        types = ["full_attention" if not k or (i + 1) % k == 0 else "linear_attention" for i in range(L)]
    if len(types) != L:
        raise ValueError(f"{name}: layer_types has {len(types)} entries for {L} layers")
    is_kv = ["linear" not in s and "mamba" not in s for s in types]
    wdt = str(t.get("torch_dtype") or t.get("dtype") or cfg.get("torch_dtype") or "bfloat16")
    wb = _WEIGHT_DTYPE_BYTES.get(wdt, 2)

    gate = t.get("attn_output_gate", mt.startswith(("qwen3_next", "qwen3_5")))
    attn = h * H * D * (2 if gate else 1) + 2 * h * Hkv * D + H * D * h
    attn += (H + 2 * Hkv) * D if t.get("attention_bias") or mt.startswith("qwen2") else 0
    attn += 2 * D if mt.startswith("qwen3") else 0  # q_norm, k_norm
    lin = state = 0
    if not all(is_kv):
        nk, nv = _need(t, "linear_num_key_heads"), _need(t, "linear_num_value_heads")
        dk, dv = _need(t, "linear_key_head_dim"), _need(t, "linear_value_head_dim")
        K = _need(t, "linear_conv_kernel_dim")
        conv = 2 * nk * dk + nv * dv
        lin = h * (conv + nv * dv + 2 * nv) + conv * K + 2 * nv + dv + nv * dv * h
        ssm_bytes = 4  # kvserve keeps the SSM state in float32 (runner/state_pool.py), as vLLM advises for all of them
        state = conv * (K - 1) * wb + nv * dk * dv * ssm_bytes
    E = t.get("num_experts") or t.get("num_local_experts") or 0
    dense = 3 * h * t.get("intermediate_size", 0)
    routed = E * 3 * h * t.get("moe_intermediate_size", t.get("intermediate_size", 0))  # one layer's experts
    moe = routed + E * h  # + the router
    if t.get("shared_expert_intermediate_size"):
        moe += 3 * h * t["shared_expert_intermediate_size"] + h
    step, dense_only = t.get("decoder_sparse_step", 1) or 1, set(t.get("mlp_only_layers") or [])
    params = h  # final norm
    n_moe = 0
    for i in range(L):
        is_moe = E and (i + 1) % step == 0 and i not in dense_only
        n_moe += bool(is_moe)
        params += (attn if is_kv[i] else lin) + (moe if is_moe else dense) + 2 * h
    tied = t.get("tie_word_embeddings", cfg.get("tie_word_embeddings", False))
    params += V * h  # lm_head (the embedding table itself when tied); an untied embedding is gathered
    n_state = sum(not k for k in is_kv)
    expert_params = n_moe * routed
    if weight_bytes is None:
        total, experts = params * wb, expert_params * wb
    else:  # the checkpoint's bytes; its routed experts' share as its tensors give it, else by parameters
        total, experts = weight_bytes, (expert_bytes if expert_bytes is not None
                                        else round(weight_bytes * expert_params / params))
    return ModelShape(name, L, sum(is_kv), Hkv, D, params, total, "bf16" if weight_bytes is None else "checkpoint",
                      state * n_state, E if n_moe else 0, (t.get("num_experts_per_tok") or 0) if n_moe else 0,
                      expert_params, experts if n_moe else 0)


_ROUTED_EXPERT = re.compile(r"\.experts\.(\d+\.|gate_up_proj|down_proj)")  # not the shared expert


def _safetensors_bytes(folder: Path) -> tuple[int, int] | None:
    """Bytes of the tensors a forward step reads and of its routed experts among them, from the
    safetensors headers (fp32 counted as bf16, as ``--dtype auto`` serves it); None when the folder
    has no safetensors."""
    tensors: dict[str, dict[str, Any]] = {}
    for f in sorted(folder.glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            tensors.update(json.loads(fh.read(n)))
    tensors.pop("__metadata__", None)
    if not tensors:
        return None
    untied = any("lm_head" in k for k in tensors)
    total = experts = 0
    for k, v in tensors.items():
        if k.startswith("mtp.") or "visual" in k or "vision" in k or (untied and "embed_tokens" in k):
            continue
        nbytes = v["data_offsets"][1] - v["data_offsets"][0]
        nbytes = nbytes // 2 if v["dtype"] == "F32" else nbytes
        total += nbytes
        experts += nbytes if _ROUTED_EXPERT.search(k) else 0
    return total, experts


def model_shape(model: str) -> ModelShape:
    """Resolve a preset name (or HF id of one), a checkpoint folder, or a config.json path."""
    p = Path(model).expanduser()
    if p.exists():
        cfg_path = p / "config.json" if p.is_dir() else p
        if not cfg_path.is_file():
            raise ValueError(f"model folder {model!r} has no config.json")
        try:
            cfg = json.loads(cfg_path.read_text())
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{str(cfg_path)!r} is not a JSON config: {e}") from None
        counted = _safetensors_bytes(cfg_path.parent)
        return shape_from_config(cfg, model, *(counted or (None, None)))
    key = model.lower().rsplit("/", 1)[-1]
    key = _ALIASES.get(key, key)
    if key in PRESETS:
        return PRESETS[key]
    raise ValueError(f"unknown model {model!r}: give a preset ({', '.join(PRESETS)}), "
                     "a checkpoint folder with config.json, or a config.json path")


@dataclass(frozen=True)
class StepBytes:
    """Bytes one forward step moves; ``tokens`` are the step's query tokens."""

    weights: int
    kv_write: int
    kv_read: int
    state: int
    tokens: int

    @property
    def total(self) -> int:
        return self.weights + self.kv_write + self.kv_read + self.state

    @property
    def kv_share(self) -> float:
        return (self.kv_write + self.kv_read) / self.total


@dataclass(frozen=True)
class DtypeTraffic:
    """One KV dtype's bytes: per request, one prefill (all its chunks), a decode step at the mean
    and at the last context."""

    kv_bytes_per_token: int
    request_kv_write: int
    request_prefill_kv_read: int
    request_decode_kv_read: int
    request_kv_resident: int  # pages held at the end (block_size granularity)
    snapshot_interval: int  # hybrid prefix caching: tokens between state snapshots (0: not hybrid)
    prefill: StepBytes
    decode_mean: StepBytes
    decode_last: StepBytes


@dataclass(frozen=True)
class TrafficReport:
    shape: ModelShape
    input_len: int
    output_len: int
    concurrency: int
    kv_cache_dtype: str
    selected: str  # "bf16" | "fp8"
    bandwidth: float
    flops: float
    block_size: int
    prefill_chunk: int
    q_tile: int
    bf16: DtypeTraffic
    fp8: DtypeTraffic

    def memory_s(self, s: StepBytes) -> float:
        return s.total / self.bandwidth

    def compute_s(self, s: StepBytes) -> float:
        return 2 * self.shape.active_params * s.tokens / self.flops

    def time_s(self, s: StepBytes) -> float:
        """Roofline: the slower of memory and matmul compute."""
        return max(self.memory_s(s), self.compute_s(s))

    def change_pct(self, step: str, roofline: bool = False) -> float:
        """fp8 step time vs bf16, percent (negative = faster)."""
        f = self.time_s if roofline else self.memory_s
        b, q = f(getattr(self.bf16, step)), f(getattr(self.fp8, step))
        return 100.0 * (q - b) / b

    def to_dict(self) -> dict[str, Any]:
        def step(s: StepBytes) -> dict[str, Any]:
            return {**asdict(s), "total": s.total, "kv_share": s.kv_share, "memory_s": self.memory_s(s),
                    "compute_s": self.compute_s(s), "time_s": self.time_s(s)}

        def dt(d: DtypeTraffic) -> dict[str, Any]:
            out = {k: v for k, v in asdict(d).items() if not isinstance(v, dict)}
            return {**out, "prefill": step(d.prefill), "decode_mean": step(d.decode_mean),
                    "decode_last": step(d.decode_last)}

        head = {k: getattr(self, k) for k in ("input_len", "output_len", "concurrency", "kv_cache_dtype",
                                               "selected", "bandwidth", "flops", "block_size",
                                               "prefill_chunk", "q_tile")}
        change = {f"{s}_{m}_pct": self.change_pct(s, m == "roofline")
                  for s in ("prefill", "decode_mean", "decode_last") for m in ("memory", "roofline")}
        return {"model": asdict(self.shape), **head, "bf16": dt(self.bf16), "fp8": dt(self.fp8),
                "fp8_vs_bf16": change}


def prefill_read_tokens(input_len: int, chunk: int, q_tile: int) -> int:
    """Token K/V reads of a causal prefill in chunks of ``chunk`` with query tiles of ``q_tile``
    rows: each tile reads every position up to its last row."""
    total = 0
    for c0 in range(0, input_len, chunk):
        n = min(chunk, input_len - c0)
        m = math.ceil(n / q_tile)
        total += m * c0 + q_tile * m * (m - 1) // 2 + n
    return total


def kv_dtype_column(kv_cache_dtype: str) -> str:
    """The table column for an engine ``--kv-cache-dtype`` value (auto -> bf16)."""
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} is not supported. "
                         f"Supported values: {list(KV_CACHE_DTYPES)}")
    return "fp8" if kv_cache_dtype.startswith("fp8") else "bf16"


def traffic(shape: ModelShape, input_len: int, output_len: int, concurrency: int = 1,
            kv_cache_dtype: str = "auto", bandwidth: float = DEFAULT_BANDWIDTH, block_size: int = 16,
            prefill_chunk: int = 0, q_tile: int = 128, flops: float = DEFAULT_FLOPS) -> TrafficReport:
    """The byte model of the module docstring, bf16 and fp8. ``prefill_chunk`` 0 = the whole
    prompt in one chunk; ``q_tile`` 0 = one tile per chunk (each chunk reads the cache once)."""
    selected = kv_dtype_column(kv_cache_dtype)
    for name, v, lo, what in (("input_len", input_len, 1, "an integer >= 1"),
                              ("output_len", output_len, 1, "an integer >= 1"),
                              ("concurrency", concurrency, 1, "an integer >= 1"),
                              ("block_size", block_size, 1, "an integer >= 1"),
                              ("prefill_chunk", prefill_chunk, 0, "an integer >= 0 (0 = the whole prompt)"),
                              ("q_tile", q_tile, 0, "an integer >= 0 (0 = the whole chunk)")):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} {v!r} is invalid: expected {what}")
    for name, x in (("bandwidth", bandwidth), ("flops", flops)):
        if not isinstance(x, (int, float)) or isinstance(x, bool) or not 0 < x < math.inf:
            raise ValueError(f"{name} {x!r} is invalid: expected a number > 0 (bytes or FLOPs per second)")
    chunk = prefill_chunk or input_len
    tile = min(q_tile or chunk, chunk)
    I, O, N = input_len, output_len, concurrency
    chunks = math.ceil(I / chunk)
    read_tokens = prefill_read_tokens(I, chunk, tile)
    resident_tokens = math.ceil((I + O) / block_size) * block_size
    S = shape.state_bytes
    # weights: each prefill chunk (one request alone, its chunk's tokens) and each decode step (N tokens)
    # read the step's weights; with routed experts, those of the experts its tokens go to
    W_prefill = sum(shape.step_weight_bytes(min(chunk, I - j * chunk)) for j in range(chunks))
    W_decode = shape.step_weight_bytes(N)

    n_state_layers = shape.num_layers - shape.num_attention_layers

    def one(elem: int) -> DtypeTraffic:
        kv = shape.kv_bytes_per_token(elem)
        interval = 0
        if S and n_state_layers:
            interval = snapshot_interval_tokens(S // n_state_layers, kv // shape.num_attention_layers, block_size)
        return DtypeTraffic(
            kv_bytes_per_token=kv,
            request_kv_write=(I + O) * kv,
            request_prefill_kv_read=read_tokens * kv,
            request_decode_kv_read=(O * I + O * (O + 1) // 2) * kv,
            request_kv_resident=resident_tokens * kv,
            snapshot_interval=interval,
            prefill=StepBytes(W_prefill, I * kv, read_tokens * kv, (2 * chunks - 1) * S, I),
            # mean context I + (O + 1) / 2; kv is even, so the product is an integer
            decode_mean=StepBytes(W_decode, N * kv, N * (2 * I + O + 1) * kv // 2, 2 * N * S, N),
            decode_last=StepBytes(W_decode, N * kv, N * (I + O) * kv, 2 * N * S, N),
        )

    return TrafficReport(shape, I, O, N, kv_cache_dtype, selected, float(bandwidth), float(flops),
                         block_size, chunk, tile, one(KV_ELEM_BYTES["bf16"]), one(KV_ELEM_BYTES["fp8"]))


def _b(n: float) -> str:
    for unit, f in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n:.0f} B"


def _t(s: float) -> str:
    return f"{s * 1e3:.3f} ms" if s >= 1e-3 else f"{s * 1e6:.2f} us"


def format_report(r: TrafficReport) -> str:
    """The human table: bf16 and fp8 side by side, the requested one marked with *."""
    s = r.shape
    mark = {c: f"{c}{' *' if c == r.selected else ''}" for c in ("bf16", "fp8")}
    rows: list[tuple[str, str, str, str]] = []

    def row(label: str, b: float, q: float, fmt: Any = _b, ratio: str | None = None) -> None:
        rows.append((label, fmt(b), fmt(q), ratio if ratio is not None else (f"{q / b:.2f}x" if b else "-")))

    def section(title: str, name: str) -> None:
        b, q = getattr(r.bf16, name), getattr(r.fp8, name)
        rows.append((title, "", "", ""))
        row("  weights", b.weights, q.weights)
        row("  KV written (store)", b.kv_write, q.kv_write)
        row("  KV read (attention)", b.kv_read, q.kv_read)
        if s.state_bytes:
            row("  recurrent state (read+write)", b.state, q.state)
        row("  total", b.total, q.total)
        row("  KV share of bytes", b.kv_share, q.kv_share, lambda x: f"{100 * x:.2f}%", "")
        row(f"  memory time at {r.bandwidth / 1e12:.2f} TB/s", r.memory_s(b), r.memory_s(q), _t,
            f"{r.change_pct(name):+.2f}%")
        row(f"  matmul time at {r.flops / 1e12:.0f} TFLOP/s", r.compute_s(b), r.compute_s(q), _t, "")
        row("  roofline time (max)", r.time_s(b), r.time_s(q), _t, f"{r.change_pct(name, True):+.2f}%")

    b, q = r.bf16, r.fp8
    row("KV bytes per token (all KV layers)", b.kv_bytes_per_token, q.kv_bytes_per_token)
    rows.append(("per request", "", "", ""))
    row("  KV written by the store", b.request_kv_write, q.request_kv_write)
    row("  KV read by prefill attention", b.request_prefill_kv_read, q.request_prefill_kv_read)
    row("  KV read by decode attention", b.request_decode_kv_read, q.request_decode_kv_read)
    row(f"  KV resident ({r.block_size}-token pages)", b.request_kv_resident, q.request_kv_resident)
    if s.state_bytes:
        rows.append(("prefix caching (align mode)", "", "", ""))
        row("  tokens between state snapshots", b.snapshot_interval, q.snapshot_interval, lambda x: f"{x:,}")
        row("  snapshot bytes / KV bytes of an interval", s.state_bytes / (b.snapshot_interval * b.kv_bytes_per_token),
            s.state_bytes / (q.snapshot_interval * q.kv_bytes_per_token), lambda x: f"{x:.2f}", "")
    chunks = math.ceil(r.input_len / r.prefill_chunk)
    section(f"prefill (1 request, {r.input_len} tokens, {chunks} chunk{'s' * (chunks > 1)})", "prefill")
    mean_ctx = r.input_len + (r.output_len + 1) / 2
    reqs = f"{r.concurrency} request{'s' * (r.concurrency > 1)}"
    section(f"decode step ({reqs}, mean context {mean_ctx:g})", "decode_mean")
    section(f"decode step ({reqs}, last context {r.input_len + r.output_len})", "decode_last")

    w = max(len(x[0]) for x in rows)
    head = (f"{s.name}: {s.num_layers} layers, {s.num_attention_layers} with paged KV, {s.num_kv_heads} KV heads"
            f" x {s.head_dim}; {s.num_params / 1e9:.2f}e9 params, {_b(s.weight_bytes)} {s.weight_dtype} weights"
            f" in all" + (f"; recurrent state {_b(s.state_bytes)}/sequence" if s.state_bytes else "")
            + (f"; {s.num_experts} routed experts a layer, {s.experts_per_token} a token ({_b(s.expert_bytes)} of the"
               f" weights: a step reads the experts its tokens go to, {_b(s.step_weight_bytes(1))} at 1 token, "
               f"{_b(s.step_weight_bytes(r.concurrency))} at {r.concurrency})" if s.num_experts else ""))
    sub = (f"ISL {r.input_len}, OSL {r.output_len}, concurrency {r.concurrency}, kv-cache-dtype "
           f"{r.kv_cache_dtype} (* = {r.selected}), prefill chunk {r.prefill_chunk}, query tile {r.q_tile}")
    lines = [head, sub, "", f"{'':<{w}}  {mark['bf16']:>12}  {mark['fp8']:>12}  {'fp8/bf16':>9}"]
    lines += [f"{a:<{w}}  {x:>12}  {y:>12}  {z:>9}".rstrip() for a, x, y, z in rows]
    return "\n".join(lines)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``kvserve traffic`` on an argparse subparsers object."""
    p = subparsers.add_parser("traffic", help="KV / weight bytes per request and step, bf16 vs fp8 KV",
                              description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True,
                   help=f"preset ({', '.join(PRESETS)}), checkpoint folder, or config.json path")
    p.add_argument("--input-len", type=int, required=True, help="prompt tokens (ISL)")
    p.add_argument("--output-len", type=int, required=True, help="generated tokens (OSL)")
    p.add_argument("--concurrency", type=int, default=1, help="requests decoding together")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="the column to mark; auto = bf16 here")
    p.add_argument("--bandwidth", type=float, default=DEFAULT_BANDWIDTH, help="bytes/s (default 4.1e12, H200)")
    p.add_argument("--flops", type=float, default=DEFAULT_FLOPS, help="matmul FLOP/s (default 750e12, H200 bf16)")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--prefill-chunk", type=int, default=0, help="prefill chunk tokens (0 = whole prompt)")
    p.add_argument("--q-tile", type=int, default=128, help="query tile rows (0 = whole chunk)")
    p.add_argument("--json", action="store_true", help="one JSON object, byte counts as integers")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    r = traffic(model_shape(args.model), args.input_len, args.output_len, args.concurrency, args.kv_cache_dtype,
                args.bandwidth, args.block_size, args.prefill_chunk, args.q_tile, args.flops)
    print(json.dumps(r.to_dict()) if args.json else format_report(r), flush=True)
    return 0
