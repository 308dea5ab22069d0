"""The benchmark suite (benchmarks/): each family's ``--smoke`` run on the CPU, in a subprocess as
``gpu.sh`` runs it (``python benchmarks/X.py`` with the repository on PYTHONPATH, nothing
installed needed), and ``gpu.sh``'s argument checks."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
BENCH = REPO / "benchmarks"
RUN_FIELDS = {"benchmark", "date", "command", "smoke", "git_commit", "gpu", "cpu", "python", "torch", "triton",
              "transformers"}
# one smoke test per script below; the helper modules beside them are not benchmarks
SMOKE_TESTED = {"kernel_bench", "e2e_bench", "gdn_bench", "hybrid_bench", "quant_bench", "moe_bench", "serve_bench",
                "cpu_bench", "parity_bench"}
HELPERS = {"common", "flex_paged", "flashinfer_peer", "vllm_triton_peer"}
FAMILIES = ("kernels", "e2e", "gdn", "hybrid", "quant", "moe", "serve", "cpu", "profile", "parity")
ALL = ("kernels", "e2e", "gdn", "hybrid", "quant", "moe", "serve", "cpu")  # gpu.sh all


def run_smoke(script: str, tmp_path: Path, *extra: str, timeout: float = 300) -> tuple[dict, str]:
    """``python benchmarks/<script>.py --smoke --out J`` from the repository root; (JSON, stdout)."""
    out = tmp_path / f"{script}.json"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    env.pop("VLLM_TRITON_SRC", None)  # kernel_bench's vLLM peer: off, as on a machine without vLLM's source
    r = subprocess.run([sys.executable, f"benchmarks/{script}.py", "--smoke", "--out", str(out), *extra], cwd=REPO,
                       env=env, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 0, f"{script} exited with {r.returncode}:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    doc = json.loads(out.read_text())
    run = doc["run"]
    assert RUN_FIELDS <= run.keys()
    assert run["benchmark"] == script and run["smoke"] is True
    assert run["command"].startswith(f"python3 benchmarks/{script}.py") and "--smoke" in run["command"]
    assert run["torch"] and run["transformers"] and run["date"][:4].isdigit()
    assert any(line.startswith("summary: ") for line in r.stdout.splitlines()), "no summary line for gpu.sh"
    return doc, r.stdout


def test_every_benchmark_script_has_a_smoke_test():
    scripts = {p.stem for p in BENCH.glob("*.py")}
    assert scripts - HELPERS == SMOKE_TESTED


def test_gdn_smoke_times_every_kernel_and_checks_the_prefill_against_the_reference(tmp_path):
    doc, _ = run_smoke("gdn_bench", tmp_path)
    assert doc["prefill"] and doc["conv1d"] and doc["decode"]
    for row in doc["prefill"]:  # fp32 in the smoke run: the chunk-parallel rule within 1e-5 of the reference
        assert row["kvserve_ms"] > 0 and row["kvserve_output_rel_err"] < 1e-5 and row["kvserve_state_rel_err"] < 1e-5
    assert all(r["kvserve_ms"] > 0 and r["torch_conv1d_ms"] > 0 for r in doc["conv1d"])
    assert [r["batch"] for r in doc["decode"]] == [1, 3] and all(r["kvserve_ms"] > 0 for r in doc["decode"])


def test_quant_smoke_times_the_w4a16_gemm_and_checks_it_against_the_dequantized_product(tmp_path):
    doc, out = run_smoke("quant_bench", tmp_path)
    rows = doc["rows"]
    assert [(r["shape"], r["m"]) for r in rows] == [(s, m) for s in ("tiny", "tiny_down") for m in (1, 20, 256)]
    from kvserve.kernels.triton_w4a16 import DENSE_FROM_M

    for r in rows:  # fp32 in the smoke run: only the summation order differs from x @ dequantize(W)^T
        assert r["dense_ms"] > 0 and r["w4a16_ms"] > 0 and r["rel_err"] < 1e-5
        assert r["path"] == ("dequantize + cuBLAS" if r["m"] >= DENSE_FROM_M else "fused")
        assert len(r["sweep"]) == 3 and all(t.get("rel_err", 1) < 1e-5 for t in r["sweep"]) and r["best_ms"] > 0
        # from 128 rows both paths of w4a16_matmul are timed (what DENSE_FROM_M is set from)
        assert (r["m"] >= 128) == ("fused_ms" in r) == ("dequant_cublas_ms" in r)
    fp8 = doc["fp8_rows"]  # the FP8 layers beside the bf16 GEMM; on the CPU an fp32-accumulated GEMM
    assert [(r["shape"], r["m"]) for r in fp8] == [("tiny_fp8", 1), ("tiny_fp8", 20)]
    assert all(r["dense_ms"] > 0 and r["fp8_ms"] > 0 and r["err_over_abs_sum"] <= r["fp32_bound"] for r in fp8)
    assert "summary: w4a16 / bf16 GEMM speed tiny m1" in out and "FP8Linear / bf16 tiny_fp8 m1" in out
    moe, cfg = doc["moe_rows"], doc["moe"]  # routed experts: NVFP4Experts against its dequantized bf16 twin
    assert [r["tokens"] for r in moe] == [1, 5] and "grouped W4A16 expert GEMMs / their bytes' floor 1 tokens" in out
    h, i = cfg["hidden"], cfg["intermediate"]  # a row: 64 code bytes + 8 scale bytes a pair of 128 inputs, 4 fp32
    per_expert = (2 * i * -(-h // 128) + h * -(-i // 128)) * 72 + (2 * i + h) * 4
    for r in moe:  # fp32 on the CPU: the twin differs in summation order only
        assert 1 <= r["experts_touched"] <= min(cfg["experts"], r["tokens"] * cfg["top_k"])
        assert r["bytes_touched"] == r["experts_touched"] * per_expert
        assert r["grouped_gemms_ms"] > 0 and r["rel_err"] < 1e-5


def test_moe_smoke_times_the_grouped_gemms_and_checks_them_and_the_block_against_the_loop(tmp_path):
    doc, out = run_smoke("moe_bench", tmp_path, "--sweep", "2", "--write-config", str(tmp_path / "tables"))
    cfg, rows = doc["moe"], doc["rows"]
    # --write-config: the sweep's fastest launch per token count, as the table the engine reads
    from kvserve.kernels.moe_configs import parse_table

    table_file = Path(doc["config_file"])
    assert table_file.parent == tmp_path / "tables" and table_file.name == "E=8,N=32,device_name=cpu,dtype=float32.json"
    table = parse_table(json.loads(table_file.read_text()), str(table_file))
    assert {t: (v.block_m, v.tiles.num_stages) for t, v in table.items()} == {
        r["tokens"]: (r["sweep_best"]["block_m"], r["sweep_best"]["num_stages"]) for r in rows}
    assert all(r["launch"] == "default" for r in rows)  # off CUDA no table is read
    for r in rows:  # the tuning sweep: two other launches, each checked against the torch loop like the default
        assert [(s["block_m"], s["num_stages"]) for s in r["sweep"]] == [(16, 3), (16, 4)]
        assert all(s["ms"] > 0 and s["rel_err"] < 1e-5 for s in r["sweep"])
        assert r["sweep_best"]["ms"] == min(s["ms"] for s in r["sweep"])
    e, h, i, k = cfg["experts"], cfg["hidden"], cfg["intermediate"], cfg["top_k"]
    assert (e, h, i, k) == (8, 64, 32, 2) and doc["dtype"] == "torch.float32"
    assert [r["tokens"] for r in rows] == [1, 5, 40] and "cut_short" not in doc
    bytes_per_s = doc["copy_bandwidth"]["bytes_per_s"]
    assert bytes_per_s > 0
    per_expert = (2 * i * h + h * i) * 4  # gate | up [2I, H] and down [H, I] of one expert, fp32 here
    assert doc["weight_bytes_per_expert"] == per_expert
    for r in rows:
        t = r["tokens"]
        assert r["routed_rows"] == t * k and r["block_m"] == 16  # <= 16 rows an expert: decode-sized blocks
        assert k <= r["experts_touched"] <= min(e, t * k)  # a token's top-k experts are distinct
        assert r["bytes_touched"] == r["experts_touched"] * per_expert
        assert r["floor_ms"] == pytest.approx(r["bytes_touched"] / bytes_per_s * 1e3)
        assert r["copy_bw_fraction"] == pytest.approx(r["floor_ms"] / r["grouped_gemms_ms"])
        assert r["gemm_flops"] == 2 * t * k * (2 * i * h + h * i)
        assert r["fraction_of_dense"] == pytest.approx(r["dense_ms"] / r["grouped_gemms_ms"])
        assert r["grouped_tflops"] == pytest.approx(r["gemm_flops"] / r["grouped_gemms_ms"] / 1e9)
        for key in ("grouped_gemms_ms", "dense_ms", "block_device_graph_ms", "block_device_eager_ms",
                    "block_reference_eager_ms", "align_ms", "align_torch_ms"):
            assert r[key] > 0, key
        # fp32 on the CPU, IEEE products in the kernel (triton_moe's IEEE flag) and in the torch loop: the
        # two differ in summation order only, |error| <= gamma_n sum |products| with gamma_n ~ n 2^-24 =
        # 3.8e-6 at n = H = 64 (Higham, Accuracy and Stability of Numerical Algorithms, eq. 3.5); measured
        # ~3e-7. 1e-5 is the bar test_quant_smoke sets for the same fp32 summation-order difference.
        assert r["gemms_rel_err"] < 1e-5 and r["block_rel_err"] < 1e-5
        assert r["block_routing_mismatch_tokens"] == 0  # fp32 router: both paths pick the same experts
        # the smoke shape's shared expert is as wide as its experts (32): it joins the grouped GEMMs, timed apart too
        assert r["block_shared_in_grouped_gemms"] is True and r["block_device_graph_shared_apart_ms"] > 0
    assert "summary: moe grouped GEMMs: fraction of copy bw / of dense GEMM FLOP/s: 1 tok " in out
    assert ", 5 tok " in out and ", 40 tok " in out
    # --time-budget-s: no point starts after it; the JSON says the run was cut short
    doc, out = run_smoke("moe_bench", tmp_path, "--time-budget-s", "0")
    assert doc["rows"] == [] and doc["cut_short"] is True and "(cut short)" in out
    r = subprocess.run([sys.executable, "benchmarks/moe_bench.py", "--smoke", "--write-config", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "--write-config needs --sweep" in r.stderr


def test_quant_sweep_grid_on_an_sm90_device(monkeypatch):
    """``quant_bench.sweep_tiles`` as an H200 builds it (Gluon and wgmma reported available): every
    batch up to 256 gets a grid that starts with the default tiles without, then with, programmatic
    dependent launch, holds no tile twice, and every Gluon tile in it passes the launcher's checks."""
    import importlib

    from kvserve.kernels import gluon_w4a16 as g

    monkeypatch.syspath_prepend(str(BENCH))
    quant_bench = importlib.import_module("quant_bench")
    monkeypatch.setattr(g, "available", lambda device: True)
    monkeypatch.setattr(g, "wgmma_available", lambda device: True)
    for m in (1, 8, 9, 16, 32, 33, 64, 65, 128, 200, 256):
        grid = quant_bench.sweep_tiles(m)
        d = g.default_tiles(m, sm90=True)
        assert grid[0] == dataclasses.replace(d, pdl=False) and grid[1] == dataclasses.replace(d, pdl=True), m
        assert len(grid) == len(set(map(repr, grid))), m
        assert d.wgmma == (m > 32) and d.pdl and d.mma_overlap == (m > 64) and d.block_m >= min(m, 128)
        assert d.w_eviction_policy == ("" if 8 < m <= 32 else "evict_first"), m
        assert {t.w_eviction_policy for t in grid[2:4]} == {"", "evict_first", "evict_last"} - {d.w_eviction_policy}
        assert all(t.wgmma or t.block_m in (8, 16, 32, 64) for t in grid if isinstance(t, g.GluonTiles))


