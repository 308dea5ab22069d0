"""Bad input through LLM / Engine / the CLI on a tiny model: clear errors (vLLM's wording where
vLLM has one), nothing half-added, other in-flight requests unaffected, no KV block leaks."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvserve import LLM, SamplingParams
from kvserve.engine.engine import Engine

MAX_LEN = 64
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny(make_tiny_model) -> Path:
    return make_tiny_model("llama")


@pytest.fixture(scope="module")
def llm(tiny) -> LLM:
    # 6 blocks of 16 = 96 token slots: a few requests at once force chunking and preemption
    return LLM(
        str(tiny),
        max_model_len=MAX_LEN,
        num_gpu_blocks_override=6,
        max_num_batched_tokens=24,
        max_num_seqs=4,
        seed=0,
    )


def assert_idle(engine: Engine) -> None:
    kv = engine.kv_manager
    kv.check_invariants()
    assert kv.num_free_blocks == kv.pool.num_blocks, "KV blocks leaked"
    assert kv.req_to_blocks == {}
    assert not engine.has_unfinished_requests()
    assert engine.scheduler.requests == {} and engine.states == {}
    assert getattr(engine, "parents", {}) == {}


def greedy(max_tokens=8, **kw) -> SamplingParams:
    return SamplingParams(temperature=0, max_tokens=max_tokens, **kw)


def ids(n: int, start: int = 5) -> list[int]:
    return [(start + 7 * i) % 500 + 3 for i in range(n)]


# ---- prompts -------------------------------------------------------------------------------
def test_prompt_longer_than_max_model_len(llm):
    with pytest.raises(ValueError, match=r"The decoder prompt \(length 65\) is longer than the maximum model length of 64"):
        llm.generate({"prompt_token_ids": ids(65)}, greedy(), use_tqdm=False)
    text = "The quick brown fox jumps over the lazy dog. " * 20
    n = len(llm.get_tokenizer()(text).input_ids)
    assert n > MAX_LEN
    with pytest.raises(ValueError, match=rf"The decoder prompt \(length {n}\) is longer than the maximum model length of 64"):
        llm.generate(text, greedy(), use_tqdm=False)
    assert_idle(llm.llm_engine)


def test_prompt_at_the_length_limit_is_capped_not_rejected(llm):
    (out,) = llm.generate({"prompt_token_ids": ids(MAX_LEN)}, greedy(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    (out,) = llm.generate({"prompt_token_ids": ids(60)}, greedy(max_tokens=100, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == MAX_LEN - 60 and out.outputs[0].finish_reason == "length"
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("prompt", ["", {"prompt_token_ids": []}, {"prompt": ""}], ids=["text", "ids", "dict-text"])
def test_empty_prompt(llm, prompt):
    with pytest.raises(ValueError, match="The decoder prompt cannot be empty"):
        llm.generate(prompt, greedy(), use_tqdm=False)
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("bad", [512, 100_000, -1])
def test_token_id_out_of_vocab(llm, bad):
    with pytest.raises(ValueError, match=rf"Token id {bad} is out of vocabulary"):
        llm.generate({"prompt_token_ids": [5, 6, bad, 7]}, greedy(), use_tqdm=False)
    assert_idle(llm.llm_engine)


def test_last_vocab_id_is_accepted(llm):
    (out,) = llm.generate({"prompt_token_ids": [5, 511]}, greedy(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) >= 1


def test_prompt_of_the_wrong_type(llm):
    engine = llm.llm_engine
    for bad in (3.5, None, {"prompt_token_ids": None}, [1, "a"]):
        with pytest.raises((ValueError, TypeError)):
            engine.add_request("wrong-type", bad, greedy())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="Invalid prompt"):
        engine.add_request("wrong-type", 3.5, greedy())  # type: ignore[arg-type]
    with pytest.raises((ValueError, TypeError)):
        llm.generate(3.5, greedy(), use_tqdm=False)  # type: ignore[arg-type]
    assert_idle(engine)


def test_prompt_dict_without_known_keys(llm):
    with pytest.raises(ValueError, match="Invalid prompt"):
        llm.generate({"text": "hi"}, greedy(), use_tqdm=False)  # type: ignore[arg-type]


def test_non_integer_token_id_is_rejected_at_add_time(llm):
    engine = llm.llm_engine
    try:
        with pytest.raises((ValueError, TypeError)):
            engine.add_request("float-ids", {"prompt_token_ids": [5, 1.5, 7]}, greedy())
    finally:
        engine.abort_request(list(engine.states))


# ---- sampling parameters -------------------------------------------------------------------
BAD_SAMPLING = [
    ("temperature", dict(temperature=-1.0)),
    ("temperature", dict(temperature=float("nan"))),
    ("top_p", dict(top_p=0.0)),
    ("top_p", dict(top_p=1.5)),
    ("top_k", dict(top_k=-2)),
    ("min_p", dict(min_p=2.0)),
    ("min_p", dict(min_p=-0.1)),
    ("max_tokens", dict(max_tokens=0)),
    ("max_tokens", dict(max_tokens=-3)),
    ("n", dict(n=0)),
    ("min_tokens", dict(min_tokens=-1)),
    ("min_tokens", dict(min_tokens=9, max_tokens=8)),
    ("stop", dict(stop=[""])),
    ("stop", dict(stop="")),
    ("logprobs", dict(logprobs=-1)),
    ("prompt_logprobs", dict(prompt_logprobs=-1)),
    ("presence_penalty", dict(presence_penalty=2.5)),
    ("frequency_penalty", dict(frequency_penalty=-3.0)),
    ("repetition_penalty", dict(repetition_penalty=0.0)),
    ("stop_token_ids", dict(stop_token_ids=[-1])),
    ("detokenize", dict(stop=["x"], detokenize=False)),
]


@pytest.mark.parametrize("field,kwargs", BAD_SAMPLING, ids=[f"{f}={list(k.values())}" for f, k in BAD_SAMPLING])
def test_invalid_sampling_values_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kwargs)


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(logprobs=21), "Requested sample logprobs of 21, which is greater than max allowed: 20"),
        (dict(prompt_logprobs=21), "Requested prompt logprobs of 21, which is greater than max allowed: 20"),
    ],
)
def test_engine_level_sampling_limits(llm, kwargs, match):
    params = SamplingParams(**{"max_tokens": 4, **kwargs})
    with pytest.raises(ValueError, match=match):
        llm.generate({"prompt_token_ids": ids(5)}, params, use_tqdm=False)
    assert_idle(llm.llm_engine)


# ---- a bad request next to good ones -------------------------------------------------------
GOOD = [(ids(40, 1), 8), (ids(9, 2), 10), (ids(30, 3), 6), (ids(23, 4), 8)]


@pytest.fixture(scope="module")
def solo_outputs(llm):
    outs = []
    for prompt, k in GOOD:
        (o,) = llm.generate({"prompt_token_ids": prompt}, greedy(k), use_tqdm=False)
        outs.append(list(o.outputs[0].token_ids))
    return outs


def _bad_adds(engine: Engine):
    yield "dup", lambda: engine.add_request("g0", {"prompt_token_ids": ids(3)}, greedy()), "already exists"
    yield "long", lambda: engine.add_request("b1", {"prompt_token_ids": ids(MAX_LEN + 1)}, greedy()), "longer than the maximum model length"
    yield "empty", lambda: engine.add_request("b2", {"prompt_token_ids": []}, greedy()), "cannot be empty"
    yield "oov", lambda: engine.add_request("b3", [5, 900], greedy()), "out of vocabulary"
    yield "logprobs", lambda: engine.add_request("b4", ids(4), greedy(logprobs=50)), "greater than max allowed"
    yield "type", lambda: engine.add_request("b6", 7, greedy()), "Invalid prompt"  # type: ignore[arg-type]


def test_bad_add_request_leaves_inflight_requests_untouched(llm, solo_outputs):
    engine = llm.llm_engine
    assert_idle(engine)
    for i, (prompt, k) in enumerate(GOOD):
        engine.add_request(f"g{i}", {"prompt_token_ids": prompt}, greedy(k))
    finished: dict[str, list[int]] = {}
    preempt_before = engine.scheduler.num_preemptions
    step = 0
    bad = list(_bad_adds(engine))
    while engine.has_unfinished_requests():
        if step < len(bad):  # one bad request between every two steps, while the good ones run
            name, call, match = bad[step]
            n_unfinished = engine.get_num_unfinished_requests()
            with pytest.raises(ValueError, match=match):
                call()
            assert engine.get_num_unfinished_requests() == n_unfinished, name
            engine.kv_manager.check_invariants()
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = list(out.outputs[0].token_ids)
        step += 1
        assert step < 1000
    assert step >= len(bad)
    assert engine.scheduler.num_preemptions > preempt_before  # the good ones did get preempted
    assert finished == {f"g{i}": solo_outputs[i] for i in range(len(GOOD))}
    assert_idle(engine)


def test_bad_prompt_in_a_generate_batch_adds_nothing_and_engine_recovers(llm, solo_outputs):
    prompts = [{"prompt_token_ids": GOOD[0][0]}, {"prompt_token_ids": GOOD[1][0]}, {"prompt_token_ids": ids(MAX_LEN + 5)}]
    params = [greedy(GOOD[0][1]), greedy(GOOD[1][1]), greedy()]
    with pytest.raises(ValueError, match="longer than the maximum model length"):
        llm.generate(prompts, params, use_tqdm=False)
    assert_idle(llm.llm_engine)
    outs = llm.generate(
        [{"prompt_token_ids": p} for p, _ in GOOD], [greedy(k) for _, k in GOOD], use_tqdm=False
    )
    assert [list(o.outputs[0].token_ids) for o in outs] == solo_outputs
    assert_idle(llm.llm_engine)


@pytest.mark.parametrize("exc", [RuntimeError("simulated device failure"), KeyboardInterrupt()], ids=["error", "ctrl-c"])
def test_failed_step_aborts_cleanly_and_does_not_poison_the_prefix_cache(llm, solo_outputs, monkeypatch, exc):
    engine = llm.llm_engine
    for cache in engine.runner.kv_caches:  # stale K/V: what a never-written block would hold
        cache.fill_(0.0)
    real_execute = engine.runner.execute
    calls = []

    def failing_execute(sched):
        calls.append(sched)
        if len(calls) == 2:  # the second step dies after the blocks were allocated (and cached)
            raise exc
        return real_execute(sched)

    monkeypatch.setattr(engine.runner, "execute", failing_execute)
    with pytest.raises(type(exc)):
        llm.generate([{"prompt_token_ids": p} for p, _ in GOOD], [greedy(k) for _, k in GOOD], use_tqdm=False)
    assert len(calls) == 2
    assert_idle(engine)
    monkeypatch.setattr(engine.runner, "execute", real_execute)
    # same prompts again: any prefix hit on a block the failed step never wrote would show here
    outs = llm.generate([{"prompt_token_ids": p} for p, _ in GOOD], [greedy(k) for _, k in GOOD], use_tqdm=False)
    assert [list(o.outputs[0].token_ids) for o in outs] == solo_outputs
    assert_idle(engine)


def test_abort_of_unknown_or_finished_request_is_harmless(llm):
    engine = llm.llm_engine
    engine.abort_request("never-added")
    engine.abort_request(["x", "y"])
    assert_idle(engine)


# ---- broken checkpoints --------------------------------------------------------------------
@pytest.fixture
def ckpt(tiny, tmp_path) -> Path:
    folder = tmp_path / "ckpt"
    shutil.copytree(tiny, folder)
    return folder


def _load(folder: Path) -> LLM:
    return LLM(str(folder), max_model_len=MAX_LEN, num_gpu_blocks_override=4)


def _edit_weights(folder: Path, edit) -> None:
    from safetensors.torch import load_file, save_file

    sd = load_file(str(folder / "model.safetensors"))
    edit(sd)
    save_file(sd, str(folder / "model.safetensors"), metadata={"format": "pt"})


def test_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError) as e:
        _load(ckpt)
    msg = str(e.value)
    assert "FooForCausalLM" in msg
    for supported in ("LlamaForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM"):
        assert supported in msg


def test_not_a_checkpoint_folder(tmp_path):
    with pytest.raises(ValueError, match="config.json"):
        _load(tmp_path / "nope")


def test_missing_weight_file(ckpt):
    (ckpt / "model.safetensors").unlink()
    with pytest.raises(ValueError) as e:
        _load(ckpt)
    assert str(ckpt) in str(e.value)
    assert "safetensors" in str(e.value)


def test_missing_shard_listed_in_index(ckpt):
    (ckpt / "model.safetensors").rename(ckpt / "model-00001-of-00002.safetensors")
    weight_map = {"lm_head.weight": "model-00002-of-00002.safetensors", "model.norm.weight": "model-00001-of-00002.safetensors"}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(ValueError) as e:
        _load(ckpt)
    assert "model-00002-of-00002.safetensors" in str(e.value) and str(ckpt) in str(e.value)


@pytest.mark.parametrize("name", ["model.layers.1.mlp.down_proj.weight", "lm_head.weight", "model.norm.weight"])
def test_missing_tensor_is_named(ckpt, name):
    _edit_weights(ckpt, lambda sd: sd.pop(name))
    with pytest.raises(ValueError, match="missing") as e:
        _load(ckpt)
    assert name in str(e.value)


def test_missing_fused_shard_names_the_checkpoint_tensor(ckpt):
    _edit_weights(ckpt, lambda sd: sd.pop("model.layers.0.self_attn.k_proj.weight"))
    with pytest.raises(ValueError, match="missing") as e:
        _load(ckpt)
    assert "model.layers.0.self_attn.k_proj.weight" in str(e.value)


def test_unexpected_tensor_is_named(ckpt):
    _edit_weights(ckpt, lambda sd: sd.__setitem__("model.layers.0.mlp.extra_proj.weight", torch.ones(4, 4)))
    with pytest.raises(ValueError, match="unexpected") as e:
        _load(ckpt)
    assert "model.layers.0.mlp.extra_proj.weight" in str(e.value)


@pytest.mark.parametrize(
    "name,shape",
    [("model.layers.0.mlp.down_proj.weight", (64, 100)), ("model.layers.1.self_attn.v_proj.weight", (16, 64))],
)
def test_misshaped_tensor_is_named_with_shapes(ckpt, name, shape):
    _edit_weights(ckpt, lambda sd: sd.__setitem__(name, torch.zeros(shape)))
    with pytest.raises(ValueError, match="shape") as e:
        _load(ckpt)
    msg = str(e.value)
    assert name in msg and str(tuple(shape)) in msg


# ---- the CLI -------------------------------------------------------------------------------
def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "kvserve.entrypoints.cli", "generate", *args],
        cwd=REPO, capture_output=True, text=True, timeout=120,
    )


def test_cli_bad_sampling_value_is_a_one_line_error(tiny):
    r = _cli("hello", "--model", str(tiny), "--temperature", "-1")
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("kvserve: error:") and "temperature" in lines[0]
    assert "Traceback" not in r.stderr and r.stdout.strip() == ""


def test_cli_too_long_prompt_is_a_clear_error(tiny):
    prompt = "The quick brown fox jumps over the lazy dog. " * 10
    r = _cli(prompt, "--model", str(tiny), "--no-chat", "--max-model-len", "16", "--num-gpu-blocks-override", "2")
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvserve: error: The decoder prompt (length ")
    assert "is longer than the maximum model length of 16" in last


def test_cli_unknown_architecture(ckpt):
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["architectures"] = ["FooForCausalLM"]
    (ckpt / "config.json").write_text(json.dumps(cfg))
    r = _cli("hi", "--model", str(ckpt))
    assert r.returncode != 0
    assert "Traceback" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("kvserve: error:") and "FooForCausalLM" in last and "LlamaForCausalLM" in last
