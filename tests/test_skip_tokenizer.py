"""``skip_tokenizer_init=True`` (vLLM's flag): no tokenizer is loaded, prompts must be token ids,
outputs carry token ids and empty text, stop strings are not looked for, EOS ids come from the
generation config (``generation_config.json``, else ``config.json``) as stop token ids.

vLLM references: tests/entrypoints/llm/test_generate.py ``test_skip_tokenizer_initialization``
(text prompt -> ValueError naming `skip_tokenizer_init=True`; token prompt -> text "" and token ids),
vllm/v1/engine/detokenizer.py (no tokenizer -> no-op detokenizer), vllm/sampling_params.py
``update_from_generation_config`` (EOS id None -> generation-config EOS ids join stop_token_ids)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from kvserve import LLM, SamplingParams
from kvserve.engine.sampling import RequestOutputKind

KV = 1 << 24
PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 9], [1, 2, 3]]


def _weights_only_folder(src: Path, dst: Path, gen_eos=None, config_eos=None, keep_generation_config=True) -> Path:
    """A checkpoint folder with config.json + safetensors only (no tokenizer files)."""
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    if config_eos is not None:
        cfg["eos_token_id"] = config_eos
    (dst / "config.json").write_text(json.dumps(cfg))
    for f in src.glob("*.safetensors"):
        shutil.copy(f, dst / f.name)
    if keep_generation_config and (src / "generation_config.json").is_file():
        gen = json.loads((src / "generation_config.json").read_text())
        if gen_eos is not None:
            gen["eos_token_id"] = gen_eos
        (dst / "generation_config.json").write_text(json.dumps(gen))
    return dst


@pytest.fixture(scope="module")
def llm(tiny, one_thread):
    return LLM(str(tiny), skip_tokenizer_init=True, kv_cache_memory=KV)


@pytest.fixture(scope="module")
def llm_tok(tiny, one_thread):
    return LLM(str(tiny), kv_cache_memory=KV)


def test_no_tokenizer_loaded(llm):
    eng = llm.llm_engine
    assert eng.tokenizer is None and eng.decoder is None
    assert eng.config.tokenizer is None
    assert eng.vocab_size == eng.config.model_config.vocab_size == 512
    with pytest.raises(ValueError, match=r"Unable to get tokenizer because `skip_tokenizer_init=True`"):
        llm.get_tokenizer()


@pytest.mark.parametrize("prompt", ["abc", {"prompt": "abc"}, ["abc", [1, 2]]])
def test_text_prompt_rejected_with_vllm_text(llm, prompt):
    with pytest.raises(ValueError, match=r"You cannot pass text prompts when `skip_tokenizer_init=True`"):
        llm.generate(prompt, SamplingParams(max_tokens=2), use_tqdm=False)
    assert not llm.llm_engine.has_unfinished_requests()  # nothing half-added stays queued


def test_chat_rejected(llm):
    with pytest.raises(ValueError, match=r"Tokenizer not available when `skip_tokenizer_init=True`"):
        llm.chat([{"role": "user", "content": "hi"}], use_tqdm=False)


def test_token_prompt_gives_ids_and_empty_text(llm):
    """vLLM's test_skip_tokenizer_initialization: prompt_logprobs + detokenize=True still work."""
    params = SamplingParams(prompt_logprobs=True, detokenize=True, logprobs=2, max_tokens=6, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS] + [PROMPTS[0]], params, use_tqdm=False)
    assert len(outs) == len(PROMPTS) + 1
    for out, prompt in zip(outs, PROMPTS + [PROMPTS[0]]):
        assert out.prompt is None
        assert out.prompt_token_ids == prompt
        c = out.outputs[0]
        assert c.text == ""
        assert len(c.token_ids) == 6 and c.finish_reason == "length"
        assert all(0 <= t < 512 for t in c.token_ids)
        # logprobs are there, without decoded text
        assert len(c.logprobs) == 6
        assert all(lp.decoded_token is None for step in c.logprobs for lp in step.values())
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        assert all(lp.decoded_token is None for row in out.prompt_logprobs[1:] for lp in row.values())


def test_same_tokens_as_with_tokenizer(llm, llm_tok):
    """Greedy: identical ids with and without the tokenizer; EOS still stops the request, but as
    a generation-config stop token id (vLLM: the tokenizer's EOS id is None, so stop_reason is
    the id), where with a tokenizer it is the primary EOS (stop_reason None)."""
    params = SamplingParams(temperature=0, max_tokens=40)
    prompts = [{"prompt_token_ids": p} for p in PROMPTS]
    a = llm.generate(prompts, params, use_tqdm=False)
    b = llm_tok.generate(prompts, params, use_tqdm=False)
    for x, y in zip(a, b):
        cx, cy = x.outputs[0], y.outputs[0]
        assert cx.token_ids == cy.token_ids
        assert cx.finish_reason == cy.finish_reason
        assert cx.text == "" and isinstance(cy.text, str)
        if cy.finish_reason == "stop":
            assert cy.stop_reason is None and cx.stop_reason == cy.token_ids[-1] == 2