def test_kernels_smoke_checks_every_kernel_against_the_reference(tmp_path):
    doc, _ = run_smoke("kernel_bench", tmp_path)
    assert doc["failed"] is False and doc["errors"] == []
    checks = doc["checks"]
    assert checks and all(c["ok"] for c in checks)
    names = " ".join(c["name"] for c in checks)
    for what in ("store bf16", "store fp8", "prefill", "decode ours bf16", "decode ours fp8", "decode ours fp8q",
                 "num_splits=2", "bigpool fp8", "bigpool bf16", "ours_fp8q"):
        assert what in names, what
    for section in ("store", "prefill", "decode"):
        assert doc[section] and all(row["ms"] > 0 for row in doc[section]), section
    assert {d["cache_dtype"] for d in doc["decode"]} == {"bf16", "fp8", "fp8q"}  # fp8q: the quantized-query read
    assert {p["impl"] for p in doc["prefill"]} == {"ours", "ours_fp8", "ours_fp8q", "sdpa_gqa", "sdpa_repeat_kv"}
    # the chunked-prefill batch: every read checked; its FlashAttention-2 varlen peer needs CUDA, and says so
    assert {p["impl"] for p in doc["mixed"]} == {"ours_bf16", "ours_fp8", "ours_fp8q"}
    assert sum(c["name"].startswith("mixed") for c in checks) == 3
    assert any(x.startswith("mixed") and x.endswith("fa2_varlen: needs CUDA") for x in doc["skipped"])
    # FlashInfer, the decode peer, needs CUDA: the run says why it is absent instead of dropping it silently
    assert doc["flashinfer"] == [] and "flashinfer: no CUDA device" in doc["skipped"]
    # vLLM's Triton kernel, the other decode peer, needs its source files (not in this repository)
    assert doc["vllm_triton"] == [] and any(s.startswith("vllm_triton: no source") for s in doc["skipped"])


def test_e2e_smoke_runs_both_kv_dtypes_and_the_transformers_peer(tmp_path):
    doc, _ = run_smoke("e2e_bench", tmp_path)
    model = doc["models"]["tiny-qwen3"]
    peer = model["transformers"]
    assert peer["num_finished"] == peer["num_requests"] == 4 and peer["all_full_length"]
    for kv in ("bfloat16", "fp8"):
        point = model["kvserve"][kv]
        assert point["num_requests"] == 4 and point["output_tok_s"] > 0 and point["decode_step_ms_mean"] > 0
        assert point["output_tokens"] == peer["output_tokens"]  # every request ran to its own length
    assert model["ratios"]["fp8_over_bf16"] > 0


def test_e2e_profile_smoke_splits_a_decode_step(tmp_path):
    doc, _ = run_smoke("e2e_bench", tmp_path, "--profile")
    for kv in ("bfloat16", "fp8"):
        prof = doc["profile"]["tiny-qwen3"][kv]
        assert prof["batch"] == 4 and prof["plain_step_ms_median"] > 0 and prof["serial_step_ms_median"] > 0
        assert {"schedule", "prepare", "core._process", "outputs"} <= prof["host_parts"].keys()
        step, *funcs = prof["host_functions"]
        assert step["function"] == "engine.py(Engine.step)" and len(funcs) == 25
        assert all(0 <= f["own_ms_per_step"] <= step["cumulative_ms_per_step"] for f in funcs)
        assert {"execute", "compute_logits", "sampler"} <= prof["serial_parts"].keys()
        assert all(v["median_ms"] > 0 for v in prof["serial_parts"].values())
        assert prof["top_ops"] and prof["top_ops"][0]["cpu_time_total_us"] > 0