def test_stop_strings_ignored(llm):
    """No detokenizer, so stop strings are never matched (vLLM's no-op IncrementalDetokenizer)."""
    params = SamplingParams(stop=["a", "e", " "], max_tokens=8, ignore_eos=True, temperature=1.0, seed=3)
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[0]}, params, use_tqdm=False)
    c = out.outputs[0]
    assert len(c.token_ids) == 8 and c.text == "" and c.finish_reason == "length" and c.stop_reason is None


def test_stop_token_ids_and_parallel_sampling(llm):
    params = SamplingParams(n=3, temperature=1.0, seed=5, max_tokens=5, ignore_eos=True)
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)
    assert len(out.outputs) == 3 and all(c.text == "" and len(c.token_ids) == 5 for c in out.outputs)
    greedy = llm.generate({"prompt_token_ids": PROMPTS[1]}, SamplingParams(temperature=0, max_tokens=1),
                          use_tqdm=False)[0].outputs[0].token_ids[0]
    params = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True, stop_token_ids=[greedy])
    (out,) = llm.generate({"prompt_token_ids": PROMPTS[1]}, params, use_tqdm=False)
    c = out.outputs[0]
    assert c.token_ids == [greedy] and c.finish_reason == "stop" and c.stop_reason == greedy


def test_out_of_vocab_uses_model_vocab(llm):
    """vLLM skips this check without a tokenizer; kvserve keeps it with the model's vocab size
    (an id past the embedding table would otherwise fail inside the model)."""
    with pytest.raises(ValueError, match="Token id 512 is out of vocabulary"):
        llm.generate({"prompt_token_ids": [1, 512]}, SamplingParams(max_tokens=1), use_tqdm=False)
    with pytest.raises(ValueError, match="out-of-vocab"):
        llm.generate({"prompt_token_ids": [1]}, SamplingParams(max_tokens=1, stop_token_ids=[600]), use_tqdm=False)


def test_delta_outputs_through_engine(llm):
    eng = llm.llm_engine
    params = SamplingParams(max_tokens=4, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    eng.add_request("delta-1", {"prompt_token_ids": PROMPTS[2]}, params)
    deltas = []
    while eng.has_unfinished_requests():
        for out in eng.step():
            deltas.append(out)
    assert [len(o.outputs[0].token_ids) for o in deltas] == [1, 1, 1, 1]
    assert all(o.outputs[0].text == "" for o in deltas) and deltas[-1].finished


def _first_greedy_token(folder: Path, prompt: list[int]) -> int:
    llm = LLM(str(folder), skip_tokenizer_init=True, kv_cache_memory=KV)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    return llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0].token_ids[0]


def test_eos_from_generation_config_then_config_json(tiny, tmp_path, one_thread):
    """A folder with no tokenizer files (the dummy-weights benchmark case). EOS ids: the
    generation_config.json's (an int or a list), else config.json's eos_token_id (vLLM's
    try_get_generation_config falls back to GenerationConfig.from_model_config)."""
    prompt = PROMPTS[0]
    plain = _weights_only_folder(tiny, tmp_path / "plain")
    assert not list(plain.glob("tokenizer*"))
    t = _first_greedy_token(plain, prompt)
    params = SamplingParams(temperature=0, max_tokens=8)

    # generation_config.json with a list of EOS ids that includes t
    gen_list = _weights_only_folder(tiny, tmp_path / "gen-list", gen_eos=[(t + 1) % 512, t], config_eos=(t + 3) % 512)
    llm = LLM(str(gen_list), skip_tokenizer_init=True, kv_cache_memory=KV)
    assert sorted(llm.llm_engine.extra_eos_ids) == sorted([(t + 1) % 512, t])
    c = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == [t] and c.finish_reason == "stop" and c.stop_reason == t
    # ignore_eos: the generation-config EOS ids do not stop the request
    c = llm.generate({"prompt_token_ids": prompt}, SamplingParams(temperature=0, max_tokens=3, ignore_eos=True),
                     use_tqdm=False)[0].outputs[0]
    assert len(c.token_ids) == 3 and c.finish_reason == "length"

    # no generation_config.json: config.json's eos_token_id
    cfg_only = _weights_only_folder(tiny, tmp_path / "cfg-only", config_eos=t, keep_generation_config=False)
    assert not (cfg_only / "generation_config.json").exists()
    llm = LLM(str(cfg_only), skip_tokenizer_init=True, kv_cache_memory=KV)
    assert llm.llm_engine.extra_eos_ids == [t]
    c = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)[0].outputs[0]
    assert c.token_ids == [t] and c.finish_reason == "stop" and c.stop_reason == t


def test_without_flag_a_folder_without_tokenizer_fails(tiny, tmp_path):
    folder = _weights_only_folder(tiny, tmp_path / "no-tok")
    with pytest.raises(Exception):
        LLM(str(folder), kv_cache_memory=KV)


def test_cli_generate_text_prompt_errors(tiny, capsys):
    from kvserve.entrypoints.cli import main

    rc = main(["generate", "hello", "--model", str(tiny), "--skip-tokenizer-init", "--kv-cache-memory", str(KV),
               "--max-tokens", "2"])
    assert rc == 2
    assert "skip_tokenizer_init=True" in capsys.readouterr().err