def test_hybrid_smoke_runs_the_config_quantized_with_dummy_packed_weights(tmp_path):
    """--quantization: the tiny config's MIXED_PRECISION export without weights runs beside the bf16
    model; --quantized-kv auto resolves to fp8_e4m3 from the export's kv_cache_quant_algo."""
    doc, out = run_smoke("hybrid_bench", tmp_path, "--quantization", "MIXED_PRECISION", "--kv", "bfloat16",
                         "--peer-concurrency=")
    q = doc["kvserve_quantized"]
    assert q["algo"] == "MIXED_PRECISION" and list(q["kv"]) == ["auto"]
    run = q["kv"]["auto"]
    assert run["resolved_kv_cache_dtype"] == "fp8_e4m3" and doc["kvserve"]["bfloat16"]["resolved_kv_cache_dtype"] == "bfloat16"
    assert [r["concurrency"] for r in run["rows"]] == [1, 2] and all(r["prefill_tok_s"] > 0 for r in run["rows"])
    assert [r["concurrency"] for r in run["decode"]] == [1, 2] and all(r["step_ms"] > 0 for r in run["decode"])
    assert "MIXED_PRECISION (KV auto -> fp8_e4m3) / bf16 model (bf16 KV) prefill tok/s: c1 " in out
    assert "kvserve MIXED_PRECISION auto prefill tok/s c1 " in out


def test_hybrid_smoke_measures_prefill_and_decode_for_both_kv_dtypes(tmp_path):
    doc, _ = run_smoke("hybrid_bench", tmp_path)
    for kv in ("bfloat16", "fp8"):
        rows = doc["kvserve"][kv]["rows"]
        assert [r["concurrency"] for r in rows] == [1, 2]
        assert all(r["seconds"] > 0 and r["prefill_tok_s"] > 0 for r in rows)
        assert doc["kvserve"][kv]["state_slots"] > 0  # the GDN state pool of a hybrid model
        decode = doc["kvserve"][kv]["decode"]
        assert [r["concurrency"] for r in decode] == [1, 2] and all(r["step_ms"] > 0 for r in decode)
        # the decode step (2nd token to last) fits inside the whole run with its prefill
        assert all(r["out_tok_s"] > 0 and r["step_ms"] * 1e-3 * (doc["osl"] - 2) < r["seconds"] for r in decode)
    assert doc["osl"] == 8 and doc["copy_bandwidth_Bps"] is None  # no roofline without a GPU
    assert set(doc["traffic"]) == {"1", "2"}
    assert doc["transformers"]["rows"][0]["prefill_tok_s"] > 0


def test_serve_smoke_serves_a_config_only_model_and_stops_cleanly(tmp_path):
    doc, _ = run_smoke("serve_bench", tmp_path, "--offline")
    assert doc["failed"] is False
    points = {(p["kv_cache_dtype"], p["concurrency"]): p for p in doc["points"]}
    assert set(points) == {("auto", 1), ("auto", 4), ("fp8", 1), ("fp8", 4)}
    for p in points.values():
        assert p["all_ok"] and p["failed"] == 0 and p["completed"] == p["num_prompts"]
        assert p["total_output_tokens"] == p["num_prompts"] * 8 and p["output_throughput"] > 0
        assert p["gauges_after"]["vllm:num_requests_running"] == 0  # nothing left held after the point
        assert p["gauges_after"]["vllm:kv_cache_usage_perc"] == 0
        # --offline: the offline engine ran the point's workload (every output token, as ignore_eos asks)
        off = p["offline"]
        assert off["num_requests"] == p["num_prompts"] and off["output_tokens"] == p["num_prompts"] * 8
        assert off["output_tok_s"] > 0 and off["decode_step_ms_median"] > 0
        assert p["serve_over_offline_tok_s"] == pytest.approx(p["output_throughput"] / off["output_tok_s"])
        assert p["tpot_p50_over_offline_step"] == pytest.approx(p["median_tpot_ms"] / off["decode_step_ms_median"])
        assert "--kv-cache-dtype " + p["kv_cache_dtype"] in off["command"] and "--concurrency " in off["command"]
    assert doc["settings"]["load_format"] == "dummy"
    for server in doc["servers"].values():
        assert server["ready_s"] > 0 and server["server_returncode"] == 0  # graceful shutdown on SIGINT


def test_cpu_smoke_runs_both_engines_and_compares_their_tokens(tmp_path):
    doc, _ = run_smoke("cpu_bench", tmp_path)
    results = doc["results"]
    for name in ("kvserve", "transformers"):
        r = results[name]
        assert r["output_tokens"] > 0 and r["output_tok_s_median"] > 0 and r["runs"][0]["wall_s"] > 0
    # greedy fp32 on the same random weights: the two engines give the same tokens
    assert doc["summary"]["identical_kvserve_vs_transformers"] == doc["workload"]["num_prompts"] == 3
    assert results["kvserve"]["output_token_ids"] == results["transformers"]["output_token_ids"]


def test_parity_smoke_runs_every_cpu_read_against_references_it_makes(tmp_path):
    doc, out = run_smoke("parity_bench", tmp_path)
    jobs = {(j["read"], j["mode"], Path(j["ref"]).stem): j for j in doc["jobs"]}
    assert all(j["rc"] == 0 for j in doc["jobs"]), [j.get("log_tail") for j in doc["jobs"] if j["rc"] != 0]
    assert doc["reads"] == ["fp32", "dequant_reference", "fp8q_twin_p0", "fp8q_twin_p8"]  # no kernels on the CPU
    # the stand-in reference is the fp32 read's own greedy run: greedy exact, teacher-forced within fp32 noise
    assert jobs["fp32", "greedy", "fp32_stand_in"]["exact"] == 2
    assert jobs["fp32", "tf", "fp32_stand_in"]["agree"] == jobs["fp32", "tf", "fp32_stand_in"]["steps"] > 0
    assert jobs["fp32", "tf", "fp32_stand_in"]["p99"] < 1e-4
    for read in ("dequant_reference", "fp8q_twin_p0", "fp8q_twin_p8"):  # both modes of every fp8 read ran
        assert jobs[read, "tf", "fp32_stand_in"]["steps"] == jobs["fp32", "tf", "fp32_stand_in"]["steps"]
        assert jobs[read, "greedy", "fp32_stand_in"]["prompts"] == 2
    # the dequantized read is the fake-quant recipe's formula: far closer to it than the fp32 cache is
    assert doc["recipe"]["rc"] == 0 and doc["recipe"]["line"].startswith("recipe spread")
    here = jobs["dequant_reference", "tf", "fp8_e4m3_here"]
    assert here["p99"] < 1e-4 < jobs["fp32", "tf", "fp8_e4m3_here"]["p50"]
    for s in (0, 8):  # the twin against its own greedy file: one pass vs token by token, same tiles here
        assert jobs[f"fp8q_twin_p{s}", "tf", f"twin_p{s}_here"]["p99"] < 1e-4
    assert "summary: fp32 2/2 exact" in out and ", 0 failed" in out


def test_gpu_sh_parses():
    r = subprocess.run(["bash", "-n", str(BENCH / "gpu.sh")], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.parametrize("args", [["bogus"], ["kernels", "e2e2"]])
def test_gpu_sh_rejects_an_unknown_suite_naming_the_accepted_ones(args, tmp_path):
    r = subprocess.run(["bash", str(BENCH / "gpu.sh"), *args], capture_output=True, text=True,
                       env={**os.environ, "OUT": str(tmp_path / "out")}, timeout=30)
    assert r.returncode != 0
    assert f"'{args[-1]}'" in r.stderr
    for name in (*FAMILIES, "all"):
        assert name in r.stderr
    assert not (tmp_path / "out").exists()  # nothing ran


def test_gpu_sh_lists_every_family_with_a_command_and_a_budget():
    """FAMILIES and ALL above are gpu.sh's; every family has its command and its time budget."""
    import re

    text = (BENCH / "gpu.sh").read_text()
    assert tuple(re.search(r"^FAMILIES=\((.*)\)$", text, re.M).group(1).split()) == FAMILIES
    assert tuple(re.search(r"^ALL=\((.*)\)$", text, re.M).group(1).split()) == ALL
    commands = text[text.index("family_command() {"):text.index("budget_of() {")]
    budgets = text[text.index("budget_of() {"):]
    for fam in FAMILIES:
        assert re.search(rf"^\s+{fam}\)", commands, re.M), fam
        assert re.search(rf"\b{fam}\) echo \"\${fam.upper()}_S\"", budgets), fam
        assert re.search(rf"\b{fam.upper()}_S=\${{{fam.upper()}_S:-\d+}}", text), fam


def test_gpu_sh_without_a_suite_prints_usage():
    r = subprocess.run(["bash", str(BENCH / "gpu.sh")], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "usage: bash benchmarks/gpu.sh SUITE" in r.stderr
